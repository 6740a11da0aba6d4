"""File-system helpers for durable writes: the one home of ``fsync`` in both packages.

A durable replace is: write a temporary file in the target's folder, :func:`fsync_file` it,
``os.replace`` it onto the target, then :func:`fsync_folder` the folder so that the rename
itself survives a power loss.
"""

from __future__ import annotations

import os

__all__ = ["fsync_file", "fsync_folder"]


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a written file's data to disk."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_folder(folder: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (renames, new files) to disk, where the platform allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse fsync on a folder
        pass
    finally:
        os.close(fd)
