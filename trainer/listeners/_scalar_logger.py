"""What the scalar loggers share: the window of training scalars and the choice of rows."""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch

from trainer._runtime import batch_size_of

__all__ = ["ScalarLogger", "ScalarWindow"]


@attrs.define(eq=False)
class ScalarWindow:
    """Training scalars since the last logged row: sums on the device, counts on the host.

    The host reads the sums once per row (one ``tolist``, one synchronisation). The clock measures
    the window's wall time without validation, for samples per second.
    """

    sums: dict[str, torch.Tensor] = attrs.field(factory=dict)
    counts: dict[str, int] = attrs.field(factory=dict)
    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    started: float | None = None

    def add(self, loss: torch.Tensor, outputs: Any, batch: Any, trained: bool) -> None:
        self.steps += 1
        self.samples += batch_size_of(batch)
        if not trained:  # skipped for a non-finite loss: kept out of the means
            return
        self._add("train_loss", loss.detach().reshape(()))
        if isinstance(outputs, Mapping):
            for key, value in outputs.items():
                if key == "loss" or not isinstance(value, torch.Tensor) or value.dim() != 0:
                    continue
                if value.is_complex():
                    continue
                name = str(key) if str(key).startswith("train_") else f"train_{key}"
                self._add(name, value.detach())

    def _add(self, name: str, value: torch.Tensor) -> None:
        total = self.sums.get(name)
        if total is None:
            # A copy: the sum is updated in place and must not alias the step's own tensors.
            self.sums[name] = value.to(torch.float32, copy=True)
        else:
            total.add_(value.to(total.device))
        self.counts[name] = self.counts.get(name, 0) + 1

    def start_clock(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def stop_clock(self) -> None:
        if self.started is not None:
            self.seconds += time.perf_counter() - self.started
            self.started = None

    def take(self) -> tuple[dict[str, float], float | None]:
        """The window's means and samples per second; starts a new window."""
        names = list(self.sums)
        values: dict[str, float] = {}
        if names:
            device = self.sums[names[0]].device
            sums = torch.stack([self.sums[name].to(device) for name in names]).tolist()
            values = {name: total / self.counts[name] for name, total in zip(names, sums)}
        running = self.started is not None
        self.stop_clock()  # after the synchronisation above: the window's work is done
        rate = self.samples / self.seconds if self.samples and self.seconds > 0 else None
        self.sums, self.counts, self.steps, self.samples, self.seconds = {}, {}, 0, 0, 0.0
        if running:
            self.start_clock()
        return values, rate


def _learning_rates(raw: list[Any]) -> dict[str, float]:
    if len(raw) == 1:
        return {"lr": float(raw[0])}
    return {f"lr_group{i}": float(lr) for i, lr in enumerate(raw)}


@attrs.define(eq=False)
class ScalarLogger(abc.ABC):
    """What the scalar loggers share: which rows to write, and when.

    A training row every ``log_every_n_steps`` batches (and one for the remaining batches at
    ``train_end``) holds the means over the batches since the previous row of the loss
    (``train_loss``) and of every 0-d tensor in the step's ``outputs`` (``train_<key>``), the
    learning rate each parameter group used at the row's step (``lr``, or ``lr_group<i>``) and the
    training throughput (``samples_per_s``, validation time excluded); batches skipped for a
    non-finite loss stay out of the means, and ``skipped_batches`` counts them (when there are
    any) since the fit started. A validation row at every ``validation_end`` holds its metrics.
    Subclasses write rows, flush and close.
    """

    runs_on: ClassVar[str] = "rank_zero"
    """Where it runs in a distributed fit (see :data:`trainer.distributed.RUNS_ON`)."""

    _window: ScalarWindow = attrs.field(init=False, factory=ScalarWindow, repr=False)
    _lrs: list[Any] = attrs.field(init=False, factory=list, repr=False)
    _fresh: bool = attrs.field(init=False, default=False, repr=False)
    _resumed_at: int | None = attrs.field(init=False, default=None, repr=False)

    log_every_n_steps: int

    def on_train_start(self) -> None:
        self._window = ScalarWindow()
        self._window.start_clock()
        self._fresh, self._resumed_at = True, None

    def on_epoch_start(self, state: Any) -> None:
        self._note_resume(state)

    def on_batch_start(self, optimizer: torch.optim.Optimizer) -> None:
        self._lrs = [group["lr"] for group in optimizer.param_groups]  # host values: no sync

    def on_batch_end(self, state: Any, batch: Any, outputs: Any, loss: torch.Tensor) -> None:
        self._window.add(loss, outputs, batch, trained=not state.batch_skipped)
        if state.global_step % self.log_every_n_steps == 0:
            self._log_window(state)

    def on_epoch_end(self) -> None:
        self._flush()

    def on_validation_start(self, state: Any) -> None:
        self._note_resume(state)
        self._window.stop_clock()

    def on_validation_end(self, state: Any, metrics: Mapping[str, float]) -> None:
        if metrics:
            self._write_row(state.global_step, state.epoch, dict(metrics))
        self._window.start_clock()

    def on_train_end(self, state: Any) -> None:
        if self._window.steps:
            self._log_window(state)
        self._close()

    def on_exception(self) -> None:
        self._close()

    def _note_resume(self, state: Any) -> None:
        # The first epoch or validation of a fit; a global step above 0 here means the fit
        # resumed from a checkpoint at that step (it is restored right after train_start).
        if self._fresh:
            self._fresh = False
            self._resumed_at = state.global_step or None

    def _log_window(self, state: Any) -> None:
        values, rate = self._window.take()
        if self._lrs:
            values.update(_learning_rates(self._lrs))
        if rate is not None:
            values["samples_per_s"] = rate
        if state.skipped_batches:
            values["skipped_batches"] = state.skipped_batches
        self._write_row(state.global_step, state.epoch, values)

    @abc.abstractmethod
    def _write_row(self, step: int, epoch: int, values: dict[str, float]) -> None:
        """Write one row of ``values`` at ``step`` and ``epoch``."""

    @abc.abstractmethod
    def _flush(self) -> None:
        """Make the rows written so far readable by others."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Flush and release the output; the next row opens it again."""
