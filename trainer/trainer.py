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
:mod:`trainer.state`, the file format in :mod:`trainer.checkpoint`. A fit's setup is in
:mod:`trainer.run`, saving and restoring a trainer in :mod:`trainer.checkpointing`, and the
reading of what the step functions return in :mod:`trainer.steps`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from trainer import _runtime
from trainer import distributed as _distributed
from trainer import validators as _v
from trainer.capture import CAPTURE_MODES, check_capture_device, keep_gradients
from trainer.checkpointing import Checkpointer, check_attachable
from trainer.data import resolve_device
from trainer.events import Events
from trainer.exceptions import ListenerError, add_note
from trainer.listener_api import ListenerAPI
from trainer.run import (
    FitResult,
    Run,
    attachments,
    check_ranks_agree,
    close_epoch,
    common_payload,
    epoch_batches,
    fit_result,
    interrupted_result,
    prepare_run,
    start_run,
)
from trainer.state import TrainState
from trainer.steps import (
    StepOutput,
    nonfinite_loss_error,
    split_step_output,
    validation_metrics,
)

__all__ = ["FitResult", "StepOutput", "TrainState", "Trainer"]


def _device(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    resolve_device(value)


def _capture(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _v.one_of(*CAPTURE_MODES)(instance, attribute, value)
    if value == "graph" and instance.compile_step:
        raise ValueError(
            "Trainer.compile_step=True (the old spelling of capture='compile') contradicts "
            "capture='graph'; give capture alone"
        )
    check_capture_device(value, instance.device, "Trainer.capture")


def _compile_step(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _v.boolean(instance, attribute, value)
    if value:
        warnings.warn(
            "Trainer(compile_step=True) is deprecated: use Trainer(capture='compile')",
            DeprecationWarning,
            stacklevel=3,
        )


@attrs.define(eq=False)
class Trainer(ListenerAPI):
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
        tf32: TF32 in CUDA matmuls and convolutions during the fit: True, False or None (as is).
        channels_last: Model and image batches in ``torch.channels_last`` (kept after the fit).
        compile_step: Deprecated (warns): the old spelling of ``capture="compile"``.
        distributed: ``"auto"`` (data-parallel over the default process group when one is
            initialised), ``"init"`` (initialise it from ``torchrun``'s environment first) or
            ``"off"``. See :mod:`trainer.distributed` and the "Distributed training" page.
        capture: ``"off"`` (eager), ``"compile"`` (``torch.compile``, any device) or ``"graph"``
            (compiled and recorded as CUDA graphs, CUDA only); see :mod:`trainer.capture`.

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
    compile_step: bool = attrs.field(default=False, validator=_compile_step)
    distributed: str = attrs.field(default="auto", validator=_v.one_of(*_distributed.MODES))
    capture: str = attrs.field(default="off", validator=_capture)  # after: positions unchanged
    tf32: bool | None = attrs.field(default=None, validator=_v.optional_boolean)
    channels_last: bool = attrs.field(default=False, validator=_v.boolean)

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

    _run: Run | None = attrs.field(init=False, default=None, repr=False)
    _checkpoints: Checkpointer = attrs.field(
        init=False,
        default=attrs.Factory(lambda self: Checkpointer(self, self._emit), takes_self=True),
        repr=False,
    )

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
        self._refuse_nested_fit()
        run = prepare_run(
            self, train_loader, step, val_loader, val_step, scheduler, scheduler_interval
        )
        checkpoints = self._checkpoints
        resume = checkpoints.read_resume(resume_from, model, optimizer, scheduler, train_loader)
        before = attachments(self)
        # Start: device, attachments, DDP wrapper and shards, a fresh TrainState, the seed.
        start_run(self, run, model, optimizer, scheduler, resuming=resume is not None)
        run.payload, self._run = self._common(), run
        try:
            # Train start; a resumed fit then restores the checkpoint over what its hooks did.
            self._emit("train_start", train_loader=run.train_loader, scheduler=scheduler)
            checkpoints.resume(resume, before)
            check_ranks_agree(self.events, self.dist)
            self._validate_pending(run)
            # Epochs, until max_epochs, max_steps or a listener's state.should_stop.
            epoch, skip = self.state.resume_at
            while not self.state.finished(epoch):
                self._run_epoch(run, epoch, skip)
                epoch, skip = epoch + 1, 0
            # Train end.
            return self._end(fit_result(run, self.state, self.dist))
        except BaseException as exc:
            self.dist.share_failure(exc)  # the other ranks stop at their next safe point
            self._announce_failure(exc)
            raise
        finally:
            self._run = None
            run.restore_tf32()  # process-wide switches that start_run set

    def _run_epoch(self, run: Run, epoch: int, skip: int) -> None:
        """One epoch from batch ``skip`` (0 unless resuming mid-epoch), then its validation."""
        state = self.state
        state.epoch, run.epochs = epoch, run.epochs + 1
        self._emit("epoch_start")
        batches, length = epoch_batches(run.train_loader, state, self.dist, epoch, skip)
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
            self._optimizer_step(run)
        # Epoch end: a full epoch steps an epoch-interval scheduler first. A checkpoint written
        # from here on resumes at the next epoch (after this one's validation).
        validate = run.val_loader is not None and (epoch + 1) % self.check_val_every_n_epoch == 0
        if exhausted:
            close_epoch(run, state, epoch, resumed_at_end=done == skip)
            state.validation_pending = validate
        self._emit("epoch_end")
        state.should_stop = self.dist.safe_point("epoch_end", stop=state.should_stop)
        # Validation every n-th epoch, isolated from the training RNG stream.
        if validate:
            run.val_metrics = self._validate(run)

    def _train_batch(self, run: Run, batch_idx: int, batch: Any, *, last: bool) -> None:
        """Device, step, backward (or skip), optimizer step when due; ``batch_start``/``_end``."""
        state = self.state
        state.batch_idx = batch_idx
        batch = run.move(batch)
        self._emit("batch_start", batch=batch)
        # Forward (the caller's step) under the chosen precision, then backward.
        with run.autocast():
            outputs = run.step(batch)
        loss, outputs = split_step_output(outputs)
        self._backward_or_skip(run, loss)
        # Optimizer step when the accumulation window is full or the data ends.
        last = last or (state.max_steps is not None and state.global_step + 1 >= state.max_steps)
        # >=: a mid-window checkpoint may be resumed with a smaller accumulate_grad_batches
        if state.accumulated and (state.accumulated >= self.accumulate_grad_batches or last):
            self._optimizer_step(run)
        elif run.keep_gradients:  # gradients kept for the next step, out of CUDA-graph memory
            keep_gradients(self.optimizer)  # type: ignore[arg-type]
        state.global_step += 1
        state.resume_at = (state.epoch, batch_idx + 1)
        # Batch end: parameters are updated, the loss is still on the device.
        self._emit("batch_end", batch=batch, outputs=outputs, loss=loss)
        if run.distributed:
            state.should_stop = self.dist.safe_point("batch_end", stop=state.should_stop)
        run.last_loss = loss

    # -- phases -----------------------------------------------------------------------------------

    def _refuse_nested_fit(self) -> None:
        if self._run is not None or self.events.dispatching or self._checkpoints.collecting:
            raise RuntimeError(
                "fit() was called while this trainer is already fitting or handling an event "
                "(from a listener?); "
                "one trainer runs one fit at a time: use a second Trainer for a nested fit"
            )

    def _validate_pending(self, run: Run) -> None:
        """A checkpoint taken after an epoch, before its validation: run it now, as that epoch's."""
        state = self.state
        if state.validation_pending and run.val_loader is not None:
            state.epoch = state.resume_at[0] - 1
            run.val_metrics = self._validate(run)

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
        check_attachable(model, optimizer)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def _backward_or_skip(self, run: Run, loss: torch.Tensor) -> None:
        """Backward (scaled for accumulation and precision), or skip a non-finite loss."""
        state = self.state
        skipped = run.check_loss and not _runtime.is_finite(loss)
        if run.check_loss and run.distributed:
            skipped = self.dist.any(skipped)  # the same on all ranks
        state.batch_skipped = skipped
        if skipped:
            if self.nonfinite_loss == "raise":
                raise nonfinite_loss_error(loss, state)
            state.skipped_batches += 1
            return
        if self.accumulate_grad_batches > 1:
            loss = loss / self.accumulate_grad_batches
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        loss.backward()
        if self.dist.backend is not None:  # distributed
            self.dist.average_gradients(self.training_model, self.optimizer)  # type: ignore[arg-type]
        state.accumulated += 1

    def _optimizer_step(self, run: Run) -> None:
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
        else:  # optimizer.step(), or compiled under capture (eager at the fit's first step)
            run.optimizer_step(first=self.state.optimizer_steps == 0)
        optimizer.zero_grad(set_to_none=True)
        self.state.accumulated = 0
        self.state.optimizer_steps += 1
        if run.step_scheduler is not None:
            run.step_scheduler.step()

    def _validate(self, run: Run) -> dict[str, float]:
        """One validation pass in eval mode, isolated from the training RNG stream."""
        model = self.model
        assert model is not None
        rng = _runtime.get_rng_state()
        model.eval()
        try:
            with torch.no_grad():
                self._emit("validation_start", val_loader=run.val_loader)
                metrics = validation_metrics(
                    run.val_loader, run.val_step, run.move, run.autocast, self.dist
                )
        finally:
            model.train()
            _runtime.set_rng_state(rng)
        self.state.validation_pending = False
        self._emit("validation_end", metrics=metrics)
        self.state.should_stop = self.dist.safe_point("validation_end", stop=self.state.should_stop)
        return metrics

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
                self._end(interrupted_result(self.state), interrupted=True)
        except Exception as inner:
            add_note(exc, f"while announcing it: {inner}")

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
        self._checkpoints.save(path)

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
        self._checkpoints.load(
            path, model=model, optimizer=optimizer, scheduler=scheduler, strict=strict
        )

    def _common(self) -> dict[str, Any]:
        """The keywords every event carries."""
        return common_payload(self)
