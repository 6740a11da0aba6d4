"""The ``renate-events`` parser: one subcommand per command, its flags made from the settings,
the ``--config`` file merged under the flags, and the dispatch to the command's function."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from renate_events.cli._errors import UsageError
from renate_events.cli._evaluate import evaluate
from renate_events.cli._info import info
from renate_events.cli._options import (
    add_hyperparameter_options,
    add_setting,
    hyperparameter_epilog,
    read_config,
)
from renate_events.cli._predict import predict
from renate_events.cli._run import run
from renate_events.cli._shift import shift
from renate_events.cli._update import update
from renate_events.hyperparameters import hyperparameters
from renate_events.methods import METHODS
from renate_events.settings import COMMANDS, setting

__all__ = ["COMMAND_FUNCTIONS", "Parser", "build_parser", "examples", "parse"]

COMMAND_FUNCTIONS: dict[str, Callable[[dict[str, Any], frozenset[str]], int]] = {
    "run": run,
    "update": update,
    "evaluate": evaluate,
    "predict": predict,
    "info": info,
    "shift": shift,
}
"""Each command's function: ``(values, from_file) -> exit status``."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as :class:`UsageError` (one line) instead of usage text."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> Any:  # type: ignore[override]
        if message.startswith("unrecognized arguments: --"):
            message += "; no option or learner hyperparameter has that name"
        raise UsageError(f"{message} (see {self.prog} -h)")


def _example_methods() -> tuple[str, str]:
    """The default method, and another one with a memory and an ``alpha``, for the examples."""
    default = setting("learner").default
    other = next(
        name
        for name, spec in METHODS.items()
        if name != default and spec.uses_memory and "alpha" in hyperparameters(name)
    )
    return default, other


def examples() -> str:
    """Example command lines of every command (the top-level help's epilog)."""
    default, other = _example_methods()
    buffer = setting("memory_size").default
    summary = METHODS[default].summary.split(" (")[0]
    return (
        f"  renate-events run                                   # Split-Digits, {summary}, "
        f"buffer {buffer}\n"
        f"  renate-events run --learner {other} --seeds 0 1 2 --output-dir runs/{other}\n"
        "  renate-events run --config experiment.toml --epochs 5   # flags override the file\n"
        f"  renate-events update --input-state runs/{other}/state/seed-0 --data new.npz \\\n"
        f"      --output-state runs/{other}/next\n"
        f"  renate-events evaluate --state runs/{other}/next --scenario split-digits\n"
        f"  renate-events predict --state runs/{other}/next --data new.npz --output labels.csv\n"
        f"  renate-events info --state runs/{other}/next --json\n"
        "  renate-events shift --reference old.npz --query new.npz       # has the data shifted?"
    )


def _add_settings(parser: argparse.ArgumentParser, command: str) -> None:
    """Every flag of ``command``, in the order of :data:`~renate_events.settings.COMMANDS`."""
    for name in COMMANDS[command]:
        add_setting(parser, command, name)


def _subparser(sub: Any, command: str, epilog: str, **texts: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        command,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **texts,
    )
    _add_settings(parser, command)
    if "learner" in COMMANDS[command]:
        add_hyperparameter_options(parser)
    return parser


def _run_parser(sub: Any) -> argparse.ArgumentParser:
    default, other = _example_methods()
    return _subparser(
        sub,
        "run",
        f"examples:\n  renate-events run\n  renate-events run --learner {other} --seeds 0 1 2\n"
        "  renate-events run --config experiment.toml --epochs 5\n"
        f"  renate-events run --config-file my_config.py --chunks 5 --learner {default} "
        "--alpha 0.3\n\n" + hyperparameter_epilog(),
        help="run a whole scenario, evaluating after each update",
        description="Run a scenario: one update per task, evaluation on every task after each.",
    )


def _update_parser(sub: Any) -> argparse.ArgumentParser:
    return _subparser(
        sub,
        "update",
        "examples:\n  renate-events update --input-state runs/latest/state/seed-0 "
        "--data new.npz --output-state next-state\n"
        "  renate-events update --config-file my_config.py --chunk-id 0 --output-state s0\n"
        "  renate-events update --config-file my_config.py --input-state s0 --chunk-id 1 "
        "--output-state s1\n\n" + hyperparameter_epilog(),
        help="one model update from a state folder and new data",
        description="Load --input-state (none: the first update, from the config file's "
        "model_fn), train on --data or the config file's chunk --chunk-id, write "
        "--output-state.",
    )


