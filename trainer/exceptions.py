"""Exceptions raised by the ``trainer`` package.

Every error the package raises on purpose derives from :class:`TrainerError`, so that a caller can
catch them all in one place. Errors about bad arguments also derive from the built-in
``ValueError`` or ``TypeError`` they specialise.
"""

from __future__ import annotations

import sys

__all__ = [
    "CaptureError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "ListenerError",
    "MissingPackageError",
    "NonFiniteLossError",
    "SubscriptionError",
    "TrainerError",
    "add_note",
]


class TrainerError(Exception):
    """Raised for any failure the ``trainer`` package detects itself."""


class CaptureError(TrainerError, RuntimeError):
    """Raised when ``Trainer(capture="compile")`` or ``capture="graph"`` cannot capture a step.

    The message names the step function and what ``torch.compile`` reported (chained as the
    cause) and the eager fallback, ``capture="off"`` (``--capture off`` on the command line).
    """


class SubscriptionError(TrainerError, ValueError):
    """Raised when a listener cannot be subscribed.

    For example: a method ``on_<name>`` whose name matches no event, a hook parameter that no event
    payload provides, a listener subscribed twice, or two listeners claiming the same name.
    """


class ListenerError(TrainerError):
    """Raised when a listener (or a function connected to an event) raised while handling an event.

    The original exception is chained as ``__cause__``. ``event`` and ``listener`` name where it
    happened.
    """

    def __init__(self, message: str, *, event: str, listener: str) -> None:
        super().__init__(message)
        self.event = event
        self.listener = listener


class CheckpointError(TrainerError):
    """Raised when a checkpoint cannot be written or read."""


class CheckpointFormatError(CheckpointError):
    """Raised when a file is not a readable checkpoint of a supported format version.

    Covers missing, truncated or corrupted files, files written by something else and format
    versions this release does not know.
    """


class CheckpointMismatchError(CheckpointError):
    """Raised when a readable checkpoint does not fit the live objects it is loaded into.

    The message lists every missing or unexpected key and every shape or dtype mismatch at once.
    """


class NonFiniteLossError(TrainerError, ArithmeticError):
    """Raised when a training step's loss is NaN or infinite (``Trainer(nonfinite_loss="raise")``).

    No backward pass and no optimizer step are taken for that batch. ``step``, ``epoch`` and
    ``batch_idx`` say where it happened.
    """

    def __init__(self, message: str, *, step: int, epoch: int, batch_idx: int) -> None:
        super().__init__(message)
        self.step = step
        self.epoch = epoch
        self.batch_idx = batch_idx


class MissingPackageError(TrainerError, ImportError):
    """Raised when a listener needs an optional package that is not installed.

    The message names the package extra to install (``pip install 'renate-events[mlflow]'``).
    ``package`` is the missing package, ``extra`` the extra that installs it.
    """

    def __init__(self, message: str, *, package: str, extra: str) -> None:
        super().__init__(message, name=package)
        self.package = package
        self.extra = extra


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to the notes of ``error`` (PEP 678), which is being raised for a reason of
    its own: ``error.add_note`` on Python 3.11 and later; on Python 3.10, which has no notes,
    the ``__notes__`` list all the same (its tracebacks do not print it).

    Example:
        >>> error = KeyError("original")
        >>> add_note(error, "while cleaning up: disk full")
        >>> error.__notes__
        ['while cleaning up: disk full']
    """
    # a version check, not hasattr: mypy reads it, so a 3.11-only call outside it is an error
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        notes = getattr(error, "__notes__", None)
        notes = [*notes, note] if isinstance(notes, list) else [note]
        error.__notes__ = notes  # type: ignore[attr-defined]  # 3.10's BaseException lacks it
