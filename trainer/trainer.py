"""The event-driven training loop."""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import torch
from attrs import validators as v

from trainer import _runtime
from trainer import distributed as _distributed
from trainer.checkpoint import (
    ListenerStates,
    merge_rank_state,
    rank_path,
    rank_state,
    read_checkpoint,
    write_checkpoint,
)
from trainer.data import to_device
from trainer.events import EVENTS, Events
from trainer.exceptions import (
    CheckpointFormatError,
    CheckpointMismatchError,
    ListenerError,
    NonFiniteLossError,
    SubscriptionError,
)

__all__ = ["FitResult", "StepOutput", "TrainState", "Trainer"]

StepOutput = torch.Tensor | Mapping[str, Any]
"""What a training step returns: the loss tensor, or a mapping with ``"loss"`` and anything else."""


@attrs.define(eq=False)
class TrainState:
    """Where the loop is; every event's ``state`` keyword.

    Attributes:
        epoch: Index of the current epoch (0-based).
        batch_idx: Index of the current batch within its epoch.
        global_step: Training batches completed in this fit (resumed fits continue the count).
        optimizer_steps: Optimizer steps taken (fewer than ``global_step`` with accumulation).
        max_epochs: The epoch limit in force (None: unbounded, stop on ``max_steps``).
        max_steps: The batch limit in force, or None.
        should_stop: Set it to True from a listener to end the fit after the current batch.
        batch_skipped: True during ``batch_end`` of a batch whose non-finite loss was skipped
            (``Trainer(nonfinite_loss="skip")``): no backward pass or optimizer step was taken.
        skipped_batches: Batches skipped so far in this fit.
    """

    epoch: int = 0
    batch_idx: int = 0
    global_step: int = 0
    optimizer_steps: int = 0
    max_epochs: int | None = None
    max_steps: int | None = None
    should_stop: bool = False
    batch_skipped: bool = False
    skipped_batches: int = 0


class _LoopProgress:
    """What the loop updates every step besides ``state``: a plain slotted object, so that a step
    does not pay for the validation hooks of the trainer's own attributes."""

    __slots__ = ("accumulated", "resume_at")

    def __init__(self) -> None:
        self.accumulated = 0
        """Backward passes summed into the gradients since the last optimizer step."""
        self.resume_at = (0, 0)
        """(epoch, batch) a checkpoint taken now continues from."""


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


