"""The manifest of a state folder: its format, its file names, and the strict schema every
manifest is checked against before anything of its folder is used.

Parsing refuses what JSON allows but a manifest never holds (duplicate keys, NaN and infinities,
nesting deeper than ``_MAX_JSON_DEPTH``, more than ``_MAX_MANIFEST_BYTES``); the schema checks
the type and range of every entry and names the file and the key of the first one that is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from typing import Any

import torch

from renate_events.choices import (
    BUFFERS,
    check_known_keys,
    check_optimizer,
    trainer_arguments,
)
from renate_events.methods import LEARNERS, learner_arguments
from renate_events.state_folder.errors import StateFolderError
from trainer import validators as checks
from trainer.checkpoint import json_too_deep
from trainer.files import sha256_of_file

__all__ = [
    "BUFFER_FILE",
    "CHECKPOINT",
    "FILES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST",
    "MODEL",
    "MODEL_CARD",
    "OPTIONAL_FILES",
    "check_manifest",
    "parse_manifest",
    "read_manifest_bytes",
    "read_verified",
    "upgraded",
]

FORMAT_NAME = "renate_events.state"
"""The ``format`` of every state folder's manifest."""
FORMAT_VERSION = 2
"""The ``format_version`` written; versions 1 and 2 are read."""
_READABLE_VERSIONS = (1, 2)
CHECKPOINT = "learner.safetensors"
MODEL = "model.safetensors"
MODEL_CARD = "model.json"
MANIFEST = "manifest.json"
FILES = (CHECKPOINT, MODEL, MODEL_CARD)  # the files a state folder holds besides its manifest
_FILES_V1 = (CHECKPOINT,)
OPTIONAL_FILES = ("search.csv",)  # the trials table of a hyperparameter search
BUFFER_FILE = re.compile(r"buffer\.g[0-9]{1,18}\.[0-9]{1,4}\.bin")  # a mapped buffer's snapshot
_MANIFEST_KEYS_V1 = frozenset(
    [
        "format",
        "format_version",
        "learner",
        "learner_kwargs",
        "optimizer",
        "buffer",
        "trainer",
        "model",
        "updates",
        "task_ids",
        "metadata",
        "files",
    ]
)
_MANIFEST_KEYS = _MANIFEST_KEYS_V1 | {"architecture", "history", "config", "validation_memory"}
_MAX_MANIFEST_BYTES = 64 << 20
_MAX_JSON_DEPTH = 64
_HISTORY_KEYS = frozenset(
    [
        "task_id",
        "steps",
        "epochs",
        "stopped_early",
        "seconds",
        "metrics",
        "learner_kwargs",
        "optimizer",
        "functions",
        "functions_sha256",
        "data",
        "samples",
        "best",
        "config_sha256",
    ]
)


# -- reading -----------------------------------------------------------------------------------


def read_verified(folder: str) -> tuple[dict[str, Any], str]:
    """The manifest, checked against the schema and the files' checksums, and its token.

    The caller keeps writers away (see :func:`~renate_events.state_folder.read_manifest`).
    """
    path = os.path.join(folder, MANIFEST)
    if not os.path.lexists(path):  # a link or a folder there: refused by read_manifest_bytes
        raise StateFolderError(
            f"{folder} is not a state folder (no {MANIFEST}); pass the output_state_folder of a "
            "previous update"
        )
    raw = read_manifest_bytes(path)
    manifest = parse_manifest(path, raw)
    check_manifest(path, manifest)
    files = manifest["files"]
    for name, checksum in files.items():
        file = os.path.join(folder, name)
        if os.path.islink(file) or not os.path.isfile(file):
            raise StateFolderError(f"{folder} lacks the plain file {name} that its manifest lists")
        if sha256_of_file(file) != checksum:
            raise StateFolderError(f"{file} does not match the checksum in its manifest")
    unlisted = sorted(
        name for name in os.listdir(folder) if BUFFER_FILE.fullmatch(name) and name not in files
    )
    if unlisted:  # a mapped buffer reads only files whose checksums were checked here
        raise StateFolderError(
            f"{os.path.join(folder, unlisted[0])}: a buffer file that {MANIFEST}'s key 'files' "
            "does not list (so no checksum vouches for it); the folder was altered"
        )
    return manifest, hashlib.sha256(raw).hexdigest()


