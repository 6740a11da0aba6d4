"""Everything a trainer saves and restores, apart from the loop that changes it.

Two things live here, in the way Composer keeps its ``State`` apart from its engine:

* :class:`TrainState`, the loop's progress (the ``state`` keyword of every event);
* the checkpoint *tree*: what a trainer checkpoint holds, built by :func:`build_tree`, checked
  against the live objects by :func:`check_tree` before anything is applied, and applied by
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
import numbers
import os
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import attrs
import torch

from trainer import _runtime
from trainer.checkpoint import check_value, read_checkpoint, show
from trainer.exceptions import CheckpointFormatError, CheckpointMismatchError

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


PROGRESS_KEYS = (
    "epoch",
    "batch",
    "global_step",
    "optimizer_steps",
    "accumulated",
    "validation_pending",
)
"""The keys of ``trainer.progress``; ``epoch`` and ``batch`` say where a resumed fit continues."""


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


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


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
        pending = [p.grad for p in _params(optimizer)]
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
    params = _params(optimizer)
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
        "grads": [None if p.grad is None else p.grad.clone() for p in _params(optimizer)],
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
    for param, grad in zip(_params(optimizer), snapshot["grads"]):
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


# -- checking a tree read from a file -------------------------------------------------------------
#
# Everything read back is untrusted, even with valid checksums (whoever edits a file can recompute
# them): the sections are checked for type, range and shape against the live objects before any
# of it is applied. Layout errors raise CheckpointFormatError naming the file and the key; a file
# that is well formed but belongs to other objects raises CheckpointMismatchError listing every
# difference.

_SECTIONS: dict[str, tuple[type, ...]] = {
    "trainer": (dict,),
    "model": (dict,),
    "optimizer": (dict,),
    "rng": (dict,),
    "listeners": (dict,),
    "scheduler": (dict, type(None)),
    "grad_scaler": (dict, type(None)),
    "pending_grads": (list, type(None)),
}


def _bad(path: str, key: str, expected: str, value: Any) -> CheckpointFormatError:
    return CheckpointFormatError(f"{path}: {key} must be {expected}, got {show(value)}")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(path: str, tree: Mapping[str, Any]) -> None:
    missing = [name for name in _SECTIONS if name not in tree]
    if missing:
        raise CheckpointFormatError(f"{path} lacks the sections {missing}")
    wrong = [name for name, kinds in _SECTIONS.items() if not isinstance(tree[name], kinds)]
    progress = tree["trainer"].get("progress") if isinstance(tree["trainer"], dict) else None
    if wrong or not isinstance(progress, dict):
        raise CheckpointFormatError(
            f"{path}: the sections {wrong or ['trainer.progress']} do not have the layout "
            "of a trainer checkpoint"
        )
    for key in PROGRESS_KEYS:
        if key not in progress:
            raise CheckpointFormatError(f"{path}: trainer.progress lacks the key {key!r}")
        value = progress[key]
        if key == "validation_pending":
            if not isinstance(value, bool):
                raise _bad(path, f"trainer.progress.{key}", "true or false", value)
        elif not _is_count(value):
            raise _bad(path, f"trainer.progress.{key}", "an int >= 0", value)
    if progress["optimizer_steps"] > progress["global_step"]:
        raise _bad(path, "trainer.progress.optimizer_steps", "<= global_step", progress)
    if progress["batch"] and progress["validation_pending"]:
        raise _bad(path, "trainer.progress.batch", "0 while a validation is pending", progress)
    for key in ("optimizer_class", "precision"):
        if not isinstance(tree["trainer"].get(key), str):
            raise _bad(path, f"trainer.{key}", "a string", tree["trainer"].get(key))
    _check_rng(path, "rng.current", tree["rng"].get("current"))
    if tree["rng"].get("epoch_start") is not None:
        _check_rng(path, "rng.epoch_start", tree["rng"]["epoch_start"])
    for key, value in tree["listeners"].items():
        if not isinstance(value, dict):
            raise _bad(path, f"listeners.{key}", "a mapping of the listener's state", value)


def _check_generator_state(path: str, key: str, value: Any) -> None:
    expected = torch.get_rng_state()
    ok = isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1
    if not ok or value.numel() != expected.numel():
        what = f"a torch.uint8 tensor of shape ({expected.numel()},) (a generator state)"
        shown = (
            value if not isinstance(value, torch.Tensor) else f"{value.dtype} {tuple(value.shape)}"
        )
        raise _bad(path, key, what, shown)


def _check_rng(path: str, key: str, rng: Any) -> None:
    if not isinstance(rng, dict) or "torch" not in rng or "python" not in rng:
        raise _bad(path, key, "a mapping with the 'torch' and 'python' RNG states", rng)
    _check_generator_state(path, f"{key}.torch", rng["torch"])
    for part in ("cuda", "loader"):
        if not isinstance(rng.get(part, []), list):
            raise _bad(path, f"{key}.{part}", "a list of generator states", rng[part])
    for i, state in enumerate(rng.get("cuda") or []):
        if not (
            isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1
        ):
            raise _bad(path, f"{key}.cuda.{i}", "a torch.uint8 tensor", state)
    for i, state in enumerate(rng.get("loader") or []):
        _check_generator_state(path, f"{key}.loader.{i}", state)
    python = rng["python"]
    internal = python.get("state") if isinstance(python, dict) else None
    valid = (
        isinstance(python, dict)
        and python.get("version") == 3
        and isinstance(internal, list)
        and len(internal) == 625
        and all(_is_count(x) and x < 2**32 for x in internal)
        and internal[-1] <= 624
        and (python.get("gauss") is None or isinstance(python.get("gauss"), float))
    )
    if not valid:
        raise _bad(path, f"{key}.python", "the state of Python's random module", python)
    if "numpy" in rng:
        _check_numpy_rng(path, f"{key}.numpy", rng["numpy"])


def _check_numpy_rng(path: str, key: str, state: Any) -> None:
    keys = state.get("keys") if isinstance(state, dict) else None
    valid = (
        isinstance(state, dict)
        and state.get("name") == "MT19937"
        and isinstance(keys, torch.Tensor)
        and keys.dtype == torch.int64
        and tuple(keys.shape) == (624,)
        and bool(((keys >= 0) & (keys < 2**32)).all())
        and _is_count(state.get("pos"))
        and state["pos"] <= 624
        and state.get("has_gauss") in (0, 1)
        and isinstance(state.get("cached_gaussian"), float)
    )
    if not valid:
        raise _bad(path, key, "the state of NumPy's global MT19937 generator", state)


def _like(live: Any, saved: Any) -> bool:
    """Whether ``saved`` has the kind and shape of ``live`` (for state dicts of a class whose
    live instance shows what its saved state must look like)."""
    if isinstance(live, torch.Tensor) and live.numel() == 1 and _is_number(saved):
        return True  # a learning rate given as a tensor on one side, a float on the other
    if isinstance(live, torch.Tensor):
        return (
            isinstance(saved, torch.Tensor)
            and saved.dtype == live.dtype
            and saved.shape == live.shape
        )
    if live is None:
        return True  # unset in the live object (a best value not seen yet, say): any kind
    if isinstance(live, bool):
        return saved is None or isinstance(saved, bool)  # flags such as foreach default to None
    if isinstance(live, numbers.Real):
        return _is_number(saved)
    if isinstance(live, str):
        return isinstance(saved, str)
    if isinstance(live, Mapping):
        return isinstance(saved, Mapping) and all(
            key in saved and _like(value, saved[key]) for key, value in live.items()
        )
    if isinstance(live, (list, tuple)):
        return (
            isinstance(saved, (list, tuple))
            and len(saved) == len(live)
            and all(_like(a, b) for a, b in zip(live, saved))
        )
    return True  # anything else (a function in LambdaLR's state, say) is the class's business


def _is_number(value: Any) -> bool:
    """A real number or a one-element tensor, not a bool and not NaN (infinity is a valid
    "best so far")."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not bool(torch.isnan(value.detach().float()).any())
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


