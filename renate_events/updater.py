"""Production-style continual updates: one model update per new chunk of data, state in folders.

A *state folder* holds everything an update needs to continue where the previous one stopped:

``manifest.json``
    ``{"format": "renate_events.state", "format_version": 1, "learner": "der", "learner_kwargs":
    {...}, "optimizer": {...}, "trainer": {...}, "model": {"<parameter>": [shape, dtype], ...},
    "updates": 3, "task_ids": [...], "files": {"learner.safetensors": "<sha256>"}}``
``learner.safetensors``
    the learner's trainer checkpoint (model, optimizer, buffer, components, RNG; see
    :mod:`trainer.checkpoint`).

Folders are written under a temporary name and moved into place, so a crash never leaves a
half-written state folder where the next update looks for one (a crash between moving the old
folder aside and the new one in is repaired on the next read: the old folder is moved back).
Nothing is pickled.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn

from renate_events.learners import (
    BaseExperienceReplayLearner,
    CLSExperienceReplayLearner,
    DarkExperienceReplayLearner,
    ExperienceReplayLearner,
    FineTuningLearner,
    JointLearner,
    PooledOutputDistillationExperienceReplayLearner,
    SuperExperienceReplayLearner,
)
from renate_events.memory import (
    DataBuffer,
    GreedyClassBalancingBuffer,
    ReservoirBuffer,
    SlidingWindowBuffer,
)
from trainer import FitResult, Trainer

__all__ = ["BUFFERS", "LEARNERS", "OPTIMIZERS", "ModelUpdater", "StateFolderError", "read_manifest"]

LEARNERS: dict[str, type[BaseExperienceReplayLearner]] = {
    "fine-tuning": FineTuningLearner,
    "er": ExperienceReplayLearner,
    "der": DarkExperienceReplayLearner,
    "pod-er": PooledOutputDistillationExperienceReplayLearner,
    "cls-er": CLSExperienceReplayLearner,
    "super-er": SuperExperienceReplayLearner,
    "joint": JointLearner,
}
"""Learner names for :class:`ModelUpdater` and the command line. ``"der"`` is
:class:`DarkExperienceReplayLearner` with Renate's defaults (DER++); pass ``beta=0`` for DER."""

BUFFERS: dict[str, type[DataBuffer]] = {
    "reservoir": ReservoirBuffer,
    "sliding-window": SlidingWindowBuffer,
    "greedy-class-balancing": GreedyClassBalancingBuffer,
}
"""Buffer names for :class:`ModelUpdater` and the command line (built with the learner's
``memory_size`` and ``seed``)."""

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}

FORMAT_NAME = "renate_events.state"
FORMAT_VERSION = 1
_CHECKPOINT = "learner.safetensors"
_MANIFEST = "manifest.json"


class StateFolderError(ValueError):
    """Raised when a state folder is missing, damaged, or was written by another configuration."""


