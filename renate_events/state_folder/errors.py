"""The errors of state folders: a folder that may not be read or written, a busy lock, a conflict
with another writer."""

from __future__ import annotations

__all__ = [
    "StateFolderBusyError",
    "StateFolderConflictError",
    "StateFolderError",
    "StateFolderOverwriteError",
]


class StateFolderError(ValueError):
    """Raised when a state folder is missing, damaged, written by another configuration, or when
    a path may not be written (a file, a link, a folder that is not a state folder)."""


class StateFolderBusyError(StateFolderError):
    """Raised when another process held a state folder's lock for longer than ``lock_timeout``."""


class StateFolderConflictError(StateFolderError):
    """Raised when an output folder changed after the update looked at it: writing would discard
    the other writer's update. Rerun the update from the folder's current state."""


class StateFolderOverwriteError(StateFolderError):
    """Raised before training when the output folder holds a state of another lineage (another
    model's, not the input's nor a continuation of it): replacing it needs ``overwrite=True``
    (``renate-events update --overwrite``)."""
