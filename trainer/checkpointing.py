"""Saving and restoring one trainer's whole state, all or nothing.

A :class:`Checkpointer` assembles the checkpoint tree with every listener's
``on_save_checkpoint`` output and writes it (one file per rank in a distributed fit), and applies
a tree that :func:`~trainer.state_checks.check_tree` accepted, rolling the trainer and its
listeners back if anything fails on the way. The tree itself is :mod:`trainer.state`'s business,
the file format :mod:`trainer.checkpoint`'s.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainer import _runtime
from trainer import distributed as _distributed
from trainer import state as _state
from trainer.checkpoint import read_checkpoint, write_checkpoint
from trainer.exceptions import ListenerError, add_note
from trainer.run import restore_attachments
from trainer.state import ListenerStates
from trainer.state_checks import check_tree

__all__ = ["Checkpointer", "Resume", "check_attachable"]

Resume = tuple[str, dict[str, Any], list[str]]
"""A checkpoint read and checked for a resumed fit: its path, its tree and the listener plan."""


def check_attachable(model: Any, optimizer: Any) -> None:
    """Raise a ``TypeError`` unless ``model`` is a module and ``optimizer`` an optimizer."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")


class Checkpointer:
    """The checkpoint half of one :class:`~trainer.Trainer`.

    Args:
        trainer: The trainer whose public attributes (``model``, ``optimizer``, ``scheduler``,
            ``grad_scaler``, ``state``, ``train_loader``, ``events``, ``dist``) are saved and
            restored.
        emit: Fires an event with the trainer's common payload (the trainer's one way to do it).

    Attributes:
        collecting: True while the listeners' ``on_save_checkpoint`` hooks run.
    """

    __slots__ = ("_emit", "_trainer", "collecting")

    def __init__(self, trainer: Any, emit: Callable[..., None]) -> None:
        self._trainer = trainer
        self._emit = emit
        self.collecting = False

    # -- saving -----------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """:meth:`Trainer.save_checkpoint <trainer.Trainer.save_checkpoint>`."""
        self.require_attached("save")
        if self.collecting:
            raise RuntimeError(
                "save_checkpoint() was called from an on_save_checkpoint hook, while a checkpoint "
                "is being assembled; write the listener's state into its `checkpoint` argument "
                "instead, and call save_checkpoint() from another event (batch_end, epoch_end)"
            )
        events = self._trainer.events
        if events.dispatching:
            # Called from a listener: write once every listener has handled the current event,
            # so that the file holds one consistent state whatever the listener order.
            events.defer(lambda: self.write(os.fspath(path)))
            return
        self.write(os.fspath(path))

    def write(self, path: str) -> None:
        """Assemble and write a checkpoint; in a distributed fit, one file per rank as well.

        Every rank collects its listeners' states; only when all succeeded do the ranks write
        their own files (:func:`~trainer.state.rank_path`), then rank zero the main file,
        and nobody continues before it is on disk (see :mod:`trainer.checkpoint`).
        """
        ctx = self._trainer.dist
        tree = ctx.together("checkpoint_states", lambda: self.tree(path))
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

    def tree(self, path: str) -> dict[str, Any]:
        """The checkpoint tree of the trainer now, the listeners' states included."""
        self.require_attached("save")
        states = self.collect_listener_states(path)
        subscriptions = self._trainer.events.subscriptions()
        stateful = [s.key for s in subscriptions if "save_checkpoint" in s.receivers]
        order = [s.key for s in subscriptions]
        return _state.build_tree(self._trainer, states.to_tree(), order=order, stateful=stateful)

    def collect_listener_states(self, path: str) -> ListenerStates:
        """Every listener's ``on_save_checkpoint`` output (for a file or a rollback snapshot)."""
        states = ListenerStates()
        self.collecting = True
        try:
            self._emit("save_checkpoint", checkpoint=states, path=path)
        finally:
            self.collecting = False
        return states

    def give_listener_states(self, states: Mapping[str, Any], path: str) -> None:
        """Hand each listener its part of ``states`` (listeners without a part are not called)."""
        self._emit("load_checkpoint", checkpoint=ListenerStates(states), path=path)

    # -- loading ----------------------------------------------------------------------------------

    def read(
        self,
        path: str,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        strict: bool,
        loader: Any = None,
    ) -> tuple[dict[str, Any], list[str]]:
        """Read ``path`` (and this rank's own file) and check it against the given objects.

        Returns:
            The tree and the keys of the listeners that receive their state, in order.
        """
        ctx = self._trainer.dist
        tree = _state.merge_rank_state(path, read_checkpoint(path), ctx.rank, ctx.world_size)
        plan = check_tree(
            path,
            tree,
            self._trainer,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            strict=strict,
            loader=loader,
        )
        return tree, plan

    def load(
        self,
        path: str | os.PathLike[str],
        *,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        strict: bool,
    ) -> None:
        """:meth:`Trainer.load_checkpoint <trainer.Trainer.load_checkpoint>` between fits."""
        trainer = self._trainer
        model = trainer.model if model is None else model
        optimizer = trainer.optimizer if optimizer is None else optimizer
        scheduler = trainer.scheduler if scheduler is None else scheduler
        if model is None or optimizer is None:
            raise RuntimeError(
                "cannot load a checkpoint: no model and optimizer are attached; call fit() or "
                "attach(model, optimizer) first, or pass model= and optimizer="
            )
        check_attachable(model, optimizer)
        path = os.fspath(path)
        if not trainer.dist.enabled:
            trainer.dist = _distributed.resolve(trainer.distributed)
            trainer.events.rank = trainer.dist.rank
        tree, plan = self.read(
            path, model=model, optimizer=optimizer, scheduler=scheduler, strict=strict
        )
        attached = (trainer.model, trainer.optimizer, trainer.scheduler)
        trainer.model, trainer.optimizer, trainer.scheduler = model, optimizer, scheduler
        try:
            self.apply(path, tree, plan)
        except BaseException:
            trainer.model, trainer.optimizer, trainer.scheduler = attached
            raise

    def read_resume(
        self,
        resume_from: str | os.PathLike[str] | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        train_loader: Any,
    ) -> Resume | None:
        """Resolve the fit's process group; read and check the checkpoint to resume from."""
        trainer = self._trainer
        ctx = trainer.dist = _distributed.resolve(trainer.distributed)
        trainer.events.rank = ctx.rank
        if resume_from is None:
            return None
        path = os.fspath(resume_from)
        tree, plan = self.read(
            path,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            strict=True,
            loader=train_loader,
        )
        return path, tree, plan

    def resume(self, resume: Resume | None, before: tuple[Any, ...]) -> None:
        """Restore the checkpoint read by :meth:`read_resume` (all or nothing: if it is refused,
        the trainer's state and attachments from ``before`` the fit are put back)."""
        if resume is None:
            return
        trainer = self._trainer
        path, tree, plan = resume
        try:
            self.apply(path, tree, plan, loader=trainer.train_loader)
        except BaseException:
            restore_attachments(trainer, before)
            raise
        state = trainer.state
        if state.finished(state.resume_at[0]) and not state.validation_pending:
            warnings.warn(
                f"{path} is the checkpoint of a finished run (epoch {state.resume_at[0]}, step "
                f"{state.global_step}); this fit trains nothing. To train further on new data, "
                "restore it with load_checkpoint() and call fit() without resume_from.",
                stacklevel=3,
            )

    def apply(
        self, path: str, tree: dict[str, Any], plan: list[str], *, loader: Any = None
    ) -> None:
        """Restore a checkpoint that :func:`~trainer.state_checks.check_tree` accepted, all or
        nothing.

        If anything fails on the way (a listener refusing its state, say), the model, optimizer,
        scheduler, grad scaler, progress, RNG and the listeners that already received their
        state are put back as they were.
        """
        trainer = self._trainer
        model, _ = self.require_attached("load")
        # The model's tensors are swapped for the loaded ones where that is a plain copy (the
        # old ones are kept for a rollback); otherwise they are copied in, after a snapshot.
        swaps = None if trainer.dist.enabled else _runtime.swap_plan(model, tree["model"])
        snapshot = _state.take_snapshot(trainer, model=swaps is None)
        before = self._listener_snapshot(plan, path)
        undo = None
        try:
            if swaps is not None:
                undo = _runtime.swap_in_module_state(swaps)
            _state.restore_tree(trainer, tree, path, model=undo is None, loader=loader)
            self.give_listener_states({key: tree["listeners"][key] for key in plan}, path)
        except BaseException as exc:
            if undo is not None:
                undo()
            # Listeners first: one that writes to the TrainState while loading (EarlyStopping's
            # should_stop) must not change it after the trainer's own rollback.
            self._roll_back_listeners(plan, before, path, exc)
            _state.roll_back(trainer, snapshot)
            raise

    def _listener_snapshot(self, plan: list[str], path: str) -> dict[str, Any]:
        """Copies of the current state of every receiving listener but the last: if a later one
        refuses its state, the earlier ones get these back. (The last one has nobody after it;
        a listener keeps its own load all or nothing.)"""
        if len(plan) < 2:
            return {}
        states = self.collect_listener_states(path).to_tree()
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
            self.give_listener_states(states, path)
        except Exception as inner:  # the error being raised stays the one to report
            add_note(exc, f"while putting the listeners' state back: {inner}")

    def require_attached(self, verb: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The attached model and optimizer; a ``RuntimeError`` naming ``verb`` without them."""
        trainer = self._trainer
        if trainer.model is None or trainer.optimizer is None:
            raise RuntimeError(
                f"cannot {verb} a checkpoint: no model and optimizer are attached; call fit() "
                "or attach(model, optimizer) first"
            )
        return trainer.model, trainer.optimizer