def _section_problems(name: str, live: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(live) | set(saved))
    problems = [f"{name}: missing key {key!r}" for key in keys if key not in saved]
    problems += [f"{name}: unexpected key {key!r}" for key in keys if key not in live]
    problems += [
        f"{name}: {key!r} is {show(saved[key])} in the file, which does not have the kind "
        f"or shape of the live value {show(live[key])}"
        for key in keys
        if key in live and key in saved and not _like(live[key], saved[key])
    ]
    return problems


def check_tree(
    path: str,
    tree: Mapping[str, Any],
    trainer: Any,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    strict: bool,
    loader: Any = None,
) -> list[str]:
    """Check a tree read from ``path`` against the objects it is meant for, before any change.

    Args:
        path: The file, for messages.
        tree: What :func:`~trainer.checkpoint.read_checkpoint` (and :func:`merge_rank_state`)
            returned.
        trainer: The trainer (its precision and subscribed listeners).
        model: The model that will receive the ``model`` section.
        optimizer: The optimizer that will receive the ``optimizer`` section.
        scheduler: The scheduler that will receive the ``scheduler`` section, or None.
        strict: When False, listener state without a listener (or the reverse) only warns.
        loader: The train loader of a resumed fit (its generators must match the file's).

    Returns:
        The keys of the listeners that will receive state, in dispatch order.

    Raises:
        CheckpointFormatError: A section does not have the layout of a trainer checkpoint.
        CheckpointMismatchError: The file is well formed but does not fit the live objects; the
            message lists every difference.
    """
    _check_layout(path, tree)
    problems = _model_problems(model, tree["model"])
    problems += _optimizer_problems(path, tree, optimizer)
    problems += _scheduler_problems(tree, scheduler)
    problems += _scaler_problems(tree, trainer)
    problems += _loader_problems(tree, loader)
    receiving, listener_problems = _listener_problems(trainer, tree["listeners"])
    if listener_problems and not strict:
        for problem in listener_problems:
            warnings.warn(f"{path}: {problem}", stacklevel=4)
    else:
        problems += listener_problems
    if problems:
        raise CheckpointMismatchError(
            f"{path} does not match the live objects ({len(problems)} problems):\n  - "
            + "\n  - ".join(problems)
        )
    return [key for key in receiving if key in tree["listeners"]]


