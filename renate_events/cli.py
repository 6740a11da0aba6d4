"""The ``renate-events`` command: run a scenario, update a state folder, evaluate one.

Examples::

    renate-events run                                   # Split-Digits, DER++, buffer 200
    renate-events run --learner er --seeds 0 1 2 --output-dir runs/er
    renate-events run --config experiment.toml --epochs 5   # flags override the file
    renate-events update --input-state runs/er/state/seed-0 --data new.npz \\
        --output-state runs/er/next
    renate-events evaluate --state runs/er/next --scenario split-digits

Every option is checked against a typed schema (the ``_*Options`` classes) before anything is
trained or written; a bad option, file or state folder is one line on standard error and exit
status 2.
"""

from __future__ import annotations

import argparse
import csv
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

from renate_events.scenarios import SCENARIOS
from renate_events.updater import (
    BUFFERS,
    LEARNERS,
    ModelUpdater,
    StagedStateFolder,
    StateFolderError,
    read_manifest,
    state_token,
)
from trainer import CheckpointError, NonFiniteLossError
from trainer import validators as checks
from trainer.files import fsync_file, fsync_folder, temporary_sibling

__all__ = ["main"]

_PRECISIONS = ("32", "bf16-mixed", "16-mixed")
_MAX_PARAMETERS = 10**9  # 4 GB of float32: the command line builds small MLPs
_MAX_SEED = 2**63
_RESULT_FILES = ("metrics.csv", "accuracy_matrix.png", "results.json")  # results.json last


class UsageError(Exception):
    """A bad argument or input file: reported in one line with exit code 2."""


# -- the parser ---------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as :class:`UsageError` (one line) instead of usage text."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} -h)")


def _training_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--learner",
        choices=sorted(LEARNERS),
        default="der",
        help="continual-learning method (default: der, i.e. DER++)",
    )
    p.add_argument(
        "--buffer", choices=list(BUFFERS), default="reservoir", help="memory buffer type"
    )
    p.add_argument("--memory-size", type=int, default=200, help="buffer slots (default 200)")
    p.add_argument("--epochs", type=int, default=10, help="epochs per update (default 10)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--batch-size", type=int, default=32, help="new-data batch (default 32)")
    p.add_argument("--memory-batch-size", type=int, default=32, help="memory batch (default 32)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda:0")
    p.add_argument(
        "--precision",
        choices=_PRECISIONS,
        default="32",
        help="floating-point precision of training (default 32)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _run_parser(sub: Any) -> argparse.ArgumentParser:
    run = sub.add_parser(
        "run",
        help="run a whole scenario, evaluating after each update",
        description="Run a scenario: one update per task, evaluation on every task after each.",
        epilog="examples:\n  renate-events run\n  renate-events run --learner er --seeds 0 1 2\n"
        "  renate-events run --config experiment.toml --epochs 5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--config", help="TOML file with any of these options (flags override it)")
    run.add_argument(
        "--scenario",
        default="split-digits",
        help="split-digits (default), permuted-digits or rotated-digits",
    )
    run.add_argument("--seeds", type=int, nargs="+", default=[0], help="one or several seeds")
    run.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[256],
        help="hidden layer sizes of the MLP (default 256)",
    )
    run.add_argument("--output-dir", default="runs/latest", help="where results are written")
    _training_options(run)
    return run


