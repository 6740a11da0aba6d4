"""Hyperparameter search for one update, with Optuna (``pip install 'renate-events[search]'``).

Each trial trains the same update from the same input state with other hyperparameters; a
listener on ``validation_end`` reports the metric to Optuna and stops a trial its pruner gives up
on. The best trial's state is the update's result, and the table of all trials is kept in the
output state folder as ``search.csv``, so that the next update tries the earlier best
configurations first (Renate's transfer of the tuning history, in its simplest form).

A search space maps a name to a range or a list of choices::

    {"alpha": {"low": 0.05, "high": 1.0, "log": True},   # a float (log-uniform)
     "epochs": {"low": 1, "high": 5},                     # ints give an int range
     "learner": {"choices": ["er", "der"]}}               # categorical

The names are learner hyperparameters (:mod:`renate_events.hyperparameters`) and the options
:data:`OPTIONS` (``lr``, ``epochs``, ...).

Example:
    >>> space = parse_space({"alpha": {"low": 0.1, "high": 1.0, "log": True}}, "search")
    >>> space["alpha"]
    FloatRange(low=0.1, high=1.0, log=True)
    >>> parse_space({"alpha": {"low": 2.0, "high": 1.0}}, "search")
    Traceback (most recent call last):
    ...
    renate_events.search.SearchSpaceError: search: alpha has low 2.0 > high 1.0; give low <= high
"""

from __future__ import annotations

import csv
import io
import math
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from trainer import validators

__all__ = [
    "OPTIONS",
    "PRUNERS",
    "WORKER",
    "Choice",
    "FloatRange",
    "IntRange",
    "SearchSpaceError",
    "TrialPruner",
    "earlier_best",
    "fail_dead_trials",
    "parse_space",
    "suggest",
    "trials_table",
    "worker_id",
]

OPTIONS = ("lr", "epochs", "batch_size", "memory_batch_size", "memory_size", "learner", "buffer")
"""Settings a search may vary besides the learners' hyperparameters."""

SEARCH_FILE = "search.csv"
"""The trials table in a state folder written by a search."""


class SearchSpaceError(ValueError):
    """Raised for a search space that cannot be searched: an unknown name, low > high, a log
    range that is not positive, an empty list of choices."""


@attrs.frozen
class FloatRange:
    low: float
    high: float
    log: bool = False


@attrs.frozen
class IntRange:
    low: int
    high: int
    log: bool = False


@attrs.frozen
class Choice:
    choices: tuple[Any, ...]


Parameter = FloatRange | IntRange | Choice


def parse_space(mapping: Mapping[str, Any], where: str) -> dict[str, Parameter]:
    """Check a search space (``where`` names its source in errors) and return its parameters."""
    space: dict[str, Parameter] = {}
    for name, spec in mapping.items():
        if not isinstance(spec, Mapping):
            raise SearchSpaceError(f"{where}: {name} must be a table, got {spec!r}")
        space[name] = _parameter(name, spec, where)
    return space


def _parameter(name: str, spec: Mapping[str, Any], where: str) -> Parameter:
    if set(spec) == {"choices"}:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise SearchSpaceError(f"{where}: {name}.choices must be a non-empty list")
        return Choice(tuple(choices))
    if not {"low", "high"} <= set(spec) <= {"low", "high", "log"}:
        raise SearchSpaceError(
            f"{where}: {name} must be {{low = ..., high = ...[, log = true]}} or "
            f"{{choices = [...]}}, got {dict(spec)!r}"
        )
    low, high, log = spec["low"], spec["high"], spec.get("log", False)
    if not (validators.is_real(low) and validators.is_real(high)) or not isinstance(log, bool):
        raise SearchSpaceError(f"{where}: {name} needs numbers low and high and a bool log")
    if low > high:
        raise SearchSpaceError(f"{where}: {name} has low {low} > high {high}; give low <= high")
    if log and low <= 0:
        raise SearchSpaceError(f"{where}: {name} is log-uniform, so low must be > 0, got {low}")
    if validators.is_int(low) and validators.is_int(high):
        return IntRange(low, high, log)
    return FloatRange(float(low), float(high), log)


def suggest(trial: Any, space: Mapping[str, Parameter]) -> dict[str, Any]:
    """One value of every parameter, drawn by an Optuna trial."""
    values: dict[str, Any] = {}
    for name, parameter in space.items():
        if isinstance(parameter, Choice):
            values[name] = trial.suggest_categorical(name, list(parameter.choices))
        elif isinstance(parameter, IntRange):
            values[name] = trial.suggest_int(name, parameter.low, parameter.high, log=parameter.log)
        else:
            values[name] = trial.suggest_float(
                name, parameter.low, parameter.high, log=parameter.log
            )
    return values


@attrs.define(eq=False)
class TrialPruner:
    """A listener reporting ``metric`` after every validation to an Optuna trial, and ending
    the fit (``state.should_stop``) when the trial's pruner says so."""

    trial: Any
    metric: str
    pruned: bool = False

    def on_validation_end(self, state: Any, metrics: Mapping[str, float]) -> None:
        value = float(metrics[self.metric])
        self.trial.report(value, step=int(state.epoch))
        if self.trial.should_prune():
            self.pruned = True
            state.should_stop = True


