"""One fit's setup and record, apart from the loop itself.

:class:`Run` holds what one fit needs besides its progress: the step functions, the data and the
payload of every event (:func:`common_payload`). :func:`prepare_run` checks the arguments of
``fit`` and :func:`start_run` attaches the objects, both before the first event;
:func:`epoch_batches` replays a resumed epoch's data order, :func:`close_epoch` ends a full one,
and :class:`FitResult` is what a fit returns.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import torch

from trainer import _runtime
from trainer import validators as _v
from trainer.capture import (
    capture_mode,
    capture_steps,
    check_capture_device,
    optimizer_stepper,
)
from trainer.data import resolve_device, to_device
from trainer.distributed import DistributedContext
from trainer.events import Events
from trainer.state import TrainState
from trainer.steps import StepOutput, split_step_output

__all__ = [
    "REPLACED_BY_FIT",
    "FitResult",
    "Run",
    "attachments",
    "check_ranks_agree",
    "close_epoch",
    "common_payload",
    "epoch_batches",
    "fit_result",
    "interrupted_result",
    "place_model",
    "prepare_run",
    "restore_attachments",
    "start_run",
]


@attrs.frozen
class FitResult:
    """What :meth:`Trainer.fit <trainer.Trainer.fit>` returns.

    Attributes:
        steps: Training batches completed (``state.global_step``).
        optimizer_steps: Optimizer steps taken.
        epochs: Epochs entered, counting a resumed epoch once.
        metrics: ``"train_loss"`` (the last batch's loss; in a distributed fit the mean over the
            ranks) and the last validation metrics (reduced over every rank's samples).
        stopped_early: True when a listener set ``state.should_stop``.
        skipped_batches: Batches skipped for a non-finite loss.
    """

    steps: int
    optimizer_steps: int
    epochs: int
    metrics: dict[str, float]
    stopped_early: bool
    skipped_batches: int = 0


class Run:
    """What one fit needs besides the progress: its functions, data and payload (a plain slotted
    object, so that the per-step reads cost no attrs machinery)."""

    __slots__ = (
        "autocast",
        "check_loss",
        "distributed",
        "epochs",
        "keep_gradients",
        "last_loss",
        "move",
        "optimizer_step",
        "payload",
        "restore_tf32",
        "scheduler",
        "scheduler_interval",
        "step",
        "step_scheduler",
        "train_loader",
        "val_loader",
        "val_metrics",
        "val_step",
    )

    def __init__(
        self,
        step: Callable[[Any], StepOutput],
        val_step: Callable[[Any], StepOutput],
        train_loader: Iterable[Any],
        val_loader: Iterable[Any] | None,
        scheduler: Any,
        scheduler_interval: str,
        check_loss: bool,
    ) -> None:
        self.step, self.val_step = step, val_step
        self.train_loader, self.val_loader = train_loader, val_loader
        self.scheduler, self.scheduler_interval = scheduler, scheduler_interval
        self.step_scheduler = scheduler if scheduler_interval == "step" else None
        self.check_loss = check_loss
        self.distributed = False  # these four are set by start_run
        self.move: Callable[[Any], Any] = _identity  # set by start_run for the device
        self.optimizer_step: Callable[..., None] = _identity  # set by start_run
        self.autocast: Callable[[], Any] = contextlib.nullcontext
        self.payload: dict[str, Any] = {}  # set by the trainer once the run started
        self.epochs = 0
        self.keep_gradients = False  # set by start_run: see trainer.capture.keep_gradients
        self.last_loss: torch.Tensor | None = None
        self.val_metrics: dict[str, float] = {}
        self.restore_tf32 = _runtime.set_tf32(None)  # nothing to put back; set by start_run


def _identity(value: Any) -> Any:
    return value


def prepare_run(
    trainer: Any,
    train_loader: Iterable[Any],
    step: Callable[[Any], StepOutput],
    val_loader: Iterable[Any] | None,
    val_step: Callable[[Any], StepOutput] | None,
    scheduler: Any,
    scheduler_interval: str,
) -> Run:
    """Check the arguments of ``trainer.fit`` and make the :class:`Run`; nothing changes yet.

    Raises:
        ValueError: For an unknown ``scheduler_interval``, or ``capture="graph"`` without a CUDA
            device.
        TypeError: For a ``ReduceLROnPlateau`` scheduler or a ``step`` that is not callable.
    """
    _v.check_one_of("scheduler_interval", scheduler_interval, ("epoch", "step"))
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError(
            "ReduceLROnPlateau needs a metric the trainer does not choose; step it from a "
            "listener: def on_validation_end(self, metrics): sched.step(metrics['val_loss'])"
        )
    if not callable(step):
        raise TypeError(f"step must be callable as step(batch), got {step!r}")
    if val_step is None:

        def val_step(batch: Any) -> StepOutput:
            return split_step_output(step(batch))[0]

    mode = capture_mode(trainer)
    check_capture_device(mode, trainer.device, "Trainer.capture")  # set after construction?
    step, val_step = capture_steps(mode, step, val_step)
    return Run(
        step=step,
        val_step=val_step,
        train_loader=train_loader,
        val_loader=val_loader,
        scheduler=scheduler,
        scheduler_interval=scheduler_interval,
        check_loss=trainer.nonfinite_loss != "off",
    )


def place_model(trainer: Any, model: torch.nn.Module) -> torch.device:
    """Put ``model`` where a fit of ``trainer`` trains it and return that device: the trainer's
    ``device`` (``"auto"``: CUDA when available; on a distributed CUDA run, this process's GPU),
    in the channels-last memory format with ``channels_last``. Each fit starts with it; code that
    runs the model before the first fit (an evaluation of the untrained model) calls it first,
    so that the model runs on the training device from the start."""
    device = resolve_device(trainer.dist.device_for(trainer.device))
    if trainer.channels_last:
        # the 4-dimensional weights (Module.to takes memory_format; its stubs do not say so)
        model.to(device, memory_format=torch.channels_last)  # type: ignore[call-overload]
    else:
        model.to(device)
    return device


def start_run(
    trainer: Any,
    run: Run,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    resuming: bool,
) -> None:
    """Device (and memory format), attachments, DDP wrapper and shards, a fresh TrainState, the
    seed, the TF32 switches (``run.restore_tf32`` puts them back).

    Sets the trainer's ``model``, ``optimizer``, ``scheduler``, ``grad_scaler``,
    ``training_model``, ``train_loader`` and ``state`` (the ones :data:`REPLACED_BY_FIT` names)
    and the run's device functions. A resumed fit keeps the gradients and RNG for its checkpoint.
    """
    ctx = trainer.dist
    device = place_model(trainer, model)
    trainer.attach(model, optimizer, scheduler)
    if trainer.precision != "16-mixed":
        trainer.grad_scaler = None
    elif trainer.grad_scaler is None or trainer.grad_scaler._device != device.type:
        trainer.grad_scaler = torch.amp.GradScaler(device.type)
    model.train()  # train_start and the steps see the model in train mode
    trainer.training_model = ctx.wrap(model, device)
    seed = trainer.seed or 0
    run.train_loader = trainer.train_loader = ctx.shard(run.train_loader, seed)
    run.val_loader = None if run.val_loader is None else ctx.shard(run.val_loader, seed)
    run.move = functools.partial(to_device, device=device, channels_last=trainer.channels_last)
    run.autocast = _runtime.autocast_factory(trainer.precision, device)
    mode = capture_mode(trainer)
    run.optimizer_step = optimizer_stepper(mode, optimizer)
    run.keep_gradients = mode == "graph" and trainer.accumulate_grad_batches > 1
    run.distributed = ctx.enabled
    max_epochs = trainer.max_epochs if trainer.max_epochs or trainer.max_steps else 1
    trainer.state = TrainState(max_epochs=max_epochs, max_steps=trainer.max_steps)
    if not resuming:  # a resumed fit takes gradients and RNG from its checkpoint
        optimizer.zero_grad(set_to_none=True)  # no stale gradients from an earlier run
        if trainer.seed is not None:
            _runtime.seed_everything(trainer.seed)
    run.restore_tf32 = _runtime.set_tf32(trainer.tf32)  # last: the fit's `finally` puts it back


def common_payload(trainer: Any) -> dict[str, Any]:
    """The keywords every event of ``trainer`` carries."""
    return {
        "sender": trainer,
        "trainer": trainer,
        "model": trainer.model,
        "optimizer": trainer.optimizer,
        "state": trainer.state,
        "rank": trainer.dist.rank,
        "world_size": trainer.dist.world_size,
    }


def check_ranks_agree(events: Events, dist: DistributedContext) -> None:
    """At train start: every rank has the same collective listeners, and none failed."""
    collective = [s.key for s in events.subscriptions() if s.runs_on == "collective"]
    dist.same_everywhere(",".join(collective), "the collective listeners")
    dist.safe_point("train_start")


REPLACED_BY_FIT = (
    "state",
    "model",
    "optimizer",
    "scheduler",
    "grad_scaler",
    "training_model",
    "train_loader",
)
"""The trainer attributes a fit sets at its start; a refused resume puts them back."""


def attachments(trainer: Any) -> tuple[Any, ...]:
    """What a fit replaces at its start (see :func:`restore_attachments`)."""
    return tuple(getattr(trainer, name) for name in REPLACED_BY_FIT)


def restore_attachments(trainer: Any, values: tuple[Any, ...]) -> None:
    """Put back what :func:`attachments` returned."""
    for name, value in zip(REPLACED_BY_FIT, values):
        setattr(trainer, name, value)


def epoch_batches(
    loader: Iterable[Any], state: TrainState, dist: DistributedContext, epoch: int, skip: int
) -> tuple[Iterator[Any], int | None]:
    """The epoch's batches from ``skip`` on, and the epoch's length if the loader has one.

    The RNG that orders the epoch's data is remembered for a mid-epoch checkpoint; a resumed
    epoch replays that order, drops the batches already trained on, and continues with the
    RNG the checkpoint was taken with.
    """
    dist.set_epoch(loader, epoch)  # a sharded loader's order depends on it
    try:
        length: int | None = len(loader)  # type: ignore[arg-type]
    except TypeError:
        length = None
    if skip == 0:
        state.epoch_rng = _runtime.get_rng_state(loader)
        return iter(loader), length
    if state.loaded_rng is not None:
        _runtime.set_rng_state(state.loaded_rng)
    current = _runtime.get_rng_state()
    if state.epoch_rng is not None:
        _runtime.set_rng_state(state.epoch_rng, loader)
    iterator = iter(loader)
    for _ in itertools.islice(iterator, skip):
        pass
    _runtime.set_rng_state(current)
    return iterator, length


def close_epoch(run: Run, state: TrainState, epoch: int, *, resumed_at_end: bool) -> None:
    """A full epoch: step an epoch-interval scheduler, resume a later checkpoint after it."""
    if run.scheduler is not None and run.scheduler_interval == "epoch":
        with warnings.catch_warnings():
            if resumed_at_end:  # resumed after the epoch's last batch: no optimizer step yet
                warnings.filterwarnings("ignore", "Detected call of `lr_sched")
            run.scheduler.step()
    state.resume_at = (epoch + 1, 0)


def fit_result(run: Run, state: TrainState, dist: DistributedContext) -> FitResult:
    """The result of a fit that ended: its progress, last loss and validation metrics."""
    metrics = dict(run.val_metrics)
    if run.last_loss is not None:
        loss = dist.mean(float(run.last_loss.detach().float()))
        metrics = {"train_loss": loss, **metrics}
    return FitResult(
        steps=state.global_step,
        optimizer_steps=state.optimizer_steps,
        epochs=run.epochs,
        metrics=metrics,
        stopped_early=state.should_stop,
        skipped_batches=state.skipped_batches,
    )


def interrupted_result(state: TrainState) -> FitResult:
    """The result that ``train_end`` carries after a ``KeyboardInterrupt``."""
    return FitResult(
        steps=state.global_step,
        optimizer_steps=state.optimizer_steps,
        epochs=state.epoch + 1,
        metrics={},
        stopped_early=True,
        skipped_batches=state.skipped_batches,
    )
