"""Whether an update may replace what is at its output folder: a state folder of its own lineage,
or, with ``overwrite``, any state folder (never silently another model's).

The lineage of a state is its manifest's ``history``, one record per update (its task id, steps,
metrics, hyperparameters, data signature, ...): a later update of a state extends its history, so
two states are of one lineage when one's history is a prefix of the other's (the records'
``seconds`` aside: an update repeated exactly, same seed, data and settings, is the same). The
input folder itself and a folder this updater wrote are the updater's own; their tokens it knows
already.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from renate_events.state_folder.errors import StateFolderOverwriteError
from renate_events.state_folder.locks import read_consistent, token_of
from renate_events.state_folder.manifest import MANIFEST, parse_manifest, read_manifest_bytes

__all__ = ["output_token"]


def output_token(
    output: str, own: Mapping[str, Any] | None, overwrite: bool, timeout: float
) -> str | None:
    """:func:`~renate_events.state_folder.state_token` of ``output`` (a folder key), once its
    state, if any, was found to be of the lineage of ``own`` (the updater's manifest: the input
    state's with this process's updates; None before the first update) or ``overwrite`` allows
    replacing it.

    Raises:
        StateFolderOverwriteError: ``output`` holds a state of another lineage, and not
            ``overwrite``.
    """
    token, history = read_consistent(output, timeout, lambda: _token_and_history(output))
    mine = _plain(own.get("history", [])) if own is not None else []
    if token is None or overwrite or _one_lineage(mine, history):
        return token
    theirs = [record.get("task_id") for record in history if isinstance(record, dict)]
    source = (
        f"this updater's state (updates {[r.get('task_id') for r in mine]})"
        if mine
        else ("this first update")
    )
    raise StateFolderOverwriteError(
        f"{output} holds a state folder of another lineage (updates {theirs}), neither a part "
        f"nor a continuation of {source}; refusing to replace it: pass overwrite=True "
        "(renate-events update --overwrite) or choose another output folder"
    )


def _token_and_history(folder: str) -> tuple[str | None, list[Any]]:
    token = token_of(folder)  # refuses a file, a link and a folder that is no state folder
    if token is None:
        return None, []
    path = os.path.join(folder, MANIFEST)
    manifest = parse_manifest(path, read_manifest_bytes(path))
    history = manifest.get("history")
    if history is None and isinstance(manifest.get("task_ids"), list):  # format version 1
        history = [{"task_id": task_id} for task_id in manifest["task_ids"]]
    return token, history if isinstance(history, list) else []


def _plain(history: Any) -> list[Any]:
    """``history`` as read back from JSON (this process's records may hold tuples)."""
    return json.loads(json.dumps(history))


def _timeless(history: list[Any]) -> list[Any]:
    """The records without their ``seconds``: a state trained again exactly as another (same
    seed, data and settings) is the same model, whatever the clock said."""
    return [
        {k: v for k, v in record.items() if k != "seconds"} if isinstance(record, dict) else record
        for record in history
    ]


def _one_lineage(mine: list[Any], theirs: list[Any]) -> bool:
    """One history is a prefix of the other, and they share at least one update."""
    shorter = min(len(mine), len(theirs))
    return shorter > 0 and _timeless(mine[:shorter]) == _timeless(theirs[:shorter])
