"""The event-driven training loop.

:meth:`Trainer.fit` reads as the loop it runs; each event fires in one line, through
:meth:`Trainer._emit`::

    prepare    check the arguments and the checkpoint to resume from; nothing has changed yet
    start      model to its device, objects attached, fresh TrainState, seed       train_start
    resume     restore the checkpoint over what the train_start hooks did           load_checkpoint
    epochs     until max_epochs, max_steps or state.should_stop:
                                                                                    epoch_start
                 batches: to the device, step, backward, optimizer step   batch_start, batch_end
                 epoch end: epoch-interval scheduler                                epoch_end
                 validation every n-th epoch              validation_start, validation_end
    end        the FitResult                                                        train_end

The progress lives in :class:`~trainer.state.TrainState`, the checkpoint tree in
:mod:`trainer.state`, the file format in :mod:`trainer.checkpoint`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import torch

from trainer import _runtime
from trainer import distributed as _distributed
from trainer import state as _state
from trainer import validators as _v
from trainer.checkpoint import read_checkpoint, write_checkpoint
from trainer.data import to_device
from trainer.events import EVENTS, Events
from trainer.exceptions import ListenerError, NonFiniteLossError, SubscriptionError
from trainer.state import ListenerStates, TrainState

__all__ = ["FitResult", "StepOutput", "TrainState", "Trainer"]

StepOutput = torch.Tensor | Mapping[str, Any]
"""What a training step returns: the loss tensor, or a mapping with ``"loss"`` and anything else."""


@attrs.frozen
class FitResult:
    """What :meth:`Trainer.fit` returns.

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


