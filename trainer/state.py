"""Everything a trainer saves and restores, apart from the loop that changes it.

Two things live here, in the way Composer keeps its ``State`` apart from its engine:

* :class:`TrainState`, the loop's progress (the ``state`` keyword of every event);
* the checkpoint *tree*: what a trainer checkpoint holds, built by :func:`build_tree`, checked
  against the live objects by :func:`check_tree` (in :mod:`trainer.state_checks`, importable
  from here) before anything is applied, and applied by
  :func:`restore_tree`; :func:`take_snapshot` and :func:`roll_back` undo a load that failed half
  way. Per-rank parts of a distributed checkpoint are split and joined by :func:`rank_state` and
  :func:`merge_rank_state`.

The file format itself (safetensors + JSON, checksums, the untrusted-file reader) is
:mod:`trainer.checkpoint`; this module hands it a tree and gets a tree back.

A trainer checkpoint tree has these sections::

    trainer        {"progress": {...}, "optimizer_class", "scheduler_class", "listener_order",
                    "stateful_listeners", "precision", ["world_size"]}
    model          the model's state_dict
    optimizer      the optimizer's state_dict (parameter ids as strings)
    scheduler      the scheduler's state_dict, or None
    grad_scaler    the GradScaler's state_dict, or None
    rng            {"current": RNG, "epoch_start": RNG or None}
    pending_grads  the gradients of an unfinished accumulation window, or None
    listeners      {listener key: the state it wrote in on_save_checkpoint}
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import attrs
import torch

from trainer import _runtime
from trainer.checkpoint import check_value, read_checkpoint
from trainer.exceptions import CheckpointMismatchError
from trainer.state_checks import PROGRESS_KEYS, check_tree

__all__ = [
    "PROGRESS_KEYS",
    "ListenerState",
    "ListenerStates",
    "TrainState",
    "build_tree",
    "check_tree",
    "merge_rank_state",
    "progress_record",
    "rank_path",
    "rank_state",
    "restore_tree",
    "roll_back",
    "take_snapshot",
]


@attrs.define(eq=False)
class TrainState:
    """Where the loop is; every event's ``state`` keyword.

    The first group of attributes is for listeners; the second is the loop's own bookkeeping,
    readable by listeners but written by the trainer only.

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
        accumulated: Backward passes summed into the gradients since the last optimizer step.
        resume_at: ``(epoch, batch)`` that a checkpoint taken now continues from.
        validation_pending: The last epoch ended and its validation has not run yet.
        epoch_rng: The RNG states that ordered the current epoch's data (for a mid-epoch resume).
        loaded_rng: The RNG states of the checkpoint this fit resumed from, or None.
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
    accumulated: int = 0
    resume_at: tuple[int, int] = (0, 0)
    validation_pending: bool = False
    epoch_rng: dict[str, Any] | None = attrs.field(default=None, repr=False)
    loaded_rng: dict[str, Any] | None = attrs.field(default=None, repr=False)

    def steps_left(self) -> float:
        """Training batches left before ``max_steps`` (infinite without a limit)."""
        return math.inf if self.max_steps is None else self.max_steps - self.global_step

    def finished(self, epoch: int) -> bool:
        """Whether the fit ends before ``epoch``: a stop was asked for or a limit is reached."""
        if self.should_stop or self.steps_left() <= 0:
            return True
        return self.max_epochs is not None and epoch >= self.max_epochs


def progress_record(state: TrainState) -> dict[str, Any]:
    """The ``trainer.progress`` section for a checkpoint taken now (the one place it is built)."""
    epoch, batch = state.resume_at
    return {
        "epoch": epoch,
        "batch": batch,
        "global_step": state.global_step,
        "optimizer_steps": state.optimizer_steps,
        "accumulated": state.accumulated,
        "validation_pending": state.validation_pending,
    }


def _apply_progress(state: TrainState, progress: Mapping[str, Any]) -> None:
    state.epoch, state.batch_idx = progress["epoch"], progress["batch"]
    state.global_step = progress["global_step"]
    state.optimizer_steps = progress["optimizer_steps"]
    state.resume_at = (progress["epoch"], progress["batch"])
    state.accumulated = progress["accumulated"]
    state.validation_pending = progress["validation_pending"]


# -- listener namespaces ------------------------------------------------------------------------


