"""Learning without Forgetting (LwF): distillation of the previous model's outputs on the new
data, and its memory-free learner.

Li and Hoiem, "Learning without Forgetting", ECCV 2016 (TPAMI 2018).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from renate_events.components import Component, OldModelDistillation
from renate_events.learners import BaseExperienceReplayLearner, ReplayOnlyForMemoryLosses
from renate_events.methods.registry import MethodSpec, register
from trainer import validators as v
from trainer.capture import keep_in_step

__all__ = [
    "SPEC",
    "LearningWithoutForgettingComponent",
    "LearningWithoutForgettingLearner",
    "distillation_loss",
]


def distillation_loss(
    outputs: torch.Tensor,
    old_outputs: torch.Tensor,
    temperature: float,
    classes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``KL(softmax(old / T) || softmax(new / T))``, summed over classes, averaged over samples.

    With ``classes`` (a boolean mask over the logits) only those logits enter both softmaxes
    (the classes the old model was trained on, as Avalanche's LwF restricts it); the masking is
    a tensor operation, without a host-device synchronisation.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[1.0, 2.0]])
        >>> float(distillation_loss(logits, logits, 2.0))
        0.0
    """
    new, old = outputs / temperature, old_outputs / temperature
    if classes is not None:
        new = new.masked_fill(~classes, float("-inf"))
        old = old.masked_fill(~classes, float("-inf"))
    log_p = torch.log_softmax(new, dim=-1)
    q = torch.softmax(old, dim=-1)
    log_q = torch.log_softmax(old, dim=-1)
    if classes is not None:  # 0 * (-inf) would be NaN: the masked classes contribute nothing
        log_p = log_p.masked_fill(~classes, 0.0)
        log_q = log_q.masked_fill(~classes, 0.0)
    return (q * (log_q - log_p)).sum(dim=-1).mean()


@attrs.define(eq=False)
class LearningWithoutForgettingComponent(OldModelDistillation):
    """LwF: ``alpha * KL(old model || model)`` at temperature ``T`` on every new-data batch.

    At the start of every update (``train_start``) a frozen copy of the model is taken; from
    the second update on, each step adds :func:`distillation_loss` between the copy's and the
    model's logits on the new batch, over the classes seen in earlier updates (the targets of
    the batches trained so far; all logits when targets are not class labels), through
    :meth:`~renate_events.components.Component.new_data_loss`. Avalanche's form (which Renate
    wraps): no ``T ** 2`` factor. The copy and the classes are stored in checkpoints.

    Args:
        alpha: Weight of the distillation term (Renate's default 1).
        temperature: Softmax temperature (Renate's default 2).
    """

    alpha: float = attrs.field(default=1.0, validator=v.real_in_range(0))
    temperature: float = attrs.field(default=2.0, validator=v.real_in_range(0, low_open=True))

    @property
    def calls_model(self) -> bool:
        """The frozen copy of the model runs on every new batch (with ``alpha > 0``)."""
        return self.alpha > 0

    def new_data_loss(
        self,
        outputs: torch.Tensor,
        batch: tuple[Any, torch.Tensor],
        intermediate_representations: list[torch.Tensor] | None,
    ) -> torch.Tensor | None:
        inputs, targets = batch
        labels = not targets.dtype.is_floating_point and targets.dim() == 1
        if labels:
            self._note_classes(targets, outputs.shape[-1])
        if self._old_model is None or self.alpha == 0:
            return None
        old_outputs = self._old_outputs(inputs)
        classes = self._old_classes if labels else None
        if classes is not None and classes.device != outputs.device:
            classes = classes.to(outputs.device)
            keep_in_step(self, "_old_classes", classes)
        loss = distillation_loss(outputs, old_outputs, self.temperature, classes)
        return loss if self.alpha == 1 else loss * self.alpha


@attrs.define(eq=False)
class LearningWithoutForgettingLearner(ReplayOnlyForMemoryLosses, BaseExperienceReplayLearner):
    """LwF: fine-tuning plus distillation of the previous model's outputs on the new data.

    Li and Hoiem, "Learning without Forgetting", ECCV 2016. Renate's defaults ``alpha = 1``,
    ``temperature = 2``. The component is ``lwf``
    (:class:`LearningWithoutForgettingComponent`); no memory by default, and with a memory no
    replay unless a component of your own has a memory weight.
    """

    memory_size: int = attrs.field(default=0, validator=v.int_at_least(0))
    alpha: float = attrs.field(default=1.0, kw_only=True, validator=v.real_in_range(0))
    temperature: float = attrs.field(
        default=2.0, kw_only=True, validator=v.real_in_range(0, low_open=True)
    )

    def default_components(self) -> dict[str, Component]:
        return {
            "lwf": LearningWithoutForgettingComponent(
                alpha=self.alpha, temperature=self.temperature
            )
        }


SPEC = register(
    MethodSpec(
        name="lwf",
        learner=LearningWithoutForgettingLearner,
        summary="LwF: distillation of the previous model's outputs on the new data, no memory (Li "
        "and Hoiem, 'Learning without Forgetting', ECCV 2016, TPAMI 2018)",
        uses_memory=False,
    )
)