def _update_parser(sub: Any) -> argparse.ArgumentParser:
    update = sub.add_parser(
        "update",
        help="one model update from a state folder and a data file",
        description="Load --input-state, train on --data, write --output-state.",
        epilog="example:\n  renate-events update --input-state runs/latest/state/seed-0 "
        "--data new.npz --output-state next-state",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    update.add_argument("--input-state", required=True, help="a state folder written by run/update")
    update.add_argument(
        "--data", required=True, help=".safetensors or .npz file with 'inputs' and 'targets'"
    )
    update.add_argument(
        "--output-state",
        required=True,
        help="the state folder to write: new, empty, or a state folder (never anything else)",
    )
    update.add_argument(
        "--in-place", action="store_true", help="allow --output-state to be --input-state"
    )
    update.add_argument("--task-id", default=None, help="a name for this update")
    update.add_argument("--epochs", type=int, default=None, help="override the folder's epochs")
    update.add_argument("--device", default=None, help="override the folder's device")
    update.add_argument(
        "--lock-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for another update of the same folder (default 60)",
    )
    update.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return update


def _evaluate_parser(sub: Any) -> argparse.ArgumentParser:
    evaluate = sub.add_parser(
        "evaluate",
        help="evaluate a state folder on a data file or a scenario",
        description="Print the accuracy of a state folder's model.",
        epilog="examples:\n  renate-events evaluate --state next-state --data test.npz\n"
        "  renate-events evaluate --state next-state --scenario split-digits",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("--state", required=True, help="a state folder")
    group = evaluate.add_mutually_exclusive_group(required=True)
    group.add_argument("--data", help=".safetensors or .npz file with 'inputs' and 'targets'")
    group.add_argument("--scenario", help="evaluate on every task's test set of this scenario")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of the scenario's split")
    return evaluate


def _parser() -> _Parser:
    from renate_events import __version__

    parser = _Parser(
        prog="renate-events",
        description="Continual learning with experience replay on the event-driven trainer.",
        epilog="examples:" + __doc__.split("Examples::", 1)[1].split("\n\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"renate-events {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,update,evaluate}")
    parser.commands = {
        "run": _run_parser(sub),
        "update": _update_parser(sub),
        "evaluate": _evaluate_parser(sub),
    }
    return parser


# -- options: argparse, then the TOML file, then one typed check of everything -----------------


def _parse(argv: Sequence[str] | None) -> tuple[str, dict[str, Any], frozenset[str]]:
    """The command, its options (defaults, then ``--config``, then flags) and which of them came
    from the ``--config`` file."""
    args = vars(_parser().parse_args(argv))
    command = args.pop("command")
    from_file: set[str] = set()
    if command == "run" and args["config"] is not None:
        given = _given_on_the_command_line(argv, command)
        values = _read_config(args["config"], set(args))
        from_file = set(values) - given
        args.update({name: values[name] for name in from_file})
    return command, args, frozenset(from_file)


def _given_on_the_command_line(argv: Sequence[str] | None, command: str) -> set[str]:
    parser = _parser()
    for action in parser.commands[command]._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command"}


def _read_config(path: str, options: set[str]) -> dict[str, Any]:
    """The options of a ``--config`` TOML file, under their argparse names (not yet checked)."""
    config = _read_toml(path)
    allowed = options - {"config"}
    values: dict[str, Any] = {}
    for key, value in config.items():
        name = key.replace("-", "_")
        if name not in allowed:
            raise UsageError(
                f"{path}: unknown options [{key!r}]; see renate-events run -h for the options"
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


@attrs.frozen
class _RunOptions:
    """The options of ``renate-events run``, as argparse names them."""

    config: str | None = attrs.field(validator=_optional(_text))
    scenario: str = attrs.field(validator=checks.one_of(*sorted(SCENARIOS)))
    seeds: list[int] = attrs.field(
        validator=_list_of_ints(0, _MAX_SEED, empty=False, distinct=True)
    )
    hidden: list[int] = attrs.field(validator=_list_of_ints(1, None, empty=True, distinct=False))
    output_dir: str = attrs.field(validator=_text)
    learner: str = attrs.field(validator=checks.one_of(*sorted(LEARNERS)))
    buffer: str = attrs.field(validator=checks.one_of(*BUFFERS))
    memory_size: int = attrs.field(validator=checks.int_at_least(0))
    epochs: int = attrs.field(validator=checks.int_at_least(1))
    lr: float = attrs.field(validator=checks.real_in_range(0.0, low_open=True))
    batch_size: int = attrs.field(validator=checks.int_at_least(1))
    memory_batch_size: int = attrs.field(validator=checks.int_at_least(1))
    device: str = attrs.field(validator=_device)
    precision: str = attrs.field(validator=checks.one_of(*_PRECISIONS))
    no_progress: bool = attrs.field(validator=checks.boolean)


@attrs.frozen
class _UpdateOptions:
    """The options of ``renate-events update``."""

    input_state: str = attrs.field(validator=_text)
    data: str = attrs.field(validator=_text)
    output_state: str = attrs.field(validator=_text)
    in_place: bool = attrs.field(validator=checks.boolean)
    task_id: str | None = attrs.field(validator=_optional(_text))
    epochs: int | None = attrs.field(validator=checks.int_at_least(1, optional=True))
    device: str | None = attrs.field(validator=_optional(_device))
    lock_timeout: float = attrs.field(validator=checks.real_in_range(0.0))
    no_progress: bool = attrs.field(validator=checks.boolean)


@attrs.frozen
class _EvaluateOptions:
    """The options of ``renate-events evaluate``."""

    state: str = attrs.field(validator=_text)
    data: str | None = attrs.field(validator=_optional(_text))
    scenario: str | None = attrs.field(validator=_optional(checks.one_of(*sorted(SCENARIOS))))
    seed: int = attrs.field(validator=checks.int_at_least(0, _MAX_SEED))


def _options(
    schema: type, values: Mapping[str, Any], from_file: frozenset[str] = frozenset()
) -> Any:
    """Check ``values`` against ``schema``; a failure names the option as the user wrote it."""
    try:
        return schema(**values)
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
    """``inputs`` (N, features) and integer ``targets`` (N,) from a .safetensors or .npz file."""
    if not os.path.isfile(path):
        raise UsageError(f"--data {path}: no such file")
    if path.endswith(".safetensors"):
        tensors = _read_safetensors(path)
    elif path.endswith(".npz"):
        tensors = _read_npz(path)
    else:
        raise UsageError(f"--data {path}: expected a .safetensors or .npz file")
    missing = {"inputs", "targets"} - set(tensors)
    if missing:
        raise UsageError(f"--data {path} lacks {sorted(missing)}; it holds {sorted(tensors)}")
    return torch.utils.data.TensorDataset(
        _inputs(path, tensors["inputs"]), _targets(path, tensors["targets"])
    )


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    import safetensors.torch

    try:
        return safetensors.torch.load_file(path)
    except (safetensors.SafetensorError, OSError, ValueError) as exc:
        raise UsageError(f"--data {path} is not a readable safetensors file: {exc}") from exc


def _read_npz(path: str) -> dict[str, torch.Tensor]:
    try:
        import numpy
    except ImportError as exc:
        raise UsageError(".npz files need numpy: pip install numpy") from exc
    if not zipfile.is_zipfile(path):
        raise UsageError(f"--data {path} is not a readable .npz file (not a zip archive)")
    arrays = {}
    try:
        with numpy.load(path, allow_pickle=False) as archive:
            for key in archive.files:
                array = archive[key]
                if array.dtype.kind not in "biuf":
                    raise UsageError(
                        f"--data {path}: {key!r} holds {array.dtype} values; it must hold numbers"
                    )
                arrays[key] = torch.from_numpy(
                    array.astype(numpy.float64 if array.dtype.kind == "f" else numpy.int64)
                )
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise UsageError(f"--data {path} is not a readable .npz file: {exc}") from exc
    return arrays


def _inputs(path: str, inputs: torch.Tensor) -> torch.Tensor:
    if inputs.dim() != 2 or len(inputs) == 0:
        raise UsageError(
            f"--data {path}: 'inputs' must have the shape (samples, features) with at least one "
            f"sample, got {tuple(inputs.shape)}; flatten images first"
        )
    if inputs.dtype.is_complex or not (inputs.dtype.is_floating_point or _is_integer(inputs)):
        raise UsageError(f"--data {path}: 'inputs' holds {inputs.dtype} values, not real numbers")
    inputs = inputs.float()
    if not bool(torch.isfinite(inputs).all()):
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


def _check_fits(what: str, data: torch.utils.data.TensorDataset, spec: Mapping[str, Any]) -> None:
    """The data (``what``: where it comes from) fits the model: its features, its labels."""
    inputs, targets = data.tensors
    if len(inputs) != len(targets):
        raise UsageError(
            f"{what}: 'inputs' and 'targets' must have the same length, got {len(inputs)} "
            f"and {len(targets)}"
        )
    if inputs.shape[1] != spec["inputs"]:
        raise UsageError(
            f"{what}: the samples have {inputs.shape[1]} features; the state folder's model "
            f"takes {spec['inputs']}"
        )
    low, high = int(targets.min()), int(targets.max())
    if low < 0 or high >= spec["classes"]:
        raise UsageError(
            f"{what}: the labels range over [{low}, {high}]; the state folder's model has "
            f"{spec['classes']} classes (labels 0..{spec['classes'] - 1})"
        )


# -- state folders written by the command line --------------------------------------------------


def _model_spec(folder: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The MLP that ``metadata.model`` describes, checked against the manifest's ``model``.

    The checkpoint holds the model's parameters, so a description that would need more bytes than
    the checkpoint has is refused before anything is allocated.
    """
    path = os.path.join(folder, "manifest.json")
    spec = manifest["metadata"].get("model")
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


def _updater_from_folder(folder: str, lock_timeout: float = 60.0, **overrides: Any) -> Any:
    """A :class:`ModelUpdater` with the folder's MLP, loaded; everything checked first."""
    manifest = read_manifest(folder, timeout=lock_timeout)
    spec = _model_spec(folder, manifest)
    trainer_kwargs = dict(manifest["trainer"])
    trainer_kwargs.update({k: v for k, v in overrides.items() if v is not None})
    if "device" in trainer_kwargs and overrides.get("device") is None:
        _check_device(
            f"{folder}: the trainer device (override it with --device)", trainer_kwargs["device"]
        )
    try:
        updater = ModelUpdater(
            _mlp(spec["inputs"], spec["hidden"], spec["classes"]),
            learner=manifest["learner"],
            learner_kwargs=manifest["learner_kwargs"],
            optimizer=manifest["optimizer"],
            buffer=manifest["buffer"],
            trainer_kwargs=trainer_kwargs,
            metadata=manifest["metadata"],
            input_state_folder=folder,
            lock_timeout=lock_timeout,
        )
        updater.learner_instance  # noqa: B018 - builds and loads, so that errors come now
    except StateFolderError:
        raise
    except ValueError as exc:  # the learner's or the trainer's checks of the folder's values
        raise StateFolderError(f"{folder}: its manifest is refused: {exc}") from None
    return updater, spec


# -- run ------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Seed:
    """One seed of a run: its tasks and its updater, built (and so checked) before any training."""

    seed: int
    tasks: list[Any]
    updater: ModelUpdater
    rng_state: torch.Tensor


def _run(values: dict[str, Any], from_file: frozenset[str]) -> int:
    options = _options(_RunOptions, values, from_file)
    if options.learner in ("pod-er", "super-er") and not options.hidden:
        raise UsageError(f"--learner {options.learner} distils hidden layers: give --hidden sizes")
    # Under `torchrun --nproc_per_node=N`: data-parallel training over N processes; rank zero
    # prints and writes the results. State folders are not written (their staging folders are
    # per process), so `run` under torchrun keeps no state between invocations.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank_zero = int(os.environ.get("RANK", "0")) == 0
    tokens = None if distributed else _check_output_dir(options)
    seeds = [_prepare_seed(options, seed, distributed) for seed in options.seeds]
    started = time.perf_counter()
    runs = [_train_seed(options, plan) for plan in seeds]
    elapsed = time.perf_counter() - started
    if rank_zero:
        files = _result_files(options, runs, elapsed)
        if tokens is not None:
            _write_run(options, files, seeds, tokens)
        print(_table(options, runs, elapsed))
    return 0


def _prepare_seed(options: _RunOptions, seed: int, distributed: bool) -> _Seed:
    try:
        tasks = list(SCENARIOS[options.scenario](seed=seed).tasks())
    except ImportError as exc:
        raise UsageError(f"--scenario {options.scenario}: {exc}") from None
    inputs = tasks[0].train.tensors[0].shape[1]
    classes = 1 + max(max(task.classes) for task in tasks)
    count = _parameter_count(inputs, options.hidden, classes)
    if count > _MAX_PARAMETERS:
        raise UsageError(
            f"--hidden {options.hidden} makes an MLP of {count} parameters; the command line "
            f"builds MLPs of at most {_MAX_PARAMETERS}"
        )
    torch.manual_seed(seed)
    model = _mlp(inputs, options.hidden, classes)
    learner_kwargs: dict[str, Any] = {
        "memory_size": options.memory_size,
        "memory_batch_size": options.memory_batch_size,
        "batch_size": options.batch_size,
        "seed": seed,
    }
    if options.learner in ("fine-tuning", "joint"):
        learner_kwargs.pop("memory_size")
    if options.learner in ("pod-er", "super-er"):  # distil the outputs of the hidden layers
        learner_kwargs["feature_modules"] = [str(2 * i + 1) for i in range(len(options.hidden))]
    try:
        updater = ModelUpdater(
            model,
            learner=options.learner,
            learner_kwargs=learner_kwargs,
            optimizer={"name": "adam", "lr": options.lr},
            buffer=options.buffer,
            trainer_kwargs={
                "max_epochs": options.epochs,
                "device": options.device,
                "precision": options.precision,
                **({"distributed": "init"} if distributed else {}),
            },
            metadata={
                "model": {
                    "kind": "mlp",
                    "inputs": inputs,
                    "hidden": options.hidden,
                    "classes": classes,
                },
                "scenario": options.scenario,
            },
        )
        updater.learner_instance  # noqa: B018 - the learner's own checks, before training
    except ValueError as exc:  # the learner's checks of a combination of options
        raise UsageError(_one_line(exc)) from None
    return _Seed(seed, tasks, updater, torch.get_rng_state())


def _train_seed(options: _RunOptions, plan: _Seed) -> dict[str, Any]:
    from renate_events import evaluation

    torch.set_rng_state(plan.rng_state)  # as if this seed's model had just been built
    model, tasks = plan.updater.model, plan.tasks
    class_matrix, task_matrix = evaluation.AccuracyMatrix(), evaluation.AccuracyMatrix()
    class_matrix.baseline = evaluation.evaluate(model, tasks, mode="class-incremental")
    for task in tasks:
        description = f"seed {plan.seed} task {task.task_id}"
        _progress(plan.updater.learner_instance, description, not options.no_progress)
        plan.updater.update(task.train, task_id=task.task_id)
        class_matrix.append(evaluation.evaluate(model, tasks, mode="class-incremental"))
        task_matrix.append(evaluation.evaluate(model, tasks, mode="task-incremental"))
    return _metrics(plan.seed, class_matrix, task_matrix, tasks)


def _metrics(seed: int, class_matrix: Any, task_matrix: Any, tasks: Sequence[Any]) -> dict:
    from renate_events import evaluation

    sizes = [len(task.test) for task in tasks]
    return {
        "seed": seed,
        "class_incremental": class_matrix.to_dict(),
        "task_incremental": task_matrix.to_dict(),
        "metrics": {
            "average_accuracy": evaluation.average_accuracy(class_matrix),
            "micro_average_accuracy": evaluation.micro_average_accuracy(class_matrix, sizes),
            "task_incremental_average_accuracy": evaluation.average_accuracy(task_matrix),
            "forgetting": evaluation.forgetting(class_matrix),
            "backward_transfer": evaluation.backward_transfer(class_matrix),
            "forward_transfer": evaluation.forward_transfer(class_matrix, class_matrix.baseline),
        },
    }


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _table(options: _RunOptions, runs: Sequence[dict], elapsed: float) -> str:
    matrices = [run["class_incremental"]["rows"] for run in runs]
    size = len(matrices[0])
    lines = [
        f"{options.learner} on {options.scenario}, {len(runs)} seed(s), {elapsed:.1f} s",
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
    axes.set_title(f"{options.learner} on {options.scenario}")
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
    options = _options(_UpdateOptions, values)
    data = _load_data_file(options.data)
    updater, spec = _updater_from_folder(
        options.input_state, options.lock_timeout, max_epochs=options.epochs, device=options.device
    )
    _check_fits(f"--data {options.data}", data, spec)
    updater.output_state_folder = options.output_state
    updater.in_place = options.in_place
    _progress(updater.learner_instance, "update", not options.no_progress)
    result = updater.update(data, task_id=options.task_id)
    loss = result.metrics.get("train_loss", math.nan)
    print(f"trained {result.steps} steps; train_loss {loss:.4f}; state in {options.output_state}")
    return 0


def _evaluate(values: dict[str, Any], from_file: frozenset[str]) -> int:
    from renate_events import evaluation
    from renate_events.scenarios import Task

    options = _options(_EvaluateOptions, values)
    if options.data is not None:
        data = _load_data_file(options.data)
    updater, spec = _updater_from_folder(options.state)
    model = updater.learner_instance.model
    if options.data is not None:
        _check_fits(f"--data {options.data}", data, spec)
        classes = tuple(sorted(set(data.tensors[1].tolist())))
        tasks = [Task(task_id=0, train=data, test=data, classes=classes)]
    else:
        try:
            tasks = list(SCENARIOS[options.scenario](seed=options.seed).tasks())
        except ImportError as exc:
            raise UsageError(f"--scenario {options.scenario}: {exc}") from None
        _check_fits(f"--scenario {options.scenario}", tasks[0].test, spec)
    accuracies = evaluation.evaluate(model, tasks, mode="class-incremental")
    for task, accuracy in zip(tasks, accuracies):
        print(f"task {task.task_id}: accuracy {accuracy:.4f} ({len(task.test)} samples)")
    print(f"average accuracy {sum(accuracies) / len(accuracies):.4f}")
    return 0


_COMMANDS: dict[str, Callable[[dict[str, Any], frozenset[str]], int]] = {
    "run": _run,
    "update": _update,
    "evaluate": _evaluate,
}

_EXPECTED = (UsageError, StateFolderError, CheckpointError, NonFiniteLossError)
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
    except KeyboardInterrupt:
        print("renate-events: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
