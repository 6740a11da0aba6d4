"""``renate-events info``: what a state folder holds, from its manifest and its checkpoint (read
with the project's readers; no model code runs, nothing is unpickled), as text or as JSON with
the keys of :data:`INFO_KEYS`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from renate_events.cli._options import InfoOptions, check_options
from renate_events.state_folder import StateFolderError, folder_key
from renate_events.state_folder.locks import read_consistent
from renate_events.state_folder.manifest import CHECKPOINT, read_verified
from trainer.checkpoint import read_checkpoint

__all__ = ["INFO_KEYS", "info", "state_info"]

INFO_KEYS = ("state", "format", "learner", "model", "buffer", "updates", "config")
"""The keys of ``info --json``'s object, in this order (documented in docs/cli.rst)."""


def info(values: dict[str, Any], from_file: frozenset[str]) -> int:
    """``renate-events info``: describe a state folder, as text or (``--json``) one object."""
    options = check_options(InfoOptions, values)
    described = state_info(options.state)
    if options.json:
        print(json.dumps(described, indent=2, sort_keys=False))
    else:
        print(_text(described))
    return 0


def state_info(folder: str) -> dict[str, Any]:
    """The description of the state folder ``folder`` (the object ``info --json`` prints).

    Raises:
        StateFolderError: The folder is missing or damaged (the manifest's checks, the files'
            checksums).
        CheckpointError: The learner's checkpoint cannot be read.
    """
    manifest, tree = read_consistent(folder_key(folder), 60.0, lambda: _read(folder))
    shapes = [shape for shape, _ in manifest["model"].values()]
    config = manifest.get("config")
    return {
        "state": folder,
        "format": {"name": manifest["format"], "version": manifest["format_version"]},
        "learner": {
            "name": manifest["learner"],
            "hyperparameters": manifest["learner_kwargs"],
            "optimizer": manifest["optimizer"],
            "trainer": manifest["trainer"],
        },
        "model": {
            "architecture": manifest.get("architecture"),
            "parameters": sum(math.prod(shape) for shape in shapes),
            "tensors": len(shapes),
            "spec": manifest.get("metadata", {}).get("model"),
        },
        "buffer": _buffer(manifest, tree),
        "updates": [_update(record) for record in manifest.get("history", [])],
        "config": None if config is None else {"file": config["file"], "sha256": config["sha256"]},
    }


def _read(folder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest and the learner's checkpoint tree of one version of the folder (run by
    ``read_consistent``, which reads again if a writer swapped the folder in between)."""
    manifest = read_verified(folder)[0]
    try:
        return manifest, read_checkpoint(os.path.join(folder, CHECKPOINT))
    except FileNotFoundError:  # removed since the manifest was read
        raise StateFolderError(f"{folder}: {CHECKPOINT} is missing") from None


def _buffer(manifest: Mapping[str, Any], tree: Mapping[str, Any]) -> dict[str, Any] | None:
    """The replay buffer's kind, storage, capacity and fill (None: the learner keeps none)."""
    learner = tree.get("listeners", {}).get("learner", {})
    saved = learner.get("buffer") if isinstance(learner, Mapping) else None
    if not isinstance(saved, Mapping):
        return None
    config = saved.get("config") or {}
    return {
        "kind": manifest["buffer"],
        "storage": manifest.get("buffer_storage", "memory"),
        "size": config.get("max_size"),
        "fill": saved.get("length"),
        "seen": saved.get("num_seen"),
    }


def _update(record: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "task_id": record.get("task_id"),
        "steps": record.get("steps"),
        "epochs": record.get("epochs"),
        "samples": record.get("samples"),
        "seconds": record.get("seconds"),
        "metrics": record.get("metrics", {}),
    }


def _text(described: Mapping[str, Any]) -> str:
    """``info``'s readable text."""
    learner, model, buffer = described["learner"], described["model"], described["buffer"]
    form = described["format"]
    lines = [
        f"state folder {described['state']} ({form['name']} format version {form['version']})",
        f"learner: {learner['name']} {json.dumps(learner['hyperparameters'], sort_keys=True)}",
        f"optimizer: {json.dumps(learner['optimizer'], sort_keys=True)}",
        f"trainer: {json.dumps(learner['trainer'], sort_keys=True)}",
        f"model: {model['architecture']}, {model['parameters']:,} parameters in "
        f"{model['tensors']} tensors"
        + ("" if model["spec"] is None else f" ({json.dumps(model['spec'], sort_keys=True)})"),
    ]
    if buffer is None:
        lines.append("buffer: none")
    else:
        lines.append(
            f"buffer: {buffer['kind']} ({buffer['storage']}), {buffer['fill']} of "
            f"{buffer['size']} slots filled, {buffer['seen']} samples seen"
        )
    if described["config"] is not None:
        lines.append(f"config file: {described['config']['file']}")
    lines.append(f"updates: {len(described['updates'])}")
    for index, update in enumerate(described["updates"]):
        metrics = ", ".join(f"{name} {value:.4g}" for name, value in update["metrics"].items())
        lines.append(
            f"  {index}: task {update['task_id']}, {update['steps']} steps, "
            f"{update['samples']} samples, {update['seconds']} s"
            + (f"; {metrics}" if metrics else "")
        )
    return "\n".join(lines)