def _json_able(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    try:
        json.dumps(value)
    except TypeError as exc:
        raise TypeError(
            f"ModelUpdater.{attribute.name} must be JSON-able (it is stored in the state folder's "
            f"manifest to check later updates against it): {exc}"
        ) from None


def _learner_name(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in LEARNERS:
        raise ValueError(f"unknown learner {value!r}; choose one of {sorted(LEARNERS)}")


def _optimizer_config(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _json_able(instance, attribute, value)
    name = value.get("name", "adam") if isinstance(value, Mapping) else None
    if name not in OPTIMIZERS:
        raise ValueError(
            f"optimizer must be a dict with 'name' in {sorted(OPTIMIZERS)} and its keyword "
            f"arguments (e.g. {{'name': 'adam', 'lr': 0.001}}), got {value!r}"
        )


@attrs.define(eq=False)
class ModelUpdater:
    """Runs one continual-learning update per call, carrying all state through folders.

    Args:
        model: The model to update; its architecture must match the input state folder's.
        learner: A name from :data:`LEARNERS`.
        learner_kwargs: Keyword arguments of the learner (JSON-able: ``memory_size``,
            ``alpha``, ``batch_size``, ``seed``, ...).
        optimizer: ``{"name": "adam" | "adamw" | "sgd", **kwargs}``; a fresh optimizer is made for
            every update.
        buffer: A name from :data:`BUFFERS` (used by learners with a memory).
        trainer_kwargs: Keyword arguments of :class:`trainer.Trainer` (``max_epochs``, ``device``,
            ``precision``, ...).
        metadata: Anything JSON-able to keep in the manifest (the command line stores how to
            rebuild its model there).
        input_state_folder: A folder written by a previous update, or None for the first one.
        output_state_folder: Where to write the state after each update, or None.

    Example:
        >>> import torch, tempfile
        >>> from torch.utils.data import TensorDataset
        >>> folder = tempfile.mkdtemp()
        >>> data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
        >>> updater = ModelUpdater(torch.nn.Linear(4, 2), learner="er",
        ...     learner_kwargs={"memory_size": 16, "memory_batch_size": 8},
        ...     trainer_kwargs={"device": "cpu"},
        ...     output_state_folder=folder)
        >>> updater.update(data, task_id="day-1").steps
        1
        >>> read_manifest(folder)["task_ids"]
        ['day-1']
    """

    model: nn.Module = attrs.field(validator=attrs.validators.instance_of(nn.Module))
    learner: str = attrs.field(default="der", validator=_learner_name)
    learner_kwargs: dict[str, Any] = attrs.field(factory=dict, validator=_json_able)
    optimizer: dict[str, Any] = attrs.field(
        factory=lambda: {"name": "adam", "lr": 3e-4}, validator=_optimizer_config
    )
    buffer: str = attrs.field(default="reservoir", validator=attrs.validators.in_(BUFFERS))
    trainer_kwargs: dict[str, Any] = attrs.field(factory=dict, validator=_json_able)
    metadata: dict[str, Any] = attrs.field(factory=dict, validator=_json_able)
    input_state_folder: str | os.PathLike[str] | None = None
    output_state_folder: str | os.PathLike[str] | None = None

    _learner: BaseExperienceReplayLearner | None = attrs.field(init=False, default=None)
    _manifest: dict[str, Any] | None = attrs.field(init=False, default=None)

    @property
    def learner_instance(self) -> BaseExperienceReplayLearner:
        """The learner, built (and loaded from ``input_state_folder``) on first use."""
        if self._learner is None:
            self._learner = self._build()
        return self._learner

    def update(
        self,
        train_dataset: torch.utils.data.Dataset[Any],
        val_dataset: torch.utils.data.Dataset[Any] | None = None,
        task_id: str | int | None = None,
    ) -> FitResult:
        """Train on one new chunk of data and, if configured, write the output state folder."""
        learner = self.learner_instance
        result = learner.fit(train_dataset, val_dataset)
        manifest = self._manifest_now()
        manifest["updates"] += 1
        manifest["task_ids"].append(task_id)
        if self.output_state_folder is not None:
            _write_state_folder(self.output_state_folder, learner, manifest)
        self._manifest = manifest
        return result

    # -- building and loading ----------------------------------------------------------------------

    def _build(self) -> BaseExperienceReplayLearner:
        options = dict(self.optimizer)
        factory = OPTIMIZERS[options.pop("name", "adam")]
        kwargs = dict(self.learner_kwargs)
        learner_class = LEARNERS[self.learner]
        memory_size = kwargs.get(
            "memory_size", attrs.fields_dict(learner_class)["memory_size"].default
        )
        if memory_size > 0 and learner_class is not JointLearner:
            kwargs["buffer"] = BUFFERS[self.buffer](
                max_size=memory_size, seed=kwargs.get("seed", 0)
            )
        learner = learner_class(
            model=self.model,
            optimizer=functools.partial(factory, **options),
            trainer=Trainer(**self.trainer_kwargs),
            **kwargs,
        )
        if self.input_state_folder is not None:
            manifest = read_manifest(self.input_state_folder)
            self._check_compatible(manifest)
            learner.load_checkpoint(os.path.join(self.input_state_folder, _CHECKPOINT))
            self._manifest = manifest
        return learner

    def _config(self) -> dict[str, Any]:
        return {
            "learner": self.learner,
            "learner_kwargs": self.learner_kwargs,
            "optimizer": self.optimizer,
            "buffer": self.buffer,
            "model": _model_signature(self.model),
        }

    def _manifest_now(self) -> dict[str, Any]:
        manifest = dict(self._manifest) if self._manifest is not None else {}
        manifest.update(
            format=FORMAT_NAME,
            format_version=FORMAT_VERSION,
            trainer=self.trainer_kwargs,
            metadata=self.metadata,
            **self._config(),
        )
        manifest.setdefault("updates", 0)
        manifest["task_ids"] = list(manifest.get("task_ids", []))
        return manifest

    def _check_compatible(self, manifest: Mapping[str, Any]) -> None:
        folder = self.input_state_folder
        differences = []
        mine = self._config()
        for key in ("learner", "learner_kwargs", "optimizer", "buffer"):
            if manifest.get(key) != mine[key]:
                differences.append(
                    f"{key}: the folder has {manifest.get(key)!r}, this updater {mine[key]!r}"
                )
        saved, live = manifest.get("model", {}), mine["model"]
        for name in sorted(set(saved) | set(live)):
            if name not in live:
                differences.append(f"model: the folder has parameter {name!r}, the model does not")
            elif name not in saved:
                differences.append(f"model: the model has parameter {name!r}, the folder does not")
            elif saved[name] != live[name]:
                differences.append(
                    f"model: {name!r} is {saved[name][1]} {tuple(saved[name][0])} in the folder, "
                    f"{live[name][1]} {tuple(live[name][0])} in the model"
                )
        if differences:
            raise StateFolderError(
                f"the state folder {folder} was written by a different configuration:\n  - "
                + "\n  - ".join(differences)
            )


def _model_signature(model: nn.Module) -> dict[str, list[Any]]:
    return {
        name: [list(tensor.shape), str(tensor.dtype).replace("torch.", "")]
        for name, tensor in model.state_dict().items()
    }


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and verify a state folder's manifest (format, version and file checksums).

    Raises:
        StateFolderError: When the folder or a file is missing, a checksum differs or the format
            is unknown.
    """
    folder = os.fspath(folder)
    _recover(folder)
    path = os.path.join(folder, _MANIFEST)
    if not os.path.isfile(path):
        raise StateFolderError(
            f"{folder} is not a state folder (no {_MANIFEST}); pass the output_state_folder of a "
            "previous update"
        )
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except ValueError as exc:
        raise StateFolderError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise StateFolderError(f"{path} is not a renate_events state manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise StateFolderError(
            f"{path} has format version {manifest.get('format_version')!r}; this release reads "
            f"version {FORMAT_VERSION}"
        )
    for name, checksum in manifest.get("files", {}).items():
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            raise StateFolderError(f"{folder} lacks {name}, which its manifest lists")
        if _sha256(file) != checksum:
            raise StateFolderError(f"{file} does not match the checksum in its manifest")
    return manifest


def _recover(folder: str) -> None:
    """Finish a folder swap that a crash interrupted.

    :func:`_write_state_folder` renames the old folder aside, then the new one into place. A
    crash between the two renames leaves only the old folder, under ``.<name>.old.*``: move it
    back so that the previous state stays loadable.
    """
    if os.path.exists(folder):
        return
    parent, name = os.path.split(os.path.abspath(folder))
    if not os.path.isdir(parent):
        return
    retired = sorted(
        entry
        for entry in os.listdir(parent)
        if entry.startswith(f".{name}.old.")
        and os.path.isfile(os.path.join(parent, entry, _MANIFEST))
    )
    if retired:
        os.replace(os.path.join(parent, retired[-1]), folder)


def _write_state_folder(
    folder: str | os.PathLike[str], learner: BaseExperienceReplayLearner, manifest: dict[str, Any]
) -> None:
    """Write into a temporary sibling folder, then move it into place."""
    folder = os.path.abspath(os.fspath(folder))
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", dir=parent)
    try:
        checkpoint = os.path.join(staging, _CHECKPOINT)
        learner.save_checkpoint(checkpoint)
        manifest = {**manifest, "files": {_CHECKPOINT: _sha256(checkpoint)}}
        manifest_path = os.path.join(staging, _MANIFEST)
        with open(manifest_path, "w", encoding="utf-8") as handle:
            json.dump(manifest, handle, indent=2, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        retired = None
        _recover(folder)
        if os.path.exists(folder):
            retired = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.old.", dir=parent)
            os.rmdir(retired)
            os.replace(folder, retired)
        os.replace(staging, folder)
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_directory(parent)
    for entry in os.listdir(parent):  # leftovers of writers that were killed
        stale = os.path.join(parent, entry)
        if entry.startswith(f".{os.path.basename(folder)}.") and os.path.isdir(stale):
            shutil.rmtree(stale, ignore_errors=True)


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
