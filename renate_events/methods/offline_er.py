"""Offline experience replay (Renate's Offline-ER): the buffer filled at the end of each update,
and a loss weighted between the new data and the memory by their sizes.

Renate (Amazon's continual-learning library), ``OfflineExperienceReplayLearner``; the method of
Renate's published benchmark configurations.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import attrs
from torch.utils.data import Dataset

from renate_events.components import Component, WeightedCustomLossComponent
from renate_events.learners import BUFFER_FILLINGS, BaseExperienceReplayLearner
from renate_events.methods.registry import MethodSpec, register
from trainer import FitResult, validators

__all__ = ["SPEC", "OfflineExperienceReplayLearner"]


@attrs.define(eq=False)
class OfflineExperienceReplayLearner(BaseExperienceReplayLearner):
    """Offline-ER (Renate's ``OfflineExperienceReplayLearner``): the buffer is filled at the end
    of each update, and the loss is ``w * L_new + (1 - w) * L_memory``.

    During an update the buffer holds only earlier updates' data; at the trainer's
    ``train_end`` every sample of the update's data is offered to it with the final model's
    logits (``buffer_filling="end"``, this learner's default: the base learner's end fill).
    ``loss_weight_new_data`` is ``w`` in ``[0, 1]``, or ``None`` (Renate's default) for
    ``w = N_t / (N_t + N_memory)``: the update's size over itself plus the buffer's, fixed when
    the update starts. Without a memory batch yet (the first update) the loss is ``L_new``, as in
    Renate. The memory loss is ``memory_loss`` (the learner's loss function, a fresh batch).
    Renate's defaults: ``memory_size = 32``, ``loss_weight_new_data = None``.
    """

    loss_weight_new_data: float | None = attrs.field(
        default=None,
        kw_only=True,
        validator=validators.real_in_range(0, 1, optional=True),
    )
    buffer_filling: str = attrs.field(
        default="end", kw_only=True, validator=validators.one_of(*BUFFER_FILLINGS)
    )

    def default_components(self) -> dict[str, Component]:
        return {
            "memory_loss": WeightedCustomLossComponent(
                loss_fn=self.loss_fn, weight=0.0, sample_new_memory_batch=True
            )
        }

    def fit(
        self,
        train_data: Dataset[Any] | Iterable[Any],
        val_data: Dataset[Any] | Iterable[Any] | None = None,
        *,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> FitResult:
        memory_loss = self.components.get("memory_loss")
        weights = (self.loss_weight, None if memory_loss is None else memory_loss.weight)
        self._set_weights(train_data)
        try:
            return super().fit(train_data, val_data, resume_from=resume_from)
        except BaseException:  # a refused or failed update leaves the weights as they were
            self.loss_weight = weights[0]
            if memory_loss is not None and weights[1] is not None:
                memory_loss.weight = weights[1]
            raise

    def _set_weights(self, train_data: Any) -> None:
        """``loss_weight = w`` and the memory loss's weight ``1 - w`` for this update."""
        buffer = self.buffer
        held = 0 if buffer is None else len(buffer)
        weight = self.loss_weight_new_data
        if held < self._memory_batch():
            weight = 1.0  # no memory batch yet: the new-data loss alone
        elif weight is None:
            try:
                size = len(train_data)
            except TypeError:
                raise ValueError(
                    f"{type(self).__name__}.loss_weight_new_data=None weighs the update by its "
                    "size, but the training data has no len(); pass a dataset or set "
                    "loss_weight_new_data to a number in [0, 1]"
                ) from None
            weight = size / (size + held)
        self.loss_weight = float(weight)
        memory_loss = self.components.get("memory_loss")
        if isinstance(memory_loss, WeightedCustomLossComponent):
            memory_loss.weight = 1.0 - float(weight)

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["loss_weight"] = self.loss_weight

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        """As the base learner's; a resumed update keeps the weights it started with."""
        super().on_load_checkpoint(checkpoint)
        weight = checkpoint.get("loss_weight")
        if weight is not None:
            if not validators.is_real(weight) or not 0 <= weight <= 1:
                raise ValueError(
                    f"{type(self).__name__}: checkpoint key 'loss_weight' must be a real number "
                    f"in [0, 1], got {weight!r}"
                )
            self.loss_weight = float(weight)
            memory_loss = self.components.get("memory_loss")
            if isinstance(memory_loss, WeightedCustomLossComponent):
                memory_loss.weight = 1.0 - float(weight)


SPEC = register(
    MethodSpec(
        name="offline-er",
        learner=OfflineExperienceReplayLearner,
        summary="Offline-ER: the buffer filled at the end of each update, the loss weighted by "
        "the sizes of new data and memory (Renate's OfflineExperienceReplayLearner)",
    )
)
