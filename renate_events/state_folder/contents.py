"""The contents of a state folder besides its manifest: the learner's checkpoint (with a mapped
buffer's snapshot files), the model alone and its card; written into a staging folder
(:func:`write_contents`, the manifest last, with every file's checksum) and loaded back into a
learner (:func:`load_state`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import safetensors.torch
import torch

from renate_events.choices import MAPPED_TYPES
from renate_events.learners import BaseExperienceReplayLearner, LoadLimits, loading_limits
from renate_events.memory.mapped import MappedFileError
from renate_events.state_folder.errors import StateFolderError
from renate_events.state_folder.locks import read_consistent
from renate_events.state_folder.manifest import (
    BUFFER_FILE,
    CHECKPOINT,
    FILES,
    MANIFEST,
    MODEL,
    MODEL_CARD,
    OPTIONAL_FILES,
    check_manifest,
    read_verified,
    upgraded,
)
from trainer import CheckpointError
from trainer import validators as checks
from trainer.checkpoint import read_checkpoint
from trainer.exceptions import ListenerError
from trainer.files import fsync_folder, set_usual_mode, sha256_of_file

__all__ = ["check_model_file", "load_limits", "load_state", "mapped_files", "write_contents"]


def load_state(
    folder: str,
    learner: BaseExperienceReplayLearner,
    timeout: float,
    prepare: Callable[[dict[str, Any]], None],
) -> tuple[dict[str, Any], str]:
    """Load the state of ``folder`` into ``learner``, with no writer swapping it meanwhile.

    The manifest is read and verified (a version-1 one in the shape of version 2) and handed to
    ``prepare``, which may refuse it or subscribe the listeners whose state the checkpoint holds;
    then the checkpoint is loaded.

    Returns:
        The manifest and its token (:func:`~renate_events.state_folder.state_token`).
    """

    def load() -> tuple[dict[str, Any], str]:
        manifest, token = read_verified(folder)
        manifest = upgraded(manifest)
        prepare(manifest)
        check_model_file(folder, manifest, learner.model)
        limits = load_limits(os.path.join(folder, MANIFEST), manifest)
        with mapped_files(learner, "snapshots_from", folder), loading_limits(learner, limits):
            try:
                learner.load_checkpoint(os.path.join(folder, CHECKPOINT))
            except CheckpointError as exc:  # the trainer's checks of the tree; names the file
                raise StateFolderError(str(exc)) from None
        return manifest, token

    return read_consistent(folder, timeout, load)


def check_model_file(folder: str, manifest: Mapping[str, Any], model: torch.nn.Module) -> None:
    """``model.safetensors`` (whose checksum :func:`read_verified` checked) parsed by the
    untrusted reader, each tensor of the model's name, shape and dtype, and finite: what a
    deployment loads with ``load_file`` must be the model, not bytes that only hash right."""
    if MODEL not in manifest["files"]:
        return  # a version-1 folder has none
    path = os.path.join(folder, MODEL)
    try:
        tensors = read_checkpoint(path, tensors_only=True)
    except CheckpointError as exc:  # its message names the file
        raise StateFolderError(str(exc)) from None
    expected = model.state_dict()
    missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise StateFolderError(
            f"{path}: the model's tensors {missing} are missing, unknown tensors {unknown}"
        )
    for name, tensor in tensors.items():
        own = expected[name]
        if tensor.shape != own.shape or tensor.dtype != own.dtype:
            raise StateFolderError(
                f"{path}: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, the model's is "
                f"{own.dtype} {list(own.shape)}"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise StateFolderError(f"{path}: tensor {name!r} holds NaN or infinite values")


def load_limits(path: str, manifest: Mapping[str, Any]) -> LoadLimits:
    """What the manifest at ``path`` says the checkpoint's buffer may hold: the last recorded
    sample signature, and at most ``samples * epochs`` samples seen per update (each sample is
    offered to the buffer at most once an epoch); no bound when a record lacks its count (a
    folder written before counts were recorded)."""
    history = manifest["history"]
    counts = [(r.get("samples"), r.get("epochs")) for r in history]
    seen = None
    if all(checks.is_int(n) and checks.is_int(e) for n, e in counts):
        seen = sum(n * max(e, 1) for n, e in counts)
    signed = [(i, r["data"]) for i, r in enumerate(history) if r.get("data")]
    if not signed:
        return LoadLimits(samples_seen=seen)
    index, signature = signed[-1]
    source = f"{path}'s key 'history[{index}].data'"
    return LoadLimits(samples_seen=seen, signature=signature, source=source)


def write_contents(
    staging: str,
    learner: BaseExperienceReplayLearner,
    manifest: dict,
    extra: Mapping[str, bytes],
) -> str:
    """Write the checkpoint, the model alone, its card, the ``extra`` files (of
    ``OPTIONAL_FILES``) and the manifest into ``staging``; return the manifest's token."""
    checkpoint = os.path.join(staging, CHECKPOINT)
    with mapped_files(learner, "snapshots_to", staging):  # a mapped buffer's files go there
        learner.save_checkpoint(checkpoint)
    buffer_files = sorted(name for name in os.listdir(staging) if BUFFER_FILE.fullmatch(name))
    model_file = os.path.join(staging, MODEL)
    weights = {  # copies: tied or non-contiguous tensors are saved whole, each under its name
        name: tensor.detach().to("cpu", copy=True).contiguous()
        for name, tensor in learner.model.state_dict().items()
    }
    safetensors.torch.save_file(weights, model_file, metadata={"format": "pt"})
    set_usual_mode(model_file)  # the file to serve: readable like the folder's other files
    card = os.path.join(staging, MODEL_CARD)
    _write_json(card, _model_card(manifest))
    for name, data in extra.items():
        if name not in OPTIONAL_FILES:
            raise ValueError(f"a state folder holds no file {name!r}; it may hold {OPTIONAL_FILES}")
        with open(os.path.join(staging, name), "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    files = {
        name: sha256_of_file(os.path.join(staging, name))
        for name in (*FILES, *extra, *buffer_files)
    }
    manifest = {**manifest, "files": files}
    check_manifest(os.path.join(staging, MANIFEST), manifest)
    raw = _write_json(os.path.join(staging, MANIFEST), manifest)
    fsync_folder(staging)
    return hashlib.sha256(raw).hexdigest()


