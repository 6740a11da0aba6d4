"""The base of the loggers that write to an experiment tracker's run (MLflow, Weights & Biases,
TensorBoard): the scalar rows, the per-epoch means, and what a caller logs itself."""

from __future__ import annotations

import abc
import json
import numbers
import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from trainer import validators
from trainer.listeners._scalar_logger import ScalarLogger, ScalarWindow

__all__ = ["ExperimentTracker", "flat_params"]

_PARAM_TYPES = (bool, int, float, str)


def flat_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``params`` with nested mappings flattened into dotted keys, and values that are not a
    bool, int, float, string or None as JSON (a list) or text (anything else).

    Example:
        >>> flat_params({"lr": 0.1, "trainer": {"max_epochs": 2, "device": None}, "hidden": [8]})
        {'lr': 0.1, 'trainer.max_epochs': 2, 'trainer.device': None, 'hidden': '[8]'}
    """
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_params(value, f"{name}."))
        elif value is None or isinstance(value, _PARAM_TYPES):
            flat[name] = value
        elif isinstance(value, (list, tuple)):
            try:
                flat[name] = json.dumps(list(value))
            except TypeError:
                flat[name] = str(list(value))
        else:
            flat[name] = str(value)
    return flat


@attrs.define(eq=False)
class ExperimentTracker(ScalarLogger):
    """The rows of :class:`~trainer.listeners.MetricsLogger`, and per-epoch means, as the metrics of
    one run of an experiment tracker; hyperparameters, metrics and artifacts logged by the caller.

    What the loop logs, at the run's step (see below):

    * every ``log_every_n_steps`` batches, the means since the previous row of ``train_loss``
      and of every 0-d tensor in the step's outputs (``train_<key>``), ``lr`` (or
      ``lr_group<i>``), ``samples_per_s`` and ``skipped_batches`` (as
      :class:`~trainer.listeners.MetricsLogger` writes them);
    * at every ``epoch_end``, the epoch's means of the training scalars (``train_loss_epoch``,
      ``train_<key>_epoch``) and ``epoch``;
    * at every ``validation_end``, the validation metrics (``val_loss``, ...).

    Between rows the sums stay on the device: no host synchronisation but one per row and one
    per epoch.

    The run opens at the first value logged. Unless ``keep_open``, it ends at ``train_end``
    (``finish()``) or failed on an exception, and a later fit logs to a new one; with
    ``keep_open``, several fits log to the same run until the caller calls :meth:`finish`. The
    run's step is the trainer's global step, offset so that a fit starting from step 0 continues
    after the last step this logger logged (a fit resumed from a checkpoint keeps its steps).

    Args:
        keep_open: Keep the run open after a fit (keyword only); the caller ends it with
            :meth:`finish`.

    Subclasses open and end the run and send metrics, parameters and artifacts.
    """

    keep_open: bool = attrs.field(default=False, kw_only=True, validator=validators.boolean)
    _epoch: ScalarWindow = attrs.field(init=False, factory=ScalarWindow, repr=False)
    _offset: int = attrs.field(init=False, default=0, repr=False)
    _step: int = attrs.field(init=False, default=0, repr=False)
    _running: bool = attrs.field(init=False, default=False, repr=False)

    @property
    def step(self) -> int:
        """The run's step: the largest step logged so far (0 before any)."""
        return self._step

    @property
    def running(self) -> bool:
        """Whether a run is open."""
        return self._running

    # -- what a caller logs ----------------------------------------------------------------------

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log hyperparameters (nested mappings as dotted keys, see :func:`flat_params`).

        Opens the run if none is open.
        """
        flat = flat_params(params)
        if flat:
            self._ensure_run()
            self._send_params(flat)

    def log_metrics(self, values: Mapping[str, float], step: int | None = None) -> None:
        """Log numbers at ``step`` (default: the run's current step, :attr:`step`).

        Raises:
            ValueError: When ``step`` is not an int >= 0 or a value is not a real number (NaN
                and infinities are logged as they are).
        """
        if step is None:
            step = self._step
        validators.check_int(f"{type(self).__name__}.log_metrics step", step, 0)
        given: dict[str, float] = {}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise validators.WrongTypeError(
                    f"{type(self).__name__}.log_metrics: {name!r} must be a number (a tensor: "
                    f"call .item() once), got {value!r}"
                )
            given[str(name)] = float(value)
        if not given:
            return
        self._ensure_run()
        self._send_metrics(given, step)
        self._step = max(self._step, step)

    def log_artifact(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        """Log a file or a folder (all its files) as an artifact of the run, called ``name``
        (default: the file's or folder's own name; MLflow keeps a file under its own name and a
        folder's files under ``name``).

        Raises:
            FileNotFoundError: When ``path`` is neither a file nor a folder.
        """
        path = os.fspath(path)
        if not (os.path.isfile(path) or os.path.isdir(path)):
            raise FileNotFoundError(
                f"{type(self).__name__}.log_artifact: {path} is neither a file nor a folder"
            )
        self._ensure_run()
        self._send_artifact(path, name or os.path.basename(os.path.normpath(path)))

    def finish(self, failed: bool = False) -> None:
        """End the run (as failed when ``failed``); nothing happens when none is open."""
        if self._running:
            self._running = False
            self._end_run(failed)

    # -- the loop --------------------------------------------------------------------------------

    def on_train_start(self) -> None:
        super().on_train_start()
        self._epoch = ScalarWindow()

    def on_batch_end(self, state: Any, batch: Any, outputs: Any, loss: torch.Tensor) -> None:
        self._epoch.add(loss, outputs, batch, trained=not state.batch_skipped)
        super().on_batch_end(state, batch, outputs, loss)

    def on_epoch_end(self, state: Any) -> None:  # type: ignore[override]
        self._log_epoch(state)
        super().on_epoch_end()

    def on_train_end(self, state: Any) -> None:
        self._log_epoch(state)  # a fit that stopped within an epoch
        super().on_train_end(state)

    def on_exception(self) -> None:
        if self.keep_open:
            self._flush()
        else:
            self.finish(failed=True)

    def _log_epoch(self, state: Any) -> None:
        if not self._epoch.steps:
            return
        means, _ = self._epoch.take()
        row = {f"{name}_epoch": value for name, value in means.items()}
        self._write_row(state.global_step, state.epoch, {**row, "epoch": state.epoch})

    def _note_resume(self, state: Any) -> None:
        starting = self._fresh
        super()._note_resume(state)
        if starting and not state.global_step:  # a fit from step 0 follows what was logged
            self._offset = self._step

    def _write_row(self, step: int, epoch: int, values: dict[str, float]) -> None:
        self.log_metrics(values, self._offset + step)

    def _close(self) -> None:
        if self.keep_open:
            self._flush()
        else:
            self.finish()

    def _ensure_run(self) -> None:
        if not self._running:
            self._start_run()
            self._running = True

    # -- what a tracker implements ---------------------------------------------------------------

    @abc.abstractmethod
    def _start_run(self) -> None:
        """Open a run."""

    @abc.abstractmethod
    def _send_metrics(self, values: dict[str, float], step: int) -> None:
        """Log ``values`` at ``step`` to the open run."""

    @abc.abstractmethod
    def _send_params(self, params: dict[str, Any]) -> None:
        """Log flat hyperparameters to the open run."""

    @abc.abstractmethod
    def _send_artifact(self, path: str, name: str) -> None:
        """Log the file or folder ``path`` as the artifact ``name`` of the open run."""

    @abc.abstractmethod
    def _end_run(self, failed: bool) -> None:
        """End the open run."""
