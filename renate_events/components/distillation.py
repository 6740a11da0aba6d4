"""Distillation from the model as it was when an update started: the part that methods distilling
from a frozen copy of the old model (Learning without Forgetting, iCaRL) share."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, cast

import attrs
import torch
from torch import nn

from renate_events.components.component import Component, call_model
from renate_events.components.features import copy_without_hooks
from trainer import validators as v
from trainer.capture import keep_in_step

__all__ = ["OldModelDistillation"]


@attrs.define(eq=False)
class OldModelDistillation(Component):
    """The part LwF and iCaRL share: a frozen copy of the model taken at the start of every
    update after the first, the classes seen in the batches trained so far, the classes seen
    before the copy was taken, and all three in checkpoints (the copy checked against the
    model's state before anything is restored)."""

    _old_model: nn.Module | None = attrs.field(init=False, default=None)
    _seen: torch.Tensor | None = attrs.field(init=False, default=None)  # classes seen so far
    _old_classes: torch.Tensor | None = attrs.field(init=False, default=None)  # at train_start
    _updates: int = attrs.field(init=False, default=0)  # updates started
    # What on_train_start replaced, until a batch went through (put back by on_exception).
    _before: tuple[Any, ...] | None = attrs.field(init=False, default=None)

    def on_train_start(self, model: nn.Module) -> None:
        """Freeze a copy of the model as it is before this update (none before the first)."""
        self._before = (self._updates, self._old_model, self._old_classes, self._seen)
        self._updates += 1
        if self._updates == 1:
            self._old_model, self._old_classes = None, None
            return
        self._old_model = self._frozen(model)
        self._old_classes = None if self._seen is None else self._seen.clone()

    def on_train_batch_end(self, model: nn.Module) -> None:
        """A batch went through: the update is under way and no longer undone on failure."""
        self._before = None

    def on_exception(self) -> None:
        """An update that fails before its first batch went through leaves no trace: the count
        of updates, the frozen copy and the classes are put back as they were before it (else
        a retried first update would distil from the untrained model)."""
        before, self._before = self._before, None
        if before is not None:
            self._updates, self._old_model, self._old_classes, self._seen = before

    @staticmethod
    def _frozen(model: nn.Module) -> nn.Module:
        twin = copy_without_hooks(model).eval()
        for parameter in twin.parameters():
            parameter.requires_grad_(False)
        return twin

    def _old_outputs(self, inputs: Any) -> torch.Tensor:
        """The frozen copy's outputs on ``inputs`` (no gradients)."""
        with torch.no_grad():
            return call_model(cast(nn.Module, self._old_model), inputs)

    def _note_classes(self, targets: torch.Tensor, classes: int) -> None:
        seen = self._seen
        if seen is None or seen.numel() != classes or seen.device != targets.device:
            grown = torch.zeros(classes, dtype=torch.bool, device=targets.device)
            if seen is not None:
                grown[: min(classes, seen.numel())] = seen[:classes].to(targets.device)
            seen = grown
        keep_in_step(self, "_seen", seen.index_fill(0, targets.reshape(-1).long(), True))

    def on_save_checkpoint(self, checkpoint: MutableMapping[str, Any]) -> None:
        checkpoint["updates"] = self._updates
        if self._seen is not None:
            checkpoint["seen_classes"] = self._seen
        if self._old_classes is not None:
            checkpoint["old_classes"] = self._old_classes
        if self._old_model is not None:
            checkpoint["old_model"] = dict(self._old_model.state_dict())

    def on_load_checkpoint(self, checkpoint: Mapping[str, Any], model: nn.Module) -> None:
        """Restore the frozen copy (checked against ``model``'s state) and the classes seen."""
        name = type(self).__name__
        updates = checkpoint.get("updates")
        if not v.is_int(updates) or updates < 0:
            raise ValueError(
                f"{name}: checkpoint key 'updates' must be an int >= 0, got {updates!r}"
            )
        for key in ("seen_classes", "old_classes"):
            value = checkpoint.get(key)
            if value is not None and (
                not isinstance(value, torch.Tensor) or value.dtype != torch.bool or value.dim() != 1
            ):
                raise ValueError(f"{name}: checkpoint key {key!r} must be a 1-d bool tensor")
        old_model = self._restored_copy(checkpoint.get("old_model"), model)
        self._updates = updates
        self._seen = checkpoint.get("seen_classes")
        self._old_classes = checkpoint.get("old_classes")
        self._old_model = old_model

    def _restored_copy(self, state: Any, model: nn.Module) -> nn.Module | None:
        if state is None:
            return None
        name, expected = type(self).__name__, model.state_dict()
        if not isinstance(state, Mapping) or set(state) != set(expected):
            raise ValueError(
                f"{name}: checkpoint key 'old_model' must hold the model's state "
                f"({len(expected)} tensors named as model.state_dict())"
            )
        for key, tensor in state.items():
            if not isinstance(tensor, torch.Tensor) or tensor.shape != expected[key].shape:
                raise ValueError(
                    f"{name}: checkpoint 'old_model'[{key!r}] does not match the model's "
                    f"shape {tuple(expected[key].shape)}"
                )
        old_model = self._frozen(model)
        old_model.load_state_dict(dict(state))
        return old_model
