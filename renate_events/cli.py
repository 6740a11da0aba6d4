"""The ``renate-events`` command: run a scenario, update a state folder, evaluate one, test for
shift.

Examples::

    renate-events run                                   # Split-Digits, DER++, buffer 200
    renate-events run --learner er --seeds 0 1 2 --output-dir runs/er
    renate-events run --config experiment.toml --epochs 5   # flags override the file
    renate-events update --input-state runs/er/state/seed-0 --data new.npz \\
        --output-state runs/er/next
    renate-events evaluate --state runs/er/next --scenario split-digits
    renate-events shift --reference old.npz --query new.npz       # has the data shifted?

Every option is checked against a typed schema (the ``_*Options`` classes) before anything is
trained or written; a bad option, file or state folder is one line on standard error and exit
status 2.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import io
import itertools
import json
import math
import os
import re
import shutil
import sys
import time
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from renate_events.choices import BUFFER_STORAGES, BUFFERS, OPTIMIZERS, default_buffer
from renate_events.config import ConfigError, ConfigFile, load_config
from renate_events.hyperparameters import HyperparameterError, check_value, hyperparameters
from renate_events.inference import forward, inference, model_device, outputs_in_batches
from renate_events.memory.mapped import MappedFileError
from renate_events.methods import LEARNERS, METHODS, method, method_of
from renate_events.models import MODELS, build_model
from renate_events.scenarios import IMAGE_SCENARIOS, SCENARIOS
from renate_events.search import SearchSpaceError
from renate_events.shift import ShiftDetectionError
from renate_events.state_folder import (
    StagedStateFolder,
    StateFolderError,
    read_manifest,
    state_token,
)
from renate_events.updater import ModelUpdater, UpdateInputError, check_config_file, dataset_tensors
from trainer import CheckpointError, NonFiniteLossError
from trainer import validators as checks
from trainer.exceptions import ListenerError
from trainer.files import fsync_file, fsync_folder, temporary_sibling

__all__ = ["main"]

_PRECISIONS = ("32", "bf16-mixed", "16-mixed")
_MAX_PARAMETERS = 10**9  # 4 GB of float32: the command line builds small MLPs
_MAX_SEED = 2**63
_RESULT_FILES = ("metrics.csv", "accuracy_matrix.png", "results.json")  # results.json last
_DEDICATED = frozenset(("memory_size", "batch_size", "memory_batch_size", "seed"))
"""Learner hyperparameters with options of their own (``--memory-size``, ...; ``--seed``)."""


class UsageError(Exception):
    """A bad argument or input file: reported in one line with exit code 2."""


# -- the parser ---------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as :class:`UsageError` (one line) instead of usage text."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> Any:  # type: ignore[override]
        if message.startswith("unrecognized arguments: --"):
            message += "; no option or learner hyperparameter has that name"
        raise UsageError(f"{message} (see {self.prog} -h)")


def _training_options(p: argparse.ArgumentParser, *, later: bool) -> None:
    """The learner, buffer, optimizer and trainer options. ``later``: for ``update``, where an
    option left out keeps the input state's value (or, for a first update, the default)."""

    def default(value: Any) -> Any:
        return None if later else value

    keeps = " (default: the input state's, else %s)" if later else " (default %s)"
    p.add_argument(
        "--learner",
        choices=sorted(LEARNERS),
        default=default("der"),
        help="continual-learning method" + keeps % "der, i.e. DER++",
    )
    p.add_argument(
        "--buffer",
        choices=list(BUFFERS),
        default=None,  # the learner's: greedy-class-balancing for gdumb, herding for icarl
        help="memory buffer type"
        + keeps % "reservoir; greedy-class-balancing for gdumb, herding for icarl",
    )
    p.add_argument(  # None: 200, or 0 for the memory-free learners (fine-tuning, ewc, ...)
        "--memory-size", type=int, default=None, help="buffer slots" + keeps % 200
    )
    p.add_argument("--epochs", type=int, default=default(10), help="epochs per update" + keeps % 10)
    p.add_argument(  # None: 1e-3, or what the input state or the config's optimizer_fn has
        "--lr", type=float, default=None, help="learning rate" + keeps % "1e-3"
    )
    p.add_argument(  # None: adam, or the input state's; --momentum is SGD's only
        "--optimizer", choices=list(OPTIMIZERS), default=None, help="optimizer" + keeps % "adam"
    )
    p.add_argument("--momentum", type=float, default=None, help="SGD momentum" + keeps % 0)
    p.add_argument(  # None: torch's default of the optimizer
        "--weight-decay", type=float, default=None, help="weight decay" + keeps % "torch's"
    )
    p.add_argument(
        "--batch-size", type=int, default=default(32), help="new-data batch" + keeps % 32
    )
    p.add_argument(
        "--memory-batch-size", type=int, default=default(32), help="memory batch" + keeps % 32
    )
    p.add_argument(
        "--device", default=default("auto"), help="auto (CUDA if available), cpu, cuda:0"
    )
    p.add_argument(
        "--precision",
        choices=_PRECISIONS,
        default=default("32"),
        help="floating-point precision of training" + keeps % "32",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _config_file_options(p: argparse.ArgumentParser) -> None:
    """The options of an update from a Python config file of functions."""
    p.add_argument(
        "--config-file",
        help="Python file defining model_fn, data_fn and optionally loss_fn, optimizer_fn, ... "
        "(see the docs' 'Bring your own model and data')",
    )
    p.add_argument(
        "--metric",
        help="validation metric whose best epoch's weights the state keeps (val_loss, "
        "val_accuracy, val_<metrics_fn name>)",
    )
    p.add_argument(
        "--mode",
        choices=("min", "max"),
        default=None,
        help="min or max (default: max for a metric named *accuracy, else min)",
    )
    p.add_argument(
        "--early-stopping",
        type=int,
        default=None,
        metavar="PATIENCE",
        help="stop an update after PATIENCE validations without improvement of --metric",
    )
    p.add_argument(
        "--no-validation-memory",
        action="store_true",
        help="validate on this update's validation data only (default: also on earlier ones')",
    )


def _model_options(p: argparse.ArgumentParser, *, later: bool) -> None:
    """``--model`` and ``--model-args``. ``later``: for ``update``, where they only check that
    the input state holds that model (its architecture never changes)."""
    if later:
        what = " (a check: the input state's model must be this one)"
        p.add_argument("--model", choices=sorted(MODELS), default=None, help="model" + what)
        p.add_argument("--model-args", default=None, metavar="TABLE", help="its arguments" + what)
        return
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="model of renate_events.models (default: mlp for the digits scenarios, resnet18 with "
        "nf 20 for the image ones)",
    )
    p.add_argument(
        "--model-args",
        default=None,
        metavar="TABLE",
        help="the model's arguments as a TOML or JSON table: '{nf = 20}', '{\"dim\": 64}' "
        "(num_classes, inputs, in_channels and image_size come from the scenario)",
    )


def _hyperparameter_names() -> dict[str, str]:
    """Every learner hyperparameter without an option of its own, with its kind."""
    names: dict[str, str] = {}
    for learner in sorted(LEARNERS):
        for name, entry in hyperparameters(learner).items():
            if name not in _DEDICATED:
                names.setdefault(name, entry.kind)
    return names


def _hyperparameter_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "learner hyperparameters",
        "each learner's own (see the list below); a value is parsed as in TOML: 0.5, true, "
        '["layer1"]; a TOML --config file may set them too',
    )
    for name, kind in _hyperparameter_names().items():
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=argparse.SUPPRESS,
            metavar="LIST" if kind.startswith("Sequence") else kind.split(" ")[0].upper(),
        )


def _hyperparameter_epilog() -> str:
    """The hyperparameters all learners share, then each learner's own, with their defaults."""
    schemas = {learner: hyperparameters(learner) for learner in sorted(LEARNERS)}
    shared = set.intersection(*(set(schema) for schema in schemas.values()))
    defaults = [[json.dumps(s[name].default) for s in schemas.values()] for name in shared]
    usual = {  # a learner with another default (offline-er's buffer_filling) lists it itself
        name: max(values, key=values.count) for name, values in zip(shared, defaults)
    }

    def shown(schema: Mapping[str, Any], names: Any) -> str:
        return " ".join(
            f"--{name.replace('_', '-')} "
            + ("(unset)" if schema[name].default is None else json.dumps(schema[name].default))
            for name in schema
            if name in names and name not in _DEDICATED
        )

    first = next(iter(schemas.values()))
    lines = ["learner hyperparameters (defaults):", f"  every learner: {shown(first, shared)}"]
    for learner, schema in schemas.items():
        own = set(schema) - shared
        own |= {name for name in shared if json.dumps(schema[name].default) != usual[name]}
        lines.append(f"  {learner}: {shown(schema, own) or '(none of its own)'}")
    return "\n".join(lines)


def _run_parser(sub: Any) -> argparse.ArgumentParser:
    run = sub.add_parser(
        "run",
        help="run a whole scenario, evaluating after each update",
        description="Run a scenario: one update per task, evaluation on every task after each.",
        epilog="examples:\n  renate-events run\n  renate-events run --learner er --seeds 0 1 2\n"
        "  renate-events run --config experiment.toml --epochs 5\n"
        "  renate-events run --config-file my_config.py --chunks 5 --learner der --alpha 0.3\n\n"
        + _hyperparameter_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--config", help="TOML file with any of these options (flags override it)")
    run.add_argument(
        "--scenario",
        default="split-digits",
        help="split-digits (default), permuted-digits, rotated-digits; seq-cifar10, seq-cifar100 "
        "(read from --data-dir)",
    )
    run.add_argument(
        "--data-dir",
        default=None,
        help="with seq-cifar10/100: the folder of the CIFAR binary version (never downloaded)",
    )
    run.add_argument(
        "--no-augment",
        action="store_true",
        help="image scenarios: no random crop and flip in training (still to float, normalised)",
    )
    run.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="with --config-file: the number of updates (data_fn's chunks 0..N-1)",
    )
    run.add_argument("--seeds", type=int, nargs="+", default=[0], help="one or several seeds")
    run.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=None,
        help="hidden layer sizes of --model mlp (default 256)",
    )
    _model_options(run, later=False)
    run.add_argument("--output-dir", default="runs/latest", help="where results are written")
    _training_options(run, later=False)
    _config_file_options(run)
    _hyperparameter_options(run)
    return run


def _update_parser(sub: Any) -> argparse.ArgumentParser:
    update = sub.add_parser(
        "update",
        help="one model update from a state folder and new data",
        description="Load --input-state (none: the first update, from the config file's "
        "model_fn), train on --data or the config file's chunk --chunk-id, write "
        "--output-state.",
        epilog="examples:\n  renate-events update --input-state runs/latest/state/seed-0 "
        "--data new.npz --output-state next-state\n"
        "  renate-events update --config-file my_config.py --chunk-id 0 --output-state s0\n"
        "  renate-events update --config-file my_config.py --input-state s0 --chunk-id 1 "
        "--output-state s1\n\n" + _hyperparameter_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    update.add_argument("--config", help="TOML file with any of these options (flags override it)")
    update.add_argument("--input-state", help="a state folder written by run/update")
    update.add_argument(
        "--data", help=".safetensors or .npz file with 'inputs' and 'targets' (no --config-file)"
    )
    update.add_argument(
        "--output-state",
        required=True,
        help="the state folder to write: new, empty, or a state folder (never anything else)",
    )
    update.add_argument(
        "--chunk-id",
        type=int,
        default=None,
        help="with --config-file: the chunk data_fn gives (default: the input state's number of "
        "updates, so 0 for a first update)",
    )
    update.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds model_fn's initial weights and is given to data_fn (default 0)",
    )
    update.add_argument(
        "--in-place", action="store_true", help="allow --output-state to be --input-state"
    )
    update.add_argument(
        "--accept-config-change",
        action="store_true",
        help="continue a state folder written with another version of the config file",
    )
    update.add_argument("--task-id", default=None, help="a name for this update")
    _model_options(update, later=True)
    update.add_argument(
        "--search",
        type=int,
        default=None,
        metavar="TRIALS",
        help="with --config-file: run TRIALS trials of this update (Optuna) over the search "
        "space of the --config TOML file and keep the best (see the docs' search section)",
    )
    update.add_argument(
        "--search-storage",
        default=None,
        help="Optuna storage URL (sqlite:///search.db, postgresql://...): resume an interrupted "
        "search, or share one among workers",
    )
    update.add_argument("--search-study", default=None, help="the study's name in --search-storage")
    update.add_argument(
        "--search-pruner",
        choices=("median", "none"),
        default="median",
        help="median (default): stop trials worse than the median at the same epoch; none",
    )
    update.add_argument(
        "--buffer-storage",
        choices=BUFFER_STORAGES,
        default=None,
        help="memory: the buffer in RAM, saved in the checkpoint; mapped: memory-mapped files, "
        "saved as files of the state folder, for buffers larger than RAM (default: the input "
        "state's, else memory)",
    )
    update.add_argument(
        "--lock-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for another update of the same folder (default 60)",
    )
    _training_options(update, later=True)
    _config_file_options(update)
    _hyperparameter_options(update)
    return update