def _model_problems(model: torch.nn.Module, saved: Mapping[str, Any]) -> list[str]:
    live = model.state_dict()
    problems = [f"model: missing key {key!r}" for key in sorted(set(live) - set(saved))]
    problems += [f"model: unexpected key {key!r}" for key in sorted(set(saved) - set(live))]
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
    return problems


def _optimizer_problems(
    path: str, tree: Mapping[str, Any], optimizer: torch.optim.Optimizer
) -> list[str]:
    saved_class = tree["trainer"]["optimizer_class"]
    if saved_class != type(optimizer).__qualname__:
        return [
            f"optimizer: the file was written by {saved_class}, the trainer has "
            f"{type(optimizer).__qualname__}"
        ]
    saved = tree["optimizer"]
    groups, states = saved.get("param_groups"), saved.get("state", {})
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise _bad(path, "optimizer.param_groups", "a list of parameter groups", groups)
    if not isinstance(states, dict) or not all(isinstance(s, dict) for s in states.values()):
        raise _bad(path, "optimizer.state", "a mapping of per-parameter state", states)
    live_sizes = [len(g["params"]) for g in optimizer.param_groups]
    saved_sizes = [len(g.get("params", [])) for g in groups]
    if live_sizes != saved_sizes:
        return [
            f"optimizer: parameter groups of sizes {saved_sizes} in the file, "
            f"{live_sizes} in the optimizer"
        ]
    problems = _parameter_id_problems(groups, states)
    for i, (live, group) in enumerate(zip(optimizer.param_groups, groups)):
        if "lr" in live and "lr" not in group:
            problems.append(f"optimizer: param_groups[{i}] has no 'lr' in the file")
        for key in sorted(set(live) & set(group) - {"params"}):
            if not _like(live[key], group[key]):
                problems.append(
                    f"optimizer: param_groups[{i}].{key} is {show(group[key])} in the "
                    f"file, which does not have the kind of the live value {show(live[key])}"
                )
    params = _params(optimizer)
    problems += _parameter_state_problems(states, params)
    problems += _pending_grad_problems(tree["pending_grads"], params)
    return problems


_FACTORED_STATE = frozenset({"row_var", "col_var"})


def _parameter_state_problems(states: Mapping[str, Any], params: list[torch.Tensor]) -> list[str]:
    """Per-parameter state (Adam's moments, say) must fit its parameter: a tensor of more than one
    element has the parameter's shape (factored statistics such as Adafactor's ``row_var`` and
    ``col_var``: the parameter's rank, each dimension equal or 1), and no tensor is empty unless
    its parameter is."""
    problems = []
    for index, values in states.items():
        position = int(index) if str(index).isdigit() else -1
        if not 0 <= position < len(params):
            problems.append(f"optimizer: state for parameter {index!r}, which does not exist")
            continue
        shape = tuple(params[position].shape)
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                factored = name in _FACTORED_STATE and value.dim() == len(shape)
                fits = (value.numel() == 1 or tuple(value.shape) == shape) or (
                    factored and all(a in (b, 1) for a, b in zip(value.shape, shape))
                )
                fits = fits and (value.numel() > 0 or params[position].numel() == 0)
                if not fits:
                    problems.append(
                        f"optimizer: state {name!r} of parameter {index} has shape "
                        f"{tuple(value.shape)} in the file, the parameter has shape {shape}"
                    )
            elif not (isinstance(value, numbers.Real) or value is None):
                problems.append(
                    f"optimizer: state {name!r} of parameter {index} is {show(value)}, "
                    "not a tensor or a number"
                )
    return problems


