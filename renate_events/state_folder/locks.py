"""Locks of state folders, and reading under them: a folder's identity (:func:`folder_key`), its
exclusive and shared locks, a read that no swap disturbs, and what a folder holds
(:func:`state_token`, :func:`read_manifest`).

A writer holds the exclusive lock ``.<name>.lock`` beside the folder
(:class:`trainer.files.FileLock`) from staging to the end of its swap; readers hold the shared
lock, or none at all where no writer ever came (see :func:`read_consistent`).
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from renate_events.state_folder.errors import StateFolderBusyError, StateFolderError
from renate_events.state_folder.manifest import (
    BUFFER_FILE,
    FILES,
    FORMAT_NAME,
    MANIFEST,
    OPTIONAL_FILES,
    parse_manifest,
    read_manifest_bytes,
    read_verified,
)
from renate_events.state_folder.recovery import leftovers, recover, retired_state
from trainer.files import FileLock, LockFileError, lock_path

__all__ = [
    "acquire",
    "folder_key",
    "read_consistent",
    "read_manifest",
    "state_token",
    "token_of",
]

_T = TypeVar("_T")


def folder_key(folder: str | os.PathLike[str]) -> str:
    """The folder's path with its parents' links resolved (its own name is kept as it is)."""
    parent, name = os.path.split(os.path.abspath(os.fspath(folder)))
    return os.path.join(os.path.realpath(parent), name)


def acquire(folder: str, *, shared: bool, timeout: float) -> FileLock:
    """Take ``folder``'s lock; a busy lock is a :class:`StateFolderBusyError`, a link or a folder
    at the lock file's path a :class:`StateFolderError`."""
    lock = FileLock(lock_path(folder), shared=shared, timeout=timeout)
    try:
        lock.acquire()
    except LockFileError as exc:
        raise StateFolderError(f"{folder} cannot be locked: {exc}") from None
    except TimeoutError as exc:
        raise StateFolderBusyError(
            f"{folder} is locked by another update ({exc}); try again when it has finished, or "
            "wait longer (lock_timeout, renate-events update --lock-timeout)"
        ) from None
    return lock


def _reader_lock(folder: str, timeout: float) -> FileLock | None:
    """The shared lock, or None where there is nothing to lock or the lock cannot be made."""
    try:
        return acquire(folder, shared=True, timeout=timeout)
    except OSError as exc:  # no parent folder, or a read-only one without a lock file
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS):
            return None
        raise


@contextmanager
def _reading(folder: str, timeout: float) -> Iterator[None]:
    """Hold ``folder``'s shared lock, first clearing up after a dead writer (:func:`_clear_up`).

    A live writer holds the exclusive lock from staging to the end of its swap, so a half-done
    swap or a work folder seen under the shared lock is a dead writer's.
    """
    lock = _reader_lock(folder, timeout)
    try:
        if retired_state(folder) is not None or leftovers(folder):
            if lock is not None:
                lock.release()
            _clear_up(folder, timeout)
            lock = _reader_lock(folder, timeout)
        yield
    finally:
        if lock is not None:
            lock.release()


def _clear_up(folder: str, timeout: float) -> None:
    """Finish a swap that a dead writer left half done and remove its work folders, under the
    exclusive lock (waiting for it like any writer where the folder is missing; else only if it
    is free now: a reader needs no clean-up, and the next one or a writer does it)."""
    retired = retired_state(folder)
    try:
        repair = acquire(folder, shared=False, timeout=timeout if retired else 0.0)
    except StateFolderBusyError:
        if retired is not None:
            raise
        return
    except OSError as exc:  # a read-only parent folder: no lock file can be made there
        if retired is not None:
            raise _cannot_move_back(folder, retired, exc) from None
        return
    try:
        recover(folder)
    except OSError as exc:  # only moving the old folder back raises
        raise _cannot_move_back(folder, retired_state(folder) or retired or "", exc) from None
    finally:
        repair.release()


