"""The command line's usage error and its one-line messages."""

from __future__ import annotations

__all__ = ["UsageError", "one_line"]


class UsageError(Exception):
    """A bad argument or input file: reported in one line with exit code 2."""


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())
