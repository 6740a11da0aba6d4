"""The ``renate-events`` command: run a scenario, update a state folder, evaluate one, predict
with one, describe one, test for shift (``renate-events --help`` prints examples of each).

Every option is a setting of :mod:`renate_events.settings` and is checked against the command's
typed schema before anything is trained or written; a bad option, file or state folder is one
line on standard error and exit status 2.

The package holds one module per command (``_run``, ``_update`` with its search ``_tuning``,
``_evaluate``, ``_predict``, ``_info``, ``_shift``) over the shared parts: the parser and the
dispatch (``_parser``), the options and their files (``_options``), data files
(``_data_files``), the command line's models (``_zoo``), the updater of a command
(``_updaters``), the results of a run (``_results``) and the experiment tracker of
``--tracker`` (``_tracking``).

Example:
    >>> import contextlib, io
    >>> from renate_events.cli import main
    >>> with contextlib.redirect_stderr(io.StringIO()) as err:
    ...     main(["shift", "--reference", "missing.npz", "--query", "new.npz"])
    2
    >>> print(err.getvalue().strip())
    renate-events: error: --reference missing.npz: no such file
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from renate_events.cli._errors import UsageError, command_line_message, one_line
from renate_events.cli._options import given_texts
from renate_events.cli._parser import COMMAND_FUNCTIONS, parse
from renate_events.config import ConfigError
from renate_events.learners import TransformError
from renate_events.memory.mapped import MappedFileError
from renate_events.search import SearchSpaceError
from renate_events.shift import ShiftDetectionError
from renate_events.state_folder import StateFolderError
from renate_events.updater import UpdateInputError
from trainer import CheckpointError, NonFiniteLossError
from trainer.exceptions import CaptureError, ListenerError

__all__ = ["UsageError", "main"]

_EXPECTED = (
    UsageError,
    StateFolderError,
    CheckpointError,
    NonFiniteLossError,
    CaptureError,
    ConfigError,
    UpdateInputError,
    TransformError,
    ShiftDetectionError,
    SearchSpaceError,
)
"""What a bad argument, file, state folder or full disk raises: one line, exit status 2. Anything
else is a bug and keeps its traceback."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``renate-events`` console script; returns the exit status.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).
    """
    given: dict[str, object] = {}  # the options as parsed (a command may take some out)
    try:
        command, values, from_file = parse(argv)
        given = dict(values)
        return COMMAND_FUNCTIONS[command](values, from_file)
    except _EXPECTED as exc:
        texts = given_texts(sys.argv[1:] if argv is None else argv, given)
        print(f"renate-events: error: {command_line_message(exc, texts)}", file=sys.stderr)
        return 2
    except ListenerError as exc:  # a mapped buffer's file failing in training: a full disk;
        # a transform breaking its contract on a later batch (buffer filling, herding)
        if not isinstance(exc.__cause__, (MappedFileError, TransformError)):
            raise
        print(f"renate-events: error: {one_line(exc.__cause__)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("renate-events: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of the output went away (`| head`): no traceback
        _drop_stdout()
        return 1


def _drop_stdout() -> None:
    """Point standard output at the null device, so that the interpreter's last flush of what
    could not be written raises nothing more (Python's advice for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (captured output)
        pass