class ListenerState(MutableMapping[str, Any]):
    """The part of a checkpoint that belongs to one listener.

    Listeners receive it as the ``checkpoint`` keyword of ``on_save_checkpoint`` (writable) and
    ``on_load_checkpoint`` (read-only). Keys are strings; values are checked with
    :func:`check_value` when they are set.

    Example:
        >>> state = ListenerState("counter_0")
        >>> state["seen"] = 3
        >>> dict(state)
        {'seen': 3}
    """

    def __init__(
        self, key: str, data: Mapping[str, Any] | None = None, *, readonly: bool = False
    ) -> None:
        self.key = key
        self.readonly = readonly
        self._data: dict[str, Any] = dict(data or {})

    def __getitem__(self, name: str) -> Any:
        try:
            return self._data[name]
        except KeyError:
            raise KeyError(
                f"listener {self.key!r} has no {name!r} in this checkpoint; "
                f"it holds {sorted(self._data)}"
            ) from None

    def __setitem__(self, name: str, value: Any) -> None:
        if self.readonly:
            raise TypeError(
                f"the checkpoint of listener {self.key!r} is read-only while loading; "
                "write state in on_save_checkpoint"
            )
        if not isinstance(name, str) or not name:
            raise TypeError(f"checkpoint keys must be non-empty strings, got {name!r}")
        check_value(value, f"checkpoint[{name!r}] of listener {self.key!r}")
        self._data[name] = value

    def __delitem__(self, name: str) -> None:
        if self.readonly:
            raise TypeError(f"the checkpoint of listener {self.key!r} is read-only while loading")
        del self._data[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"ListenerState({self.key!r}, keys={sorted(self._data)})"


class ListenerStates:
    """The ``checkpoint`` payload of the checkpoint events: one :class:`ListenerState` per listener.

    The dispatcher hands each receiver ``for_listener(key)``, so a listener sees only its own
    namespace.
    """

    def __init__(self, saved: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.readonly = saved is not None
        self._states = {
            key: ListenerState(key, value, readonly=True) for key, value in (saved or {}).items()
        }

    def for_listener(self, key: str) -> ListenerState | None:
        """The namespace of listener ``key``: created empty when saving, None when loading a file
        without state for ``key`` (the listener is then not called)."""
        if key not in self._states:
            if self.readonly:
                return None
            self._states[key] = ListenerState(key)
        return self._states[key]

    def to_tree(self) -> dict[str, dict[str, Any]]:
        """Every namespace as a plain dict, for :func:`write_checkpoint`."""
        return {key: dict(state) for key, state in self._states.items()}


# -- building, restoring and rolling back --------------------------------------------------------


def build_tree(
    trainer: Any, listener_states: dict[str, Any], *, order: list[str], stateful: list[str]
) -> dict[str, Any]:
    """The checkpoint tree of ``trainer`` now, with the listener states already collected.

    Args:
        trainer: A :class:`~trainer.Trainer` with a model and an optimizer attached.
        listener_states: ``{key: state}`` that the listeners wrote in ``on_save_checkpoint``.
        order: Every subscribed listener's key, in dispatch order.
        stateful: The keys of the listeners that save state.
    """
    model, optimizer, state = trainer.model, trainer.optimizer, trainer.state
    progress = progress_record(state)
    pending = None
    if state.accumulated:
        pending = [p.grad for p in _runtime.optimizer_params(optimizer)]
    scheduler, scaler = trainer.scheduler, trainer.grad_scaler
    return {
        "trainer": {
            "progress": progress,
            "optimizer_class": type(optimizer).__qualname__,
            "scheduler_class": None if scheduler is None else type(scheduler).__qualname__,
            "listener_order": order,
            "stateful_listeners": stateful,
            "precision": trainer.precision,
        },
        "model": model.state_dict(),
        "optimizer": _runtime.optimizer_state_to_tree(optimizer.state_dict()),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "grad_scaler": None if scaler is None else scaler.state_dict(),
        "rng": {
            # With the loader's own generators, so that an epoch-boundary resume shuffles on.
            "current": _runtime.get_rng_state(trainer.train_loader),
            "epoch_start": state.epoch_rng if progress["batch"] else None,
        },
        "pending_grads": pending,
        "listeners": listener_states,
    }


def restore_tree(
    trainer: Any, tree: Mapping[str, Any], path: str, *, model: bool = True, loader: Any = None
) -> None:
    """Apply a tree that :func:`check_tree` accepted to the trainer's attached objects.

    Args:
        trainer: The trainer whose model, optimizer, scheduler, grad scaler, progress and RNG
            receive the checkpoint (listeners are the trainer's business).
        tree: The checked checkpoint tree.
        path: The file it came from, for messages.
        model: False when the model's tensors were already swapped in.
        loader: The train loader of a resumed fit, whose own generators are restored too.
    """
    module, optimizer = trainer.model, trainer.optimizer
    if model:
        module.load_state_dict(tree["model"])
    optimizer.load_state_dict(_runtime.optimizer_state_from_tree(tree["optimizer"], path))
    if trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(tree["scheduler"])
    if trainer.grad_scaler is not None and tree["grad_scaler"] is not None:
        trainer.grad_scaler.load_state_dict(tree["grad_scaler"])
    state = trainer.state
    _apply_progress(state, tree["trainer"]["progress"])
    params = _runtime.optimizer_params(optimizer)
    grads = tree["pending_grads"] or [None] * len(params)
    for param, grad in zip(params, grads):
        param.grad = None if grad is None else grad.to(param.device, param.dtype)
    _runtime.set_rng_state(tree["rng"]["current"], loader)
    state.loaded_rng = tree["rng"]["current"]
    state.epoch_rng = tree["rng"]["epoch_start"]


def take_snapshot(trainer: Any, *, model: bool = True) -> dict[str, Any]:
    """What :func:`roll_back` needs to put the trainer back exactly as it is now.

    Tensors are copied where a restore writes into them (the model's, unless ``model`` is False
    because the load swaps tensors instead); the optimizer's state is not copied, since
    ``load_state_dict`` replaces it without writing into the old tensors.
    """
    module, optimizer = trainer.model, trainer.optimizer
    scheduler, scaler = trainer.scheduler, trainer.grad_scaler
    return {
        "model": {k: v.detach().clone() for k, v in module.state_dict().items()} if model else None,
        "optimizer": optimizer.state_dict(),
        "scheduler": None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
        "grad_scaler": None if scaler is None else scaler.state_dict(),
        "grads": [
            None if p.grad is None else p.grad.clone() for p in _runtime.optimizer_params(optimizer)
        ],
        "rng": _runtime.get_rng_state(trainer.train_loader),
        "state": attrs.asdict(trainer.state, recurse=False),
    }


def roll_back(trainer: Any, snapshot: Mapping[str, Any]) -> None:
    """Put back what :func:`take_snapshot` recorded, the whole :class:`TrainState` included."""
    module, optimizer = trainer.model, trainer.optimizer
    if snapshot["model"] is not None:
        module.load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    if trainer.scheduler is not None and snapshot["scheduler"] is not None:
        trainer.scheduler.load_state_dict(snapshot["scheduler"])
    if trainer.grad_scaler is not None and snapshot["grad_scaler"] is not None:
        trainer.grad_scaler.load_state_dict(snapshot["grad_scaler"])
    for param, grad in zip(_runtime.optimizer_params(optimizer), snapshot["grads"]):
        param.grad = grad
    _runtime.set_rng_state(snapshot["rng"], trainer.train_loader)
    for name, value in snapshot["state"].items():
        setattr(trainer.state, name, value)


def clone_tensors(value: Any) -> Any:
    """A copy of a nested state in which every tensor is cloned (a snapshot that later writes
    into the live tensors cannot change)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {key: clone_tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_tensors(item) for item in value)
    return value


# -- distributed checkpoints ---------------------------------------------------------------------

_SUFFIX = ".safetensors"


def rank_path(path: str | os.PathLike[str], rank: int) -> str:
    """The file of rank ``rank``'s own state next to the checkpoint ``path``.

    Example:
        >>> rank_path("ckpt/last.safetensors", 1)
        'ckpt/last.rank1.safetensors'
    """
    path = os.fspath(path)
    stem, suffix = (path[: -len(_SUFFIX)], _SUFFIX) if path.endswith(_SUFFIX) else (path, "")
    return f"{stem}.rank{rank}{suffix}"


def rank_state(tree: Mapping[str, Any], rank: int, world_size: int) -> tuple[dict, dict]:
    """Split a full checkpoint tree into rank zero's main tree and one rank's own tree.

    Returns:
        ``(main, own)``: ``main`` holds what every rank shares (``listeners`` emptied,
        ``trainer.world_size`` set); ``own`` holds the rank's listener states, RNG states and
        the progress (to pair it with its main file).
    """
    trainer = dict(tree["trainer"])
    trainer["world_size"] = world_size
    main = {**tree, "trainer": trainer, "listeners": {}}
    own = {
        "rank": rank,
        "world_size": world_size,
        "progress": tree["trainer"]["progress"],
        "rng": tree["rng"],
        "listeners": tree["listeners"],
    }
    return main, own


def merge_rank_state(
    path: str | os.PathLike[str], tree: dict[str, Any], rank: int, world_size: int
) -> dict[str, Any]:
    """Check the world size of the checkpoint ``tree`` read from ``path``; join this rank's file.

    Raises:
        CheckpointMismatchError: When the checkpoint was written by another number of processes,
            or the rank file belongs to another save.
        FileNotFoundError: When this rank's file is missing.
    """
    path = os.fspath(path)
    section = tree.get("trainer")
    trainer: dict[str, Any] = section if isinstance(section, dict) else {}
    saved = trainer.get("world_size", 1)
    if saved != world_size:
        raise CheckpointMismatchError(
            f"{path} was written by {saved} process(es) and this run has {world_size}: data "
            "shards, per-rank replay buffers and RNG streams depend on the number of processes, "
            f"so the run cannot continue with another. Resume with `torchrun --nproc_per_node="
            f"{saved}` (or one process for world size 1)"
        )
    if world_size == 1:
        return tree
    own_path = rank_path(path, rank)
    own = read_checkpoint(own_path)
    if own.get("rank") != rank or own.get("progress") != trainer.get("progress"):
        raise CheckpointMismatchError(
            f"{own_path} does not belong to {path}: it was written by rank {own.get('rank')} at "
            f"progress {own.get('progress')}, the main file is at {trainer.get('progress')} "
            "(a save was interrupted between the rank files and the main file); resume from an "
            "earlier checkpoint"
        )
    return {**tree, "rng": own["rng"], "listeners": own["listeners"]}