class _Run:
    """What one fit needs besides the progress: its functions, data and payload (a plain slotted
    object, so that the per-step reads cost no attrs machinery)."""

    __slots__ = (
        "autocast",
        "check_loss",
        "distributed",
        "epochs",
        "last_loss",
        "move",
        "payload",
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
        self.distributed = False  # these four are set by Trainer._start
        self.move: Callable[[Any], Any] = _identity  # set by Trainer._start for the device
        self.autocast: Callable[[], Any] = contextlib.nullcontext
        self.payload: dict[str, Any] = {}
        self.epochs = 0
        self.last_loss: torch.Tensor | None = None
        self.val_metrics: dict[str, float] = {}


def _identity(value: Any) -> Any:
    return value


_REPLACED_BY_FIT = (
    "state",
    "model",
    "optimizer",
    "scheduler",
    "grad_scaler",
    "training_model",
    "train_loader",
)
"""The trainer attributes a fit sets at its start; a refused resume puts them back."""


def _device(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _runtime.resolve_device(value)


@attrs.define(eq=False)
class Trainer:
    """A small training loop that announces each phase over blinker signals.

    The caller supplies the model, the optimizer, the data and a ``step(batch)`` function that
    returns the loss (or a mapping with ``"loss"``); the trainer moves batches to the device, runs
    the step under the chosen precision, does backward, clipping, accumulation and the optimizer
    and scheduler steps, validates, and saves or restores its whole state with safetensors.

    Args:
        max_epochs: Epochs per fit. None means 1 unless ``max_steps`` is set.
        max_steps: Stop after this many training batches in total, or None.
        device: ``"auto"`` (CUDA when available, else CPU), a ``torch.device`` or a string.
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"`` (with a ``torch.amp.GradScaler``).
        gradient_clip_val: Clip gradients to this norm or value, or None.
        gradient_clip_algorithm: ``"norm"`` or ``"value"``.
        accumulate_grad_batches: Batches whose gradients are summed per optimizer step.
        check_val_every_n_epoch: Validate after every n-th epoch when a ``val_loader`` is given.
        seed: Seeds torch, ``random`` and (if imported) NumPy at the start of each fit that does
            not resume from a checkpoint.
        nonfinite_loss: What a NaN or infinite loss does: ``"raise"`` a
            :class:`~trainer.NonFiniteLossError` naming the step (no optimizer step is taken),
            ``"skip"`` the batch (counted in ``state.skipped_batches``, flagged by
            ``state.batch_skipped`` at its ``batch_end``), or ``"off"`` (no check). The check reads
            one boolean from the device per step, a synchronisation on a GPU; ``"off"`` avoids it.
        compile_step: Wrap ``step`` (and ``val_step``) in ``torch.compile`` for this fit. The
            first steps then pay the compilation; later ones run the compiled graph.
        distributed: ``"auto"`` (data-parallel over the default process group when one is
            initialised), ``"init"`` (initialise it from ``torchrun``'s environment first) or
            ``"off"``. See :mod:`trainer.distributed` and the "Distributed training" page.

    Example:
        >>> import torch
        >>> from trainer import Trainer
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
        >>> def step(batch):
        ...     x, y = batch
        ...     return torch.nn.functional.mse_loss(model(x), y)
        >>> result = Trainer(max_epochs=2, device="cpu").fit(
        ...     model, torch.optim.SGD(model.parameters(), lr=0.1), data, step)
        >>> result.steps
        6
    """

    max_epochs: int | None = attrs.field(default=None, validator=_v.int_at_least(1, optional=True))
    max_steps: int | None = attrs.field(default=None, validator=_v.int_at_least(1, optional=True))
    device: str | torch.device = attrs.field(default="auto", validator=_device)
    precision: str = attrs.field(default="32", validator=_v.one_of(*_runtime.PRECISIONS))
    gradient_clip_val: float | None = attrs.field(
        default=None, validator=_v.real_in_range(0, low_open=True, optional=True)
    )
    gradient_clip_algorithm: str = attrs.field(default="norm", validator=_v.one_of("norm", "value"))
    accumulate_grad_batches: int = attrs.field(default=1, validator=_v.int_at_least(1))
    check_val_every_n_epoch: int = attrs.field(default=1, validator=_v.int_at_least(1))
    seed: int | None = attrs.field(default=None, validator=_v.int_at_least(None, optional=True))
    nonfinite_loss: str = attrs.field(default="raise", validator=_v.one_of("raise", "skip", "off"))
    compile_step: bool = attrs.field(default=False, validator=_v.boolean)
    distributed: str = attrs.field(default="auto", validator=_v.one_of(*_distributed.MODES))

    events: Events = attrs.field(
        init=False, default=attrs.Factory(lambda self: Events(self), takes_self=True), repr=False
    )
    """This trainer's signals, one attribute per event (``trainer.events.batch_end``)."""
    state: TrainState = attrs.field(init=False, factory=TrainState, repr=False)
    model: torch.nn.Module | None = attrs.field(init=False, default=None, repr=False)
    optimizer: torch.optim.Optimizer | None = attrs.field(init=False, default=None, repr=False)
    scheduler: Any = attrs.field(init=False, default=None, repr=False)
    grad_scaler: torch.amp.GradScaler | None = attrs.field(init=False, default=None, repr=False)
    training_model: torch.nn.Module | None = attrs.field(init=False, default=None, repr=False)
    """What a training step should call: ``model``, or its DistributedDataParallel wrapper."""
    dist: _distributed.DistributedContext = attrs.field(
        init=False, factory=_distributed.DistributedContext, repr=False
    )
    """This process's rank and world size in the current fit (rank 0 of 1 when alone)."""
    train_loader: Iterable[Any] | None = attrs.field(init=False, default=None, repr=False)
    """The training data of the current or last fit (its generators are saved in checkpoints)."""

    _run: _Run | None = attrs.field(init=False, default=None, repr=False)
    _collecting: bool = attrs.field(init=False, default=False, repr=False)

    # -- listeners ------------------------------------------------------------------------------

    def subscribe(
        self,
        listener: Any,
        priority: int = 0,
        *,
        name: str | None = None,
        runs_on: str | None = None,
    ) -> str:
        """Connect every ``on_<event>`` method of ``listener`` to this trainer's events.

        Hooks are checked now: a method name that matches no event, or a parameter that the
        event's payload does not provide, raises. ``on_train_batch_end`` is an alias of
        ``on_batch_end``. The trainer keeps a strong reference until :meth:`unsubscribe`.

        Args:
            listener: Any object with ``on_<event>`` methods, typically an attrs class.
            priority: Higher runs earlier; equal priorities run in subscription order.
            name: Key of the listener's checkpoint namespace; derived from its class name and a
                counter (``my_logger_0``, ``my_logger_1``) when omitted.
            runs_on: Where it runs in a distributed fit: ``"all"`` ranks, ``"rank_zero"`` only,
                or ``"collective"`` (every rank at the same point; checked at ``train_start``).
                Default: the listener's ``runs_on`` attribute, else ``"all"``.

        Returns:
            The listener's key.

        Raises:
            SubscriptionError: When a hook does not fit, or the listener or name is taken.
        """
        return self.events.subscribe(listener, priority=priority, name=name, runs_on=runs_on)

    def unsubscribe(self, listener: Any) -> None:
        """Disconnect a listener (or a connected function) from every event."""
        self.events.unsubscribe(listener)

    @contextlib.contextmanager
    def subscribed(
        self, listener: Any, priority: int = 0, *, name: str | None = None
    ) -> Iterator[Any]:
        """Subscribe ``listener`` for the duration of a ``with`` block."""
        self.subscribe(listener, priority, name=name)
        try:
            yield listener
        finally:
            if self.events.subscription_of(listener) is not None:
                self.unsubscribe(listener)

    def connect(
        self,
        event: str,
        function: Callable[..., Any],
        priority: int = 0,
        *,
        name: str | None = None,
    ) -> Callable[..., Any]:
        """Connect a plain function to one event (same as ``trainer.events.<event>.connect``)."""
        if event not in EVENTS:
            raise SubscriptionError(f"unknown event {event!r}; events are {sorted(EVENTS)}")
        return self.events.signals[event].connect(function, priority=priority, name=name)

    @property
    def listeners(self) -> list[tuple[str, Any]]:
        """``(key, listener)`` for every subscription, in dispatch order."""
        return [(s.key, s.target) for s in self.events.subscriptions()]

    # -- the loop -------------------------------------------------------------------------------

    def fit(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: Iterable[Any],
        step: Callable[[Any], StepOutput],
        *,
        val_loader: Iterable[Any] | None = None,
        val_step: Callable[[Any], StepOutput] | None = None,
        scheduler: Any = None,
        scheduler_interval: str = "epoch",
        resume_from: str | os.PathLike[str] | None = None,
    ) -> FitResult:
        """Train ``model`` with ``step`` on ``train_loader``; the events mark each phase.

        Args:
            model: The module to train; moved to the trainer's device.
            optimizer: Optimizer over the model's parameters.
            train_loader: Any iterable of batches (nested tuples/lists/dicts of tensors).
            step: ``step(batch)`` computes the loss of one batch; it returns the loss tensor or a
                mapping with ``"loss"`` and anything listeners should see (``outputs``).
            val_loader: Optional validation batches.
            val_step: ``val_step(batch)`` returns a scalar tensor (reported as ``val_loss``) or a
                mapping of scalars (each reported as ``val_<name>``). Defaults to the loss of
                ``step``.
            scheduler: Optional learning-rate scheduler, stepped per ``scheduler_interval``.
            scheduler_interval: ``"epoch"`` (after each full epoch) or ``"step"`` (after each
                optimizer step).
            resume_from: A checkpoint to continue from (progress, RNG, optimizer, listeners).
                It is read and checked before anything changes, and restored right after
                ``train_start``. A refused checkpoint leaves the trainer as it was.

        Returns:
            A :class:`FitResult`.

        Raises:
            ListenerError: A listener raised; the ``exception`` event fired first.
            RuntimeError: ``fit`` was called while this trainer is fitting (from a listener).
        """
        # Prepare: check the arguments and the checkpoint; nothing has changed yet.
        run = self._prepare(train_loader, step, val_loader, val_step, scheduler, scheduler_interval)
        resume = self._read_resume(resume_from, model, optimizer, scheduler, train_loader)
        before = self._attachments()
        self._start(run, model, optimizer, scheduler, resuming=resume is not None)
        try:
            # Train start; a resumed fit then restores the checkpoint over what its hooks did.
            self._emit("train_start", train_loader=run.train_loader, scheduler=scheduler)
            self._resume(resume, before)
            self._check_ranks_agree()
            self._validate_pending(run)
            # Epochs, until max_epochs, max_steps or a listener's state.should_stop.
            epoch, skip = self.state.resume_at
            while not self.state.finished(epoch):
                self._run_epoch(run, epoch, skip)
                epoch, skip = epoch + 1, 0
            # Train end.
            return self._end(self._result(run))
        except BaseException as exc:
            self.dist.share_failure(exc)  # the other ranks stop at their next safe point
            self._announce_failure(exc)
            raise
        finally:
            self._run = None

    def _run_epoch(self, run: _Run, epoch: int, skip: int) -> None:
        """One epoch from batch ``skip`` (0 unless resuming mid-epoch), then its validation."""
        state = self.state
        state.epoch, run.epochs = epoch, run.epochs + 1
        self._emit("epoch_start")
        batches, length = self._epoch_batches(run.train_loader, epoch, skip)
        done, exhausted = skip, True
        for batch_idx, batch in enumerate(batches, start=skip):
            done = batch_idx + 1
            self._train_batch(run, batch_idx, batch, last=done == length)
            limit = state.max_steps  # read per batch: a listener may change it
            if state.should_stop or (limit is not None and state.global_step >= limit):
                exhausted = done == length
                break
        if done == 0:
            raise ValueError("train_loader yielded no batches; give it data or check its sampler")
        if state.accumulated:  # an iterable without len() ended mid-window
            self._optimizer_step(run.step_scheduler)
        # Epoch end: a full epoch steps an epoch-interval scheduler first. A checkpoint written
        # from here on resumes at the next epoch (after this one's validation).
        validate = run.val_loader is not None and (epoch + 1) % self.check_val_every_n_epoch == 0
        if exhausted:
            self._close_epoch(run, epoch, resumed_at_end=done == skip)
            state.validation_pending = validate
        self._emit("epoch_end")
        state.should_stop = self.dist.safe_point("epoch_end", stop=state.should_stop)
        # Validation every n-th epoch, isolated from the training RNG stream.
        if validate:
            run.val_metrics = self._validate(run)

    def _train_batch(self, run: _Run, batch_idx: int, batch: Any, *, last: bool) -> None:
        """Device, step, backward (or skip), optimizer step when due; ``batch_start``/``_end``."""
        state = self.state
        state.batch_idx = batch_idx
        batch = run.move(batch)
        self._emit("batch_start", batch=batch)
        # Forward (the caller's step) under the chosen precision, then backward.
        with run.autocast():
            outputs = run.step(batch)
        loss, outputs = _split_step_output(outputs)
        self._backward_or_skip(run, loss)
        # Optimizer step when the accumulation window is full or the data ends.
        limit = state.max_steps
        last = last or (limit is not None and state.global_step + 1 >= limit)
        # >=: a mid-window checkpoint may be resumed with a smaller accumulate_grad_batches
        if state.accumulated and (state.accumulated >= self.accumulate_grad_batches or last):
            self._optimizer_step(run.step_scheduler)
        state.global_step += 1
        state.resume_at = (state.epoch, batch_idx + 1)
        # Batch end: parameters are updated, the loss is still on the device.
        self._emit("batch_end", batch=batch, outputs=outputs, loss=loss)
        if run.distributed:
            state.should_stop = self.dist.safe_point("batch_end", stop=state.should_stop)
        run.last_loss = loss

    # -- phases -----------------------------------------------------------------------------------

    def _prepare(
        self,
        train_loader: Iterable[Any],
        step: Callable[[Any], StepOutput],
        val_loader: Iterable[Any] | None,
        val_step: Callable[[Any], StepOutput] | None,
        scheduler: Any,
        scheduler_interval: str,
    ) -> _Run:
        """Check the arguments; nothing of the trainer changes here."""
        if self._run is not None or self.events.dispatching or self._collecting:
            raise RuntimeError(
                "fit() was called while this trainer is already fitting or handling an event "
                "(from a listener?); "
                "one trainer runs one fit at a time: use a second Trainer for a nested fit"
            )
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
                return _split_step_output(step(batch))[0]

        if self.compile_step:
            step, val_step = torch.compile(step), torch.compile(val_step)
        return _Run(
            step=step,
            val_step=val_step,
            train_loader=train_loader,
            val_loader=val_loader,
            scheduler=scheduler,
            scheduler_interval=scheduler_interval,
            check_loss=self.nonfinite_loss != "off",
        )

    def _read_resume(
        self,
        resume_from: str | os.PathLike[str] | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        train_loader: Iterable[Any],
    ) -> tuple[str, dict[str, Any], list[str]] | None:
        """Read and check the checkpoint to resume from against the objects of this fit."""
        ctx = self.dist = _distributed.resolve(self.distributed)
        self.events.rank = ctx.rank
        if resume_from is None:
            return None
        path = os.fspath(resume_from)
        tree = _state.merge_rank_state(path, read_checkpoint(path), ctx.rank, ctx.world_size)
        plan = _state.check_tree(
            path,
            tree,
            self,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            strict=True,
            loader=train_loader,
        )
        return path, tree, plan

    def _start(
        self,
        run: _Run,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        *,
        resuming: bool,
    ) -> None:
        """Device, attachments, DDP wrapper and shards, a fresh TrainState, the seed."""
        ctx = self.dist
        device = _runtime.resolve_device(ctx.device_for(self.device))
        model.to(device)
        self.attach(model, optimizer, scheduler)
        if self.precision != "16-mixed":
            self.grad_scaler = None
        elif self.grad_scaler is None or self.grad_scaler._device != device.type:
            self.grad_scaler = torch.amp.GradScaler(device.type)
        model.train()  # train_start and the steps see the model in train mode
        self.training_model = ctx.wrap(model, device)
        seed = self.seed or 0
        run.train_loader = self.train_loader = ctx.shard(run.train_loader, seed)
        run.val_loader = None if run.val_loader is None else ctx.shard(run.val_loader, seed)
        run.move = functools.partial(to_device, device=device)
        run.autocast = _runtime.autocast_factory(self.precision, device)
        run.distributed = ctx.enabled
        max_epochs = self.max_epochs if self.max_epochs or self.max_steps else 1
        self.state = TrainState(max_epochs=max_epochs, max_steps=self.max_steps)
        run.payload = self._common()
        self._run = run
        if not resuming:  # a resumed fit takes gradients and RNG from its checkpoint
            optimizer.zero_grad(set_to_none=True)  # no stale gradients from an earlier run
            if self.seed is not None:
                _runtime.seed_everything(self.seed)

    def _resume(
        self, resume: tuple[str, dict[str, Any], list[str]] | None, before: tuple[Any, ...]
    ) -> None:
        """Restore the checkpoint read in :meth:`_read_resume` (all or nothing: if it is refused,
        the trainer's state and attachments from ``before`` the fit are put back)."""
        if resume is None:
            return
        path, tree, plan = resume
        try:
            self._apply_checkpoint(path, tree, plan, loader=self.train_loader)
        except BaseException:
            self._restore_attachments(before)
            raise
        state = self.state
        if state.finished(state.resume_at[0]) and not state.validation_pending:
            warnings.warn(
                f"{path} is the checkpoint of a finished run (epoch {state.resume_at[0]}, step "
                f"{state.global_step}); this fit trains nothing. To train further on new data, "
                "restore it with load_checkpoint() and call fit() without resume_from.",
                stacklevel=3,
            )

    def _attachments(self) -> tuple[Any, ...]:
        """What a fit replaces at its start (see :meth:`_restore_attachments`)."""
        return tuple(getattr(self, name) for name in _REPLACED_BY_FIT)

    def _restore_attachments(self, values: tuple[Any, ...]) -> None:
        for name, value in zip(_REPLACED_BY_FIT, values):
            setattr(self, name, value)

    def _validate_pending(self, run: _Run) -> None:
        """A checkpoint taken after an epoch, before its validation: run it now, as that epoch's."""
        state = self.state
        if state.validation_pending and run.val_loader is not None:
            state.epoch = state.resume_at[0] - 1
            run.val_metrics = self._validate(run)

    def _result(self, run: _Run) -> FitResult:
        state = self.state
        metrics = dict(run.val_metrics)
        if run.last_loss is not None:
            loss = self.dist.mean(float(run.last_loss.detach().float()))
            metrics = {"train_loss": loss, **metrics}
        return FitResult(
            steps=state.global_step,
            optimizer_steps=state.optimizer_steps,
            epochs=run.epochs,
            metrics=metrics,
            stopped_early=state.should_stop,
            skipped_batches=state.skipped_batches,
        )

    def _end(self, result: FitResult, *, interrupted: bool = False) -> FitResult:
        self._emit("train_end", result=result)
        if not interrupted:
            self.dist.safe_point("train_end")
        return result

    # -- loop helpers ---------------------------------------------------------------------------

    def _emit(self, event: str, /, **extra: Any) -> None:
        """Send ``event`` with the common payload (built once per fit) and ``extra``, if anyone
        listens: the one place where the trainer fires an event."""
        signal = self.events.signals[event]
        if signal.active:
            run = self._run
            signal.send(self, **(run.payload if run is not None else self._common()), **extra)

    def attach(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None
    ) -> None:
        """Attach the objects that checkpoints save and restore, without training.

        ``fit`` attaches its arguments itself; call this to save or load a checkpoint before the
        first ``fit`` (for example to inspect a run's state in a new process).
        """
        _check_attachable(model, optimizer)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def _epoch_batches(
        self, loader: Iterable[Any], epoch: int, skip: int
    ) -> tuple[Iterator[Any], int | None]:
        """The epoch's batches from ``skip`` on, and the epoch's length if the loader has one.

        The RNG that orders the epoch's data is remembered for a mid-epoch checkpoint; a resumed
        epoch replays that order, drops the batches already trained on, and continues with the
        RNG the checkpoint was taken with.
        """
        state = self.state
        self.dist.set_epoch(loader, epoch)  # a sharded loader's order depends on it
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

    def _backward_or_skip(self, run: _Run, loss: torch.Tensor) -> None:
        state = self.state
        skipped = run.check_loss and not _runtime.is_finite(loss)
        if run.check_loss and run.distributed:
            skipped = self.dist.any(skipped)  # the same on all ranks
        state.batch_skipped = skipped
        if not skipped:
            self._backward(loss)
            return
        if self.nonfinite_loss == "raise":
            raise NonFiniteLossError(
                f"the loss is {loss.detach().float().tolist()} at step {state.global_step} "
                f"(epoch {state.epoch}, batch {state.batch_idx}); no optimizer step was taken for "
                "it. Check the data and the learning rate, or pass "
                "Trainer(nonfinite_loss='skip') to skip such batches",
                step=state.global_step,
                epoch=state.epoch,
                batch_idx=state.batch_idx,
            )
        state.skipped_batches += 1

    def _backward(self, loss: torch.Tensor) -> None:
        if self.accumulate_grad_batches > 1:
            loss = loss / self.accumulate_grad_batches
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        loss.backward()
        if self.dist.backend is not None:  # distributed
            self.dist.average_gradients(self.training_model, self.optimizer)  # type: ignore[arg-type]
        self.state.accumulated += 1

    def _optimizer_step(self, scheduler: Any) -> None:
        optimizer: torch.optim.Optimizer = self.optimizer  # type: ignore[assignment]
        scaler = self.grad_scaler
        if self.gradient_clip_val is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if self.gradient_clip_algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(params, self.gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_value_(params, self.gradient_clip_val)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.state.accumulated = 0
        self.state.optimizer_steps += 1
        if scheduler is not None:
            scheduler.step()

    def _close_epoch(self, run: _Run, epoch: int, *, resumed_at_end: bool) -> None:
        """A full epoch: step an epoch-interval scheduler, resume a later checkpoint after it."""
        if run.scheduler is not None and run.scheduler_interval == "epoch":
            with warnings.catch_warnings():
                if resumed_at_end:  # resumed after the epoch's last batch: no optimizer step yet
                    warnings.filterwarnings("ignore", "Detected call of `lr_sched")
                run.scheduler.step()
        self.state.resume_at = (epoch + 1, 0)

    def _validate(self, run: _Run) -> dict[str, float]:
        """One validation pass in eval mode, isolated from the training RNG stream."""
        model = self.model
        assert model is not None
        rng = _runtime.get_rng_state()
        model.eval()
        try:
            with torch.no_grad():
                self._emit("validation_start", val_loader=run.val_loader)
                metrics = self._validation_metrics(run)
        finally:
            model.train()
            _runtime.set_rng_state(rng)
        self.state.validation_pending = False
        self._emit("validation_end", metrics=metrics)
        self.state.should_stop = self.dist.safe_point("validation_end", stop=self.state.should_stop)
        return metrics

    def _validation_metrics(self, run: _Run) -> dict[str, float]:
        """Batch-size weighted means of what ``val_step`` returns, over every rank's samples."""
        totals: dict[str, torch.Tensor] = {}
        count = 0
        for batch in run.val_loader or ():
            batch = run.move(batch)
            with run.autocast():
                values = _validation_values(run.val_step(batch))
            size = _runtime.batch_size_of(batch)
            for name, value in values.items():
                weighted = value.detach().float() * size
                totals[name] = totals[name] + weighted if name in totals else weighted
            count += size
        names = list(totals)
        if not names:
            return {}
        counted = totals[names[0]].new_tensor(float(count))
        sums = self.dist.sum(torch.stack([*(totals[n] for n in names), counted]))
        return dict(zip(names, (sums[:-1] / max(float(sums[-1]), 1.0)).tolist()))

    def _announce_failure(self, exc: BaseException) -> None:
        """Fire ``exception`` (and, for Ctrl-C, ``train_end``) before the error propagates.

        After a ``KeyboardInterrupt`` the run is in a consistent state between two events, so
        ``train_end`` also fires and listeners can flush files or write a final checkpoint
        (``trainer.save_checkpoint`` from a listener is written once that event finished).
        """
        event = exc.event if isinstance(exc, ListenerError) else None
        listener = exc.listener if isinstance(exc, ListenerError) else None
        try:
            self._emit("exception", exception=exc, event=event, listener=listener)
            if isinstance(exc, KeyboardInterrupt):
                state = self.state
                result = FitResult(
                    steps=state.global_step,
                    optimizer_steps=state.optimizer_steps,
                    epochs=state.epoch + 1,
                    metrics={},
                    stopped_early=True,
                    skipped_batches=state.skipped_batches,
                )
                self._end(result, interrupted=True)
        except Exception as inner:
            if hasattr(exc, "add_note"):
                exc.add_note(f"while announcing it: {inner}")

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write the whole training state to one safetensors file, atomically.

        The file holds the model, the optimizer, the scheduler, the grad scaler, the progress,
        the RNG states (the train loader's own generators included) and the state every listener
        stores in its ``on_save_checkpoint``. Nothing is written if a listener raises.

        Called from inside a listener (say at ``batch_end`` or ``epoch_end``), the file is written
        as soon as every listener has handled that event, so that it holds one consistent state
        whatever the order of the listeners; if a listener of that event raises, nothing is
        written.

        Args:
            path: The file to write (conventionally ``*.safetensors``).

        Raises:
            RuntimeError: When no model is attached (call ``fit`` or ``attach`` first), or when
                called from an ``on_save_checkpoint`` hook (it would save forever).
            ListenerError: When a listener's ``on_save_checkpoint`` raised, for example a
                ``TypeError`` for a value a checkpoint cannot hold (chained as the cause).
            TypeError: When the scheduler or grad scaler state cannot be stored.
        """
        self._require_attached("save")
        if self._collecting:
            raise RuntimeError(
                "save_checkpoint() was called from an on_save_checkpoint hook, while a checkpoint "
                "is being assembled; write the listener's state into its `checkpoint` argument "
                "instead, and call save_checkpoint() from another event (batch_end, epoch_end)"
            )
        if self.events.dispatching:
            # Called from a listener: write once every listener has handled the current event,
            # so that the file holds one consistent state whatever the listener order.
            self.events.defer(lambda: self._write(os.fspath(path)))
            return
        self._write(os.fspath(path))

    def _write(self, path: str) -> None:
        """Assemble and write a checkpoint; in a distributed fit, one file per rank as well.

        Every rank collects its listeners' states; only when all succeeded do the ranks write
        their own files (:func:`~trainer.state.rank_path`), then rank zero the main file,
        and nobody continues before it is on disk (see :mod:`trainer.checkpoint`).
        """
        ctx = self.dist
        tree = ctx.together("checkpoint_states", lambda: self._checkpoint_tree(path))
        if not ctx.enabled:
            write_checkpoint(path, tree)
            return
        main, own = _state.rank_state(tree, ctx.rank, ctx.world_size)
        own_path = _state.rank_path(path, ctx.rank)
        ctx.together("checkpoint_written", lambda: write_checkpoint(own_path, own))
        if ctx.is_zero:
            ctx.together("checkpoint_main", lambda: write_checkpoint(path, main))
        else:
            ctx.together("checkpoint_main", lambda: None)

    def _checkpoint_tree(self, path: str) -> dict[str, Any]:
        self._require_attached("save")
        states = self._collect_listener_states(path)
        subscriptions = self.events.subscriptions()
        stateful = [s.key for s in subscriptions if "save_checkpoint" in s.receivers]
        order = [s.key for s in subscriptions]
        return _state.build_tree(self, states.to_tree(), order=order, stateful=stateful)

    def _collect_listener_states(self, path: str) -> ListenerStates:
        """Every listener's ``on_save_checkpoint`` output (for a file or a rollback snapshot)."""
        states = ListenerStates()
        self._collecting = True
        try:
            self._emit("save_checkpoint", checkpoint=states, path=path)
        finally:
            self._collecting = False
        return states

    def _give_listener_states(self, states: Mapping[str, Any], path: str) -> None:
        """Hand each listener its part of ``states`` (listeners without a part are not called)."""
        self._emit("load_checkpoint", checkpoint=ListenerStates(states), path=path)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        strict: bool = True,
    ) -> None:
        """Restore a checkpoint into the attached (or given) objects and the subscribed listeners.

        Everything is read and checked before anything changes: a file that does not match
        raises and leaves the model, optimizer, listeners and attachments untouched, and so does
        a listener that refuses its state (the others get theirs back). Listener state goes to
        the listener instances subscribed now, by key.

        Args:
            path: A file written by :meth:`save_checkpoint`.
            model: Attach this model (default: the one of the last ``fit``) once the file loaded.
            optimizer: Attach this optimizer once the file loaded.
            scheduler: Attach this scheduler once the file loaded.
            strict: When False, listener state without a subscribed listener, or a stateful
                listener without state, only warns.

        Raises:
            FileNotFoundError: No file at ``path``.
            CheckpointFormatError: The file is not a readable checkpoint.
            CheckpointMismatchError: Keys, shapes or dtypes differ; the message lists them all.
        """
        if self.events.dispatching or self._run is not None:
            raise RuntimeError(
                "cannot load a checkpoint while a listener is handling an event or a fit is "
                "running; resume a run "
                "with fit(..., resume_from=path) or load between fits"
            )
        model = self.model if model is None else model
        optimizer = self.optimizer if optimizer is None else optimizer
        scheduler = self.scheduler if scheduler is None else scheduler
        if model is None or optimizer is None:
            raise RuntimeError(
                "cannot load a checkpoint: no model and optimizer are attached; call fit() or "
                "attach(model, optimizer) first, or pass model= and optimizer="
            )
        _check_attachable(model, optimizer)
        path = os.fspath(path)
        if not self.dist.enabled:
            self.dist = _distributed.resolve(self.distributed)
            self.events.rank = self.dist.rank
        ctx = self.dist
        tree = _state.merge_rank_state(path, read_checkpoint(path), ctx.rank, ctx.world_size)
        plan = _state.check_tree(
            path, tree, self, model=model, optimizer=optimizer, scheduler=scheduler, strict=strict
        )
        attached = (self.model, self.optimizer, self.scheduler)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        try:
            self._apply_checkpoint(path, tree, plan)
        except BaseException:
            self.model, self.optimizer, self.scheduler = attached
            raise

    def _apply_checkpoint(
        self, path: str, tree: dict[str, Any], plan: list[str], *, loader: Any = None
    ) -> None:
        """Restore a checkpoint that :func:`~trainer.state.check_tree` accepted, all or nothing.

        If anything fails on the way (a listener refusing its state, say), the model, optimizer,
        scheduler, grad scaler, progress, RNG and the listeners that already received their
        state are put back as they were.
        """
        model, _ = self._require_attached("load")
        # The model's tensors are swapped for the loaded ones where that is a plain copy (the
        # old ones are kept for a rollback); otherwise they are copied in, after a snapshot.
        swaps = None if self.dist.enabled else _runtime.swap_plan(model, tree["model"])
        snapshot = _state.take_snapshot(self, model=swaps is None)
        before = self._listener_snapshot(plan, path)
        undo = None
        try:
            if swaps is not None:
                undo = _runtime.swap_in_module_state(swaps)
            _state.restore_tree(self, tree, path, model=undo is None, loader=loader)
            self._give_listener_states({key: tree["listeners"][key] for key in plan}, path)
        except BaseException as exc:
            if undo is not None:
                undo()
            # Listeners first: one that writes to the TrainState while loading (EarlyStopping's
            # should_stop) must not change it after the trainer's own rollback.
            self._roll_back_listeners(plan, before, path, exc)
            _state.roll_back(self, snapshot)
            raise

    def _listener_snapshot(self, plan: list[str], path: str) -> dict[str, Any]:
        """Copies of the current state of every receiving listener but the last: if a later one
        refuses its state, the earlier ones get these back. (The last one has nobody after it;
        a listener keeps its own load all or nothing.)"""
        if len(plan) < 2:
            return {}
        states = self._collect_listener_states(path).to_tree()
        return {key: _state.clone_tensors(states[key]) for key in plan[:-1] if key in states}

    def _roll_back_listeners(
        self, plan: list[str], before: dict[str, Any], path: str, exc: BaseException
    ) -> None:
        failed = exc.listener if isinstance(exc, ListenerError) else None
        given = plan[: plan.index(failed)] if failed in plan else plan
        states = {key: before[key] for key in given if key in before}
        if not states:
            return
        try:
            self._give_listener_states(states, path)
        except Exception as inner:  # the error being raised stays the one to report
            exc.add_note(f"while putting the listeners' state back: {inner}")

    def _require_attached(self, verb: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        if self.model is None or self.optimizer is None:
            raise RuntimeError(
                f"cannot {verb} a checkpoint: no model and optimizer are attached; call fit() "
                "or attach(model, optimizer) first"
            )
        return self.model, self.optimizer

    def _common(self) -> dict[str, Any]:
        """The keywords every event carries."""
        return {
            "sender": self,
            "trainer": self,
            "model": self.model,
            "optimizer": self.optimizer,
            "state": self.state,
            "rank": self.dist.rank,
            "world_size": self.dist.world_size,
        }

    def _check_ranks_agree(self) -> None:
        """At train start: every rank has the same collective listeners, and none failed."""
        collective = [s.key for s in self.events.subscriptions() if s.runs_on == "collective"]
        self.dist.same_everywhere(",".join(collective), "the collective listeners")
        self.dist.safe_point("train_start")


def _check_attachable(model: Any, optimizer: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")


def _split_step_output(outputs: Any) -> tuple[torch.Tensor, Mapping[str, Any]]:
    if isinstance(outputs, torch.Tensor):
        return outputs, {"loss": outputs}
    if isinstance(outputs, Mapping) and isinstance(outputs.get("loss"), torch.Tensor):
        return outputs["loss"], outputs
    raise TypeError(
        "step(batch) must return the loss tensor or a mapping with a 'loss' tensor; got "
        f"{type(outputs).__name__}"
        + (f" with keys {sorted(outputs)}" if isinstance(outputs, Mapping) else "")
    )


def _validation_values(outputs: Any) -> dict[str, torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        outputs = {"loss": outputs}
    if not isinstance(outputs, Mapping):
        raise TypeError(
            f"val_step(batch) must return a scalar tensor or a mapping of scalars, got "
            f"{type(outputs).__name__}"
        )
    values = {}
    for name, value in outputs.items():
        tensor = torch.as_tensor(value)
        if tensor.numel() != 1:
            raise ValueError(
                f"val_step returned {name!r} with shape {tuple(tensor.shape)}; validation metrics "
                "must be scalars (reduce them in val_step, e.g. .mean())"
            )
        key = name if str(name).startswith("val_") else f"val_{name}"
        values[key] = tensor.reshape(())
    return values
