"""Training and validation scalars, hyperparameters and artifact paths to TensorBoard."""

from __future__ import annotations

import os
from typing import Any

import attrs

from trainer import validators
from trainer.listeners._common import import_optional
from trainer.listeners.tracker import ExperimentTracker

__all__ = ["TensorBoardLogger"]


def _summary_writer() -> Any:
    module = import_optional(
        "torch.utils.tensorboard",
        owner="TensorBoardLogger",
        package="tensorboard",
        extra="tensorboard",
        install="tensorboard",
    )
    return module.SummaryWriter


@attrs.define(eq=False)
class TensorBoardLogger(ExperimentTracker):
    """The scalars of :class:`MetricsLogger`, written with TensorBoard's ``SummaryWriter``.

    Each value is a scalar named like the :class:`MetricsLogger` column (``train_loss``, ``lr``,
    ``samples_per_s``, ``val_loss``, ...) at the row's global step, with the per-epoch means of
    :class:`ExperimentTracker` (``train_loss_epoch``, ...). The writer is created on the first
    row, flushed at ``epoch_end`` and closed at ``train_end`` or on an exception (a later row opens
    it again, in the same folder). A fit resumed from a checkpoint at step ``s`` purges what an
    earlier run logged after ``s`` in the same folder (TensorBoard's ``purge_step``).

    :meth:`log_params` writes the hyperparameters as a table in the text tab
    (``hyperparameters``); TensorBoard keeps no files, so :meth:`log_artifact` writes the
    artifact's absolute path there (``artifacts``) and copies nothing.

    Args:
        log_dir: The folder of the event files.
        log_every_n_steps: Batches per training row.

    Raises:
        MissingPackageError: When tensorboard is not installed (an ``ImportError``).
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

    def _start_run(self) -> None:
        purge = None if self._resumed_at is None else self._offset + self._resumed_at + 1
        self._resumed_at = None  # purge once; a writer reopened later keeps this run's data
        self._writer = self._writer_class(log_dir=self.log_dir, purge_step=purge)

    def _send_metrics(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)

    def _send_params(self, params: dict[str, Any]) -> None:
        rows = "\n".join(f"| {name} | {value} |" for name, value in params.items())
        table = f"| parameter | value |\n|---|---|\n{rows}"
        self._writer.add_text("hyperparameters", table, global_step=self.step)

    def _send_artifact(self, path: str, name: str) -> None:
        text = f"{name}: {os.path.abspath(path)}"
        self._writer.add_text("artifacts", text, global_step=self.step)

    def _flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def _end_run(self, failed: bool) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