def _cannot_move_back(folder: str, retired: str, exc: OSError) -> StateFolderError:
    reason = exc.strerror or str(exc)
    return StateFolderError(
        f"{folder} is missing: an update killed during its swap left the previous state at "
        f"{retired}, and this read cannot move it back ({reason}); move it back by hand "
        f"(mv {retired} {folder}), or read it where its parent folder is writable"
    )


def read_consistent(folder: str, timeout: float, read: Callable[[], _T]) -> _T:
    """``read()``, with no writer swapping ``folder`` meanwhile; readers create no lock file
    (unless a dead writer's leftovers are to be removed).

    A writer creates the lock file before anything else. So without one, no writer has started
    here; and if none appeared by the end of an unlocked read, none disturbed it. Otherwise (and
    to clear up after a dead writer) the read runs under the shared lock.

    So ``read`` may run twice, and only the second run's result counts: it must change nothing
    but what it returns, or start each run afresh (what a first run did is replaced, not added
    to), so that a retried read gives what one read gives.

    Raises:
        StateFolderError: Something else than a plain file is at the lock file's path, or the
            folder is missing and a dead writer's old folder cannot be moved back (the message
            says why and what to do); whatever ``read`` raises.
        StateFolderBusyError: A writer held the lock for ``timeout`` seconds.
    """
    lock = lock_path(folder)
    if not os.path.lexists(lock) and retired_state(folder) is None and not leftovers(folder):
        try:
            result = read()
        except Exception:
            if not os.path.lexists(lock):
                raise
        else:
            if not os.path.lexists(lock):
                return result
    with _reading(folder, timeout):
        return read()


# -- what is at a path -------------------------------------------------------------------------


def state_token(folder: str | os.PathLike[str], *, timeout: float = 60.0) -> str | None:
    """What is at ``folder`` now, for :meth:`ModelUpdater.stage_state
    <renate_events.updater.ModelUpdater.stage_state>`'s ``expected``.

    Returns:
        None when nothing (or an empty folder) is there, else the SHA-256 of its manifest, which
        changes with every update written there.

    Raises:
        StateFolderError: ``folder`` may not be replaced: it is a file or a link, or a folder that
            is not a state folder (it holds other files, or no renate_events manifest).
    """
    folder = folder_key(folder)
    return read_consistent(folder, timeout, lambda: token_of(folder))


def token_of(folder: str) -> str | None:
    """:func:`state_token` without the lock: the caller keeps writers away."""
    if not os.path.lexists(folder):
        return None
    if os.path.islink(folder) or not os.path.isdir(folder):
        raise StateFolderError(
            f"{folder} exists and is not a folder; a state folder is never written over a file "
            "or a link: choose another output folder"
        )
    entries = sorted(os.listdir(folder))
    if not entries:
        return None
    known = (MANIFEST, *FILES, *OPTIONAL_FILES)
    others = [e for e in entries if e not in known and not BUFFER_FILE.fullmatch(e)]
    if others or MANIFEST not in entries:
        shown = others[:5] + (["..."] if len(others) > 5 else [])
        raise StateFolderError(
            f"{folder} is not a state folder (it holds {shown or entries}); refusing to replace "
            "it: choose another output folder"
        )
    raw = read_manifest_bytes(os.path.join(folder, MANIFEST))
    manifest = parse_manifest(os.path.join(folder, MANIFEST), raw)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise StateFolderError(
            f"{folder} is not a state folder (its {MANIFEST} is not a renate_events state "
            "manifest); refusing to replace it: choose another output folder"
        )
    return hashlib.sha256(raw).hexdigest()


def read_manifest(folder: str | os.PathLike[str], *, timeout: float = 60.0) -> dict[str, Any]:
    """Read and verify a state folder's manifest: its schema and every file's checksum.

    Waits (up to ``timeout`` seconds) for a writer that is swapping the folder, and finishes a
    swap that a killed writer left half done.

    Raises:
        StateFolderError: When the folder or a file is missing, a checksum differs, or the
            manifest breaks the schema (the message names the file and the key).
        StateFolderBusyError: When a writer held the folder's lock for ``timeout`` seconds.
    """
    folder = folder_key(folder)
    return read_consistent(folder, timeout, lambda: read_verified(folder)[0])