def _parameter_id_problems(groups: list[dict[str, Any]], states: Mapping[str, Any]) -> list[str]:
    """The groups' ``params`` are the ids 0..n-1, each once (as ``state_dict()`` numbers them)."""
    ids = [i for group in groups for i in group.get("params", [])]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or sorted(ids) != list(
        range(len(ids))
    ):
        return [
            f"optimizer: the parameter ids of the groups are {show(ids)}, not 0..{len(ids) - 1}"
        ]
    return []


def _pending_grad_problems(pending: Any, params: list[torch.Tensor]) -> list[str]:
    if pending is None:
        return []
    if len(pending) != len(params):
        return [f"pending_grads: {len(pending)} gradients in the file, {len(params)} parameters"]
    problems = []
    for i, (grad, param) in enumerate(zip(pending, params)):
        if grad is None:
            continue
        if not isinstance(grad, torch.Tensor) or grad.shape != param.shape:
            got = tuple(grad.shape) if isinstance(grad, torch.Tensor) else show(grad)
            problems.append(
                f"pending_grads: gradient {i} is {got} in the file, the parameter has shape "
                f"{tuple(param.shape)}"
            )
        elif not grad.dtype.is_floating_point:
            problems.append(f"pending_grads: gradient {i} has dtype {grad.dtype}, not a float")
    return problems


def _scheduler_problems(tree: Mapping[str, Any], scheduler: Any) -> list[str]:
    saved = tree["scheduler"]
    if (saved is None) != (scheduler is None):
        saved_one = "no scheduler" if saved is None else "a scheduler"
        have = "a scheduler" if scheduler is not None else "none"
        return [f"scheduler: the file has {saved_one}, the trainer has {have}"]
    if scheduler is None:
        return []
    saved_class = tree["trainer"].get("scheduler_class")  # absent in files of older releases
    if saved_class is not None and saved_class != type(scheduler).__qualname__:
        return [
            f"scheduler: the file was written by {saved_class}, the trainer has "
            f"{type(scheduler).__qualname__}"
        ]
    return _section_problems("scheduler", scheduler.state_dict(), saved)


def _scaler_problems(tree: Mapping[str, Any], trainer: Any) -> list[str]:
    saved = tree["grad_scaler"]
    if saved is None:
        return []
    if trainer.precision != "16-mixed":
        return [
            f"grad scaler: the file was written with precision "
            f"{tree['trainer'].get('precision')!r}, this trainer uses {trainer.precision!r}"
        ]
    scaler = trainer.grad_scaler or torch.amp.GradScaler("cpu")  # a fresh one shows the layout
    live = scaler.state_dict()
    problems = _section_problems("grad scaler", live, saved) if live else []
    scale, interval = saved.get("scale"), saved.get("growth_interval")
    if not problems and live and not (_is_number(scale) and 0 < float(scale) < math.inf):
        problems.append(f"grad scaler: scale is {show(scale)}, not a positive finite number")
    if not problems and live and not (_is_count(interval) and interval >= 1):
        problems.append(f"grad scaler: growth_interval is {show(interval)}, not an int >= 1")
    return problems


def _loader_problems(tree: Mapping[str, Any], loader: Any) -> list[str]:
    if loader is None:
        return []
    # The resume batch is not checked against len(loader): a loader may only get its data at
    # train_start (JointLearner's does), after this check.
    have = len(_runtime.loader_generators(loader))
    problems = []
    for when in ("current", "epoch_start"):
        rng = tree["rng"].get(when) or {}
        saved = len(rng.get("loader") or [])
        if saved and saved != have:
            problems.append(
                f"train_loader: the file saved the state of {saved} data-loader generator(s), "
                f"the train_loader has {have}; resume with the same kind of loader"
            )
            break
    return problems


def _listener_problems(trainer: Any, stored: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    subscriptions = trainer.events.subscriptions()
    receiving = [s.key for s in subscriptions if "load_checkpoint" in s.receivers]
    problems = [
        f"listener {key!r}: subscribed with on_load_checkpoint, but the file has no state for it"
        for key in receiving
        if key not in stored
    ]
    subscribed = {s.key for s in subscriptions}
    for key in stored:
        if key not in subscribed:
            problems.append(
                f"listener {key!r}: the file has its state, but no listener of that name is "
                f"subscribed (subscribed: {sorted(subscribed)})"
            )
        elif key not in receiving:
            problems.append(
                f"listener {key!r}: the file has its state, but it has no on_load_checkpoint"
            )
    return receiving, problems


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
