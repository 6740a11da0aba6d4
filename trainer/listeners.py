"""Ready-made listeners.

Each is an attrs class; subscribe an instance with ``trainer.subscribe(...)`` (the :class:`Timer`
attaches itself with ``timer.attach(trainer)``, since it needs two places in the dispatch order).

* :class:`ProgressBar`: a tqdm bar per epoch (needs ``tqdm``).
* :class:`MetricsLogger`: training and validation scalars to a CSV or JSON-lines file.
* :class:`TensorBoardLogger`: the same scalars to TensorBoard (needs ``tensorboard``).
* :class:`ModelCheckpoint`: periodic, last and best checkpoints, keeping the last K.
* :class:`EarlyStopping`: ends the fit when a validation metric stops improving.
* :class:`LearningRateMonitor`: the learning rate of every parameter group, step by step.
* :class:`Timer`: host wall time spent in the listeners of each event.

The loggers read Python numbers from the device only every ``log_every_n_steps`` batches: in
between they add the losses up on the device, so that they add no host synchronisation to the
other steps. They keep no state in checkpoints, so they can be added to or removed from a run
between a save and a resume; :class:`ModelCheckpoint` and :class:`EarlyStopping` do keep theirs.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch

from trainer._runtime import batch_size_of
from trainer.checkpoint import rank_path
from trainer.events import EVENTS

__all__ = [
    "EarlyStopping",
    "LearningRateMonitor",
    "MetricsLogger",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoardLogger",
    "Timer",
]


# -- argument checks ---------------------------------------------------------------------------


def _int_at_least(minimum: int, *, optional: bool = False) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
            return
        allowed = f"an int >= {minimum}" + (" or None" if optional else "")
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be {allowed}, got {value!r}"
        )

    return check


def _number_at_least(minimum: float) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= minimum
        ):
            return
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a finite number >= {minimum}, "
            f"got {value!r}"
        )

    return check


def _one_of(*allowed: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in allowed:
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name} must be one of {list(allowed)}, "
                f"got {value!r}"
            )

    return check


def _metric_name(*, optional: bool = False) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, str) and value:
            return
        allowed = "a metric name such as 'val_loss'" + (" or None" if optional else "")
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be {allowed}, got {value!r}"
        )

    return check


def _improved(value: float, best: float | None, mode: str, min_delta: float) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` (NaN never does)."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


def _monitored(owner: Any, monitor: str, metrics: Mapping[str, float]) -> float:
    if monitor not in metrics:
        raise ValueError(
            f"{type(owner).__name__} monitors {monitor!r}, which is not among the validation "
            f"metrics {sorted(metrics)}; set monitor= to one of them (val_step's keys get a "
            "'val_' prefix)"
        )
    return float(metrics[monitor])


def _after_pending_saves(trainer: Any, action: Callable[[], Any]) -> None:
    """Run ``action`` after the checkpoints a listener asked for during this event are written.

    ``trainer.save_checkpoint`` called from a listener waits until every listener has handled
    the event; actions deferred after it run after it, and are dropped if the write fails.
    """
    if trainer.events.dispatching:
        trainer.events.defer(action)
    else:
        action()


# -- progress bar --------------------------------------------------------------------------------


def _tqdm() -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "ProgressBar needs tqdm: pip install 'renate-events[progress]' (or pip install tqdm)"
        ) from exc
    return tqdm


@attrs.define(eq=False)
class ProgressBar:
    """A tqdm progress bar per epoch with the loss, refreshed every ``log_every_n_steps``.

    The loss is read as a Python number only every ``log_every_n_steps`` batches, so the bar adds
    no device synchronisation to the other steps. The bar is silent when the output is not a
    terminal (tqdm's ``disable=None``) unless ``always`` is set.

    Args:
        description: Text in front of each bar (e.g. the task's name).
        log_every_n_steps: How often the loss shown is refreshed.
        always: Show the bar even when the output is not a terminal.
        leave: Keep finished bars on screen.

    Raises:
        ImportError: When tqdm is not installed.
        ValueError: When ``log_every_n_steps`` is not an int >= 1.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer()
        >>> trainer.subscribe(ProgressBar(description="task 1"))
        'progress_bar_0'
    """

    runs_on: ClassVar[str] = "rank_zero"
    """Where it runs in a distributed fit (see :data:`trainer.distributed.RUNS_ON`)."""

    description: str = ""
    log_every_n_steps: int = attrs.field(default=10, validator=_int_at_least(1))
    always: bool = False
    leave: bool = False
    _total: int | None = attrs.field(init=False, default=None)
    _bar: Any = attrs.field(init=False, default=None)
    _factory: Any = attrs.field(init=False, factory=_tqdm)

    def on_train_start(self, train_loader: Iterable[Any]) -> None:
        try:
            self._total = len(train_loader)  # type: ignore[arg-type]
        except TypeError:
            self._total = None

    def on_epoch_start(self, state: Any) -> None:
        self._close()
        epochs = f"/{state.max_epochs}" if state.max_epochs else ""
        prefix = f"{self.description} " if self.description else ""
        self._bar = self._factory(
            total=self._total,
            desc=f"{prefix}epoch {state.epoch + 1}{epochs}",
            disable=False if self.always else None,
            leave=self.leave,
            unit="batch",
        )

    def on_batch_end(self, state: Any, loss: Any) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        if state.global_step % self.log_every_n_steps == 0:
            value = loss.detach() if isinstance(loss, torch.Tensor) else loss
            self._bar.set_postfix(loss=f"{float(value):.4f}", refresh=False)

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4f}" for k, v in metrics.items()}, refresh=True)

    def on_train_end(self) -> None:
        self._close()

    def on_exception(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# -- scalar loggers ------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Window:
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
class _ScalarLogger:
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

    _window: _Window = attrs.field(init=False, factory=_Window, repr=False)
    _lrs: list[Any] = attrs.field(init=False, factory=list, repr=False)
    _fresh: bool = attrs.field(init=False, default=False, repr=False)
    _resumed_at: int | None = attrs.field(init=False, default=None, repr=False)

    log_every_n_steps: int

    def on_train_start(self) -> None:
        self._window = _Window()
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

    def _write_row(self, step: int, epoch: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


@attrs.define(eq=False)
class MetricsLogger(_ScalarLogger):
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
    format: str = attrs.field(default="csv", validator=_one_of("csv", "jsonl"))
    log_every_n_steps: int = attrs.field(default=50, validator=_int_at_least(1))
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
class TensorBoardLogger(_ScalarLogger):
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
    log_every_n_steps: int = attrs.field(default=50, validator=_int_at_least(1))
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


# -- checkpoints and stopping --------------------------------------------------------------------

_SUFFIX = ".safetensors"


def _check_filename(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    problem = None
    if not isinstance(value, str) or not value:
        problem = "is not a non-empty string"
    else:
        try:
            name = value.format(epoch=0, step=0)
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            problem = f"does not format with only {{epoch}} and {{step}} ({exc!r})"
        else:
            if "/" in name or os.sep in name or (os.altsep and os.altsep in name):
                problem = "holds a path separator (put folders into dirpath)"
            elif name in ("best", "last") or name.startswith("."):
                problem = "clashes with best/last or hidden temporary files"
    if problem is not None:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a file name pattern with the "
            f"fields {{epoch}} and {{step}} and no suffix, like 'epoch={{epoch}}-step={{step}}'; "
            f"got {value!r}, which {problem}"
        )


def _replace_with_copy_of(source: str, target: str) -> None:
    """Make ``target`` hold the bytes of ``source`` atomically: a hard link, else a copy."""
    folder = os.path.dirname(target)
    temporary = os.path.join(folder, f".{os.path.basename(target)}.{uuid.uuid4().hex}.tmp")
    try:
        try:
            os.link(source, temporary)
        except OSError:  # no hard links on this file system
            shutil.copyfile(source, temporary)
            with open(temporary, "rb") as handle:
                os.fsync(handle.fileno())
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


@attrs.define(eq=False)
class ModelCheckpoint:
    """Saves the whole training state periodically, at the end, and whenever a metric improves.

    Every ``every_n_steps`` batches and/or every ``every_n_epochs`` epochs it writes
    ``dirpath/<filename>.safetensors`` with :meth:`Trainer.save_checkpoint` (atomic; written once
    every listener has handled the event) and keeps the last ``keep_last`` of these periodic
    files, deleting older ones only after the new one is on disk. With ``save_last``,
    ``last.safetensors`` is the newest periodic file (a hard link, else a copy) and is written at
    every ``train_end``. With ``monitor``, ``best.safetensors`` is written at each validation
    that improves the metric. The list of kept files and the best score are stored in every
    checkpoint, so a resumed run keeps counting and deleting where it left off.

    Files it did not write are never deleted. Periodic names repeat across fits of one trainer
    (``step`` restarts with every fit), so use a ``dirpath`` per fit to keep them apart.

    Args:
        dirpath: The folder of the checkpoints; created if missing.
        every_n_steps: Save after every n-th training batch (global step), or None.
        every_n_epochs: Save after every n-th epoch, or None.
        monitor: A validation metric (``"val_loss"``) whose best value gets ``best.safetensors``.
        mode: ``"min"`` or ``"max"``: whether a lower or a higher ``monitor`` is better.
        save_last: Keep ``last.safetensors`` up to date.
        keep_last: How many periodic files to keep (None: all; 0: none, only last and best).
        filename: Pattern of the periodic files' names, with ``{epoch}`` (0-based) and ``{step}``
            (the global step), without the suffix.

    Raises:
        ValueError: When an argument is out of range, or the combination saves nothing.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer(max_epochs=10)
        >>> trainer.subscribe(ModelCheckpoint("ckpt", monitor="val_loss", keep_last=2))
        'model_checkpoint_0'
    """

    runs_on: ClassVar[str] = "collective"
    """Where it runs in a distributed fit (see :data:`trainer.distributed.RUNS_ON`)."""

    dirpath: str = attrs.field(converter=os.fspath)
    every_n_steps: int | None = attrs.field(default=None, validator=_int_at_least(1, optional=True))
    every_n_epochs: int | None = attrs.field(default=1, validator=_int_at_least(1, optional=True))
    monitor: str | None = attrs.field(default=None, validator=_metric_name(optional=True))
    mode: str = attrs.field(default="min", validator=_one_of("min", "max"))
    save_last: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    keep_last: int | None = attrs.field(default=3, validator=_int_at_least(0, optional=True))
    filename: str = attrs.field(default="epoch={epoch}-step={step}", validator=_check_filename)
    _kept: list[str] = attrs.field(init=False, factory=list, repr=False)
    _best_score: float | None = attrs.field(init=False, default=None, repr=False)
    _best_step: int | None = attrs.field(init=False, default=None, repr=False)
    _validated: bool = attrs.field(init=False, default=False, repr=False)

    def __attrs_post_init__(self) -> None:
        periodic = (self.every_n_steps or self.every_n_epochs) and self.keep_last != 0
        if not (periodic or self.save_last or self.monitor):
            raise ValueError(
                f"ModelCheckpoint would save nothing: every_n_steps={self.every_n_steps!r}, "
                f"every_n_epochs={self.every_n_epochs!r}, keep_last={self.keep_last!r}, "
                f"save_last={self.save_last!r}, monitor={self.monitor!r}; enable one of them"
            )

    @property
    def kept(self) -> list[str]:
        """Paths of the periodic checkpoints kept now, oldest first."""
        return [os.path.join(self.dirpath, name) for name in self._kept]

    @property
    def best_score(self) -> float | None:
        """The best ``monitor`` value so far, or None."""
        return self._best_score

    @property
    def best_step(self) -> int | None:
        """The global step of the best checkpoint, or None."""
        return self._best_step

    @property
    def best_model_path(self) -> str:
        """Where the best checkpoint is written (it exists once ``best_score`` is set)."""
        return os.path.join(self.dirpath, "best" + _SUFFIX)

    @property
    def last_model_path(self) -> str:
        """Where the last checkpoint is written."""
        return os.path.join(self.dirpath, "last" + _SUFFIX)

    def on_train_start(self) -> None:
        self._validated = False

    def on_batch_end(self, trainer: Any, state: Any) -> None:
        if self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self._save_periodic(trainer, state)

    def on_epoch_end(self, trainer: Any, state: Any) -> None:
        if self.every_n_epochs and (state.epoch + 1) % self.every_n_epochs == 0:
            self._save_periodic(trainer, state)

    def on_validation_end(self, trainer: Any, state: Any, metrics: Mapping[str, float]) -> None:
        if self.monitor is None:
            return
        self._validated = True
        value = _monitored(self, self.monitor, metrics)
        if _improved(value, self._best_score, self.mode, 0.0):
            self._best_score, self._best_step = value, state.global_step
            trainer.save_checkpoint(self.best_model_path)

    def on_train_end(self, trainer: Any) -> None:
        if self.save_last:
            trainer.save_checkpoint(self.last_model_path)
        if self.monitor is not None and not self._validated:
            warnings.warn(
                f"ModelCheckpoint(monitor={self.monitor!r}) saw no validation in this fit, so "
                "no best checkpoint was written; pass val_loader= to fit()",
                stacklevel=2,
            )

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        checkpoint["kept"] = list(self._kept)
        checkpoint["best_score"] = self._best_score
        checkpoint["best_step"] = self._best_step

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        self._kept = [str(name) for name in checkpoint["kept"]]
        best = checkpoint["best_score"]
        self._best_score = None if best is None else float(best)
        self._best_step = checkpoint["best_step"]

    def _save_periodic(self, trainer: Any, state: Any) -> None:
        if self.keep_last == 0:
            if self.save_last:
                trainer.save_checkpoint(self.last_model_path)
            return
        name = self.filename.format(epoch=state.epoch, step=state.global_step) + _SUFFIX
        kept = [other for other in self._kept if other != name] + [name]
        cut = 0 if self.keep_last is None else max(len(kept) - self.keep_last, 0)
        dropped, self._kept = kept[:cut], kept[cut:]  # the new file stores the list it ends
        path = os.path.join(self.dirpath, name)
        trainer.save_checkpoint(path)
        files = _files_of_this_rank(trainer)
        _after_pending_saves(trainer, lambda: self._after_periodic(path, dropped, files))

    def _after_periodic(
        self, path: str, dropped: list[str], files: Callable[[str], list[str]]
    ) -> None:
        if self.save_last:
            for source, target in zip(files(path), files(self.last_model_path)):
                _replace_with_copy_of(source, target)
        for name in dropped:
            for file in files(os.path.join(self.dirpath, name)):
                with contextlib.suppress(FileNotFoundError):  # gone already (an older timeline)
                    os.remove(file)


def _files_of_this_rank(trainer: Any) -> Callable[[str], list[str]]:
    """The files this process writes for a checkpoint path: the path itself when alone; in a
    distributed fit its own rank file, plus the main file on rank zero."""
    ctx = getattr(trainer, "dist", None)
    if ctx is None or not ctx.enabled:
        return lambda path: [path]
    own = [] if ctx.rank else [True]
    return lambda path: [path for _ in own] + [rank_path(path, ctx.rank)]


@attrs.define(eq=False)
class EarlyStopping:
    """Ends the fit when a validation metric has not improved for ``patience`` validations.

    After each validation, a value better than the best so far by more than ``min_delta`` resets
    the count; otherwise the count grows, and at ``patience`` it sets ``state.should_stop`` (the
    fit ends before the next epoch and ``FitResult.stopped_early`` is True). A NaN or infinite
    value stops at once when ``check_finite`` is set. The counters restart with every fit and are
    stored in checkpoints, so a resumed fit stops where the uninterrupted one would have.

    Args:
        monitor: The validation metric to watch, e.g. ``"val_loss"`` or ``"val_accuracy"``.
        mode: ``"min"`` or ``"max"``: whether a lower or a higher value is better.
        patience: Validations without improvement before stopping.
        min_delta: The smallest change that counts as an improvement.
        check_finite: Stop as soon as the metric is NaN or infinite.

    Raises:
        ValueError: When an argument is out of range.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer(max_epochs=100)
        >>> trainer.subscribe(EarlyStopping(monitor="val_loss", patience=5))
        'early_stopping_0'
    """

    monitor: str = attrs.field(default="val_loss", validator=_metric_name())
    mode: str = attrs.field(default="min", validator=_one_of("min", "max"))
    patience: int = attrs.field(default=3, validator=_int_at_least(1))
    min_delta: float = attrs.field(default=0.0, validator=_number_at_least(0.0))
    check_finite: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    best_score: float | None = attrs.field(init=False, default=None)
    """The best value seen in this fit, or None."""
    wait_count: int = attrs.field(init=False, default=0)
    """Validations since the last improvement."""
    stopped_epoch: int | None = attrs.field(init=False, default=None)
    """The epoch after which it stopped the fit, or None."""

    def on_train_start(self) -> None:
        self.best_score, self.wait_count, self.stopped_epoch = None, 0, None

    def on_validation_end(self, state: Any, metrics: Mapping[str, float]) -> None:
        value = _monitored(self, self.monitor, metrics)
        if self.check_finite and not math.isfinite(value):
            self._stop(state)
        elif _improved(value, self.best_score, self.mode, self.min_delta):
            self.best_score, self.wait_count = value, 0
        else:
            self.wait_count += 1
            if self.wait_count >= self.patience:
                self._stop(state)

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        checkpoint["best_score"] = self.best_score
        checkpoint["wait_count"] = self.wait_count
        checkpoint["stopped_epoch"] = self.stopped_epoch

    def on_load_checkpoint(self, checkpoint: Any, state: Any) -> None:
        best = checkpoint["best_score"]
        self.best_score = None if best is None else float(best)
        self.wait_count = int(checkpoint["wait_count"])
        self.stopped_epoch = checkpoint["stopped_epoch"]
        if self.stopped_epoch is not None:
            state.should_stop = True  # the run had stopped: resuming it trains no further

    def _stop(self, state: Any) -> None:
        state.should_stop = True
        self.stopped_epoch = state.epoch


# -- learning rate and timing --------------------------------------------------------------------


@attrs.define(eq=False)
class LearningRateMonitor:
    """Records the learning rate of every parameter group every ``log_every_n_steps`` batches.

    ``history`` holds ``(step, [lr of group 0, lr of group 1, ...])`` with the rates that batch
    number ``step`` (the global step it completes) trained with, read before its optimizer step
    (so a scheduler stepped per batch shows each rate at the step that used it). Rates are host
    numbers, so reading them costs no synchronisation. The history covers the fits of this
    process; it is not stored in checkpoints.

    Args:
        log_every_n_steps: Batches between records.

    Raises:
        ValueError: When ``log_every_n_steps`` is not an int >= 1.

    Example:
        >>> from trainer import Trainer
        >>> monitor = LearningRateMonitor(log_every_n_steps=10)
        >>> Trainer().subscribe(monitor)
        'learning_rate_monitor_0'
    """

    log_every_n_steps: int = attrs.field(default=1, validator=_int_at_least(1))
    history: list[tuple[int, list[float]]] = attrs.field(init=False, factory=list)
    """``(step, learning rates)`` records, oldest first."""

    @property
    def last(self) -> list[float] | None:
        """The most recent learning rates, or None before the first record."""
        return self.history[-1][1] if self.history else None

    def on_batch_start(self, state: Any, optimizer: torch.optim.Optimizer) -> None:
        step = state.global_step + 1  # the step this batch completes
        if step % self.log_every_n_steps == 0:
            self.history.append((step, [float(group["lr"]) for group in optimizer.param_groups]))


class _TimerBracket:
    """Receives every event at one end of the dispatch order and tells its :class:`Timer`."""

    __slots__ = ("opening", "timer")

    def __init__(self, timer: Timer, opening: bool) -> None:
        self.timer = timer
        self.opening = opening


def _bracket_hook(event: str) -> Callable[[_TimerBracket], None]:
    def hook(self: _TimerBracket) -> None:
        self.timer._mark(event, self.opening)

    hook.__name__ = hook.__qualname__ = f"on_{event}"
    return hook


_TIMED = tuple(event for event in EVENTS if event != "load_checkpoint")
"""The events a :class:`Timer` measures. Not ``load_checkpoint``: the trainer takes any receiver of
it for a stateful listener whose state a checkpoint must hold, so resuming would fail."""

for _event in _TIMED:  # one hook per event, so that a new event is timed without a change here
    setattr(_TimerBracket, f"on_{_event}", _bracket_hook(_event))
del _event


@attrs.define(eq=False)
class Timer:
    """Host wall time spent in the listeners of each event, to find the slow ones.

    :meth:`attach` subscribes two small receivers to every event of a trainer, one with the
    highest priority (it runs first) and one with the lowest (it runs last): the time between
    them is the time all other listeners of that event took. :meth:`summary` lists it per event
    with the keys of the listeners that receive the event, so a slow event points at its
    listeners; the fit's total wall time puts the listeners' share in proportion. Only the trainer's
    public subscription API is used.

    ``load_checkpoint`` is not timed: a receiver of it would make the trainer expect state for
    the timer in every checkpoint it resumes from.

    Times are host wall-clock: CUDA work is asynchronous, so a listener shows the time it waits
    for the device only when it synchronises (``.item()``, ``float(tensor)``). A checkpoint that
    a listener requests is written after its event, so its cost shows in the ``save_checkpoint``
    event (the state gathering) and in the fit total, not in the event that asked for it.

    Args:
        clock: The clock to read, in seconds (default ``time.perf_counter``).

    Example:
        >>> from trainer import Trainer
        >>> timer = Timer().attach(Trainer())
        >>> sorted(timer.summary())[:2]
        ['batch_end', 'batch_start']
    """

    FIRST = sys.maxsize
    """The priority of the opening receiver (listeners with the same priority run before it)."""
    LAST = -sys.maxsize
    """The priority of the closing receiver."""

    clock: Callable[[], float] = time.perf_counter
    _trainer: Any = attrs.field(init=False, default=None, repr=False)
    _brackets: tuple[_TimerBracket, ...] = attrs.field(init=False, default=(), repr=False)
    _started: dict[str, float] = attrs.field(init=False, factory=dict, repr=False)
    _calls: dict[str, int] = attrs.field(init=False, factory=dict, repr=False)
    _total: dict[str, float] = attrs.field(init=False, factory=dict, repr=False)
    _max: dict[str, float] = attrs.field(init=False, factory=dict, repr=False)
    _fit_started: float | None = attrs.field(init=False, default=None, repr=False)
    _fit_seconds: float = attrs.field(init=False, default=0.0, repr=False)

    def attach(self, trainer: Any) -> Timer:
        """Start timing the events of ``trainer``; returns the timer.

        Raises:
            RuntimeError: When the timer is attached already.
        """
        if self._trainer is not None:
            raise RuntimeError("this Timer is attached to a trainer already; detach() it first")
        opening, closing = _TimerBracket(self, True), _TimerBracket(self, False)
        trainer.subscribe(opening, priority=self.FIRST)
        try:
            trainer.subscribe(closing, priority=self.LAST)
        except BaseException:
            trainer.unsubscribe(opening)
            raise
        self._trainer, self._brackets = trainer, (opening, closing)
        return self

    def detach(self) -> None:
        """Stop timing; what was measured stays."""
        if self._trainer is not None:
            for bracket in self._brackets:
                self._trainer.unsubscribe(bracket)
        self._trainer, self._brackets = None, ()
        self._started.clear()

    def reset(self) -> None:
        """Forget what was measured."""
        self._started.clear()
        self._calls.clear()
        self._total.clear()
        self._max.clear()
        self._fit_started, self._fit_seconds = None, 0.0

    @property
    def fit_seconds(self) -> float:
        """Wall time from ``train_start`` to ``train_end`` (or the failure), summed over fits."""
        return self._fit_seconds

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per event: ``calls``, ``total_s``, ``mean_s``, ``max_s`` and ``listeners`` (keys).

        Every event but ``load_checkpoint`` is listed, in the order of :data:`trainer.EVENTS`,
        with zeros for events that did not fire; ``listeners`` are those subscribed now, in
        dispatch order.
        """
        own: set[str] = set()
        signals = {}
        if self._trainer is not None:
            events = self._trainer.events
            subscriptions = [events.subscription_of(bracket) for bracket in self._brackets]
            own = {s.key for s in subscriptions if s is not None}
            signals = events.signals
        table = {}
        for event in _TIMED:
            calls, total = self._calls.get(event, 0), self._total.get(event, 0.0)
            receivers = signals[event].ordered_receivers if event in signals else []
            table[event] = {
                "calls": calls,
                "total_s": total,
                "mean_s": total / calls if calls else 0.0,
                "max_s": self._max.get(event, 0.0),
                "listeners": [key for key, _ in receivers if key not in own],
            }
        return table

    def report(self) -> str:
        """:meth:`summary` as a text table, slowest event first, with the listeners' share."""
        rows = sorted(self.summary().items(), key=lambda item: -item[1]["total_s"])
        lines = [
            f"{'event':<18}{'calls':>8}{'total ms':>12}{'mean ms':>11}{'max ms':>11}  listeners"
        ]
        for event, row in rows:
            lines.append(
                f"{event:<18}{row['calls']:>8}{row['total_s'] * 1e3:>12.2f}"
                f"{row['mean_s'] * 1e3:>11.3f}{row['max_s'] * 1e3:>11.3f}  "
                + (", ".join(row["listeners"]) or "-")
            )
        spent = sum(row["total_s"] for _, row in rows)
        share = f" ({100 * spent / self._fit_seconds:.1f}%)" if self._fit_seconds > 0 else ""
        lines.append(f"listeners: {spent:.3f} s of {self._fit_seconds:.3f} s in fit{share}")
        return "\n".join(lines)

    def _mark(self, event: str, opening: bool) -> None:
        now = self.clock()
        if opening:
            if event == "exception":
                self._started.clear()  # the event that failed never reached its closing receiver
            if event == "train_start":
                self._fit_started = now
            self._started[event] = now
            return
        started = self._started.pop(event, None)
        if started is not None:
            elapsed = now - started
            self._calls[event] = self._calls.get(event, 0) + 1
            self._total[event] = self._total.get(event, 0.0) + elapsed
            self._max[event] = max(self._max.get(event, 0.0), elapsed)
        if event in ("train_end", "exception") and self._fit_started is not None:
            self._fit_seconds += now - self._fit_started
            self._fit_started = None
