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

__all__ = ["interrupted_swap", "recover", "siblings"]


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


def interrupted_swap(folder: str) -> bool:
    """Whether ``folder`` is missing while an old state folder of a swap waits beside it."""
    return not os.path.lexists(folder) and any(
        os.path.isfile(os.path.join(old, MANIFEST)) for old in siblings(folder, "old")
    )


def recover(folder: str) -> None:
    """Move back the old folder of a swap whose writer died; remove its other leftovers.

    Staging and :meth:`~renate_events.state_folder.StagedStateFolder.commit` run under the
    exclusive lock, so when the caller holds it, no live writer owns anything named
    ``.<name>.staging.*`` or ``.<name>.old.*``.
    """
    if interrupted_swap(folder):
        retired = [old for old in siblings(folder, "old") if os.path.isfile(f"{old}/{MANIFEST}")]
        os.rename(max(retired, key=lambda old: os.stat(old).st_mtime_ns), folder)
        fsync_folder(os.path.dirname(folder))
    for leftover in siblings(folder, "staging") + siblings(folder, "old"):
        shutil.rmtree(leftover, ignore_errors=True)