def read_manifest_bytes(path: str) -> bytes:
    """The manifest file's bytes, refused beyond ``_MAX_MANIFEST_BYTES`` and refused where it is
    a link (never followed: like every file of a state folder, it may not point elsewhere) or
    not a plain file."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if os.path.islink(path):
            raise _not_plain(path, "a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_plain(path, "not a plain file")
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read(_MAX_MANIFEST_BYTES + 1)
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise StateFolderError(f"{path} is larger than {_MAX_MANIFEST_BYTES >> 20} MiB")
    return raw


def _not_plain(path: str, kind: str) -> StateFolderError:
    return StateFolderError(
        f"{path} is {kind}; the files of a state folder are plain files, never links: replace "
        "it by a copy of the file it stands for"
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"the key {key!r} appears twice in one object")
        result[key] = value
    return result


def parse_manifest(path: str, raw: bytes) -> Any:
    """The JSON value of a manifest file's bytes (not yet checked against the schema)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StateFolderError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    if json_too_deep(text, _MAX_JSON_DEPTH):
        raise StateFolderError(f"{path} nests deeper than {_MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise StateFolderError(f"{path} is not valid JSON: {exc}") from None


def upgraded(manifest: dict[str, Any]) -> dict[str, Any]:
    """A version-1 manifest in the shape of version 2 (a history without details)."""
    if manifest["format_version"] >= 2:
        return manifest
    return {
        **manifest,
        "history": [{"task_id": task_id} for task_id in manifest["task_ids"]],
        "config": None,
        "architecture": None,
        "validation_memory": False,
    }


# -- the schema --------------------------------------------------------------------------------


def check_manifest(path: str, manifest: Any) -> None:
    """Refuse anything but what :class:`~renate_events.updater.ModelUpdater` writes, naming the
    file and the key.

    Raises:
        StateFolderError: The first entry that breaks the schema.
    """
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise StateFolderError(f"{path} is not a renate_events state manifest")
    version = manifest.get("format_version")
    if not checks.is_int(version) or version not in _READABLE_VERSIONS:
        raise StateFolderError(
            f"{path} has format version {version!r}; this release reads versions "
            f"{list(_READABLE_VERSIONS)}"
        )
    keys = _MANIFEST_KEYS if version >= 2 else _MANIFEST_KEYS_V1
    optional = {"buffer_storage"} if version >= 2 else set()
    missing, unknown = keys - set(manifest), set(manifest) - keys - optional
    if missing or unknown:
        raise StateFolderError(
            f"{path}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}"
        )
    steps = [_check_learner, _check_model, _check_progress, _check_files]
    if version >= 2:
        steps += [_check_history, _check_config]
    try:
        for check in steps:
            check(f"{path}: key", manifest)
    except ValueError as exc:  # the shared checks raise ValueError (and WrongTypeError)
        raise StateFolderError(str(exc)) from None


def _check_dict(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise checks.WrongTypeError(f"{name} must be a JSON object, got {value!r}")


def _check_learner(key: str, manifest: dict[str, Any]) -> None:
    checks.check_one_of(f"{key} 'learner'", manifest["learner"], sorted(LEARNERS))
    checks.check_one_of(f"{key} 'buffer'", manifest["buffer"], sorted(BUFFERS))
    if "buffer_storage" in manifest:  # absent: "memory"
        checks.check_one_of(f"{key} 'buffer_storage'", manifest["buffer_storage"], ["mapped"])
    for name in ("learner_kwargs", "optimizer", "trainer", "metadata"):
        _check_dict(f"{key} {name!r}", manifest[name])
    known = learner_arguments(LEARNERS[manifest["learner"]])
    check_known_keys(f"{key} 'learner_kwargs'", manifest["learner_kwargs"], known)
    check_known_keys(f"{key} 'trainer'", manifest["trainer"], trainer_arguments())
    optimizer = manifest["optimizer"]
    if set(optimizer) == {"function"}:  # a factory, recorded by name
        if not isinstance(optimizer["function"], str):
            raise checks.WrongTypeError(f"{key} 'optimizer.function' must be a string")
    else:
        check_optimizer(f"{key} 'optimizer'", optimizer)


def _check_model(key: str, manifest: dict[str, Any]) -> None:
    model = manifest["model"]
    _check_dict(f"{key} 'model'", model)
    for name, entry in model.items():
        where = f"{key} 'model.{name}'"
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)):
            raise checks.WrongTypeError(f"{where} must be [shape, dtype], got {entry!r}")
        for size in entry[0]:
            checks.check_int(f"{where} shape", size, 0)
        if not isinstance(getattr(torch, str(entry[1]), None), torch.dtype):
            raise ValueError(f"{where} names no torch dtype: {entry[1]!r}")


