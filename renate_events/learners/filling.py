"""When a learner's buffer is filled: after every step with that step's logits and features
(``buffer_filling="step"``), or at the end of the update with the final model's (``"end"``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import attrs
import torch
from torch import nn

from renate_events.inference import forward, inference, model_device
from renate_events.learners.batches import unpack_task
from renate_events.memory import DataBuffer
from trainer.data import to_device

__all__ = ["BUFFER_FILLINGS", "BufferFilling", "buffer_metadata"]

BUFFER_FILLINGS = ("step", "end")
"""The values of the learners' ``buffer_filling``: offer each trained batch to the buffer after
its step, or the whole update's data at its end with the final model's logits."""


def buffer_metadata(
    logits: torch.Tensor,
    features: Sequence[torch.Tensor],
    task_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """What the buffer stores beside each sample: ``logits``, the intermediate
    representations and, for task-incremental data, ``task_id`` (so that a replayed sample
    goes through its own head)."""
    # detach() and float() dispatch even on a tensor they would return as it is.
    if logits.requires_grad:
        logits = logits.detach()
    if logits.dtype != torch.float32:
        logits = logits.float()  # full precision under bf16/16-mixed
    metadata = {"logits": logits}
    for i, feature in enumerate(features):
        metadata[f"intermediate_representation_{i}"] = feature.detach()
    if task_ids is not None:
        metadata["task_id"] = task_ids
    return metadata


@attrs.define(eq=False)
class BufferFilling:
    """The buffer-filling part of :class:`~renate_events.learners.BaseExperienceReplayLearner`
    (a mixin of it, not usable alone; its state is the base learner's fields).

    A preset that fills its buffer its own way overrides :meth:`_add_to_buffer` (nothing per
    step) or :meth:`on_train_end`.
    """

    def on_batch_end(self, batch: Any, outputs: Mapping[str, Any], state: Any) -> None:
        """Offer the batch, its unmasked logits and its features to the buffer (with
        ``buffer_filling="step"``)."""
        self._undo = None  # a batch went through: nothing to undo any more
        if self.buffer is None or state.batch_skipped or self.buffer_filling == "end":
            return
        self._add_to_buffer(batch, outputs)

    def on_train_end(self, model: nn.Module) -> None:
        """With ``buffer_filling="end"``: offer the update's data to the buffer, once, unless the
        update failed or was interrupted (a ``KeyboardInterrupt`` also ends in ``train_end``)."""
        buffer, data = self.buffer, self._update_data
        if buffer is None or data is None or self._failed or self._filled:
            return
        self._filled = True  # from here on a failure, even a KeyboardInterrupt, takes it back
        self._fill_buffer(model, buffer, data)

    def _fill_buffer(self, model: nn.Module, buffer: DataBuffer, data: Any) -> None:
        """Offer every raw sample of ``data`` to ``buffer``, in order, with ``model``'s logits
        (eval mode, no gradients, inputs through ``test_transform``) and recorded features."""
        device = model_device(model)
        with inference(model):
            for batch in self._loader(data, shuffle=False):
                inputs, targets, task_ids = unpack_task(batch)
                shown = to_device(inputs, device)
                shown = self._transformed("test_transform", shown, len(targets))
                ids = None if task_ids is None else task_ids.to(device)
                logits = forward(model, shown, ids)
                metadata = buffer_metadata(logits, self._features(), task_ids)
                buffer.update(inputs, targets, metadata)

    def _add_to_buffer(self, batch: Any, outputs: Mapping[str, Any]) -> None:
        inputs, targets, task_ids = unpack_task(batch)
        metadata = buffer_metadata(outputs["logits"], outputs["features"], task_ids)
        cast(DataBuffer, self.buffer).update(inputs, targets, metadata)