def _positive_or_none(name: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")

    return check


def _positive_int(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _one_of(*allowed: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"{attribute.name} must be one of {list(allowed)}, got {value!r}")

    return check


def _clip_value(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (
        not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0
    ):
        raise ValueError(f"gradient_clip_val must be a number > 0 or None, got {value!r}")


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

    max_epochs: int | None = attrs.field(default=None, validator=_positive_or_none("max_epochs"))
    max_steps: int | None = attrs.field(default=None, validator=_positive_or_none("max_steps"))
    device: str | torch.device = attrs.field(default="auto", validator=_device)
    precision: str = attrs.field(default="32", validator=_one_of(*_runtime.PRECISIONS))
    gradient_clip_val: float | None = attrs.field(default=None, validator=_clip_value)
    gradient_clip_algorithm: str = attrs.field(default="norm", validator=_one_of("norm", "value"))
    accumulate_grad_batches: int = attrs.field(default=1, validator=_positive_int)
    check_val_every_n_epoch: int = attrs.field(default=1, validator=_positive_int)
    seed: int | None = attrs.field(default=None, validator=v.optional(v.instance_of(int)))
    nonfinite_loss: str = attrs.field(default="raise", validator=_one_of("raise", "skip", "off"))
    compile_step: bool = attrs.field(default=False, validator=v.instance_of(bool))
    distributed: str = attrs.field(default="auto", validator=_one_of(*_distributed.MODES))

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

    _loop: _LoopProgress = attrs.field(init=False, factory=lambda: _LoopProgress(), repr=False)
    _epoch_rng: dict[str, Any] | None = attrs.field(init=False, default=None, repr=False)
    _loaded_epoch_rng: dict[str, Any] | None = attrs.field(init=False, default=None, repr=False)
    _loaded_rng: dict[str, Any] | None = attrs.field(init=False, default=None, repr=False)
    _validation_pending: bool = attrs.field(init=False, default=False, repr=False)

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
                It is read and checked before ``train_start`` and restored right after it.

        Returns:
            A :class:`FitResult`.

        Raises:
            ListenerError: A listener raised; the ``exception`` event fired first.
        """
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(
                f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}"
            )
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
        # Distributed: this rank's device, the DDP wrapper and this rank's share of the data.
        ctx = self.dist = _distributed.resolve(self.distributed)
        self.events.rank = ctx.rank
        device = _runtime.resolve_device(ctx.device_for(self.device))
        model.to(device)
        self._attach_for_fit(model, optimizer, scheduler, device)
        self.training_model = ctx.wrap(model, device)
        seed = self.seed or 0
        train_loader = ctx.shard(train_loader, seed)
        val_loader = None if val_loader is None else ctx.shard(val_loader, seed)
        max_epochs = self.max_epochs if self.max_epochs or self.max_steps else 1
        state = self.state = TrainState(max_epochs=max_epochs, max_steps=self.max_steps)
        self._loop.resume_at, self._loaded_epoch_rng, self._loaded_rng = (0, 0), None, None
        self._loop.accumulated, self._validation_pending = 0, False
        resume = None
        if resume_from is not None:  # read and check now, restore after train_start
            path = os.fspath(resume_from)
            tree = merge_rank_state(path, read_checkpoint(path), ctx.rank, ctx.world_size)
            resume = (path, tree, self._check_checkpoint(path, tree, model, optimizer, True))
        else:
            optimizer.zero_grad(set_to_none=True)  # no stale gradients from an earlier run
            if self.seed is not None:
                _runtime.seed_everything(self.seed)
        move = functools.partial(to_device, device=device)
        autocast = _runtime.autocast_factory(self.precision, device)
        check_loss = self.nonfinite_loss != "off"
        distributed, accumulate = ctx.enabled, self.accumulate_grad_batches
        step_scheduler = scheduler if scheduler_interval == "step" else None
        ev = self.events
        common = {"sender": self, "trainer": self, "model": model, "optimizer": optimizer}
        common.update(state=state, rank=ctx.rank, world_size=ctx.world_size)
        try:
            # Train start: the model is on its device and in train mode. When resuming, the
            # checkpoint is restored right after, overriding what start-of-training hooks did
            # (re-initialisation, model copies) with the saved state.
            model.train()
            if ev.train_start.active:
                ev.train_start.send(self, train_loader=train_loader, scheduler=scheduler, **common)
            if resume is not None:
                self._apply_checkpoint(*resume)
                if self._finished(self._loop.resume_at[0]) and not self._validation_pending:
                    warnings.warn(
                        f"{resume[0]} is the checkpoint of a finished run (epoch "
                        f"{self._loop.resume_at[0]}, step {state.global_step}); this fit trains "
                        "nothing. To train further on new data, restore it with "
                        "load_checkpoint() and call fit() without resume_from.",
                        stacklevel=2,
                    )
            self._check_ranks_agree()
            epochs, last_loss, val_metrics = 0, None, {}
            first_epoch, skip = self._loop.resume_at
            if self._validation_pending and val_loader is not None:
                # The checkpoint was taken after an epoch, before its validation: run it now,
                # as the validation of that epoch.
                state.epoch = first_epoch - 1
                val_metrics = self._validate(model, val_loader, val_step, move, autocast, common)
            for epoch in itertools.count(first_epoch):
                if self._finished(epoch):
                    break
                state.epoch, epochs = epoch, epochs + 1
                skip = skip if epoch == first_epoch else 0
                if ev.epoch_start.active:
                    ev.epoch_start.send(self, **common)
                # Remember the RNG that orders this epoch's data (for a mid-epoch resume); in a
                # resumed epoch, replay that order and continue with the checkpoint's RNG.
                ctx.set_epoch(train_loader, epoch)  # a sharded loader's order depends on it
                if skip == 0:
                    self._epoch_rng = _runtime.get_rng_state(train_loader)
                elif self._loaded_rng is not None:
                    _runtime.set_rng_state(self._loaded_rng)
                batches, length = self._epoch_batches(train_loader, skip)
                done, exhausted = skip, True
                loop = self._loop
                for batch_idx, batch in enumerate(batches, start=skip):
                    # Batch start: the batch is on the device.
                    state.batch_idx = batch_idx
                    batch = move(batch)
                    if ev.batch_start.active:
                        ev.batch_start.send(self, batch=batch, **common)
                    # Forward (the caller's step) under the chosen precision, then backward.
                    with autocast():
                        outputs = step(batch)
                    loss, outputs = _split_step_output(outputs)
                    skipped = check_loss and not _runtime.is_finite(loss)
                    if check_loss and distributed:
                        skipped = ctx.any(skipped)  # the same on all ranks
                    state.batch_skipped = skipped
                    if skipped:
                        self._nonfinite(loss)
                    else:
                        self._backward(loss)
                    # Optimizer step when the accumulation window is full or the data ends.
                    done = batch_idx + 1
                    limit = state.max_steps
                    last = done == length or (limit is not None and state.global_step + 1 >= limit)
                    if loop.accumulated and (loop.accumulated == accumulate or last):
                        self._optimizer_step(step_scheduler)
                    state.global_step += 1
                    loop.resume_at = (epoch, done)
                    # Batch end: parameters are updated, the loss is still on the device.
                    if ev.batch_end.active:
                        ev.batch_end.send(self, batch=batch, outputs=outputs, loss=loss, **common)
                    if distributed:
                        state.should_stop = ctx.safe_point("batch_end", stop=state.should_stop)
                    last_loss = loss
                    if state.should_stop or (limit is not None and state.global_step >= limit):
                        exhausted = done == length
                        break
                if done == 0:
                    raise ValueError(
                        "train_loader yielded no batches; give it data or check its sampler"
                    )
                if self._loop.accumulated:  # an iterable without len() ended mid-window
                    self._optimizer_step(step_scheduler)
                # Epoch end: a full epoch steps an epoch-interval scheduler first. A checkpoint
                # written from here on resumes at the next epoch (after this one's validation).
                validate = (
                    val_loader is not None and (epoch + 1) % self.check_val_every_n_epoch == 0
                )
                if exhausted:
                    if scheduler is not None and scheduler_interval == "epoch":
                        with warnings.catch_warnings():
                            if done == skip:  # resumed after the epoch's last batch
                                warnings.filterwarnings("ignore", "Detected call of `lr_sched")
                            scheduler.step()
                    self._loop.resume_at = (epoch + 1, 0)
                    self._validation_pending = validate
                if ev.epoch_end.active:
                    ev.epoch_end.send(self, **common)
                state.should_stop = ctx.safe_point("epoch_end", stop=state.should_stop)
                # Validation every n-th epoch, isolated from the training RNG stream.
                if validate and val_loader is not None:
                    val_metrics = self._validate(
                        model, val_loader, val_step, move, autocast, common
                    )
            # Train end.
            metrics = dict(val_metrics)
            if last_loss is not None:
                metrics = {"train_loss": ctx.mean(float(last_loss.detach().float())), **metrics}
            result = FitResult(
                steps=state.global_step,
                optimizer_steps=state.optimizer_steps,
                epochs=epochs,
                metrics=metrics,
                stopped_early=state.should_stop,
                skipped_batches=state.skipped_batches,
            )
            if ev.train_end.active:
                ev.train_end.send(self, result=result, **common)
            ctx.safe_point("train_end")
            return result
        except BaseException as exc:
            ctx.share_failure(exc)  # the other ranks stop at their next safe point
            self._announce_failure(exc, common)
            raise

    # -- loop helpers ---------------------------------------------------------------------------

    def attach(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None
    ) -> None:
        """Attach the objects that checkpoints save and restore, without training.

        ``fit`` attaches its arguments itself; call this to save or load a checkpoint before the
        first ``fit`` (for example to inspect a run's state in a new process).
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def _attach_for_fit(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        device: torch.device,
    ) -> None:
        self.attach(model, optimizer, scheduler)
        if self.precision == "16-mixed":
            if self.grad_scaler is None or self.grad_scaler._device != device.type:
                self.grad_scaler = torch.amp.GradScaler(device.type)
        else:
            self.grad_scaler = None

    def _finished(self, epoch: int) -> bool:
        state = self.state
        if state.should_stop or self._steps_left() <= 0:
            return True
        return state.max_epochs is not None and epoch >= state.max_epochs

    def _steps_left(self) -> float:
        if self.state.max_steps is None:
            return math.inf
        return self.state.max_steps - self.state.global_step

    def _epoch_batches(self, loader: Iterable[Any], skip: int) -> tuple[Iterator[Any], int | None]:
        try:
            length: int | None = len(loader)  # type: ignore[arg-type]
        except TypeError:
            length = None
        if skip == 0:
            return iter(loader), length
        # Mid-epoch resume: replay the epoch's data order from its saved RNG, drop the batches
        # already trained on, then continue with the RNG the checkpoint was taken with.
        current = _runtime.get_rng_state()
        if self._epoch_rng is not None:
            _runtime.set_rng_state(self._epoch_rng, loader)
        iterator = iter(loader)
        for _ in itertools.islice(iterator, skip):
            pass
        _runtime.set_rng_state(current)
        return iterator, length

    def _nonfinite(self, loss: torch.Tensor) -> None:
        state = self.state
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
        self._loop.accumulated += 1

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
        self._loop.accumulated = 0
        self.state.optimizer_steps += 1
        if scheduler is not None:
            scheduler.step()

    def _validate(
        self,
        model: torch.nn.Module,
        val_loader: Iterable[Any],
        val_step: Callable[[Any], StepOutput],
        move: Callable[[Any], Any],
        autocast: Callable[[], Any],
        common: dict[str, Any],
    ) -> dict[str, float]:
        ev = self.events
        rng = _runtime.get_rng_state()
        model.eval()
        try:
            with torch.no_grad():
                if ev.validation_start.active:
                    ev.validation_start.send(self, val_loader=val_loader, **common)
                totals: dict[str, torch.Tensor] = {}
                count = 0
                for batch in val_loader:
                    batch = move(batch)
                    with autocast():
                        values = _validation_values(val_step(batch))
                    size = _runtime.batch_size_of(batch)
                    for name, value in values.items():
                        weighted = value.detach().float() * size
                        totals[name] = totals[name] + weighted if name in totals else weighted
                    count += size
        finally:
            model.train()
            _runtime.set_rng_state(rng)
        names = list(totals)
        means: list[float] = []
        if names:
            counted = totals[names[0]].new_tensor(float(count))
            sums = torch.stack([*(totals[n] for n in names), counted])
            sums = self.dist.sum(sums)  # over every rank's samples (as is when alone)
            means = (sums[:-1] / max(float(sums[-1]), 1.0)).tolist()
        metrics = dict(zip(names, means))
        self._validation_pending = False
        if ev.validation_end.active:
            ev.validation_end.send(self, metrics=metrics, **common)
        self.state.should_stop = self.dist.safe_point("validation_end", stop=self.state.should_stop)
        return metrics

    def _announce_failure(self, exc: BaseException, common: dict[str, Any]) -> None:
        """Fire ``exception`` (and, for Ctrl-C, ``train_end``) before the error propagates.

        After a ``KeyboardInterrupt`` the run is in a consistent state between two events, so
        ``train_end`` also fires and listeners can flush files or write a final checkpoint
        (``trainer.save_checkpoint`` from a listener is written once that event finished).
        """
        ev = self.events
        event = exc.event if isinstance(exc, ListenerError) else None
        listener = exc.listener if isinstance(exc, ListenerError) else None
        try:
            if ev.exception.active:
                ev.exception.send(self, exception=exc, event=event, listener=listener, **common)
            if isinstance(exc, KeyboardInterrupt) and ev.train_end.active:
                state = self.state
                result = FitResult(
                    steps=state.global_step,
                    optimizer_steps=state.optimizer_steps,
                    epochs=state.epoch + 1,
                    metrics={},
                    stopped_early=True,
                    skipped_batches=state.skipped_batches,
                )
                ev.train_end.send(self, result=result, **common)
        except Exception as inner:
            if hasattr(exc, "add_note"):
                exc.add_note(f"while announcing it: {inner}")

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write the whole training state to one safetensors file, atomically.

        The file holds the model, the optimizer, the scheduler, the grad scaler, the progress,
        the RNG states and the state every listener stores in its ``on_save_checkpoint``. Nothing
        is written if a listener raises.

        Called from inside a listener (say at ``batch_end`` or ``epoch_end``), the file is written
        as soon as every listener has handled that event, so that it holds one consistent state
        whatever the order of the listeners; if a listener of that event raises, nothing is
        written.

        Args:
            path: The file to write (conventionally ``*.safetensors``).

        Raises:
            RuntimeError: When no model is attached (call ``fit`` or ``attach`` first).
            ListenerError: When a listener's ``on_save_checkpoint`` raised, for example a
                ``TypeError`` for a value a checkpoint cannot hold (chained as the cause).
            TypeError: When the scheduler or grad scaler state cannot be stored.
        """
        self._require_attached("save")
        if self.events.dispatching:
            # Called from a listener: write once every listener has handled the current event,
            # so that the file holds one consistent state whatever the listener order.
            self.events.defer(lambda: self._write(os.fspath(path)))
            return
        self._write(os.fspath(path))

    def _write(self, path: str) -> None:
        """Assemble and write a checkpoint; in a distributed fit, one file per rank as well.

        Every rank collects its listeners' states; only when all succeeded do the ranks write
        their own files (:func:`~trainer.checkpoint.rank_path`), then rank zero the main file,
        and nobody continues before it is on disk (see :mod:`trainer.checkpoint`).
        """
        ctx = self.dist
        tree = ctx.together("checkpoint_states", lambda: self._checkpoint_tree(path))
        if not ctx.enabled:
            write_checkpoint(path, tree)
            return
        main, own = rank_state(tree, ctx.rank, ctx.world_size)
        ctx.together("checkpoint_written", lambda: write_checkpoint(rank_path(path, ctx.rank), own))
        if ctx.is_zero:
            ctx.together("checkpoint_main", lambda: write_checkpoint(path, main))
        else:
            ctx.together("checkpoint_main", lambda: None)

    def _checkpoint_tree(self, path: str) -> dict[str, Any]:
        model, optimizer = self._require_attached("save")
        states = ListenerStates()
        ev = self.events
        if ev.save_checkpoint.active:
            ev.save_checkpoint.send(self, checkpoint=states, path=path, **self._common())
        stateful = [s.key for s in self.events.subscriptions() if "save_checkpoint" in s.receivers]
        pending = None
        if self._loop.accumulated:
            pending = [p.grad for group in optimizer.param_groups for p in group["params"]]
        epoch, batch = self._loop.resume_at
        tree = {
            "trainer": {
                "progress": {
                    "epoch": epoch,
                    "batch": batch,
                    "global_step": self.state.global_step,
                    "optimizer_steps": self.state.optimizer_steps,
                    "accumulated": self._loop.accumulated,
                    "validation_pending": self._validation_pending,
                },
                "optimizer_class": type(optimizer).__qualname__,
                "listener_order": [s.key for s in self.events.subscriptions()],
                "stateful_listeners": stateful,
                "precision": self.precision,
            },
            "model": model.state_dict(),
            "optimizer": _runtime.optimizer_state_to_tree(optimizer.state_dict()),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
            "rng": {
                "current": _runtime.get_rng_state(),
                "epoch_start": self._epoch_rng if batch else None,
            },
            "pending_grads": pending,
            "listeners": states.to_tree(),
        }
        return tree

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
        raises and leaves the model, optimizer and listeners untouched. Listener state goes to
        the listener instances subscribed now, by key.

        Args:
            path: A file written by :meth:`save_checkpoint`.
            model: Attach this model first (default: the one of the last ``fit``).
            optimizer: Attach this optimizer first.
            scheduler: Attach this scheduler first.
            strict: When False, listener state without a subscribed listener, or a stateful
                listener without state, only warns.

        Raises:
            FileNotFoundError: No file at ``path``.
            CheckpointFormatError: The file is not a readable checkpoint.
            CheckpointMismatchError: Keys, shapes or dtypes differ; the message lists them all.
        """
        if self.events.dispatching:
            raise RuntimeError(
                "cannot load a checkpoint while a listener is handling an event; resume a run "
                "with fit(..., resume_from=path) or load between fits"
            )
        model = self.model if model is None else model
        optimizer = self.optimizer if optimizer is None else optimizer
        if model is None or optimizer is None:
            raise RuntimeError(
                "cannot load a checkpoint: no model and optimizer are attached; call fit() or "
                "attach(model, optimizer) first, or pass model= and optimizer="
            )
        self.attach(model, optimizer, self.scheduler if scheduler is None else scheduler)
        path = os.fspath(path)
        if not self.dist.enabled:
            self.dist = _distributed.resolve(self.distributed)
            self.events.rank = self.dist.rank
        ctx = self.dist
        tree = merge_rank_state(path, read_checkpoint(path), ctx.rank, ctx.world_size)
        plan = self._check_checkpoint(path, tree, model, optimizer, strict)
        self._apply_checkpoint(path, tree, plan)

    def _apply_checkpoint(self, path: str, tree: dict[str, Any], plan: list[str]) -> None:
        """Restore a checkpoint that :meth:`_check_checkpoint` accepted, all or nothing.

        If anything fails on the way (a listener refusing its state, say), the model, optimizer,
        scheduler, grad scaler, progress and RNG are put back as they were.
        """
        model, _ = self._require_attached("load")
        # The model's tensors are swapped for the loaded ones where that is a plain copy (the
        # old ones are kept for a rollback); otherwise they are copied in, after a snapshot.
        swaps = None if self.dist.enabled else _runtime.swap_plan(model, tree["model"])
        swap = swaps is not None
        snapshot = self._snapshot(model=not swap)
        undo = None
        try:
            if swaps is not None:
                undo = _runtime.swap_in_module_state(swaps)
            self._restore(tree, path, model=undo is None)
            ev = self.events
            if ev.load_checkpoint.active:
                saved = {key: tree["listeners"][key] for key in plan}
                ev.load_checkpoint.send(
                    self, checkpoint=ListenerStates(saved), path=path, **self._common()
                )
        except BaseException:
            if undo is not None:
                undo()
            self._restore(snapshot, path, model=not swap)
            raise

    def _snapshot(self, model: bool = True) -> dict[str, Any]:
        """The restorable state in the layout of a checkpoint tree (the model's only if
        ``model``). Tensors are copied where restoring writes into them; the optimizer's state
        is not: ``load_state_dict`` replaces it without writing into the old tensors."""
        module, optimizer = self._require_attached("load")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {
            "model": {k: v.detach().clone() for k, v in module.state_dict().items()}
            if model
            else None,
            "optimizer": _runtime.optimizer_state_to_tree(optimizer.state_dict()),
            "scheduler": None
            if self.scheduler is None
            else copy.deepcopy(self.scheduler.state_dict()),
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
            "trainer": {
                "progress": {
                    "epoch": self._loop.resume_at[0],
                    "batch": self._loop.resume_at[1],
                    "global_step": self.state.global_step,
                    "optimizer_steps": self.state.optimizer_steps,
                    "accumulated": self._loop.accumulated,
                    "validation_pending": self._validation_pending,
                }
            },
            "pending_grads": [None if p.grad is None else p.grad.clone() for p in params],
            "rng": {"current": _runtime.get_rng_state(), "epoch_start": self._epoch_rng},
        }

    def _restore(self, tree: dict[str, Any], path: str, model: bool = True) -> None:
        module, optimizer = self._require_attached("load")
        if model:
            module.load_state_dict(tree["model"])
        optimizer.load_state_dict(_runtime.optimizer_state_from_tree(tree["optimizer"], path))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(tree["scheduler"])
        if self.grad_scaler is not None and tree["grad_scaler"] is not None:
            self.grad_scaler.load_state_dict(tree["grad_scaler"])
        progress = tree["trainer"]["progress"]
        self.state.epoch, self.state.batch_idx = progress["epoch"], progress["batch"]
        self.state.global_step = progress["global_step"]
        self.state.optimizer_steps = progress["optimizer_steps"]
        self._loop.resume_at = (progress["epoch"], progress["batch"])
        self._loop.accumulated = progress["accumulated"]
        self._validation_pending = progress["validation_pending"]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = tree["pending_grads"] or [None] * len(params)
        for param, grad in zip(params, grads):
            param.grad = None if grad is None else grad.to(param.device, param.dtype)
        _runtime.set_rng_state(tree["rng"]["current"])
        self._loaded_rng = tree["rng"]["current"]
        self._loaded_epoch_rng = tree["rng"]["epoch_start"]
        self._epoch_rng = self._loaded_epoch_rng

    def _check_checkpoint(
        self,
        path: str,
        tree: dict[str, Any],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        strict: bool,
    ) -> list[str]:
        """Collect every mismatch; return the listener keys that will receive state."""
        sections = ("trainer", "model", "optimizer", "scheduler", "grad_scaler", "rng", "listeners")
        missing = [s for s in (*sections, "pending_grads") if s not in tree]
        if missing:
            raise CheckpointFormatError(f"{path} lacks the sections {missing}")
        kinds: dict[str, type | tuple[type, ...]] = {
            "trainer": dict,
            "model": dict,
            "optimizer": dict,
            "rng": dict,
            "listeners": dict,
            "scheduler": (dict, type(None)),
            "grad_scaler": (dict, type(None)),
            "pending_grads": (list, type(None)),
        }
        wrong = [name for name, kind in kinds.items() if not isinstance(tree[name], kind)]
        progress = tree["trainer"].get("progress") if isinstance(tree["trainer"], dict) else None
        if wrong or not isinstance(progress, dict):
            raise CheckpointFormatError(
                f"{path}: the sections {wrong or ['trainer.progress']} do not have the layout "
                "of a trainer checkpoint"
            )
        problems: list[str] = []
        live = model.state_dict()
        saved = tree["model"]
        for key in sorted(set(live) - set(saved)):
            problems.append(f"model: missing key {key!r}")
        for key in sorted(set(saved) - set(live)):
            problems.append(f"model: unexpected key {key!r}")
        for key in sorted(set(live) & set(saved)):
            have, got = live[key], saved[key]
            if not isinstance(got, torch.Tensor):
                problems.append(f"model: {key!r} is not a tensor in the file")
            elif have.shape != got.shape:
                problems.append(
                    f"model: {key!r} has shape {tuple(got.shape)} in the file, "
                    f"{tuple(have.shape)} in the model"
                )
            elif have.dtype != got.dtype:
                problems.append(
                    f"model: {key!r} has dtype {got.dtype} in the file, {have.dtype} in the model"
                )
        saved_class = tree["trainer"].get("optimizer_class")
        if saved_class != type(optimizer).__qualname__:
            problems.append(
                f"optimizer: the file was written by {saved_class}, the trainer has "
                f"{type(optimizer).__qualname__}"
            )
        groups = tree["optimizer"].get("param_groups", []) if tree["optimizer"] else []
        live_sizes = [len(g["params"]) for g in optimizer.param_groups]
        saved_sizes = [len(g.get("params", [])) for g in groups]
        if live_sizes != saved_sizes:
            problems.append(
                f"optimizer: parameter groups of sizes {saved_sizes} in the file, "
                f"{live_sizes} in the optimizer"
            )
        else:
            problems.extend(_optimizer_state_problems(tree["optimizer"], optimizer))
        if (tree["scheduler"] is None) != (self.scheduler is None):
            saved_one = "no scheduler" if tree["scheduler"] is None else "a scheduler"
            have = "a scheduler" if self.scheduler is not None else "none"
            problems.append(f"scheduler: the file has {saved_one}, the trainer has {have}")
        if tree["grad_scaler"] is not None and self.grad_scaler is None:
            problems.append(
                f"grad scaler: the file was written with precision "
                f"{tree['trainer'].get('precision')!r}, this trainer uses {self.precision!r}"
            )
        subscriptions = self.events.subscriptions()
        receiving = [s.key for s in subscriptions if "load_checkpoint" in s.receivers]
        stored = tree["listeners"]
        listener_problems = [
            f"listener {key!r}: subscribed with on_load_checkpoint, but the file has no state "
            "for it"
            for key in receiving
            if key not in stored
        ]
        subscribed = {s.key for s in subscriptions}
        for key in stored:
            if key not in subscribed:
                listener_problems.append(
                    f"listener {key!r}: the file has its state, but no listener of that name is "
                    f"subscribed (subscribed: {sorted(subscribed)})"
                )
            elif key not in receiving:
                listener_problems.append(
                    f"listener {key!r}: the file has its state, but it has no on_load_checkpoint"
                )
        if listener_problems and not strict:
            for problem in listener_problems:
                warnings.warn(f"{path}: {problem}", stacklevel=3)
        else:
            problems.extend(listener_problems)
        if problems:
            raise CheckpointMismatchError(
                f"{path} does not match the live objects ({len(problems)} problems):\n  - "
                + "\n  - ".join(problems)
            )
        return [key for key in receiving if key in stored]

    def _require_attached(self, verb: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        if self.model is None or self.optimizer is None:
            raise RuntimeError(
                f"cannot {verb} a checkpoint: no model and optimizer are attached; call fit() "
                "or attach(model, optimizer) first"
            )
        return self.model, self.optimizer

    def _common(self) -> dict[str, Any]:
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


def _optimizer_state_problems(saved: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """Per-parameter state whose shape cannot belong to its parameter (e.g. Adam moments)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    problems = []
    for index, values in (saved.get("state") or {}).items():
        position = int(index) if str(index).isdigit() else -1
        if not 0 <= position < len(params):
            problems.append(f"optimizer: state for parameter {index!r}, which does not exist")
            continue
        shape = tuple(params[position].shape)
        for name, value in values.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() == len(shape)
                and value.dim() > 0
                and tuple(value.shape) != shape
            ):
                problems.append(
                    f"optimizer: state {name!r} of parameter {index} has shape "
                    f"{tuple(value.shape)} in the file, the parameter has shape {shape}"
                )
    return problems


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