def _check_progress(key: str, manifest: dict[str, Any]) -> None:
    checks.check_int(f"{key} 'updates'", manifest["updates"], 0)
    task_ids = manifest["task_ids"]
    if not isinstance(task_ids, list) or len(task_ids) != manifest["updates"]:
        raise checks.WrongTypeError(
            f"{key} 'task_ids' must be a list of one task id per update "
            f"({manifest['updates']}), got {task_ids!r}"
        )
    for task_id in task_ids:
        if not (task_id is None or isinstance(task_id, str) or checks.is_int(task_id)):
            raise checks.WrongTypeError(f"{key} 'task_ids' holds {task_id!r}, not a str or int")


def _check_history(key: str, manifest: dict[str, Any]) -> None:
    """One record per update, of the keys :meth:`ModelUpdater.update` writes."""
    if not isinstance(manifest["validation_memory"], bool):
        raise checks.WrongTypeError(f"{key} 'validation_memory' must be true or false")
    if not (isinstance(manifest["architecture"], str) and manifest["architecture"]):
        raise checks.WrongTypeError(f"{key} 'architecture' must be a non-empty string")
    history = manifest["history"]
    if not isinstance(history, list) or len(history) != manifest["updates"]:
        raise checks.WrongTypeError(
            f"{key} 'history' must be a list of one record per update ({manifest['updates']})"
        )
    for index, record in enumerate(history):
        where = f"{key} 'history[{index}]'"
        _check_dict(where, record)
        unknown = sorted(set(record) - _HISTORY_KEYS)
        if unknown or record.get("task_id", object()) != manifest["task_ids"][index]:
            raise ValueError(
                f"{where} must hold the task id of update {index} and only the keys "
                f"{sorted(_HISTORY_KEYS)} (unknown: {unknown})"
            )
        _check_record(where, record)


def _check_record(where: str, record: dict[str, Any]) -> None:
    """Every key of one history record, of the type :func:`update_record` writes it."""
    for name in ("steps", "epochs"):
        if name in record:
            checks.check_int(f"{where}.{name}", record[name], 0)
    if record.get("samples") is not None:  # null: data without len()
        checks.check_int(f"{where}.samples", record["samples"], 0)
    if not isinstance(record.get("stopped_early", False), bool):
        raise checks.WrongTypeError(f"{where}.stopped_early must be true or false")
    seconds = record.get("seconds", 0.0)
    if not (checks.is_real(seconds) and seconds >= 0):
        raise checks.WrongTypeError(f"{where}.seconds must be a number >= 0, got {seconds!r}")
    for name in ("metrics", "learner_kwargs", "optimizer", "functions", "functions_sha256"):
        _check_dict(f"{where}.{name}", record.get(name, {}))
    for name, value in record.get("metrics", {}).items():
        if not checks.is_real(value):
            raise checks.WrongTypeError(f"{where}.metrics.{name} must be a number")
    for name, value in record.get("functions_sha256", {}).items():
        if not isinstance(value, str):
            raise checks.WrongTypeError(f"{where}.functions_sha256.{name} must be a string")
    sha = record.get("config_sha256")
    if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
        raise ValueError(f"{where}.config_sha256 must be null or a SHA-256 in hex, got {sha!r}")
    _check_best(f"{where}.best", record.get("best"))
    _check_signature(f"{where}.data", record.get("data"))