@contextmanager
def mapped_files(learner: BaseExperienceReplayLearner, which: str, folder: str) -> Iterator[None]:
    """A context in which the learner's mapped buffer (if it has one) writes (``which`` is
    ``"snapshots_to"``) or reads (``"snapshots_from"``) its snapshot files in ``folder``; its
    file errors (a full disk, a file of the wrong size) come out as :class:`trainer.
    CheckpointError` (writing) or :class:`StateFolderError` (reading), not inside the trainer's
    ``ListenerError``. So does, reading, any listener refusing the state the folder's checkpoint
    holds for it (a component's key out of range): the folder is bad, not the program."""
    buffer = getattr(learner, "buffer", None)
    with getattr(buffer, which)(folder) if isinstance(buffer, MAPPED_TYPES) else nullcontext():
        try:
            yield
        except ListenerError as exc:
            cause = exc.__cause__
            if isinstance(cause, MappedFileError):
                error = CheckpointError if which == "snapshots_to" else StateFolderError
                raise error(f"{folder}: {cause}") from exc
            if which == "snapshots_to" or exc.event != "load_checkpoint":
                raise
            raise StateFolderError(f"{os.path.join(folder, CHECKPOINT)}: {exc}") from exc


def _model_card(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``model.json``: what a deployment needs to know about ``model.safetensors``."""
    config = manifest["config"]
    return {
        "format": "renate_events.model",
        "format_version": 1,
        "architecture": manifest["architecture"],
        "config_sha256": None if config is None else config["sha256"],
        "parameters": manifest["model"],
        "learner": manifest["learner"],
        "updates": [
            {key: record.get(key) for key in ("task_id", "steps", "metrics", "best")}
            for record in manifest["history"]
        ],
    }


def _write_json(path: str, value: Any) -> bytes:
    raw = json.dumps(value, indent=2, sort_keys=True, allow_nan=False).encode("utf-8")
    with open(path, "xb") as handle:
        handle.write(raw)
        handle.flush()
        os.fsync(handle.fileno())
    return raw