def _evaluate_parser(sub: Any) -> argparse.ArgumentParser:
    evaluate = sub.add_parser(
        "evaluate",
        help="evaluate a state folder on a data file, a scenario or a config file's test data",
        description="Print the accuracy (and the config file's metrics) of a state folder's model.",
        epilog="examples:\n  renate-events evaluate --state next-state --data test.npz\n"
        "  renate-events evaluate --state next-state --scenario split-digits\n"
        "  renate-events evaluate --state s1 --config-file my_config.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("--state", required=True, help="a state folder")
    group = evaluate.add_mutually_exclusive_group(required=True)
    group.add_argument("--data", help=".safetensors or .npz file with 'inputs' and 'targets'")
    group.add_argument("--scenario", help="evaluate on every task's test set of this scenario")
    group.add_argument("--config-file", help="evaluate on test_data_fn's chunks (see --chunk-ids)")
    evaluate.add_argument(
        "--chunk-ids",
        type=int,
        nargs="+",
        default=None,
        help="with --config-file: the chunks to evaluate on (default: those the state was "
        "trained on, 0..updates-1)",
    )
    evaluate.add_argument(
        "--data-dir",
        default=None,
        help="with --scenario seq-cifar10/100: the folder of the CIFAR binary version",
    )
    evaluate.add_argument("--seed", type=int, default=0, help="seed of the split / of data_fn")
    evaluate.add_argument(
        "--classifier",
        choices=("logits", "nme"),
        default="logits",
        help="logits: the model's argmax (default); nme: iCaRL's nearest mean of exemplars "
        "(a state folder of --learner icarl)",
    )
    evaluate.add_argument(
        "--accept-config-change",
        action="store_true",
        help="evaluate a state folder written with another version of the config file",
    )
    return evaluate


def _shift_parser(sub: Any) -> argparse.ArgumentParser:
    shift = sub.add_parser(
        "shift",
        help="test whether new data differs from a reference (covariate shift)",
        description="A two-sample test of --query against --reference, on the raw inputs or on "
        "the features of a state folder's model; prints the statistic, the p-value and the "
        "decision at --level.",
        epilog="examples:\n  renate-events shift --reference old.npz --query new.npz\n"
        "  renate-events shift --reference old.npz --query new.npz --detector ks --state s1 "
        "--feature-module backbone",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shift.add_argument("--reference", required=True, help=".npz or .safetensors with 'inputs'")
    shift.add_argument("--query", required=True, help=".npz or .safetensors with 'inputs'")
    shift.add_argument(
        "--detector", choices=("mmd", "ks"), default="mmd", help="mmd (default) or ks"
    )
    shift.add_argument("--level", type=float, default=0.05, help="significance (default 0.05)")
    shift.add_argument(
        "--num-permutations", type=int, default=1000, help="MMD permutations (default 1000)"
    )
    shift.add_argument(
        "--max-samples", type=int, default=2000, help="MMD samples per side (default 2000)"
    )
    shift.add_argument("--seed", type=int, default=0, help="seed of the permutations")
    shift.add_argument("--state", help="test on the features of this state folder's model")
    shift.add_argument("--config-file", help="the config file the --state was written with")
    shift.add_argument(
        "--accept-config-change",
        action="store_true",
        help="use a --state written with another version of the config file",
    )
    shift.add_argument(
        "--feature-module",
        help="with --state: the submodule whose outputs are the features (default: the logits)",
    )
    return shift


def _parser() -> _Parser:
    from renate_events import __version__

    parser = _Parser(
        prog="renate-events",
        description="Continual learning with experience replay on the event-driven trainer.",
        epilog="examples:" + __doc__.split("Examples::", 1)[1].split("\n\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"renate-events {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{run,update,evaluate,shift}"
    )
    parser.commands = {
        "run": _run_parser(sub),
        "update": _update_parser(sub),
        "evaluate": _evaluate_parser(sub),
        "shift": _shift_parser(sub),
    }
    return parser


# -- options: argparse, then the TOML file, then one typed check of everything -----------------


def _parse(argv: Sequence[str] | None) -> tuple[str, dict[str, Any], frozenset[str]]:
    """The command, its options (defaults, then ``--config``, then flags) and which of them came
    from the ``--config`` file."""
    args = vars(_parser().parse_args(argv))
    command = args.pop("command")
    from_file: set[str] = set()
    if command == "update":
        args["search_space"] = {}
    if args.get("config") is not None:
        given = _given_on_the_command_line(argv, command)
        known = set(args) | set(_hyperparameter_names())
        values = _read_config(args["config"], known, command)
        if command == "update":  # tables are the ranges of a search, not values
            ranges = {k for k, v in values.items() if isinstance(v, dict) and k != "model_args"}
            args["search_space"] = {k: values[k] for k in ranges}
            values = {k: v for k, v in values.items() if k not in ranges}
        from_file = set(values) - given
        args.update({name: values[name] for name in from_file})
    return command, args, frozenset(from_file)


def _given_on_the_command_line(argv: Sequence[str] | None, command: str) -> set[str]:
    parser = _parser()
    for action in parser.commands[command]._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command"}


def _read_config(path: str, options: set[str], command: str) -> dict[str, Any]:
    """The options of a ``--config`` TOML file, under their argparse names (not yet checked)."""
    config = _read_toml(path)
    allowed = options - {"config"}
    values: dict[str, Any] = {}
    for key, value in config.items():
        name = key.replace("-", "_")
        if name not in allowed:
            raise UsageError(
                f"{path}: unknown options [{key!r}]; see renate-events {command} -h for the "
                "options and the learners' hyperparameters"
            )
        if name in values:
            raise UsageError(f"{path}: the option {name.replace('_', '-')} is given twice")
        values[name] = value
    return values


def _read_toml(path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError as exc:
            raise UsageError(
                "reading --config on Python 3.10 needs tomli: pip install tomli"
            ) from exc
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise UsageError(f"cannot read --config {path}: {exc.strerror}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}") from exc


def _list_of_ints(low: int, high: int | None, *, empty: bool, distinct: bool) -> Any:
    """An attrs validator: a list of ints in ``[low, high)``, checked with ``check_int``."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        name = checks.field_name(instance, attribute)
        if not isinstance(value, list) or (not value and not empty):
            what = "a list" if empty else "a non-empty list"
            raise checks.WrongTypeError(f"{name} must be {what} of ints, got {value!r}")
        for item in value:
            checks.check_int(name, item, low, high)
        if distinct and len(set(value)) != len(value):
            raise ValueError(f"{name} must not repeat a value, got {value!r}")

    return validate


def _device(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """``auto``, ``cpu``, or an accelerator that this machine has."""
    _check_device(checks.field_name(instance, attribute), value)


def _check_device(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise checks.WrongTypeError(f"{name} must be a device name such as 'cpu', got {value!r}")
    if value == "auto":
        return
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{name} must be auto, cpu, cuda, cuda:<index> or mps, got {value!r}"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise ValueError(
                f"{name} {value}: this machine has {count} CUDA device(s) usable by torch "
                f"{torch.__version__}; use cpu or auto"
            )
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{name} {value}: MPS is not available here; use cpu or auto")
    elif device.type != "cpu":
        raise ValueError(f"{name} must be auto, cpu, cuda, cuda:<index> or mps, got {value!r}")


def _text(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A non-empty string (a path, a name)."""
    if not isinstance(value, str) or not value:
        raise checks.WrongTypeError(
            f"{checks.field_name(instance, attribute)} must be a non-empty string, got {value!r}"
        )


_optional = attrs.validators.optional
_FINITE_POSITIVE = checks.real_in_range(0.0, low_open=True)


def _table_value(value: Any) -> Any:
    """``--model-args`` text as a TOML inline table (``{nf = 20}``) or a JSON object; a table
    from a TOML file stays as it is; anything else is left for the check to refuse."""
    value = _parse_value(value)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _model_args(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (isinstance(value, dict) and all(map(_is_name, value))):
        raise checks.WrongTypeError(
            f"{checks.field_name(instance, attribute)} must be a table of the model's arguments "
            f"such as '{{nf = 20}}' (TOML) or '{{\"nf\": 20}}' (JSON), got {value!r}"
        )


def _is_name(key: Any) -> bool:
    return isinstance(key, str) and key.isidentifier()


@attrs.frozen
class _RunOptions:
    """The options of ``renate-events run``, as argparse names them."""

    config: str | None = attrs.field(validator=_optional(_text))
    scenario: str = attrs.field(validator=checks.one_of(*sorted({**SCENARIOS, **IMAGE_SCENARIOS})))
    chunks: int | None = attrs.field(validator=checks.int_at_least(1, 10**6, optional=True))
    seeds: list[int] = attrs.field(
        validator=_list_of_ints(0, _MAX_SEED, empty=False, distinct=True)
    )
    hidden: list[int] | None = attrs.field(
        validator=_optional(_list_of_ints(1, None, empty=True, distinct=False))
    )
    model: str | None = attrs.field(validator=_optional(checks.one_of(*sorted(MODELS))))
    model_args: dict[str, Any] | None = attrs.field(converter=_table_value, validator=_model_args)
    data_dir: str | None = attrs.field(validator=_optional(_text))
    no_augment: bool = attrs.field(validator=checks.boolean)
    output_dir: str = attrs.field(validator=_text)
    learner: str = attrs.field(validator=checks.one_of(*sorted(LEARNERS)))
    buffer: str | None = attrs.field(validator=_optional(checks.one_of(*BUFFERS)))
    memory_size: int | None = attrs.field(validator=checks.int_at_least(0, optional=True))
    epochs: int = attrs.field(validator=checks.int_at_least(1))
    lr: float | None = attrs.field(validator=_optional(_FINITE_POSITIVE))
    optimizer: str | None = attrs.field(validator=_optional(checks.one_of(*OPTIMIZERS)))
    momentum: float | None = attrs.field(validator=_optional(checks.real_in_range(0.0)))
    weight_decay: float | None = attrs.field(validator=_optional(checks.real_in_range(0.0)))
    batch_size: int = attrs.field(validator=checks.int_at_least(1))
    memory_batch_size: int = attrs.field(validator=checks.int_at_least(1))
    device: str = attrs.field(validator=_device)
    precision: str = attrs.field(validator=checks.one_of(*_PRECISIONS))
    no_progress: bool = attrs.field(validator=checks.boolean)
    config_file: str | None = attrs.field(validator=_optional(_text))
    metric: str | None = attrs.field(validator=_optional(_text))
    mode: str | None = attrs.field(validator=_optional(checks.one_of("min", "max")))
    early_stopping: int | None = attrs.field(validator=checks.int_at_least(1, optional=True))
    no_validation_memory: bool = attrs.field(validator=checks.boolean)


@attrs.frozen
class _UpdateOptions:
    """The options of ``renate-events update``; the training options are None where left out."""

    config: str | None = attrs.field(validator=_optional(_text))
    input_state: str | None = attrs.field(validator=_optional(_text))
    data: str | None = attrs.field(validator=_optional(_text))
    output_state: str = attrs.field(validator=_text)
    chunk_id: int | None = attrs.field(validator=checks.int_at_least(0, optional=True))
    seed: int = attrs.field(validator=checks.int_at_least(0, _MAX_SEED))
    in_place: bool = attrs.field(validator=checks.boolean)
    accept_config_change: bool = attrs.field(validator=checks.boolean)
    task_id: str | None = attrs.field(validator=_optional(_text))
    model: str | None = attrs.field(validator=_optional(checks.one_of(*sorted(MODELS))))
    model_args: dict[str, Any] | None = attrs.field(converter=_table_value, validator=_model_args)
    search: int | None = attrs.field(validator=checks.int_at_least(1, 10**5, optional=True))
    search_storage: str | None = attrs.field(validator=_optional(_text))
    search_study: str | None = attrs.field(validator=_optional(_text))
    search_pruner: str = attrs.field(validator=checks.one_of("median", "none"))
    search_space: dict[str, Any] = attrs.field(validator=attrs.validators.instance_of(dict))
    lock_timeout: float = attrs.field(validator=checks.real_in_range(0.0))
    learner: str | None = attrs.field(validator=_optional(checks.one_of(*sorted(LEARNERS))))
    buffer: str | None = attrs.field(validator=_optional(checks.one_of(*BUFFERS)))
    buffer_storage: str | None = attrs.field(validator=_optional(checks.one_of(*BUFFER_STORAGES)))
    memory_size: int | None = attrs.field(validator=checks.int_at_least(0, optional=True))
    epochs: int | None = attrs.field(validator=checks.int_at_least(1, optional=True))
    lr: float | None = attrs.field(validator=_optional(_FINITE_POSITIVE))
    optimizer: str | None = attrs.field(validator=_optional(checks.one_of(*OPTIMIZERS)))
    momentum: float | None = attrs.field(validator=_optional(checks.real_in_range(0.0)))
    weight_decay: float | None = attrs.field(validator=_optional(checks.real_in_range(0.0)))
    batch_size: int | None = attrs.field(validator=checks.int_at_least(1, optional=True))
    memory_batch_size: int | None = attrs.field(validator=checks.int_at_least(1, optional=True))
    device: str | None = attrs.field(validator=_optional(_device))
    precision: str | None = attrs.field(validator=_optional(checks.one_of(*_PRECISIONS)))
    no_progress: bool = attrs.field(validator=checks.boolean)
    config_file: str | None = attrs.field(validator=_optional(_text))
    metric: str | None = attrs.field(validator=_optional(_text))
    mode: str | None = attrs.field(validator=_optional(checks.one_of("min", "max")))
    early_stopping: int | None = attrs.field(validator=checks.int_at_least(1, optional=True))
    no_validation_memory: bool = attrs.field(validator=checks.boolean)


@attrs.frozen
class _EvaluateOptions:
    """The options of ``renate-events evaluate``."""

    state: str = attrs.field(validator=_text)
    data: str | None = attrs.field(validator=_optional(_text))
    scenario: str | None = attrs.field(
        validator=_optional(checks.one_of(*sorted({**SCENARIOS, **IMAGE_SCENARIOS})))
    )
    data_dir: str | None = attrs.field(validator=_optional(_text))
    config_file: str | None = attrs.field(validator=_optional(_text))
    chunk_ids: list[int] | None = attrs.field(
        validator=_optional(_list_of_ints(0, None, empty=False, distinct=True))
    )
    seed: int = attrs.field(validator=checks.int_at_least(0, _MAX_SEED))
    accept_config_change: bool = attrs.field(validator=checks.boolean)
    classifier: str = attrs.field(default="logits", validator=checks.one_of("logits", "nme"))


@attrs.frozen
class _ShiftOptions:
    """The options of ``renate-events shift``."""

    reference: str = attrs.field(validator=_text)
    query: str = attrs.field(validator=_text)
    detector: str = attrs.field(validator=checks.one_of("mmd", "ks"))
    level: float = attrs.field(
        validator=checks.real_in_range(0.0, 1.0, low_open=True, high_open=True)
    )
    num_permutations: int = attrs.field(validator=checks.int_at_least(1, 10**7))
    max_samples: int = attrs.field(validator=checks.int_at_least(10, 10**6))
    seed: int = attrs.field(validator=checks.int_at_least(0, _MAX_SEED))
    state: str | None = attrs.field(validator=_optional(_text))
    config_file: str | None = attrs.field(validator=_optional(_text))
    accept_config_change: bool = attrs.field(validator=checks.boolean)
    feature_module: str | None = attrs.field(validator=_optional(_text))


def _options(
    schema: type, values: Mapping[str, Any], from_file: frozenset[str] = frozenset()
) -> Any:
    """Check ``values`` against ``schema``; a failure names the option as the user wrote it."""
    names = {field.name for field in attrs.fields(schema)}
    try:
        return schema(**{name: value for name, value in values.items() if name in names})
    except ValueError as exc:  # the shared checks' contract (WrongTypeError is one too)
        message = str(exc)
        for field in attrs.fields(schema):
            prefix = f"{schema.__name__}.{field.name} "
            if message.startswith(prefix):
                flag = "--" + field.name.replace("_", "-")
                message = _flag_message(flag, message.removeprefix(prefix), exc)
                if field.name in from_file:
                    message += f" (in {values['config']})"
        raise UsageError(message) from None


def _flag_message(flag: str, rest: str, exc: ValueError) -> str:
    """The check's message in the command line's words: ``unknown --scenario 'x'; choose from
    [...]`` for a value outside a choice, ``--epochs must be >= 1, got 0`` for an int out of range
    (the type is right, so only the range is said)."""
    choice = re.fullmatch(r"must be one of (\[.*\]), got (.*)", rest)
    if choice:
        return f"unknown {flag} {choice.group(2)}; choose from {choice.group(1)}"
    if not isinstance(exc, checks.WrongTypeError):
        rest = rest.replace("must be an int >= ", "must be >= ", 1)
    return f"{flag} {rest}"


# -- learner hyperparameters --------------------------------------------------------------------


def _parse_value(text: Any) -> Any:
    """A flag's text as a TOML value (``0.5``, ``true``, ``["a"]``); other text stays a string."""
    if not isinstance(text, str):
        return text  # from a TOML file: typed already
    import tomllib

    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _hyperparameter_values(
    values: dict[str, Any], learner: str, from_file: frozenset[str], config: str | None
) -> dict[str, Any]:
    """Take the learner hyperparameters out of ``values``, each checked against ``learner``."""
    chosen: dict[str, Any] = {}
    for name in _hyperparameter_names():
        if name not in values:
            continue
        raw = values.pop(name)
        where = f" (in {config})" if name in from_file else ""
        value = raw if name in from_file else _parse_value(raw)
        try:
            chosen[name] = check_value(learner, name, value)
        except HyperparameterError as exc:
            flag = "--" + name.replace("_", "-")
            message = str(exc).replace(f"{name} must be", f"{flag} must be", 1)
            if message.startswith("the learner"):
                message = f"{flag}: {message}"
            raise UsageError(message + where) from None
    return chosen


def _learner_message(exc: ValueError) -> str:
    """A learner's check (``DarkExperienceReplayLearner.alpha must be ...``) in flag words."""
    message = _one_line(exc)
    match = re.match(r"\w+Learner\.(\w+) (.*)", message)
    if match:
        return f"--{match.group(1).replace('_', '-')} {match.group(2)}"
    return message


# -- shared pieces ------------------------------------------------------------------------------


def _mlp(inputs: int, hidden: Sequence[int], classes: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    width = inputs
    for size in hidden:
        layers += [torch.nn.Linear(width, size), torch.nn.ReLU()]
        width = size
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


def _mlp_signature(inputs: int, hidden: Sequence[int], classes: int) -> dict[str, list[Any]]:
    """What :func:`_mlp` would record in a manifest, computed without building it."""
    signature: dict[str, list[Any]] = {}
    widths = [inputs, *hidden, classes]
    for layer, (width_in, width_out) in enumerate(itertools.pairwise(widths)):
        signature[f"{2 * layer}.weight"] = [[width_out, width_in], "float32"]
        signature[f"{2 * layer}.bias"] = [[width_out], "float32"]
    return signature


def _parameter_count(inputs: int, hidden: Sequence[int], classes: int) -> int:
    widths = [inputs, *hidden, classes]
    return sum(a * b + b for a, b in itertools.pairwise(widths))


def _progress(learner: Any, description: str, enabled: bool) -> None:
    """Show a progress bar for the learner's next update (tqdm is optional)."""
    if not enabled:
        return
    trainer = learner.trainer
    current = dict(trainer.listeners).get("progress")
    if current is None:
        try:
            from trainer.listeners import ProgressBar

            current = ProgressBar()
        except ImportError:
            return
        trainer.subscribe(current, name="progress")
    current.description = description


def _one_line(error: BaseException) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


# -- data files ---------------------------------------------------------------------------------


def _load_data_file(path: str) -> torch.utils.data.TensorDataset:
    """``inputs`` (N, ...) and integer ``targets`` (N,) from a .safetensors or .npz file; the
    inputs keep their dtype until :func:`_fitted` converts them for the state's model."""
    tensors = _read_tensors("--data", path)
    missing = {"inputs", "targets"} - set(tensors)
    if missing:
        raise UsageError(f"--data {path} lacks {sorted(missing)}; it holds {sorted(tensors)}")
    inputs, targets = _inputs(path, tensors["inputs"]), _targets(path, tensors["targets"])
    if len(inputs) != len(targets):
        raise UsageError(
            f"--data {path}: 'inputs' and 'targets' must have the same length, got {len(inputs)} "
            f"and {len(targets)}"
        )
    return torch.utils.data.TensorDataset(inputs, targets)


def _read_tensors(flag: str, path: str) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors or .npz file (``flag`` names the option in errors)."""
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path}: no such file")
    if path.endswith(".safetensors"):
        return _read_safetensors(flag, path)
    if path.endswith(".npz"):
        return _read_npz(flag, path)
    raise UsageError(f"{flag} {path}: expected a .safetensors or .npz file")


def _read_safetensors(flag: str, path: str) -> dict[str, torch.Tensor]:
    import safetensors.torch

    try:
        return safetensors.torch.load_file(path)
    except (safetensors.SafetensorError, OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path} is not a readable safetensors file: {exc}") from exc


def _read_npz(flag: str, path: str) -> dict[str, torch.Tensor]:
    try:
        import numpy
    except ImportError as exc:
        raise UsageError(".npz files need numpy: pip install numpy") from exc
    if not zipfile.is_zipfile(path):
        raise UsageError(f"{flag} {path} is not a readable .npz file (not a zip archive)")
    arrays = {}
    try:
        with numpy.load(path, allow_pickle=False) as archive:
            for key in archive.files:
                array = archive[key]
                if array.dtype.kind not in "biuf":
                    raise UsageError(
                        f"{flag} {path}: {key!r} holds {array.dtype} values; it must hold numbers"
                    )
                arrays[key] = torch.from_numpy(
                    array.astype(numpy.float64 if array.dtype.kind == "f" else numpy.int64)
                )
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise UsageError(f"{flag} {path} is not a readable .npz file: {exc}") from exc
    return arrays


def _inputs(path: str, inputs: torch.Tensor) -> torch.Tensor:
    if inputs.dim() < 2 or len(inputs) == 0:
        raise UsageError(
            f"--data {path}: 'inputs' must have the shape (samples, features) or (samples, "
            f"channels, height, width) with at least one sample, got {tuple(inputs.shape)}"
        )
    if inputs.dtype.is_complex or not (inputs.dtype.is_floating_point or _is_integer(inputs)):
        raise UsageError(f"--data {path}: 'inputs' holds {inputs.dtype} values, not real numbers")
    if inputs.dtype.is_floating_point and not bool(torch.isfinite(inputs).all()):
        raise UsageError(f"--data {path}: 'inputs' holds NaN or infinite values")
    return inputs


def _is_integer(tensor: torch.Tensor) -> bool:
    return not tensor.dtype.is_floating_point and not tensor.dtype.is_complex


def _targets(path: str, targets: torch.Tensor) -> torch.Tensor:
    if targets.dim() != 1:
        raise UsageError(
            f"--data {path}: 'targets' must be one class index per sample, got the shape "
            f"{tuple(targets.shape)}"
        )
    if targets.dtype == torch.bool or targets.dtype.is_complex:
        raise UsageError(
            f"--data {path}: 'targets' holds {targets.dtype} values, not class indices"
        )
    if targets.dtype.is_floating_point and not bool((targets == targets.round()).all()):
        raise UsageError(f"--data {path}: 'targets' holds non-integer values, not class indices")
    return targets.long()


def _fitted(
    what: str, data: torch.utils.data.TensorDataset, spec: Mapping[str, Any]
) -> torch.utils.data.TensorDataset:
    """The data (``what``: where it comes from) as the model takes it: float feature vectors for
    the command line's MLP, raw ``uint8`` images for a zoo model on images; labels checked."""
    inputs, targets = data.tensors
    if len(inputs) != len(targets):
        raise UsageError(
            f"{what}: 'inputs' and 'targets' must have the same length, got {len(inputs)} "
            f"and {len(targets)}"
        )
    inputs = (
        _mlp_inputs(what, inputs, spec) if spec["kind"] == "mlp" else _images(what, inputs, spec)
    )
    low, high = int(targets.min()), int(targets.max())
    if low < 0 or high >= spec["classes"]:
        raise UsageError(
            f"{what}: the labels range over [{low}, {high}]; the state folder's model has "
            f"{spec['classes']} classes (labels 0..{spec['classes'] - 1})"
        )
    return torch.utils.data.TensorDataset(inputs, targets)


def _mlp_inputs(what: str, inputs: torch.Tensor, spec: Mapping[str, Any]) -> torch.Tensor:
    if inputs.dim() != 2:
        raise UsageError(
            f"{what}: 'inputs' must have the shape (samples, features), got "
            f"{tuple(inputs.shape)}; the state folder's model is an MLP: flatten images first"
        )
    if inputs.shape[1] != spec["inputs"]:
        raise UsageError(
            f"{what}: the samples have {inputs.shape[1]} features; the state folder's model "
            f"takes {spec['inputs']}"
        )
    inputs = inputs.float()
    if not bool(torch.isfinite(inputs).all()):
        raise UsageError(f"{what}: 'inputs' holds values too large for float32")
    return inputs


def _images(what: str, inputs: torch.Tensor, spec: Mapping[str, Any]) -> torch.Tensor:
    """Raw images of the spec's shape, as ``uint8`` (the state's transforms make the floats)."""
    shape = tuple(spec["inputs"])
    if tuple(inputs.shape[1:]) != shape:
        raise UsageError(
            f"{what}: the samples have the shape {tuple(inputs.shape[1:])}; the state folder's "
            f"model takes {shape}"
        )
    if inputs.dtype.is_floating_point or int(inputs.min()) < 0 or int(inputs.max()) > 255:
        raise UsageError(
            f"{what}: 'inputs' must be raw images, integers 0..255 (uint8), got {inputs.dtype} "
            f"values in [{float(inputs.min()):g}, {float(inputs.max()):g}]; the state folder's "
            f"{spec['transforms']} transforms convert them to floats per batch"
        )
    return inputs.to(torch.uint8)


# -- state folders written by the command line --------------------------------------------------


def _model_spec(folder: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The MLP that ``metadata.model`` describes, checked against the manifest's ``model``.

    The checkpoint holds the model's parameters, so a description that would need more bytes than
    the checkpoint has is refused before anything is allocated.
    """
    path = os.path.join(folder, "manifest.json")
    spec = manifest["metadata"].get("model")
    if isinstance(spec, dict) and spec.get("kind") == "zoo":
        return _zoo_spec(folder, manifest)
    if not isinstance(spec, dict) or spec.get("kind") != "mlp":
        raise UsageError(
            f"{folder} was not written by renate-events run/update (its manifest has no model "
            "description); load it from Python with ModelUpdater and your own model"
        )
    try:
        checks.check_int(f"{path}: key 'metadata.model.inputs'", spec.get("inputs"), 1)
        checks.check_int(f"{path}: key 'metadata.model.classes'", spec.get("classes"), 1)
        hidden = spec.get("hidden")
        if not isinstance(hidden, list):
            raise checks.WrongTypeError(
                f"{path}: key 'metadata.model.hidden' must be a list, got {hidden!r}"
            )
        for width in hidden:
            checks.check_int(f"{path}: key 'metadata.model.hidden'", width, 1)
    except ValueError as exc:
        raise StateFolderError(str(exc)) from None
    shape = (spec["inputs"], hidden, spec["classes"])
    if _mlp_signature(*shape) != manifest["model"]:
        raise StateFolderError(
            f"{path}: key 'metadata.model' describes another MLP than its key 'model' lists"
        )
    if 4 * _parameter_count(*shape) > os.path.getsize(os.path.join(folder, "learner.safetensors")):
        raise StateFolderError(
            f"{path}: key 'metadata.model' describes an MLP larger than the checkpoint beside it"
        )
    return spec


def _updater_from_folder(
    folder: str,
    lock_timeout: float = 60.0,
    overrides: Mapping[str, Any] | None = None,
    hyper: Mapping[str, Any] | None = None,
) -> Any:
    """A :class:`ModelUpdater` with the folder's MLP, loaded; everything checked first."""
    manifest = read_manifest(folder, timeout=lock_timeout)
    if manifest.get("config") is not None:
        raise UsageError(
            f"{folder} was written from the config file {manifest['config']['file']}; pass it "
            "as --config-file"
        )
    spec = _model_spec(folder, manifest)
    overrides = overrides or {}
    learner, buffer, learner_kwargs = _learner_settings(overrides, hyper or {}, manifest)
    if spec["kind"] == "mlp":
        model = _mlp(spec["inputs"], spec["hidden"], spec["classes"])
    else:
        model = build_model(spec["name"], **spec["args"])
    try:
        updater = ModelUpdater(
            model,
            transforms=_spec_transforms(spec),
            learner=learner,
            learner_kwargs=learner_kwargs,
            buffer=buffer,
            buffer_storage=_buffer_storage(overrides, manifest),
            trainer_kwargs=_trainer_setting(overrides, manifest, folder),
            metadata=manifest["metadata"],
            input_state_folder=folder,
            lock_timeout=lock_timeout,
            validation_memory=manifest.get("validation_memory", False),
            **_optimizer_setting(overrides, manifest, None),
        )
        updater.learner_instance  # noqa: B018 - builds and loads, so that errors come now
    except StateFolderError:
        raise
    except ValueError as exc:  # the learner's or the trainer's checks of the folder's values
        raise StateFolderError(f"{folder}: its manifest is refused: {exc}") from None
    return updater, spec


# -- zoo models and image scenarios ---------------------------------------------------------------

_IMAGE_DATA = {
    "seq-cifar10": (
        "cifar10",
        "the CIFAR-10 binary version, DIR/cifar-10-batches-bin/data_batch_1.bin ... "
        "data_batch_5.bin and test_batch.bin (cifar-10-binary.tar.gz from "
        "https://www.cs.toronto.edu/~kriz/cifar.html, extracted with tar xzf "
        "cifar-10-binary.tar.gz -C DIR)",
    ),
    "seq-cifar100": (
        "cifar100",
        "the CIFAR-100 binary version, DIR/cifar-100-binary/train.bin and test.bin "
        "(cifar-100-binary.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, extracted "
        "with tar xzf cifar-100-binary.tar.gz -C DIR)",
    ),
}
"""The image scenarios: the transform preset (its normalisation) and the files they read."""
_IMAGE_MODEL = ("resnet18", {"nf": 20})  # GEM's reduced ResNet-18: the default on images
_INFERRED = ("inputs", "num_classes", "in_channels", "image_size")
"""Model arguments the command line takes from the scenario's data, never from --model-args."""
_MAX_LAYERS = 64
"""The most blocks (vit ``depth``) or hidden layers (mlp ``hidden``) a zoo model of the command
line has: building one costs time per layer even on the meta device, so a state folder's
description cannot make a reader build for minutes before its size is checked."""


def _check_zoo_args(where: str, args: Mapping[str, Any]) -> None:
    """Every argument an int (``hidden``: a list of ints) of a size the model can be built at."""
    for key, value in args.items():
        if key == "hidden" and isinstance(value, list) and len(value) <= _MAX_LAYERS:
            continue
        high = _MAX_LAYERS + 1 if key == "depth" else 2**31
        checks.check_int(f"{where} {key}", value, 0, high)


def _check_data_dir(scenario: str | None, data_dir: str | None) -> None:
    """``--data-dir`` goes with an image scenario, and only with one."""
    if scenario in IMAGE_SCENARIOS and data_dir is None:
        raise UsageError(
            f"--scenario {scenario} reads {_IMAGE_DATA[scenario][1]}: give --data-dir DIR; "
            "nothing is downloaded"
        )
    if scenario not in IMAGE_SCENARIOS and data_dir is not None:
        where = f"{scenario} uses the bundled digits" if scenario else "is not given"
        raise UsageError(
            f"--data-dir is for the image scenarios {sorted(IMAGE_SCENARIOS)}; --scenario {where}"
        )


def _resolved_model(options: _RunOptions) -> _RunOptions:
    """The run's options with the model, its arguments and ``--hidden`` made explicit, after
    the checks of which scenario, data folder and model go together."""
    image = options.scenario in IMAGE_SCENARIOS
    _check_data_dir(options.scenario, options.data_dir)
    if not image and options.no_augment:
        raise UsageError(
            f"--no-augment is for the image scenarios {sorted(IMAGE_SCENARIOS)}; --scenario "
            f"{options.scenario} uses the bundled digits"
        )
    model = options.model or (_IMAGE_MODEL[0] if image else "mlp")
    args = options.model_args
    if args is None:
        args = dict(_IMAGE_MODEL[1]) if image and options.model is None else {}
    if not image and model != "mlp":
        raise UsageError(
            f"--model {model} takes images; --scenario {options.scenario} gives flat vectors of "
            "features: use --model mlp (with --hidden), or an image scenario "
            f"{sorted(IMAGE_SCENARIOS)}"
        )
    if model == "mlp" and args:
        raise UsageError(
            f"--model-args {args}: the MLP's only arguments are its hidden layer sizes; give "
            "them with --hidden"
        )
    if model != "mlp" and options.hidden is not None:
        raise UsageError(f"--hidden sizes --model mlp; --model {model} takes --model-args")
    inferred = sorted(set(args) & set(_INFERRED))
    if inferred:
        raise UsageError(
            f"--model-args: {inferred} come from the scenario's data (number of classes, image "
            "shape); leave them out"
        )
    hidden = options.hidden if options.hidden is not None or model != "mlp" else [256]
    return attrs.evolve(options, model=model, model_args=args, hidden=hidden)


def _scenario_tasks(scenario: str, data_dir: str | None, seed: int) -> list[Any]:
    """The tasks of a named scenario; an image scenario's files missing or corrupt is one line
    (the reader's message names the file that was expected and where to get it)."""
    if scenario in SCENARIOS:
        try:
            return list(SCENARIOS[scenario](seed=seed).tasks())
        except ImportError as exc:
            raise UsageError(f"--scenario {scenario}: {exc}") from None
    try:
        return list(IMAGE_SCENARIOS[scenario](data_dir, seed=seed).tasks())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--scenario {scenario} --data-dir {data_dir}: {_one_line(exc)}") from None


def _zoo_spec_for_run(options: _RunOptions, tasks: Sequence[Any], classes: int) -> dict[str, Any]:
    """What the manifest records of a zoo model on an image scenario: its name, every argument
    (the given ones and those of the data), the image shape and the transforms."""
    name = options.model or _IMAGE_MODEL[0]
    shape = list(tasks[0].train.tensors[0].shape[1:])
    data = {
        "inputs": math.prod(shape),
        "num_classes": classes,
        "in_channels": shape[0],
        "image_size": shape[-1],
        "hidden": options.hidden,
    }
    takes = inspect.signature(MODELS[name]).parameters
    args = {**(options.model_args or {}), **{k: v for k, v in data.items() if k in takes}}
    try:
        _check_zoo_args("--model-args", options.model_args or {})
    except ValueError as exc:
        raise UsageError(_one_line(exc)) from None
    spec = {
        "kind": "zoo",
        "name": name,
        "args": args,
        "inputs": shape,
        "classes": classes,
        "transforms": _IMAGE_DATA[options.scenario][0],
        "augment": not options.no_augment,
    }
    try:
        size = _state_bytes(_zoo_on_meta(name, args))
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--model-args: {_one_line(exc)}") from None
    if size > 4 * _MAX_PARAMETERS:
        raise UsageError(
            f"--model {name} with {options.model_args} has {size} bytes of parameters; the "
            f"command line builds models of at most {4 * _MAX_PARAMETERS}"
        )
    return spec


def _zoo_on_meta(name: str, args: Mapping[str, Any]) -> torch.nn.Module:
    """The model built on the meta device: its shapes, with no memory allocated."""
    with torch.device("meta"):
        return build_model(name, **args)


def _state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _spec_transforms(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The batch transforms of a zoo model on images: raw ``uint8`` in the buffer, floats made
    per batch (random crop and flip in training and replay unless ``augment`` is false)."""
    if spec["kind"] != "zoo":
        return {}
    from renate_events.transforms import cifar_test_transform, cifar_train_transform

    test = cifar_test_transform(spec["transforms"])
    train = cifar_train_transform(spec["transforms"]) if spec["augment"] else test
    return {"train_transform": train, "buffer_transform": train, "test_transform": test}


def _evaluated(model: torch.nn.Module, transforms: Mapping[str, Any]) -> torch.nn.Module:
    """The model as evaluation sees it: through the test transform, if any."""
    test = transforms.get("test_transform")
    return model if test is None else _Transformed(model, test)


def _zoo_spec(folder: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The zoo model that ``metadata.model`` describes, every key checked; built on the meta
    device first (nothing allocated) so that one larger than the checkpoint is refused. The
    updater then compares its parameters with the manifest's ``model``."""
    path = os.path.join(folder, "manifest.json")
    spec = manifest["metadata"]["model"]
    key = f"{path}: key 'metadata.model"
    try:
        checks.check_one_of(f"{key}.name'", spec.get("name"), tuple(MODELS))
        checks.check_one_of(f"{key}.transforms'", spec.get("transforms"), ("cifar10", "cifar100"))
        if not isinstance(spec.get("augment"), bool):
            raise checks.WrongTypeError(f"{key}.augment' must be true or false")
        if not isinstance(spec.get("args"), dict):
            raise checks.WrongTypeError(f"{key}.args' must be an object")
        shape = spec.get("inputs")
        if not isinstance(shape, list) or len(shape) != 3:
            raise checks.WrongTypeError(f"{key}.inputs' must be [channels, height, width]")
        for size in shape:
            checks.check_int(f"{key}.inputs'", size, 1, 2**15)
        checks.check_int(f"{key}.classes'", spec.get("classes"), 1)
        if spec["args"].get("num_classes") != spec["classes"]:
            raise ValueError(f"{key}.args.num_classes' must equal its key 'classes'")
        _check_zoo_args(f"{key}.args'", spec["args"])
        shown = {"inputs": math.prod(shape), "in_channels": shape[0], "image_size": shape[-1]}
        for name, value in shown.items():
            if spec["args"].get(name, value) != value:
                raise ValueError(f"{key}.args.{name}' does not fit its key 'inputs' {shape}")
        model = _zoo_on_meta(spec["name"], spec["args"])
    except (ValueError, TypeError) as exc:
        raise StateFolderError(_one_line(exc)) from None
    if _state_bytes(model) > os.path.getsize(os.path.join(folder, "learner.safetensors")):
        raise StateFolderError(f"{key}' describes a model larger than the checkpoint beside it")
    return spec


def _check_same_model(options: _UpdateOptions, spec: Mapping[str, Any], folder: str) -> None:
    """``update --model/--model-args`` must name the input state's model: an architecture never
    changes between the updates of one state folder."""
    name = "mlp" if spec["kind"] == "mlp" else spec["name"]
    recorded = {} if spec["kind"] == "mlp" else spec["args"]
    if options.model is not None and options.model != name:
        raise UsageError(
            f"--model {options.model}: the state folder {folder} holds a {name} model, and later "
            f"updates keep its architecture; leave --model out, or start a new state folder "
            f"with renate-events run --model {options.model}"
        )
    for key, value in (options.model_args or {}).items():
        if recorded.get(key, None) != value:
            raise UsageError(
                f"--model-args {key} = {value!r}: the state folder {folder} holds a {name} model "
                f"with {key} = {recorded.get(key)!r}, and later updates keep its architecture"
            )


# -- config files: the settings of an update ------------------------------------------------------

_TRAINING = ("learner", "buffer", "memory_size", "epochs", "lr", "batch_size", "memory_batch_size")
_OPTIMIZER_OPTIONS = ("optimizer", "lr", "momentum", "weight_decay")
_FIRST_UPDATE = {"memory_size": 200, "batch_size": 32, "memory_batch_size": 32}


def _load_config_file(path: str) -> ConfigFile:
    return load_config(path)  # a ConfigError is one line, exit 2


def _learner_settings(
    overrides: Mapping[str, Any], hyper: Mapping[str, Any], manifest: Mapping[str, Any] | None
) -> tuple[str, str, dict[str, Any]]:
    """The learner's name, the buffer and ``learner_kwargs``: the input state's (or the first
    update's defaults), then the options given."""
    if manifest is not None:
        learner = overrides.get("learner") or manifest["learner"]
        buffer = overrides.get("buffer") or manifest["buffer"]
        kwargs = dict(manifest["learner_kwargs"])
    else:
        learner = overrides.get("learner") or "der"
        buffer = overrides.get("buffer") or default_buffer(learner)
        kwargs = {**_FIRST_UPDATE, "seed": overrides.get("seed", 0)}
        if not method(learner).uses_memory:
            kwargs.pop("memory_size")
    for name in _FIRST_UPDATE:
        if overrides.get(name) is not None:
            kwargs[name] = overrides[name]
    kwargs.update(hyper)
    return learner, buffer, kwargs


def _buffer_storage(overrides: Mapping[str, Any], manifest: Mapping[str, Any] | None) -> str:
    """``--buffer-storage``, else the input state's (absent from its manifest: in memory)."""
    saved = "memory" if manifest is None else manifest.get("buffer_storage", "memory")
    return overrides.get("buffer_storage") or saved


def _feature_modules(learner: str, kwargs: dict[str, Any], model: torch.nn.Module) -> None:
    """Distilling learners on a zoo model distil its feature modules unless told otherwise."""
    if method(learner).features != "hidden" or "feature_modules" in kwargs:
        return
    names = getattr(model, "feature_module_names", None)
    if not names:
        raise UsageError(
            f"--learner {learner} distils intermediate features: give --feature-modules "
            '["name", ...] with names of the model\'s submodules'
        )
    kwargs["feature_modules"] = list(names)


def _optimizer_setting(
    overrides: Mapping[str, Any], manifest: Mapping[str, Any] | None, config: ConfigFile | None
) -> dict[str, Any]:
    """``{"optimizer": ...}`` for :class:`ModelUpdater`, or nothing when ``optimizer_fn`` makes
    it."""
    if config is not None and config.has("optimizer_fn"):
        for option in _OPTIMIZER_OPTIONS:
            if overrides.get(option) is not None:
                flag = "--" + option.replace("_", "-")
                raise UsageError(
                    f"{flag}: {config.path} defines optimizer_fn, which sets the learning rate "
                    f"and the other optimizer options; change it there or leave {flag} out"
                )
        return {}
    saved = None if manifest is None else manifest["optimizer"]
    if saved is not None and "function" in saved:
        raise UsageError(
            f"the state folder's optimizer came from a config file's optimizer_fn "
            f"({saved['function']}); pass that --config-file"
        )
    return {"optimizer": _optimizer_spec(saved or {"name": "adam", "lr": 1e-3}, overrides)}


def _optimizer_spec(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (``{"name": ..., "lr": ..., ...}``) with ``--optimizer``, ``--lr``,
    ``--momentum`` and ``--weight-decay`` applied; another optimizer keeps only the learning
    rate of ``base`` (its other options may not apply)."""
    optimizer = dict(base)
    name = overrides.get("optimizer")
    if name is not None and name != optimizer.get("name", "adam"):
        optimizer = {"name": name, "lr": optimizer.get("lr", 1e-3)}
    for option in _OPTIMIZER_OPTIONS[1:]:
        if overrides.get(option) is not None:
            optimizer[option] = overrides[option]
    if "momentum" in optimizer and optimizer.get("name", "adam") != "sgd":
        raise UsageError(
            f"--momentum is an option of sgd, not of {optimizer.get('name', 'adam')}: give "
            "--optimizer sgd or leave --momentum out"
        )
    return optimizer


def _trainer_setting(
    overrides: Mapping[str, Any], manifest: Mapping[str, Any] | None, folder: str | None
) -> dict[str, Any]:
    if manifest is not None:
        trainer_kwargs = dict(manifest["trainer"])
    else:
        trainer_kwargs = {"max_epochs": 10, "device": "auto", "precision": "32"}
    for option, name in (
        ("epochs", "max_epochs"),
        ("device", "device"),
        ("precision", "precision"),
    ):
        if overrides.get(option) is not None:
            trainer_kwargs[name] = overrides[option]
    if overrides.get("distributed"):
        trainer_kwargs["distributed"] = "init"
    if "device" in trainer_kwargs and overrides.get("device") is None and folder is not None:
        _check_device(
            f"{folder}: the trainer device (override it with --device)", trainer_kwargs["device"]
        )
    return trainer_kwargs


def _selection_settings(options: Any) -> dict[str, Any]:
    """Best-model selection, early stopping and the validation memory from the options."""
    metric = options.metric
    mode = options.mode
    if mode is None:  # an accuracy is better when higher; anything else (a loss) when lower
        mode = "max" if metric is not None and metric.endswith("accuracy") else "min"
    if options.early_stopping is not None and metric is None:
        raise UsageError("--early-stopping watches --metric: give --metric val_loss (or another)")
    return {
        "metric": metric,
        "mode": mode,
        "early_stopping_enabled": options.early_stopping is not None,
        "early_stopping_patience": options.early_stopping or 3,
        "validation_memory": not options.no_validation_memory,
    }


def _config_updater(
    config: ConfigFile,
    overrides: Mapping[str, Any],
    hyper: Mapping[str, Any],
    manifest: Mapping[str, Any] | None,
    **kwargs: Any,
) -> ModelUpdater:
    """A :class:`ModelUpdater` from a config file and the options, built and loaded (so that
    every check runs before training)."""
    model = config.model()
    learner, buffer, learner_kwargs = _learner_settings(overrides, hyper, manifest)
    if manifest is None:
        _feature_modules(learner, learner_kwargs, model)
    folder = kwargs.get("input_state_folder")
    try:
        updater = ModelUpdater.from_config(
            config,
            model=model,
            learner=learner,
            learner_kwargs=learner_kwargs,
            buffer=buffer,
            buffer_storage=_buffer_storage(overrides, manifest),
            trainer_kwargs=_trainer_setting(overrides, manifest, folder),
            metadata={} if manifest is None else manifest["metadata"],
            **_optimizer_setting(overrides, manifest, config),
            **kwargs,
        )
        updater.learner_instance  # noqa: B018 - builds and loads, so that errors come now
    except (StateFolderError, UpdateInputError, ConfigError):
        raise
    except ValueError as exc:  # the learner's or the trainer's checks of the settings
        raise UsageError(_learner_message(exc)) from None
    return updater


@attrs.frozen
class _ChunkTask:
    """A config file's chunk as :func:`renate_events.evaluation.evaluate` takes a task."""

    task_id: int
    train: Any
    val: Any
    test: torch.utils.data.TensorDataset
    classes: tuple[int, ...]


def _test_tensors(config: ConfigFile, chunk_id: int, seed: int, val: Any) -> Any:
    """The test data of a chunk as tensors: ``test_data_fn``'s, else the validation data."""
    test = config.test_data(chunk_id, seed)
    if test is None:
        test = val
    if test is None:
        raise UsageError(
            f"{config.path} defines no test_data_fn and data_fn gives no validation data for "
            f"chunk {chunk_id}: the command has nothing to evaluate on"
        )
    inputs, targets = dataset_tensors(test, config.collate(), f"the test data of chunk {chunk_id}")
    return torch.utils.data.TensorDataset(inputs, targets)


class _Transformed(torch.nn.Module):
    """``model(transform(x))``: the config file's test transform in evaluation."""

    def __init__(self, model: torch.nn.Module, transform: Callable[[Any], Any]) -> None:
        super().__init__()
        self.model = model
        self.transform = transform

    def forward(self, inputs: Any) -> Any:
        return self.model(self.transform(inputs))


def _for_evaluation(model: torch.nn.Module, config: ConfigFile | None) -> torch.nn.Module:
    transform = None if config is None else config.transform("test_transform")
    return model if transform is None else _Transformed(model, transform)


def _metric_means(
    model: torch.nn.Module, data: torch.utils.data.TensorDataset, metrics: Mapping[str, Any]
) -> dict[str, float]:
    """The mean of each ``metrics_fn`` metric over ``data`` (one synchronisation per metric)."""
    if not metrics:
        return {}
    device = model_device(model)
    inputs, targets = data.tensors
    sums = {name: torch.zeros((), dtype=torch.float64, device=device) for name in metrics}
    with inference(model):
        for start in range(0, len(targets), 256):
            batch = targets[start : start + 256].to(device)
            outputs = forward(model, inputs[start : start + 256].to(device))
            for name, metric in metrics.items():
                value = torch.as_tensor(metric(outputs, batch), device=device)
                sums[name] += value.double().mean() * len(batch)
    return {name: float(total) / len(targets) for name, total in sums.items()}


# -- run ------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Seed:
    """One seed of a run: its tasks and its updater, built (and so checked) before any training."""

    seed: int
    tasks: list[Any]
    updater: ModelUpdater
    rng_state: torch.Tensor
    evaluated: torch.nn.Module  # the model, with the config file's test transform if any


def _run(values: dict[str, Any], from_file: frozenset[str]) -> int:
    options = _options(_RunOptions, values, from_file)
    hyper = _hyperparameter_values(values, options.learner, from_file, options.config)
    config = _run_config_file(options)
    if config is None:
        options = _resolved_model(options)
    if config is None and method(options.learner).features == "hidden" and options.hidden == []:
        raise UsageError(f"--learner {options.learner} distils hidden layers: give --hidden sizes")
    # Under `torchrun --nproc_per_node=N`: data-parallel training over N processes; rank zero
    # prints and writes the results. State folders are not written (their staging folders are
    # per process), so `run` under torchrun keeps no state between invocations.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank_zero = int(os.environ.get("RANK", "0")) == 0
    tokens = None if distributed else _check_output_dir(options)
    seeds = [
        _prepare_seed(options, seed, distributed, hyper)
        if config is None
        else _prepare_config_seed(options, config, seed, distributed, hyper)
        for seed in options.seeds
    ]
    started = time.perf_counter()
    runs = [_train_seed(options, plan) for plan in seeds]
    elapsed = time.perf_counter() - started
    if rank_zero:
        files = _result_files(options, runs, elapsed)
        if tokens is not None:
            _write_run(options, files, seeds, tokens)
        print(_table(options, runs, elapsed))
    return 0


def _run_config_file(options: _RunOptions) -> ConfigFile | None:
    """The ``--config-file`` of a run, with the options that only it allows checked."""
    if options.config_file is None:
        for flag, value in (
            ("--chunks", options.chunks),
            ("--metric", options.metric),
            ("--early-stopping", options.early_stopping),
        ):
            if value is not None:
                raise UsageError(f"{flag} needs --config-file")
        return None
    for flag, value in (
        ("--model", options.model),
        ("--model-args", options.model_args),
        ("--hidden", options.hidden),
        ("--data-dir", options.data_dir),
    ):
        if value is not None:
            raise UsageError(
                f"{flag}: with --config-file, its model_fn builds the model (it may call "
                "renate_events.models.build_model) and data_fn gives the data; leave it out"
            )
    if options.chunks is None:
        raise UsageError(
            "--config-file needs --chunks N: the number of updates, on data_fn's chunks 0..N-1"
        )
    return _load_config_file(options.config_file)


def _prepare_config_seed(
    options: _RunOptions,
    config: ConfigFile,
    seed: int,
    distributed: bool,
    hyper: Mapping[str, Any],
) -> _Seed:
    """One seed of a run over a config file's chunks: all data read and checked first."""
    torch.manual_seed(seed)  # model_fn's initial weights, then data_fn, as in `update`
    overrides = {**_overrides(options), "seed": seed, "distributed": distributed}
    updater = _config_updater(config, overrides, hyper, None, **_selection_settings(options))
    tasks = []
    for chunk in range(options.chunks or 0):
        train, val = config.data(chunk, seed)
        test = _test_tensors(config, chunk, seed, val)
        classes = tuple(sorted(set(test.tensors[1].tolist())))
        tasks.append(_ChunkTask(chunk, train, val, test, classes))
    return _Seed(
        seed, tasks, updater, torch.get_rng_state(), _for_evaluation(updater.model, config)
    )


def _run_model(
    options: _RunOptions, tasks: Sequence[Any], seed: int
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The seed's fresh model and what the manifest records of it: the command line's MLP on
    the digits scenarios (as before zoo models existed), a zoo model on the image ones."""
    classes = 1 + max(max(task.classes) for task in tasks)
    if options.scenario in IMAGE_SCENARIOS:
        spec = _zoo_spec_for_run(options, tasks, classes)
        torch.manual_seed(seed)
        return build_model(spec["name"], **spec["args"]), spec
    hidden = options.hidden or []
    inputs = tasks[0].train.tensors[0].shape[1]
    count = _parameter_count(inputs, hidden, classes)
    if count > _MAX_PARAMETERS:
        raise UsageError(
            f"--hidden {hidden} makes an MLP of {count} parameters; the command line "
            f"builds MLPs of at most {_MAX_PARAMETERS}"
        )
    torch.manual_seed(seed)
    spec = {"kind": "mlp", "inputs": inputs, "hidden": hidden, "classes": classes}
    return _mlp(inputs, hidden, classes), spec


def _prepare_seed(
    options: _RunOptions, seed: int, distributed: bool, hyper: Mapping[str, Any]
) -> _Seed:
    tasks = _scenario_tasks(options.scenario, options.data_dir, seed)
    model, spec = _run_model(options, tasks, seed)
    transforms = _spec_transforms(spec)
    learner_kwargs: dict[str, Any] = {
        "memory_size": 200 if options.memory_size is None else options.memory_size,
        "memory_batch_size": options.memory_batch_size,
        "batch_size": options.batch_size,
        "seed": seed,
    }
    method_spec = method(options.learner)
    if not method_spec.uses_memory and options.memory_size is None:
        learner_kwargs.pop("memory_size")
    if method_spec.features == "hidden" and spec["kind"] == "mlp":  # the hidden layers' outputs
        learner_kwargs["feature_modules"] = [str(2 * i + 1) for i in range(len(spec["hidden"]))]
    if method_spec.features == "last-hidden" and spec["kind"] == "mlp" and spec["hidden"]:
        # an embedding: the last hidden layer (a zoo model's: its backbone)
        learner_kwargs["feature_modules"] = [str(2 * len(spec["hidden"]) - 1)]
    learner_kwargs.update(hyper)
    _feature_modules(options.learner, learner_kwargs, model)  # a zoo model's feature modules
    try:
        updater = ModelUpdater(
            model,
            learner=options.learner,
            learner_kwargs=learner_kwargs,
            optimizer=_optimizer_spec({"name": "adam", "lr": 1e-3}, _overrides(options)),
            buffer=options.buffer or default_buffer(options.learner),
            trainer_kwargs={
                "max_epochs": options.epochs,
                "device": options.device,
                "precision": options.precision,
                **({"distributed": "init"} if distributed else {}),
            },
            metadata={"model": spec, "scenario": options.scenario},
            transforms=transforms,
        )
        updater.learner_instance  # noqa: B018 - the learner's own checks, before training
    except ValueError as exc:  # the learner's checks of a combination of options
        raise UsageError(_learner_message(exc)) from None
    return _Seed(seed, tasks, updater, torch.get_rng_state(), _evaluated(model, transforms))


def _train_seed(options: _RunOptions, plan: _Seed) -> dict[str, Any]:
    from renate_events import evaluation

    torch.set_rng_state(plan.rng_state)  # as if this seed's model had just been built
    model, tasks = plan.evaluated, plan.tasks
    class_matrix, task_matrix = evaluation.AccuracyMatrix(), evaluation.AccuracyMatrix()
    class_matrix.baseline = evaluation.evaluate(model, tasks, mode="class-incremental")
    targets = torch.cat([task.test.tensors[-1] for task in tasks])
    previous, flips = None, []
    for task in tasks:
        description = f"seed {plan.seed} task {task.task_id}"
        _progress(plan.updater.learner_instance, description, not options.no_progress)
        plan.updater.update(task.train, getattr(task, "val", None), task_id=task.task_id)
        model = _run_classifier(plan)
        class_matrix.append(evaluation.evaluate(model, tasks, mode="class-incremental"))
        task_matrix.append(evaluation.evaluate(model, tasks, mode="task-incremental"))
        current = _predictions(model, tasks)
        if previous is not None:  # flips between consecutive model versions, on all test sets
            flips.append(evaluation.regression_metrics(previous, current, targets))
        previous = current
    return _metrics(plan.seed, class_matrix, task_matrix, tasks, flips)


def _predictions(model: torch.nn.Module, tasks: Sequence[Any]) -> torch.Tensor:
    """The model's class-incremental predictions on every task's test set, one after another."""
    predicted = []
    with inference(model):
        for task in tasks:
            for logits in outputs_in_batches(model, task.test.tensors[0]):
                predicted.append(logits.argmax(dim=-1).cpu())
    return torch.cat(predicted)


_FLIPS = {
    "nfr": "negative_flip_rate",
    "nfi": "negative_flip_impact",
    "pfr": "positive_flip_rate",
    "pfi": "positive_flip_impact",
}


def _metrics(
    seed: int,
    class_matrix: Any,
    task_matrix: Any,
    tasks: Sequence[Any],
    flips: Sequence[Mapping[str, float]],
) -> dict:
    from renate_events import evaluation

    sizes = [len(task.test) for task in tasks]
    metrics = {
        "average_accuracy": evaluation.average_accuracy(class_matrix),
        "micro_average_accuracy": evaluation.micro_average_accuracy(class_matrix, sizes),
        "task_incremental_average_accuracy": evaluation.average_accuracy(task_matrix),
        "forgetting": evaluation.forgetting(class_matrix),
        "backward_transfer": evaluation.backward_transfer(class_matrix),
        "forward_transfer": evaluation.forward_transfer(class_matrix, class_matrix.baseline),
    }
    if flips:  # the mean over consecutive pairs of model versions
        for key, name in _FLIPS.items():
            metrics[name] = sum(flip[key] for flip in flips) / len(flips)
    return {
        "seed": seed,
        "class_incremental": class_matrix.to_dict(),
        "task_incremental": task_matrix.to_dict(),
        "regression": [{"update": i + 1, **flip} for i, flip in enumerate(flips)],
        "metrics": metrics,
    }


def _title(options: _RunOptions) -> str:
    if options.config_file is not None:
        return f"{os.path.basename(options.config_file)} ({options.chunks} chunks)"
    return options.scenario


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _table(options: _RunOptions, runs: Sequence[dict], elapsed: float) -> str:
    matrices = [run["class_incremental"]["rows"] for run in runs]
    size = len(matrices[0])
    lines = [
        f"{options.learner} on {_title(options)}, {len(runs)} seed(s), {elapsed:.1f} s",
        "accuracy matrix (class-incremental; row i: after update i, column j: task j; "
        "mean over seeds)",
        "          " + " ".join(f"{'task ' + str(j):>8s}" for j in range(size)),
    ]
    for i in range(size):
        cells = [sum(m[i][j] for m in matrices) / len(matrices) for j in range(size)]
        lines.append(f"update {i:<2d} " + " ".join(f"{c:8.3f}" for c in cells))
    lines.append("metric                              mean ± std")
    for name in runs[0]["metrics"]:
        mean, std = _mean_std([run["metrics"][name] for run in runs])
        lines.append(f"{name:34s} {mean:6.3f} ± {std:.3f}")
    lines.append(f"results in {options.output_dir}")
    return "\n".join(lines)


# -- run: the output folder, written all at once at the end --------------------------------------


def _state_folder(output_dir: str, seed: int) -> str:
    return os.path.join(output_dir, "state", f"seed-{seed}")


def _check_output_dir(options: _RunOptions) -> dict[int, str | None]:
    """Check before training that the results can be written; what each state folder holds now.

    Returns:
        The :func:`~renate_events.updater.state_token` of every seed's state folder.
    """
    out = os.path.abspath(options.output_dir)
    existing = out
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a folder" if not os.path.isdir(existing) else "is not writable"
        raise UsageError(f"--output-dir {options.output_dir}: {existing} {what}")
    for name in (*_RESULT_FILES, "state"):
        path = os.path.join(out, name)
        if os.path.islink(path) or (
            os.path.exists(path) and os.path.isdir(path) != (name == "state")
        ):
            raise UsageError(
                f"--output-dir {options.output_dir}: {path} is in the way of the results"
            )
    return {seed: state_token(_state_folder(out, seed)) for seed in options.seeds}


def _result_files(options: _RunOptions, runs: Sequence[dict], elapsed: float) -> dict[str, bytes]:
    """The contents of ``results.json``, ``metrics.csv`` and (with matplotlib) the heatmap."""
    config = attrs.asdict(options)
    results = json.dumps({"config": config, "seconds": elapsed, "runs": list(runs)}, indent=2)
    table = io.StringIO()
    writer = csv.writer(table, lineterminator="\n")
    writer.writerow(["seed", "metric", "value"])
    for run in runs:
        for name, value in run["metrics"].items():
            writer.writerow([run["seed"], name, f"{value:.6f}"])
    files = {"results.json": results.encode(), "metrics.csv": table.getvalue().encode()}
    heatmap = _heatmap(options, runs)
    if heatmap is not None:
        files["accuracy_matrix.png"] = heatmap
    return files


def _heatmap(options: _RunOptions, runs: Sequence[dict]) -> bytes | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None  # the heatmap is optional (pip install 'renate-events[plot]')
    rows = [run["class_incremental"]["rows"] for run in runs]
    mean = torch.tensor(rows, dtype=torch.float64).mean(dim=0)
    figure, axes = plt.subplots(figsize=(1.2 + 0.9 * mean.shape[1], 1 + 0.8 * mean.shape[0]))
    image = axes.imshow(mean.numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
    for row in range(mean.shape[0]):
        for column in range(mean.shape[1]):
            value = float(mean[row, column])
            color = "white" if value < 0.6 else "black"
            axes.text(
                column, row, f"{value:.2f}", ha="center", va="center", color=color, fontsize=8
            )
    axes.set_xlabel("evaluated on task")
    axes.set_ylabel("after update")
    axes.set_title(f"{options.learner} on {_title(options)}")
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    plt.close(figure)
    return buffer.getvalue()


def _write_file(path: str, data: bytes) -> None:
    with open(path, "xb") as handle:
        handle.write(data)
    fsync_file(path)


def _write_run(
    options: _RunOptions,
    files: Mapping[str, bytes],
    seeds: Sequence[_Seed],
    tokens: Mapping[int, str | None],
) -> None:
    """Write the results and state folders: everything, or (on any failure) nothing."""
    out = os.path.abspath(options.output_dir)
    try:
        if not os.path.exists(out):
            _write_new_folder(out, lambda folder: _fill(folder, files, seeds))
        else:
            _replace_in_folder(out, files, seeds, tokens)
    except OSError as exc:
        raise CheckpointError(
            f"could not write the results to {out}: {_one_line(exc)}; nothing was changed"
        ) from exc


def _fill(folder: str, files: Mapping[str, bytes], seeds: Sequence[_Seed]) -> None:
    """Write results and state folders into a folder that nobody else knows of yet."""
    for name, data in files.items():
        _write_file(os.path.join(folder, name), data)
    _fill_states(os.path.join(folder, "state"), seeds)


def _fill_states(folder: str, seeds: Sequence[_Seed]) -> None:
    os.makedirs(folder, exist_ok=True)
    for plan in seeds:
        plan.updater.stage_state(os.path.join(folder, f"seed-{plan.seed}"), expected=None).commit()


def _write_new_folder(target: str, fill: Callable[[str], None]) -> None:
    """Create ``target`` whole: fill a folder beside it, then rename it into place.

    Folders created above ``target`` are removed again when anything fails.
    """
    created = []
    parent = os.path.dirname(target)
    while not os.path.exists(parent):
        created.append(parent)
        parent = os.path.dirname(parent)
    staging = temporary_sibling(target, "staging")
    try:
        for folder in reversed(created):
            os.mkdir(folder)
        os.mkdir(staging)
        fill(staging)
        fsync_folder(staging)
        os.rename(staging, target)  # refused if something appeared at target meanwhile
        fsync_folder(os.path.dirname(target))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:
            if os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)
        raise


def _replace_in_folder(
    out: str, files: Mapping[str, bytes], seeds: Sequence[_Seed], tokens: Mapping[int, str | None]
) -> None:
    """Stage everything beside its destination first; then swap it all in, results.json last."""
    state_dir = os.path.join(out, "state")
    staged: list[StagedStateFolder] = []
    temporaries: dict[str, str] = {}
    try:
        if os.path.isdir(state_dir):
            for plan in seeds:
                path = _state_folder(out, plan.seed)
                staged.append(plan.updater.stage_state(path, expected=tokens[plan.seed]))
        for name, data in files.items():
            temporaries[name] = temporary_sibling(os.path.join(out, name), "tmp")
            _write_file(temporaries[name], data)
        if not os.path.isdir(state_dir):
            _write_new_folder(state_dir, lambda folder: _fill_states(folder, seeds))
    except BaseException:
        for staged_folder in staged:
            staged_folder.abort()
        for temporary in temporaries.values():
            if os.path.exists(temporary):
                os.unlink(temporary)
        raise
    for staged_folder in staged:
        staged_folder.commit()
    for name in _RESULT_FILES:
        path = os.path.join(out, name)
        if name in temporaries:
            os.replace(temporaries[name], path)
        elif os.path.isfile(path):  # an old heatmap must not pass for this run's
            os.unlink(path)
    fsync_folder(out)


# -- update and evaluate --------------------------------------------------------------------------


def _update(values: dict[str, Any], from_file: frozenset[str]) -> int:
    options = _options(_UpdateOptions, values, from_file)
    if options.config_file is not None:
        return _update_from_config(options, values, from_file)
    if options.data is None or options.input_state is None:
        raise UsageError(
            "update needs --input-state and --data, or --config-file (its data_fn gives the "
            "data; see renate-events update -h)"
        )
    for name in ("chunk_id", "metric", "early_stopping", "search"):
        if getattr(options, name) is not None:
            raise UsageError(f"--{name.replace('_', '-')} needs --config-file")
    data = _load_data_file(options.data)
    manifest = read_manifest(options.input_state, timeout=options.lock_timeout)
    learner = options.learner or manifest["learner"]
    hyper = _hyperparameter_values(values, learner, from_file, options.config)
    updater, spec = _updater_from_folder(
        options.input_state, options.lock_timeout, _overrides(options), hyper
    )
    _check_same_model(options, spec, options.input_state)
    data = _fitted(f"--data {options.data}", data, spec)
    updater.output_state_folder = options.output_state
    updater.in_place = options.in_place
    _progress(updater.learner_instance, "update", not options.no_progress)
    result = updater.update(data, task_id=options.task_id)
    loss = result.metrics.get("train_loss", math.nan)
    print(f"trained {result.steps} steps; train_loss {loss:.4f}; state in {options.output_state}")
    return 0


def _overrides(options: Any) -> dict[str, Any]:
    """The training options given (None: keep the input state's value)."""
    names = (*_TRAINING, "optimizer", "momentum", "weight_decay", "device", "precision")
    names += ("buffer_storage",)
    return {name: getattr(options, name, None) for name in names}


def _update_from_config(
    options: _UpdateOptions, values: dict[str, Any], from_file: frozenset[str]
) -> int:
    if options.data is not None:
        raise UsageError(
            "--data and --config-file: choose one; with a config file, data_fn gives the data "
            "of --chunk-id"
        )
    if options.model is not None or options.model_args is not None:
        raise UsageError(
            f"--model{'-args' if options.model is None else ''}: with --config-file, its model_fn "
            "builds the model (it may call renate_events.models.build_model); leave it out"
        )
    config = _load_config_file(options.config_file)  # type: ignore[arg-type]
    manifest = None
    if options.input_state is not None:
        manifest = read_manifest(options.input_state, timeout=options.lock_timeout)
        if not options.accept_config_change:
            check_config_file(options.input_state, manifest.get("config"), config)
    learner = options.learner or (manifest["learner"] if manifest else "der")
    hyper = _hyperparameter_values(values, learner, from_file, options.config)
    chunk = options.chunk_id if options.chunk_id is not None else (manifest or {}).get("updates", 0)
    overrides = {**_overrides(options), "seed": options.seed}
    if options.search is not None or options.search_space:
        return _search_update(options, config, manifest, overrides, hyper, chunk)
    torch.manual_seed(options.seed)  # model_fn's initial weights, then data_fn, as in `run`
    updater = _config_updater(
        config,
        overrides,
        hyper,
        manifest,
        input_state_folder=options.input_state,
        output_state_folder=options.output_state,
        in_place=options.in_place,
        lock_timeout=options.lock_timeout,
        accept_config_change=options.accept_config_change,
        **_selection_settings(options),
    )
    train, val = config.data(chunk, options.seed)
    _progress(updater.learner_instance, f"chunk {chunk}", not options.no_progress)
    task_id = options.task_id if options.task_id is not None else chunk
    result = updater.update(train, val, task_id=task_id)
    shown = "; ".join(
        f"{name} {value:.4f}" for name, value in sorted(result.metrics.items()) if name != "epoch"
    )
    print(
        f"trained {result.steps} steps on chunk {chunk}; {shown}; state in {options.output_state}"
    )
    return 0


# -- update --search ------------------------------------------------------------------------------


def _search_update(
    options: _UpdateOptions,
    config: ConfigFile,
    manifest: Mapping[str, Any] | None,
    overrides: Mapping[str, Any],
    hyper: Mapping[str, Any],
    chunk: int,
) -> int:
    """``update --search N``: N trials of this update from the same input state; the best
    trial's state, with the trials table ``search.csv``, is the output."""
    from renate_events import search

    space = search.parse_space(options.search_space, options.config or "--config")
    if options.search is None or not space:
        raise UsageError(
            "--search TRIALS and a search space go together: give --search and, in the --config "
            "TOML file, tables such as alpha = {low = 0.05, high = 1.0, log = true}"
        )
    try:
        optuna = search.require_optuna()
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    learner = overrides.get("learner") or (manifest["learner"] if manifest else "der")
    _check_space(space, learner, manifest)
    if "lr" in space and config.has("optimizer_fn"):
        raise UsageError(
            f"--search: lr: {config.path} defines optimizer_fn, which sets the learning rate; "
            "search it there (e.g. from an environment variable) or leave lr out of the space"
        )
    selection = _selection_settings(options)
    if selection["metric"] is None:
        selection.update(metric="val_loss", mode=options.mode or "min")
    task_id = options.task_id if options.task_id is not None else chunk
    runner = _TrialRunner(options, config, manifest, overrides, hyper, chunk, selection, task_id)
    current = _current_params(space, learner, manifest, overrides, hyper, config)
    _try_every_value(runner, space, current)
    runner.check_validation()
    study = _study(optuna, options, selection["mode"])
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    finished = [t for t in study.trials if t.state in done]
    if current is not None and all(t.params != current for t in finished):
        study.enqueue_trial(current)  # the settings the update would have used without a search
    if not study.trials:
        _warm_start(study, options, manifest, space, selection["mode"])
    study.optimize(
        lambda trial: runner.trial(trial, search.suggest(trial, space), optuna),
        n_trials=max(0, options.search - len(finished)),
    )
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        raise UsageError(f"--search: none of the {len(study.trials)} trials completed")
    best = study.best_trial
    updater = runner.best_updater(best)
    updater.write_output({search.SEARCH_FILE: search.trials_table(study)})
    steps = sum(int(t.user_attrs.get("steps", 0)) for t in study.trials)
    pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials)
    print(
        f"searched {len(study.trials)} trials ({pruned} pruned, {steps} steps in all); best "
        f"trial {best.number}: {selection['metric']} {best.value:.4f} with {best.params}; "
        f"state in {options.output_state}"
    )
    return 0


def _check_space(space: Mapping[str, Any], learner: str, manifest: Any) -> None:
    """Every name in the space is an option or a hyperparameter, every value of the right kind."""
    from renate_events import search

    learners = (
        list(space["learner"].choices)
        if isinstance(space.get("learner"), search.Choice)
        else [learner]
    )
    _check_option_ranges(space)
    for name in sorted(space):
        if manifest is not None and name in ("learner", "buffer", "memory_size"):
            raise UsageError(
                f"--search: {name} shapes the stored state and cannot change on a later update; "
                "search it on the first update"
            )
        if name in search.OPTIONS:
            continue
        for candidate in learners:
            parameter = space[name]
            values = (
                parameter.choices
                if isinstance(parameter, search.Choice)
                else (parameter.low, parameter.high)
            )
            for value in values:
                try:
                    check_value(candidate, name, value)
                except HyperparameterError as exc:
                    raise UsageError(f"--search: {exc}") from None


def _try_every_value(runner: Any, space: Mapping[str, Any], current: Any) -> None:
    """Build (not train) an updater with every choice and both ends of every range, so that a
    value the learner refuses is an error before the first trial."""
    from renate_events import search

    for name, parameter in space.items():
        if isinstance(parameter, search.Choice):
            values: tuple[Any, ...] = parameter.choices
        else:
            values = (parameter.low, parameter.high)
        for value in values:
            try:
                runner.updater({**(current or {}), name: value})
            except UsageError as exc:
                raise UsageError(f"--search: {name} = {value!r} is refused: {exc}") from None


def _check_option_ranges(space: Mapping[str, Any]) -> None:
    """The searched options' values are ones the command line accepts."""
    from renate_events import search

    names = {"learner": sorted(LEARNERS), "buffer": sorted(BUFFERS)}
    for name, allowed in names.items():
        parameter = space.get(name)
        if parameter is None:
            continue
        bad = [c for c in getattr(parameter, "choices", (None,)) if c not in allowed]
        if bad:
            raise UsageError(f"--search: {name} choice {bad[0]!r} is not one of {allowed}")
    lowest = {"lr": 0.0, "epochs": 1, "batch_size": 1, "memory_batch_size": 1, "memory_size": 0}
    for name, low in lowest.items():
        parameter = space.get(name)
        values = getattr(parameter, "choices", None) or (getattr(parameter, "low", None),)
        if parameter is not None and any(not checks.is_real(v) or v < low for v in values):
            raise UsageError(f"--search: {name} must be a number >= {low} in every trial")
        if isinstance(parameter, search.FloatRange) and name != "lr":
            raise UsageError(f"--search: {name} is an int: give int low and high")


def _study(optuna: Any, options: _UpdateOptions, mode: str) -> Any:
    from renate_events import search

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our errors are one line
    try:
        return search.create_study(
            optuna,
            mode=mode,
            seed=options.seed,
            storage=options.search_storage,
            name=options.search_study,
            pruner=options.search_pruner,
        )
    except Exception as exc:  # Optuna raises many kinds for a storage it cannot open
        raise UsageError(
            f"--search-storage {options.search_storage}: cannot open it ({type(exc).__name__}: "
            f"{_one_line(exc)})"
        ) from None


def _current_params(
    space: Mapping[str, Any],
    learner: str,
    manifest: Any,
    overrides: Mapping[str, Any],
    hyper: Mapping[str, Any],
    config: ConfigFile,
) -> dict[str, Any] | None:
    """What the update would use without a search, for every searched name; None when any of
    them lies outside the space (then the search need not try it)."""
    from renate_events import search

    _, _, kwargs = _learner_settings(overrides, hyper, manifest)
    trainer = _trainer_setting(overrides, manifest, None)
    optimizer = _optimizer_setting(overrides, manifest, config).get("optimizer", {})
    known = {
        **{name: entry.default for name, entry in hyperparameters(learner).items()},
        **kwargs,
        "lr": optimizer.get("lr", 1e-3),
        "epochs": trainer.get("max_epochs"),
        "learner": learner,
        "buffer": overrides.get("buffer")
        or (manifest["buffer"] if manifest else default_buffer(learner)),
    }
    current = {name: known.get(name) for name in space}
    inside = all(
        value in parameter.choices
        if isinstance(parameter, search.Choice)
        else checks.is_real(value) and parameter.low <= value <= parameter.high
        for value, parameter in ((current[name], space[name]) for name in space)
    )
    return current if inside else None


def _warm_start(
    study: Any, options: _UpdateOptions, manifest: Any, space: Mapping[str, Any], mode: str
) -> None:
    """Try the input state's best earlier configurations first (once per study)."""
    from renate_events import search

    if manifest is None or search.SEARCH_FILE not in manifest["files"]:
        return
    path = os.path.join(options.input_state or "", search.SEARCH_FILE)
    with open(path, encoding="utf-8") as handle:
        for params in search.earlier_best(handle.read(), space, mode):
            study.enqueue_trial(params)


@attrs.define(eq=False)
class _TrialRunner:
    """Builds and trains one trial's updater; keeps the best one's in memory."""

    options: _UpdateOptions
    config: ConfigFile
    manifest: Any
    overrides: Mapping[str, Any]
    hyper: Mapping[str, Any]
    chunk: int
    selection: dict[str, Any]
    task_id: Any
    kept: dict[int, ModelUpdater] = attrs.field(factory=dict)

    def check_validation(self) -> None:
        """The metric needs validation data that reports it: said before any trial."""
        _, val = self.config.data(self.chunk, self.options.seed)
        kept = self.manifest is not None and self.manifest.get("validation_memory", False)
        metric = self.selection["metric"]
        if val is None and not (kept and self.selection["validation_memory"]):
            raise UsageError(
                f"--search compares trials by {metric}, a validation metric: make data_fn return "
                "(train, validation)"
            )
        reported = ["val_loss", "val_accuracy", *(f"val_{m}" for m in self.config.metrics())]
        if metric not in reported:
            raise UsageError(
                f"--metric {metric!r} is not reported by validation; it reports {reported}"
            )

    def trial(self, trial: Any, params: Mapping[str, Any], optuna: Any) -> float:
        from renate_events import search

        updater = self.updater(params)
        pruner = search.TrialPruner(trial, self.selection["metric"])
        trainer = updater.learner_instance.trainer
        with trainer.subscribed(pruner, name="_trial_pruner"):
            train, val = self.config.data(self.chunk, self.options.seed)
            result = updater.update(train, val, task_id=self.task_id, write=False)
        trial.set_user_attr("steps", int(result.steps))
        if pruner.pruned:
            raise optuna.TrialPruned()
        value = float(updater.history[-1]["best"]["value"])
        best = min if self.selection["mode"] == "min" else max
        if not self.kept or best(value, self._kept_value()) == value:
            self.kept = {trial.number: updater}
        trial.set_user_attr("value", value)
        return value

    def _kept_value(self) -> float:
        (updater,) = self.kept.values()
        return float(updater.history[-1]["best"]["value"])

    def best_updater(self, best: Any) -> ModelUpdater:
        """The best trial's updater: kept, or trained again from its parameters when another
        process ran it (an interrupted search, or another worker on the same storage)."""
        if best.number in self.kept:
            return self.kept[best.number]
        updater = self.updater(best.params)
        train, val = self.config.data(self.chunk, self.options.seed)
        updater.update(train, val, task_id=self.task_id, write=False)
        return updater

    def updater(self, params: Mapping[str, Any]) -> ModelUpdater:
        from renate_events import search

        overrides, hyper = dict(self.overrides), dict(self.hyper)
        for name, value in params.items():
            (overrides if name in search.OPTIONS else hyper)[name] = value
        torch.manual_seed(self.options.seed)  # every trial starts from the same weights
        return _config_updater(
            self.config,
            overrides,
            hyper,
            self.manifest,
            input_state_folder=self.options.input_state,
            output_state_folder=self.options.output_state,
            in_place=self.options.in_place,
            lock_timeout=self.options.lock_timeout,
            accept_config_change=self.options.accept_config_change,
            **self.selection,
        )


def _evaluate(values: dict[str, Any], from_file: frozenset[str]) -> int:
    from renate_events import evaluation
    from renate_events.scenarios import Task

    options = _options(_EvaluateOptions, values)
    if options.scenario is not None or options.data_dir is not None:
        _check_data_dir(options.scenario, options.data_dir)
    if options.config_file is not None:
        return _evaluate_from_config(options)
    if options.chunk_ids is not None:
        raise UsageError("--chunk-ids needs --config-file")
    if options.data is not None:
        data = _load_data_file(options.data)
    updater, spec = _updater_from_folder(options.state)
    classifier = _classifier(updater.learner_instance, options.classifier, options.state)
    model = _evaluated(classifier, updater.transforms)
    if options.data is not None:
        data = _fitted(f"--data {options.data}", data, spec)
        classes = tuple(sorted(set(data.tensors[1].tolist())))
        tasks = [Task(task_id=0, train=data, test=data, classes=classes)]
    else:
        tasks = _scenario_tasks(options.scenario, options.data_dir, options.seed)
        for task in tasks:  # every task's labels: a later task may exceed the model's classes
            _fitted(f"--scenario {options.scenario}", task.test, spec)
    accuracies = evaluation.evaluate(model, tasks, mode="class-incremental")
    for task, accuracy in zip(tasks, accuracies):
        print(f"task {task.task_id}: accuracy {accuracy:.4f} ({len(task.test)} samples)")
    print(f"average accuracy {sum(accuracies) / len(accuracies):.4f}")
    return 0


def _evaluate_from_config(options: _EvaluateOptions) -> int:
    from renate_events import evaluation

    config = _load_config_file(options.config_file)  # type: ignore[arg-type]
    manifest = read_manifest(options.state)
    updater = _config_updater(
        config,
        {},
        {},
        manifest,
        input_state_folder=options.state,
        validation_memory=manifest.get("validation_memory", False),
        accept_config_change=options.accept_config_change,
    )
    model = _for_evaluation(
        _classifier(updater.learner_instance, options.classifier, options.state), config
    )
    chunks = options.chunk_ids or list(range(manifest["updates"]))
    tasks = []
    for chunk in chunks:
        val = None if config.has("test_data_fn") else config.data(chunk, options.seed)[1]
        test = _test_tensors(config, chunk, options.seed, val)
        classes = tuple(sorted(set(test.tensors[1].tolist())))
        tasks.append(_ChunkTask(chunk, None, None, test, classes))
    accuracies = evaluation.evaluate(model, tasks, mode="class-incremental")
    metrics = config.metrics()
    for task, accuracy in zip(tasks, accuracies):
        extra = _metric_means(model, task.test, metrics)
        shown = "".join(f"; {name} {value:.4f}" for name, value in extra.items())
        print(f"chunk {task.task_id}: accuracy {accuracy:.4f}{shown} ({len(task.test)} samples)")
    print(f"average accuracy {sum(accuracies) / len(accuracies):.4f}")
    return 0


def _classifier(learner: Any, classifier: str, state: str) -> torch.nn.Module:
    """The learner's model (``logits``) or its nearest-mean-of-exemplars classifier (``nme``,
    for the methods whose spec names that classifier)."""
    if classifier == "logits":
        return learner.model
    spec = method_of(learner)
    if spec is None or spec.classifier != "nme":
        names = sorted(name for name, other in METHODS.items() if other.classifier == "nme")
        raise UsageError(
            f"--classifier nme needs a state folder of --learner {' or '.join(names)}; {state} "
            f"holds a {type(learner).__name__}"
        )
    try:
        return learner.nme_classifier()
    except ValueError as exc:
        raise UsageError(f"--classifier nme: {exc}") from None


def _run_classifier(plan: Any) -> torch.nn.Module:
    """What ``run`` evaluates after an update: the method's own classifier (the nearest mean of
    exemplars for an ``nme`` method once it has class means, with the config file's test
    transform, if any), else the model."""
    learner = plan.updater.learner_instance
    spec = method_of(learner)
    if spec is None or spec.classifier != "nme":
        return plan.evaluated
    try:
        nme = learner.nme_classifier()
    except ValueError:  # no class means yet: nothing was trained
        return plan.evaluated
    evaluated = plan.evaluated
    return _Transformed(nme, evaluated.transform) if isinstance(evaluated, _Transformed) else nme


# -- shift ----------------------------------------------------------------------------------------


def _shift(values: dict[str, Any], from_file: frozenset[str]) -> int:
    from renate_events import shift

    options = _options(_ShiftOptions, values)
    if options.state is None and (options.feature_module or options.config_file):
        raise UsageError("--feature-module and --config-file need --state")
    reference = _shift_inputs("--reference", options.reference)
    query = _shift_inputs("--query", options.query)
    extractor = None if options.state is None else _feature_extractor(options)
    if extractor is not None:
        for flag, data in (("--reference", reference), ("--query", query)):
            _check_extractor(extractor, flag, data)
    detector: shift.ShiftDetectorWithFeatureExtractor
    if options.detector == "mmd":
        detector = shift.MMDCovariateShiftDetector(
            feature_extractor=extractor,
            num_permutations=options.num_permutations,
            max_samples=options.max_samples,
            seed=options.seed,
        )
    else:
        detector = shift.KolmogorovSmirnovCovariateShiftDetector(feature_extractor=extractor)
    detector.fit(reference)
    result = detector.test(query, level=options.level)
    decision = "shift detected" if result.shift else "no shift detected"
    print(
        f"{options.detector}: statistic {result.statistic:.6g}, p-value {result.p_value:.4g} "
        f"({len(reference)} reference and {len(query)} query samples); {decision} at level "
        f"{options.level:g}"
    )
    return 0


def _shift_inputs(flag: str, path: str) -> torch.utils.data.TensorDataset:
    tensors = _read_tensors(flag, path)
    if "inputs" not in tensors:
        raise UsageError(f"{flag} {path} lacks 'inputs'; it holds {sorted(tensors)}")
    inputs = tensors["inputs"]
    if inputs.dim() == 0 or inputs.dtype.is_complex or inputs.dtype == torch.bool:
        raise UsageError(f"{flag} {path}: 'inputs' must be real numbers, one row per sample")
    if inputs.dtype.is_floating_point and not bool(torch.isfinite(inputs).all()):
        raise UsageError(f"{flag} {path}: 'inputs' holds NaN or infinite values")
    return torch.utils.data.TensorDataset(inputs.float())


def _check_extractor(
    extractor: torch.nn.Module, flag: str, data: torch.utils.data.TensorDataset
) -> None:
    """The state's model on two of the samples: a mismatch is one line, with the shapes."""
    sample = data.tensors[0][:2]
    try:
        with inference(extractor):
            extractor(sample)
    except Exception as exc:
        raise UsageError(
            f"{flag}: the state folder's model does not accept its samples (float32 "
            f"{tuple(sample.shape[1:])}): {type(exc).__name__}: {_one_line(exc)}"
        ) from None


class _ModuleOutput(torch.nn.Module):
    """The output of ``model``'s submodule ``name`` when ``model`` runs (a forward hook)."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        super().__init__()
        self.model, self.name = model, name
        self.module = dict(model.named_modules())[name]

    def forward(self, inputs: Any) -> torch.Tensor:
        captured: list[torch.Tensor] = []
        handle = self.module.register_forward_hook(lambda _m, _i, out: captured.append(out))
        try:
            self.model(inputs)
        finally:
            handle.remove()
        return captured[-1]


def _feature_extractor(options: _ShiftOptions) -> torch.nn.Module:
    """The state folder's model, or its submodule ``--feature-module``."""
    state = options.state or ""
    if options.config_file is not None:
        manifest = read_manifest(state)
        config = _load_config_file(options.config_file)
        updater = _config_updater(
            config,
            {},
            {},
            manifest,
            input_state_folder=state,
            validation_memory=manifest.get("validation_memory", False),
            accept_config_change=options.accept_config_change,
        )
    else:
        updater, _ = _updater_from_folder(state)
    model = updater.learner_instance.model
    if options.feature_module is None:
        return model
    names = [name for name, _ in model.named_modules() if name]
    if options.feature_module not in names:
        raise UsageError(
            f"--feature-module {options.feature_module!r}: the model has no such submodule; it "
            f"has {names[:20]}{' ...' if len(names) > 20 else ''}"
        )
    return _ModuleOutput(model, options.feature_module)


_COMMANDS: dict[str, Callable[[dict[str, Any], frozenset[str]], int]] = {
    "run": _run,
    "update": _update,
    "evaluate": _evaluate,
    "shift": _shift,
}

_EXPECTED = (
    UsageError,
    StateFolderError,
    CheckpointError,
    NonFiniteLossError,
    ConfigError,
    UpdateInputError,
    ShiftDetectionError,
    SearchSpaceError,
)
"""What a bad argument, file, state folder or full disk raises: one line, exit status 2. Anything
else is a bug and keeps its traceback."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``renate-events`` console script; returns the exit status."""
    try:
        command, values, from_file = _parse(argv)
        return _COMMANDS[command](values, from_file)
    except _EXPECTED as exc:
        print(f"renate-events: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except ListenerError as exc:  # a mapped buffer's file failing in training: a full disk
        if not isinstance(exc.__cause__, MappedFileError):
            raise
        print(f"renate-events: error: {_one_line(exc.__cause__)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("renate-events: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
