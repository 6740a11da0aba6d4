"""Training and validation scalars to TensorBoard."""

from __future__ import annotations

import os
from typing import Any

import attrs

from trainer import validators
from trainer.listeners._scalar_logger import ScalarLogger

__all__ = ["TensorBoardLogger"]


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "TensorBoardLogger needs the tensorboard package: pip install "
            "'renate-events[tensorboard]' (or pip install tensorboard)"
        ) from exc
    return SummaryWriter


@attrs.define(eq=False)
class TensorBoardLogger(ScalarLogger):
    """The scalars of :class:`MetricsLogger`, written with TensorBoard's ``SummaryWriter``.

    Each value is a scalar named like the :class:`MetricsLogger` column (``train_loss``, ``lr``,
    ``samples_per_s``, ``val_loss``, ...) at the row's global step. The writer is created on the
    first row, flushed at ``epoch_end`` and closed at ``train_end`` or on an exception. A fit
    resumed from a checkpoint at step ``s`` purges what an earlier run logged after ``s`` in the
    same folder (TensorBoard's ``purge_step``).

    Args:
        log_dir: The folder of the event files.
        log_every_n_steps: Batches per training row.

    Raises:
        ImportError: When tensorboard is not installed.
        ValueError: When ``log_every_n_steps`` is not an int >= 1.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer()
        >>> trainer.subscribe(TensorBoardLogger("runs/exp1"))  # doctest: +SKIP
        'tensor_board_logger_0'
    """

    log_dir: str = attrs.field(converter=os.fspath)
    log_every_n_steps: int = attrs.field(default=50, validator=validators.int_at_least(1))
    _writer_class: Any = attrs.field(init=False, factory=_summary_writer, repr=False)
    _writer: Any = attrs.field(init=False, default=None, repr=False)

    def _write_row(self, step: int, epoch: int, values: dict[str, float]) -> None:
        if self._writer is None:
            purge = None if self._resumed_at is None else self._resumed_at + 1
            self._resumed_at = None  # purge once; a writer reopened later keeps this run's data
            self._writer = self._writer_class(log_dir=self.log_dir, purge_step=purge)
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)

    def _flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