def _check_best(where: str, best: Any) -> None:
    if best is None:
        return
    if not isinstance(best, dict) or set(best) != {"metric", "mode", "value", "epoch"}:
        raise checks.WrongTypeError(
            f"{where} must be null or an object of metric, mode, value, epoch, got {best!r}"
        )
    if not (isinstance(best["metric"], str) and best["metric"]):
        raise checks.WrongTypeError(f"{where}.metric must be a non-empty string")
    checks.check_one_of(f"{where}.mode", best["mode"], ["min", "max"])
    if not checks.is_real(best["value"]):
        raise checks.WrongTypeError(f"{where}.value must be a number, got {best['value']!r}")
    if best["epoch"] is not None:
        checks.check_int(f"{where}.epoch", best["epoch"], 0)


def _check_signature(where: str, data: Any) -> None:
    """An update's sample signature: null, or ``{"inputs": part, "targets": part}`` with each
    part ``[shape, dtype]`` (a tensor's) or a type's name."""
    if data is None:
        return
    if not isinstance(data, dict) or set(data) != {"inputs", "targets"}:
        raise checks.WrongTypeError(
            f"{where} must be null or an object of inputs and targets, got {data!r}"
        )
    for name, part in data.items():
        if isinstance(part, str):
            continue
        if not (isinstance(part, list) and len(part) == 2 and isinstance(part[0], list)):
            raise checks.WrongTypeError(
                f"{where}.{name} must be [shape, dtype] or a type's name, got {part!r}"
            )
        for size in part[0]:
            checks.check_int(f"{where}.{name} shape", size, 0)
        if not isinstance(getattr(torch, str(part[1]), None), torch.dtype):
            raise ValueError(f"{where}.{name} names no torch dtype: {part[1]!r}")


def _check_config(key: str, manifest: dict[str, Any]) -> None:
    config = manifest["config"]
    if config is None:
        return
    _check_dict(f"{key} 'config'", config)
    if set(config) != {"file", "sha256", "text"}:
        raise ValueError(f"{key} 'config' must have the keys file, sha256, text")
    if not (isinstance(config["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", config["sha256"])):
        raise ValueError(f"{key} 'config.sha256' must be a SHA-256 in hex")
    if not isinstance(config["file"], str) or not (
        config["text"] is None or isinstance(config["text"], str)
    ):
        raise checks.WrongTypeError(f"{key} 'config' file must be a string, text a string or null")


def _check_files(key: str, manifest: dict[str, Any]) -> None:
    files = manifest["files"]
    _check_dict(f"{key} 'files'", files)
    expected = FILES if manifest["format_version"] >= 2 else _FILES_V1
    optional = OPTIONAL_FILES if manifest["format_version"] >= 2 else ()
    mapped = manifest.get("buffer_storage") == "mapped"
    listed = {name for name in files if not (mapped and BUFFER_FILE.fullmatch(str(name)))}
    if not set(expected) <= listed <= set(expected) | set(optional):
        raise ValueError(
            f"{key} 'files' must list exactly {list(expected)} (and optionally "
            f"{list(optional)}{', and the buffer files buffer.g<n>.<i>.bin' if mapped else ''})"
            f", got {sorted(files)}"
        )
    for name, checksum in files.items():
        if not (isinstance(checksum, str) and re.fullmatch(r"[0-9a-f]{64}", checksum)):
            raise ValueError(f"{key} 'files.{name}' must be a SHA-256 in hex, got {checksum!r}")
