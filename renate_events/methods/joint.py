"""Joint training: every update trains on all data seen so far (the upper baseline)."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, cast

import attrs
import torch
from torch.utils.data import DataLoader, Dataset

from renate_events.learners import (
    BaseExperienceReplayLearner,
    buffer_loader,
    check_splits,
    derived_seed,
    refuse_task_data,
    reset_parameters,
)
from renate_events.memory import BufferDataset, DataBuffer, InfiniteBuffer
from renate_events.methods.registry import MethodSpec, register
from trainer import FitResult, validators

__all__ = ["SPEC", "JointLearner"]


@attrs.define(eq=False)
class JointLearner(BaseExperienceReplayLearner):
    """Trains on all data seen so far at every update (an upper baseline).

    Every ``fit`` adds the new data to an :class:`~renate_events.memory.InfiniteBuffer` (stored in
    checkpoints like any buffer) and trains on the whole buffer; with ``reset_model`` (default)
    the model's parameters are re-initialised first, so each update is joint training from
    scratch. ``fit`` needs a dataset whose items are ``(inputs, target)`` tensors.
    """

    memory_size: int = attrs.field(default=0, validator=validators.int_at_least(0))
    reset_model: bool = attrs.field(default=True, kw_only=True)
    # Where this update's data starts in the buffer, until on_train_start notes it for undo.
    _added_from: int | None = attrs.field(init=False, default=None)
    _fills_own_buffer: ClassVar[bool] = True

    def __attrs_post_init__(self) -> None:
        if self.buffer is None:
            self.buffer = InfiniteBuffer(seed=derived_seed(self.seed, 0))
        super().__attrs_post_init__()

    def fit(
        self,
        train_data: Dataset[Any] | Iterable[Any],
        val_data: Dataset[Any] | Iterable[Any] | None = None,
        *,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> FitResult:
        buffer = self.buffer
        if buffer is None:  # pragma: no cover - set in __attrs_post_init__
            raise RuntimeError("JointLearner has no buffer")
        try:
            if resume_from is None:
                check_splits(self, train_data, val_data)
                self._add_update_data(train_data)
                if self.reset_model:
                    reset_parameters(self.model)
            return super().fit(buffer.dataset(), val_data, resume_from=resume_from)
        except BaseException:
            self._drop_update_data()  # when the fit failed before train_start noted it
            raise

    def check_data(self, data: Any) -> None:
        """As the base learner's; data with task ids (three tensors) is refused: the buffer's
        dataset, which this learner trains on, yields ``(inputs, targets)``."""
        refuse_task_data(self, data)
        super().check_data(data)

    def _add_update_data(self, data: Any) -> None:
        """Add the update's data to the buffer; with an :class:`InfiniteBuffer`, note where it
        starts, so that an update failing before any of its batches trained takes it back."""
        buffer = cast(DataBuffer, self.buffer)
        if isinstance(buffer, InfiniteBuffer):
            self._added_from = len(buffer)
        for inputs, targets in DataLoader(data, batch_size=1024):
            buffer.update(inputs, targets)

    def _drop_update_data(self) -> None:
        start, self._added_from = self._added_from, None
        if start is not None:
            cast(InfiniteBuffer, self.buffer).truncate(start)

    def on_train_start(self) -> None:
        """As the base learner's; the update's data is then taken back by :meth:`on_exception`
        if the update fails before a batch went through."""
        super().on_train_start()
        if self._added_from is not None and self._undo is not None:
            start, self._added_from = self._added_from, None
            self._undo.append(functools.partial(cast(InfiniteBuffer, self.buffer).truncate, start))

    def _loader(self, data: Any, shuffle: bool) -> Iterable[Any]:
        if isinstance(data, BufferDataset):  # stacked batches straight from the buffer's storage
            return buffer_loader(data, self._new_batch_size, shuffle)
        return super()._loader(data, shuffle)

    def _check_first_batch(
        self,
        inputs: Any,
        targets: torch.Tensor,
        outputs: torch.Tensor,
        features: Sequence[torch.Tensor],
        *,
        task_ids: torch.Tensor | None = None,
    ) -> None:
        """Nothing to check: the batches come from the buffer's own storage."""

    def _add_to_buffer(self, batch: Any, outputs: Mapping[str, Any]) -> None:
        """Nothing to add per step: the buffer already holds every training sample."""


SPEC = register(
    MethodSpec(
        name="joint",
        learner=JointLearner,
        summary="joint training on all data seen so far at every update, from re-initialised "
        "parameters: the upper baseline of every continual-learning comparison",
        uses_memory=False,
        own_buffer=True,
    )
)
