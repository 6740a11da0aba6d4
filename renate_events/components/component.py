"""The :class:`Component` base class: a unit of replay behaviour driven by training-loop events."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Union

import attrs
import torch
from torch import nn

from renate_events.inference import call_model
from renate_events.memory import BatchMemory
from trainer import validators as v

__all__ = ["BatchMemory", "Component", "Inputs", "call_model", "real_from"]

#: Model inputs: a tensor, or a (nested) tuple/dict of tensors.
Inputs = Union[torch.Tensor, tuple[Any, ...], Mapping[str, Any]]


def real_from(low: float, *, low_open: bool = False) -> Callable[[Any, Any, Any], None]:
    """An attrs validator of a real number in ``[low, inf)`` (``(low, inf)`` with ``low_open``):
    ``trainer.validators.real_in_range(low, low_open=...)``, its message giving the allowed
    values as an interval, as the components' always have: ``Component.weight must be a real
    number in [0, inf), got -1``."""
    check = v.real_in_range(low, low_open=low_open)
    interval = f"{'(' if low_open else '['}{low:g}, inf)"

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        try:
            check(instance, attribute, value)
        except ValueError as error:  # WrongTypeError included: it is a ValueError too
            raise type(error)(
                f"{v.field_name(instance, attribute)} must be a real number in {interval}, "
                f"got {value!r}"
            ) from None

    return validate


@attrs.define(eq=False)
class Component(abc.ABC):  # noqa: B024 - abstract by intent; every hook is optional
    """Base class of everything the replay learner composes: extra losses and model updaters.

    The training loop calls :meth:`loss` on every step that has a memory batch and the ``on_*``
    hooks on the matching events, always with keyword arguments (``model=...``,
    ``checkpoint=...``). Every hook defaults to doing nothing, so subclasses override only what
    they need. Fields are validated on construction and on assignment.

    Args:
        weight: Non-negative scale of the component's loss; ``0`` means it adds no loss.
        sample_new_memory_batch: Whether the loop should draw a fresh memory batch for this
            component instead of reusing the one shared with the other components.

    Example:
        >>> import attrs, torch
        >>> @attrs.define(eq=False)
        ... class CountSteps(Component):
        ...     steps: int = 0
        ...     def on_train_batch_end(self, model):
        ...         self.steps += 1
        >>> c = CountSteps()
        >>> c.on_train_batch_end(model=torch.nn.Linear(2, 2))
        >>> c.steps, c.loss(torch.ones(3, 2), None, None)
        (1, tensor(0.))
    """

    weight: float = attrs.field(default=0.0, validator=real_from(0.0))
    sample_new_memory_batch: bool = attrs.field(default=False, validator=v.boolean)

    def loss(
        self,
        outputs_memory: torch.Tensor,
        batch_memory: BatchMemory,
        intermediate_representation_memory: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        """Returns this component's contribution to the training loss for a memory batch.

        Args:
            outputs_memory: The current model's logits for the memory inputs, shape ``(N, K)``.
            batch_memory: ``((inputs, targets), metadata)`` drawn from the memory buffer.
            intermediate_representation_memory: The current model's recorded intermediate
                representations for the memory inputs (may be ``None`` or empty).

        Returns:
            A scalar tensor; the base class returns zero on the device of ``outputs_memory``.
        """
        return outputs_memory.new_zeros(())

    def new_data_loss(
        self,
        outputs: torch.Tensor,
        batch: tuple[Any, torch.Tensor],
        intermediate_representations: list[torch.Tensor] | None,
    ) -> torch.Tensor | None:
        """Returns this component's loss on the step's batch of new data, or ``None`` for none.

        Called on every training step, memory or not, after the new-data loss (components that
        need no memory, such as EWC and LwF, add their terms here). The term is added as it is:
        it takes no part in ``loss_normalization``, which divides by the memory losses' weights.

        Args:
            outputs: The current model's logits for the new inputs (unmasked).
            batch: ``(inputs, targets)`` of the new data.
            intermediate_representations: The recorded features of the new inputs (may be empty).
        """
        return None

    @property
    def calls_model(self) -> bool:
        """Whether this component calls the model (or a copy of it) itself, beyond the
        learner's forward passes; such calls carry no task ids, so a learner refuses
        task-incremental data with it. False here."""
        return False

    def on_train_start(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Called once when training on new data starts, with the model being trained."""

    def on_train_batch_end(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Called after every optimizer step, with the model being trained."""

    def on_save_checkpoint(self, checkpoint: MutableMapping[str, Any]) -> None:  # noqa: B027
        """Writes this component's state into ``checkpoint`` (namespaced to the component).

        Values must be tensors or JSON-able values; nested dicts/lists may contain tensors.
        """

    def on_load_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:  # noqa: B027
        """Restores the state written by :meth:`on_save_checkpoint`.

        Tensors come back on the CPU and tuples come back as lists.
        """
