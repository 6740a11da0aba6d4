"""The command line's usage error and its one-line messages."""

from __future__ import annotations

__all__ = ["UsageError", "command_line_message", "one_line"]


class UsageError(Exception):
    """A bad argument or input file: reported in one line with exit code 2."""


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


_PYTHON_ADVICE = (
    ("Trainer(nonfinite_loss='skip')", "--nonfinite-loss skip"),
    ("restart=True", "--restart"),
)
"""Advice in the library's messages that names a Python argument, and the flag that sets it."""


def command_line_message(error: BaseException) -> str:
    """:func:`one_line`, with the advice naming the flag instead of the Python argument."""
    message = one_line(error)
    for python, flag in _PYTHON_ADVICE:
        message = message.replace(python, flag)
    return message
