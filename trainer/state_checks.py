"""The checks of a checkpoint tree read from a file, before any of it is applied.

Everything read back is untrusted, even with valid checksums (whoever edits a file can recompute
them): :func:`check_tree` checks every section of a trainer checkpoint tree for type, range and
shape against the live objects. Layout errors raise
:class:`~trainer.exceptions.CheckpointFormatError` naming the file and the key; a file that is
well formed but belongs to other objects raises :class:`~trainer.exceptions.CheckpointMismatchError`
listing every difference. What the optimizer and scheduler can run (their values, by class) is
:mod:`trainer.optim_checks`; the tree's layout is described in :mod:`trainer.state`, which builds
and restores it.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from trainer import _runtime
from trainer.checkpoint import show
from trainer.exceptions import CheckpointFormatError, CheckpointMismatchError
from trainer.optim_checks import MAX_COUNT, optimizer_value_problems, scheduler_value_problems
from trainer.validators import NAME_PATTERN

__all__ = ["PROGRESS_KEYS", "check_tree"]

PROGRESS_KEYS = (
    "epoch",
    "batch",
    "global_step",
    "optimizer_steps",
    "accumulated",
    "validation_pending",
)
"""The keys of ``trainer.progress``; ``epoch`` and ``batch`` say where a resumed fit continues."""

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
    _check_progress(path, progress, pending=tree["pending_grads"] is not None)
    for key in ("optimizer_class", "precision"):
        if not isinstance(tree["trainer"].get(key), str):
            raise _bad(path, f"trainer.{key}", "a string", tree["trainer"].get(key))
    if tree["trainer"]["precision"] not in _runtime.PRECISIONS:
        expected = f"one of {_runtime.PRECISIONS}"
        raise _bad(path, "trainer.precision", expected, tree["trainer"]["precision"])
    _check_listener_names(path, tree["trainer"], tree["listeners"])
    _check_rng(path, "rng.current", tree["rng"].get("current"))
    if tree["rng"].get("epoch_start") is not None:
        _check_rng(path, "rng.epoch_start", tree["rng"]["epoch_start"])
    for key, value in tree["listeners"].items():
        if not isinstance(value, dict):
            raise _bad(path, f"listeners.{key}", "a mapping of the listener's state", value)


def _check_progress(path: str, progress: Mapping[str, Any], *, pending: bool) -> None:
    """Each counter an int in [0, 2**53], and the counters consistent with each other."""
    for key in PROGRESS_KEYS:
        if key not in progress:
            raise CheckpointFormatError(f"{path}: trainer.progress lacks the key {key!r}")
        value = progress[key]
        if key == "validation_pending":
            if not isinstance(value, bool):
                raise _bad(path, f"trainer.progress.{key}", "true or false", value)
        elif not _is_count(value):
            raise _bad(path, f"trainer.progress.{key}", "an int >= 0", value)
        elif value > MAX_COUNT:
            raise _bad(path, f"trainer.progress.{key}", "an int <= 2**53", value)
    if progress["optimizer_steps"] > progress["global_step"]:
        raise _bad(path, "trainer.progress.optimizer_steps", "<= global_step", progress)
    # Every epoch trains at least one batch, and every batch counts in global_step.
    for key in ("epoch", "batch"):
        if progress[key] > progress["global_step"]:
            raise _bad(path, f"trainer.progress.{key}", "<= global_step", progress)
    if progress["batch"] and progress["validation_pending"]:
        raise _bad(path, "trainer.progress.batch", "0 while a validation is pending", progress)
    # An accumulation window ends with its epoch; its gradients are saved with it.
    if progress["accumulated"] > progress["batch"]:
        raise _bad(path, "trainer.progress.accumulated", "<= batch", progress)
    if bool(progress["accumulated"]) != pending:
        expected = "0 without pending_grads" if not pending else "> 0 with pending_grads"
        raise _bad(path, "trainer.progress.accumulated", expected, progress)


def _check_listener_names(path: str, section: Mapping[str, Any], listeners: Any) -> None:
    """``listener_order`` and ``stateful_listeners`` (when present): distinct listener names, the
    stateful ones among those in order, and every listener state under a stateful one."""
    names: dict[str, list[str]] = {}
    for key in ("listener_order", "stateful_listeners"):
        value = section.get(key)
        if value is None:
            continue
        valid = (
            isinstance(value, list)
            and all(isinstance(name, str) and NAME_PATTERN.match(name) for name in value)
            and len(set(value)) == len(value)
        )
        if not valid:
            raise _bad(path, f"trainer.{key}", "a list of distinct listener names", value)
        names[key] = value
    order, stateful = names.get("listener_order"), names.get("stateful_listeners")
    if order is not None and stateful is not None and not set(stateful) <= set(order):
        raise _bad(
            path, "trainer.stateful_listeners", f"names from listener_order {order}", stateful
        )
    if stateful is not None and not set(listeners) <= set(stateful):
        expected = f"the names of every listener state {sorted(listeners)}"
        raise _bad(path, "trainer.stateful_listeners", expected, stateful)


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
    params = _runtime.optimizer_params(optimizer)
    problems += _parameter_index_problems(states, params)
    if not problems:  # values of the right kinds and places: what the optimizer can run
        problems += optimizer_value_problems(optimizer, groups, states, params)
    problems += _pending_grad_problems(tree["pending_grads"], params)
    return problems


def _parameter_index_problems(states: Mapping[str, Any], params: list[torch.Tensor]) -> list[str]:
    """Per-parameter state is keyed by the index of an existing parameter and holds tensors and
    numbers (what each value must be is :mod:`trainer.optim_checks`' business)."""
    problems = []
    for index, values in states.items():
        position = int(index) if str(index).isdigit() else -1
        if not 0 <= position < len(params):
            problems.append(f"optimizer: state for parameter {index!r}, which does not exist")
            continue
        problems += [
            f"optimizer: state {name!r} of parameter {index} is {show(value)}, "
            "not a tensor or a number"
            for name, value in values.items()
            if not isinstance(value, (torch.Tensor, numbers.Real)) and value is not None
        ]
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
    problems = _section_problems("scheduler", scheduler.state_dict(), saved)
    return problems or scheduler_value_problems(scheduler, saved)


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
