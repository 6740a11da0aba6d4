"""Training and validation scalars to a CSV or JSON-lines file."""

from __future__ import annotations

import csv
import json
import os
from typing import Any

import attrs

from trainer import validators
from trainer.listeners._scalar_logger import ScalarLogger

__all__ = ["MetricsLogger"]


@attrs.define(eq=False)
class MetricsLogger(ScalarLogger):
    """Training and validation scalars to a CSV or JSON-lines file.

    Every ``log_every_n_steps`` batches it writes the means since the previous row of the loss
    (``train_loss``) and of every 0-d tensor in the step's ``outputs`` mapping (``train_<key>``,
    e.g. per-component losses), the learning rate each parameter group used (``lr``, or
    ``lr_group<i>`` with several groups), the throughput (``samples_per_s``) and, if
    ``Trainer(nonfinite_loss="skip")`` skipped batches, their count so far in this fit
    (``skipped_batches``; they stay out of the means); the remaining batches get a row at
    ``train_end``. Every validation writes its metrics (``val_loss``, ...).
    Between rows the losses are summed on the device: no ``.item()``, no host synchronisation.

    ``"jsonl"`` writes one object per row: ``{"step": 8, "epoch": 0, "train_loss": 0.93, ...}``.
    ``"csv"`` writes one line per value, ``step,epoch,name,value``, so that rows with different
    names share one header (``pandas.read_csv(path).pivot_table("value", "step", "name")`` makes a
    wide table of it). The file is opened on the first row and appended to (a resumed fit
    continues it; rows a crashed run wrote after its checkpoint stay, so readers keep the last
    value per step and name), flushed at ``epoch_end`` and ``train_end`` and closed at
    ``train_end`` or on an exception.

    Args:
        path: The file to write; its folder is created if missing.
        format: ``"csv"`` or ``"jsonl"``.
        log_every_n_steps: Batches per training row.

    Raises:
        ValueError: When ``format`` or ``log_every_n_steps`` is invalid.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer()
        >>> trainer.subscribe(MetricsLogger("logs/metrics.csv", log_every_n_steps=10))
        'metrics_logger_0'
    """

    path: str = attrs.field(converter=os.fspath)
    format: str = attrs.field(default="csv", validator=validators.one_of("csv", "jsonl"))
    log_every_n_steps: int = attrs.field(default=50, validator=validators.int_at_least(1))
    _file: Any = attrs.field(init=False, default=None, repr=False)
    _csv: Any = attrs.field(init=False, default=None, repr=False)

    def _open(self) -> None:
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        if self.format == "csv":
            self._csv = csv.writer(self._file)
            if self._file.tell() == 0:
                self._csv.writerow(["step", "epoch", "name", "value"])

    def _write_row(self, step: int, epoch: int, values: dict[str, float]) -> None:
        if not values:
            return
        if self._file is None:
            self._open()
        if self.format == "csv":
            self._csv.writerows([step, epoch, name, value] for name, value in values.items())
        else:
            self._file.write(json.dumps({"step": step, "epoch": epoch, **values}) + "\n")

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file, self._csv = None, None
