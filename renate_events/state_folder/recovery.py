"""Interrupted swaps and leftovers: the work folders a writer makes beside a state folder, the
old folder that a writer killed between the swap's two renames left aside, and its repair.

Run these under the folder's exclusive lock only (:mod:`renate_events.state_folder.locks`): a
live writer holds it from staging to the end of its swap, so whatever is found then is a dead
writer's.
"""

from __future__ import annotations

import os
import shutil

from renate_events.state_folder.manifest import MANIFEST
from trainer.files import fsync_folder, is_temporary_sibling

__all__ = ["leftovers", "recover", "retired_state", "siblings"]


def siblings(folder: str, tag: str) -> list[str]:
    """This library's work folders of ``tag`` beside ``folder`` (never links)."""
    parent, name = os.path.split(folder)
    if not os.path.isdir(parent):
        return []
    return [
        os.path.join(parent, entry)
        for entry in sorted(os.listdir(parent))
        if is_temporary_sibling(entry, name, tag)
        and not os.path.islink(os.path.join(parent, entry))
        and os.path.isdir(os.path.join(parent, entry))
    ]


def leftovers(folder: str) -> list[str]:
    """The staging and old folders of writers beside ``folder``."""
    return siblings(folder, "staging") + siblings(folder, "old")


def retired_state(folder: str) -> str | None:
    """The old state folder that a swap of ``folder`` left aside (the newest, if several), or
    None when ``folder`` exists or there is none."""
    if os.path.lexists(folder):
        return None
    retired = [old for old in siblings(folder, "old") if os.path.isfile(f"{old}/{MANIFEST}")]
    return max(retired, key=lambda old: os.stat(old).st_mtime_ns, default=None)


def recover(folder: str) -> None:
    """Move back the old folder of a swap whose writer died; remove its other leftovers.

    Staging and :meth:`~renate_events.state_folder.StagedStateFolder.commit` run under the
    exclusive lock, so when the caller holds it, no live writer owns anything named
    ``.<name>.staging.*`` or ``.<name>.old.*``. A leftover that cannot be removed stays (the next
    writer tries again); a folder that cannot be moved back raises the rename's ``OSError``.
    """
    retired = retired_state(folder)
    if retired is not None:
        os.rename(retired, folder)
        fsync_folder(os.path.dirname(folder))
    for leftover in leftovers(folder):
        shutil.rmtree(leftover, ignore_errors=True)
