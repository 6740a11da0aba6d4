"""Stage and swap: a new state folder is written in full beside its destination (its contents:
:func:`~renate_events.state_folder.contents.write_contents`), then swapped in with two renames,
all under the destination's exclusive lock.

Nothing of the old folder changes until the swap; a failed write leaves nothing behind, and a
swap whose writer died is finished by the next reader or writer
(:mod:`renate_events.state_folder.recovery`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

import attrs
from safetensors import SafetensorError

from renate_events.learners import BaseExperienceReplayLearner
from renate_events.state_folder.contents import write_contents
from renate_events.state_folder.errors import StateFolderConflictError, StateFolderError
from renate_events.state_folder.locks import acquire, folder_key, read_consistent, token_of
from renate_events.state_folder.recovery import recover
from trainer import CheckpointError
from trainer.files import FileLock, creation_problem, fsync_folder, temporary_sibling

__all__ = [
    "StagedStateFolder",
    "check_writable",
    "stage",
    "write_state_folder",
]

_WRITE_ERRORS = (OSError, CheckpointError, SafetensorError)
_LONGEST_ENTRY = "buffer.g" + "0" * 18 + ".0000.bin"  # the longest name a state folder holds


def check_writable(folder: str | os.PathLike[str]) -> None:
    """Refuse, before any work, a state folder that could not be written: the folder above it
    allows no new entry (``/proc``, a read-only mount, under a file) or a name or the path is
    too long (:func:`trainer.files.creation_problem`). Nothing is left behind.

    Raises:
        StateFolderError: ``folder`` cannot be written; the message says why.
    """
    problem = creation_problem(folder, inside=_LONGEST_ENTRY)
    if problem is not None:
        raise StateFolderError(
            f"the state folder {folder} cannot be written: {problem}; nothing was written: "
            "choose another folder"
        )


def _write_failed(folder: str, exc: BaseException) -> CheckpointError:
    reason = " ".join(str(exc).split())
    return CheckpointError(
        f"could not write the state folder {folder}: {reason}; what was there is unchanged"
    )


@attrs.define(eq=False)
class StagedStateFolder:
    """A new state folder written beside its destination, not yet swapped in.

    Made by :meth:`ModelUpdater.stage_state <renate_events.updater.ModelUpdater.stage_state>`,
    which holds the destination's exclusive lock until :meth:`commit` or :meth:`abort` releases
    it.

    Attributes:
        folder: The destination.
        staging: Where the new folder is now (``.<name>.staging.<hex>`` beside ``folder``).
        token: The new folder's :func:`~renate_events.state_folder.state_token`.
    """

    folder: str
    staging: str
    token: str
    _lock: FileLock

    def commit(self) -> None:
        """Swap the new folder in (the old one aside, the new one into place, the old removed).

        Raises:
            trainer.CheckpointError: A rename failed; the old folder is back in place.
        """
        retired = None
        try:
            if os.path.lexists(self.folder):
                retired = temporary_sibling(self.folder, "old")
                os.rename(self.folder, retired)
            try:
                os.rename(self.staging, self.folder)
            except OSError:
                if retired is not None:
                    os.rename(retired, self.folder)
                    retired = None
                raise
            fsync_folder(os.path.dirname(self.folder))
        except OSError as exc:
            self.abort()
            raise _write_failed(self.folder, exc) from exc
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
        self._lock.release()

    def abort(self) -> None:
        """Remove the new folder and release the lock; the destination stays as it was."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self._lock.release()


def stage(
    folder: str,
    learner: BaseExperienceReplayLearner,
    manifest: dict[str, Any],
    expected: str | None,
    timeout: float,
    extra: Mapping[str, bytes] | None = None,
) -> StagedStateFolder:
    """Take the exclusive lock, check the destination, write the new folder beside it.

    Args:
        folder: The destination, as :func:`~renate_events.state_folder.folder_key` gives it.
        learner: Whose state is written.
        manifest: The manifest without ``files`` (added here, with every file's checksum).
        expected: What ``folder`` must still hold (its token; None: nothing, or an empty folder).
        timeout: Seconds to wait for the lock.
        extra: Optional files by name (of ``OPTIONAL_FILES``: ``search.csv``).

    Raises:
        StateFolderConflictError: ``folder`` holds something else than ``expected``.
        trainer.CheckpointError: The folder could not be written; nothing is left behind.
    """
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        lock = acquire(folder, shared=False, timeout=timeout)
    except OSError as exc:
        raise _write_failed(folder, exc) from exc
    staging = temporary_sibling(folder, "staging")
    try:
        recover(folder)
        found = token_of(folder)
        if found != expected:
            raise StateFolderConflictError(
                f"{folder} was changed by another update after this one looked at it; writing "
                "would discard that update: run this update again from the folder's current state"
            )
        os.mkdir(staging)
        token = write_contents(staging, learner, manifest, extra or {})
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        lock.release()
        if isinstance(exc, _WRITE_ERRORS):
            raise _write_failed(folder, exc) from exc
        raise
    return StagedStateFolder(folder, staging, token, lock)


def write_state_folder(
    folder: str | os.PathLike[str],
    learner: BaseExperienceReplayLearner,
    manifest: dict[str, Any],
    *,
    timeout: float = 60.0,
) -> None:
    """Replace ``folder`` with the learner's state, whatever state folder is there now."""
    folder = folder_key(folder)
    expected = read_consistent(folder, timeout, lambda: token_of(folder))
    stage(folder, learner, manifest, expected, timeout).commit()