def _evaluate_parser(sub: Any) -> argparse.ArgumentParser:
    return _subparser(
        sub,
        "evaluate",
        "examples:\n  renate-events evaluate --state next-state --data test.npz\n"
        "  renate-events evaluate --state next-state --scenario split-digits\n"
        "  renate-events evaluate --state s1 --config-file my_config.py",
        help="evaluate a state folder on a data file, a scenario or a config file's test data",
        description="Print the accuracy (and the config file's metrics) of a state folder's model.",
    )


def _predict_parser(sub: Any) -> argparse.ArgumentParser:
    return _subparser(
        sub,
        "predict",
        "examples:\n  renate-events predict --state next-state --data new.npz\n"
        "  renate-events predict --state next-state --data new.npz --output labels.csv "
        "--probabilities\n"
        "  renate-events predict --state s1 --config-file my_config.py --chunk-id 2 "
        "--output s1-chunk2.npz",
        help="predict labels (and class probabilities) with a state folder's model",
        description="Predict with a state folder's model through its recorded test transform and "
        "its method's own classifier; print a summary and, with --output, write a new .npz or "
        ".csv file.",
    )


def _info_parser(sub: Any) -> argparse.ArgumentParser:
    return _subparser(
        sub,
        "info",
        "examples:\n  renate-events info --state next-state\n"
        "  renate-events info --state next-state --json",
        help="describe a state folder: learner, model, buffer, updates, formats",
        description="Describe a state folder from its manifest and checkpoint (nothing of the "
        "model's code is run): the learner and its hyperparameters, the model's architecture "
        "and parameter count, the buffer, every update and the formats.",
    )


def _shift_parser(sub: Any) -> argparse.ArgumentParser:
    return _subparser(
        sub,
        "shift",
        "examples:\n  renate-events shift --reference old.npz --query new.npz\n"
        "  renate-events shift --reference old.npz --query new.npz --detector ks --state s1 "
        "--feature-module backbone",
        help="test whether new data differs from a reference (covariate shift)",
        description="A two-sample test of --query against --reference, on the raw inputs or on "
        "the features of a state folder's model; prints the statistic, the p-value and the "
        "decision at --level.",
    )


def build_parser() -> Parser:
    """The parser of ``renate-events``, with ``parser.commands`` holding each subparser."""
    from renate_events import __version__

    parser = Parser(
        prog="renate-events",
        description="Continual learning with experience replay on the event-driven trainer.",
        epilog="examples:\n" + examples(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"renate-events {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{" + ",".join(COMMAND_FUNCTIONS) + "}"
    )
    parser.commands = {
        "run": _run_parser(sub),
        "update": _update_parser(sub),
        "evaluate": _evaluate_parser(sub),
        "predict": _predict_parser(sub),
        "info": _info_parser(sub),
        "shift": _shift_parser(sub),
    }
    return parser


def parse(argv: Sequence[str] | None) -> tuple[str, dict[str, Any], frozenset[str]]:
    """The command, its options (defaults, then ``--config``, then flags) and which of them came
    from the ``--config`` file."""
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    from_file: set[str] = set()
    if command == "update":
        args["search_space"] = {}
    if args.get("config") is not None:
        given = _given_on_the_command_line(argv, command)
        values = read_config(args["config"], command)
        if command == "update":  # tables are the ranges of a search, not values
            ranges = {k for k, v in values.items() if isinstance(v, dict) and k != "model_args"}
            args["search_space"] = {k: values[k] for k in ranges}
            values = {k: v for k, v in values.items() if k not in ranges}
        from_file = set(values) - given
        args.update({name: values[name] for name in from_file})
    return command, args, frozenset(from_file)


def _given_on_the_command_line(argv: Sequence[str] | None, command: str) -> set[str]:
    parser = build_parser()
    for action in parser.commands[command]._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command"}