def trials_table(study: Any) -> bytes:
    """``search.csv``: one row per trial (number, state, value, steps, then the parameters)."""
    names = sorted({name for trial in study.trials for name in trial.params})
    table = io.StringIO()
    writer = csv.writer(table, lineterminator="\n")
    writer.writerow(["number", "state", "value", "steps", *names])
    for trial in study.trials:
        value = "" if trial.value is None else f"{trial.value:.6g}"
        steps = trial.user_attrs.get("steps", "")
        params = [json_value(trial.params.get(name, "")) for name in names]
        writer.writerow([trial.number, trial.state.name, value, steps, *params])
    return table.getvalue().encode("utf-8")


def json_value(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def earlier_best(
    text: str, space: Mapping[str, Parameter], mode: str, count: int = 3
) -> list[dict[str, Any]]:
    """The ``count`` best complete trials of an earlier ``search.csv`` whose parameters all lie in
    ``space`` (the configurations the next search tries first)."""
    rows = []
    for row in csv.DictReader(io.StringIO(text)):
        if row.get("state") != "COMPLETE" or not row.get("value"):
            continue
        try:
            value = float(row["value"])
            params = {name: _parse_cell(row[name], space[name]) for name in space}
        except (KeyError, ValueError):
            continue
        if math.isfinite(value) and all(_inside(params[n], space[n]) for n in space):
            rows.append((value, params))
    rows.sort(key=lambda item: item[0], reverse=(mode == "max"))
    return [params for _, params in rows[:count]]


def _parse_cell(text: str, parameter: Parameter) -> Any:
    if isinstance(parameter, IntRange):
        return int(text)
    if isinstance(parameter, FloatRange):
        return float(text)
    for choice in parameter.choices:
        if json_value(choice) == text:
            return choice
    raise ValueError(text)


def _inside(value: Any, parameter: Parameter) -> bool:
    if isinstance(parameter, Choice):
        return value in parameter.choices
    return parameter.low <= value <= parameter.high


def require_optuna() -> Any:
    """The ``optuna`` module, or an ImportError saying how to install it."""
    try:
        import optuna
    except ImportError as exc:
        raise ImportError(
            "hyperparameter search needs Optuna: pip install 'renate-events[search]'"
        ) from exc
    return optuna


PRUNERS = ("median", "none")
"""``median``: stop a trial whose metric is worse than the median of earlier trials' at the same
epoch (after two complete trials); ``none``: every trial runs to the end."""


def create_study(
    optuna: Any,
    *,
    mode: str,
    seed: int,
    storage: str | None,
    name: str | None,
    pruner: str = "median",
) -> Any:
    """An Optuna study (TPE sampler seeded by ``seed``, a pruner of :data:`PRUNERS`), loaded from
    ``storage`` when it holds one of that name, so an interrupted search continues."""
    validators.check_one_of("create_study: pruner", pruner, PRUNERS)
    chosen = (
        optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
        if pruner == "median"
        else optuna.pruners.NopPruner()
    )
    return optuna.create_study(
        direction="minimize" if mode == "min" else "maximize",
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=chosen,
        storage=storage,
        study_name=name,
        load_if_exists=storage is not None,
    )


WORKER = "worker"
"""The user attribute naming the process that runs a trial (:func:`worker_id`)."""


def worker_id() -> str:
    """This process as ``host:pid:start``: its start time (in clock ticks since boot, from
    ``/proc``; empty where there is none) tells it from a later process given the same pid."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()  # after the command's name
    except (OSError, IndexError):
        return ""
    return fields[19] if len(fields) > 19 else ""  # field 22, starttime; fields[0] is field 3


def _gone(worker: Any) -> bool:
    """Whether the process ``worker`` (a :func:`worker_id`) has ended: known only on its host."""
    if not isinstance(worker, str) or worker.count(":") < 2:
        return False  # no record (another tool, an older version): cannot tell
    host, pid, started = worker.rsplit(":", 2)
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine's worker: it may still run
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process with that pid
    return _start_time(int(pid)) != started


def fail_dead_trials(optuna: Any, study: Any) -> list[int]:
    """Mark FAIL the study's RUNNING trials whose worker process has ended (killed, or its
    machine restarted), so that the study and ``search.csv`` say so; returns their numbers.

    A trial records its worker (:data:`WORKER`) when it starts. A trial whose worker ran on
    another machine, or that has no record, is left RUNNING: it may still run. (Optuna's
    heartbeat, ``RDBStorage(heartbeat_interval=...)``, is experimental, needs a storage object
    where ``--search-storage`` is a URL, and fails a trial only after its grace period: the next
    run right after a kill would still see it RUNNING.)
    """
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    failed = [trial.number for trial in running if _gone(trial.user_attrs.get(WORKER))]
    for number in failed:  # skip_if_finished: another process may have failed it first
        study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    return failed


Objective = Callable[[Any], float]
