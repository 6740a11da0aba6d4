"""Production-style continual updates: one model update per new chunk of data, state in folders.

A *state folder* holds everything an update needs to continue where the previous one stopped:

``manifest.json``
    ``{"format": "renate_events.state", "format_version": 1, "learner": "der", "learner_kwargs":
    {...}, "optimizer": {...}, "buffer": "reservoir", "trainer": {...}, "model": {"<parameter>":
    [shape, dtype], ...}, "updates": 3, "task_ids": [...], "metadata": {...}, "files":
    {"learner.safetensors": "<sha256>"}}``
``learner.safetensors``
    the learner's trainer checkpoint (model, optimizer, buffer, components, RNG; see
    :mod:`trainer.checkpoint`).

Writing and reading (the rules of ``docs/guarantees.rst``, "State folders"):

- A writer holds the exclusive lock ``.<name>.lock`` beside the folder (:class:`trainer.files.
  FileLock`) while it stages the new folder beside the old one (``.<name>.staging.<hex>``) and
  swaps it in; readers hold the shared lock while they read, so they never see a swap half done.
- A crash between the swap's two renames leaves the old folder under ``.<name>.old.<hex>``; it is
  moved back under the exclusive lock, which a live writer would hold, so a reader never repairs
  a swap in progress.
- Only a state folder or an empty folder is ever replaced; a file, a link or any other folder at
  the output path is refused.
- An update writes its output only if the output still holds what the update saw before it
  trained (for an in-place update: the state it read). Otherwise writing would discard an update
  it never saw, and it is refused with :class:`StateFolderConflictError`.
- A manifest is checked against a strict schema (:func:`read_manifest`) and every file against its
  checksum before anything of it is used. Nothing is pickled.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import inspect
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import attrs
import torch
from safetensors import SafetensorError
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
from trainer import CheckpointError, FitResult, Trainer
from trainer import validators as checks
from trainer.files import (
    FileLock,
    fsync_folder,
    is_temporary_sibling,
    lock_path,
    sha256_of_file,
    temporary_sibling,
)

__all__ = [
    "BUFFERS",
    "LEARNERS",
    "OPTIMIZERS",
    "ModelUpdater",
    "StagedStateFolder",
    "StateFolderBusyError",
    "StateFolderConflictError",
    "StateFolderError",
    "read_manifest",
    "state_token",
]

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
_FILES = (_CHECKPOINT,)  # the files a state folder holds besides its manifest
_MANIFEST_KEYS = frozenset(
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
_MAX_MANIFEST_BYTES = 64 << 20
_MAX_JSON_DEPTH = 64
_SET_BY_THE_UPDATER = frozenset(("model", "optimizer", "trainer", "buffer"))
_T = TypeVar("_T")


class StateFolderError(ValueError):
    """Raised when a state folder is missing, damaged, written by another configuration, or when
    a path may not be written (a file, a link, a folder that is not a state folder)."""


class StateFolderBusyError(StateFolderError):
    """Raised when another process held a state folder's lock for longer than ``lock_timeout``."""


class StateFolderConflictError(StateFolderError):
    """Raised when an output folder changed after the update looked at it: writing would discard
    the other writer's update. Rerun the update from the folder's current state."""


# -- argument checks ---------------------------------------------------------------------------


def _json_object(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A dict with string keys, storable in JSON without loss (no NaN or infinities)."""
    name = checks.field_name(instance, attribute)
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise checks.WrongTypeError(f"{name} must be a dict with string keys, got {value!r}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise checks.WrongTypeError(
            f"{name} must be JSON-able (it is stored in the state folder's manifest to check later "
            f"updates against it): {exc}"
        ) from None


def _learner_arguments(learner: type[BaseExperienceReplayLearner]) -> frozenset[str]:
    init = {field.alias for field in attrs.fields(learner) if field.init}
    return frozenset(init - _SET_BY_THE_UPDATER)


def _trainer_arguments() -> frozenset[str]:
    return frozenset(inspect.signature(Trainer).parameters)


def _unknown_keys(name: str, given: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{name} has unknown arguments {unknown}; known are {sorted(known)}")


def _learner_kwargs(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _json_object(instance, attribute, value)
    if instance.learner in LEARNERS:
        known = _learner_arguments(LEARNERS[instance.learner])
        _unknown_keys(checks.field_name(instance, attribute), value, known)


def _trainer_kwargs(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _json_object(instance, attribute, value)
    _unknown_keys(checks.field_name(instance, attribute), value, _trainer_arguments())


def _check_optimizer(name: str, value: Any) -> None:
    """``{"name": ..., **kwargs}`` that the named torch optimizer accepts."""
    choice = value.get("name", "adam") if isinstance(value, Mapping) else None
    if choice not in OPTIMIZERS:
        raise ValueError(
            f"{name} must be a dict with 'name' in {sorted(OPTIMIZERS)} and its keyword "
            f"arguments (e.g. {{'name': 'adam', 'lr': 0.001}}), got {value!r}"
        )
    options = {key: item for key, item in value.items() if key != "name"}
    try:  # the optimizer's own checks, on a stand-in parameter
        OPTIMIZERS[choice]([torch.zeros(1, requires_grad=True)], **options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: torch.optim refuses {options!r} for {choice!r}: {exc}") from None


def _optimizer_config(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _json_object(instance, attribute, value)
    _check_optimizer(checks.field_name(instance, attribute), value)


def _folder(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (isinstance(value, (str, os.PathLike)) and os.fspath(value)):
        raise checks.WrongTypeError(
            f"{checks.field_name(instance, attribute)} must be a path or None, got {value!r}"
        )


def _check_task_id(task_id: Any) -> None:
    if not (task_id is None or isinstance(task_id, str) or checks.is_int(task_id)):
        raise checks.WrongTypeError(
            f"ModelUpdater.update: task_id must be a str, an int or None, got {task_id!r}"
        )


def _key(folder: str | os.PathLike[str]) -> str:
    """The folder's path with its parents' links resolved (its own name is kept as it is)."""
    parent, name = os.path.split(os.path.abspath(os.fspath(folder)))
    return os.path.join(os.path.realpath(parent), name)


# -- the updater -------------------------------------------------------------------------------


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
        output_state_folder: Where to write the state after each update, or None. It must not
            exist, or be empty, or be a state folder; it may be the input folder only with
            ``in_place``.
        in_place: Allow ``output_state_folder`` to be ``input_state_folder``.
        lock_timeout: Seconds to wait for another process's lock on a state folder before
            :class:`StateFolderBusyError`.

    Raises:
        StateFolderError: From :meth:`update`, before training, when the output folder may not
            be written; after training, :class:`StateFolderConflictError` when it changed.

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
    learner: str = attrs.field(default="der", validator=checks.one_of(*LEARNERS))
    learner_kwargs: dict[str, Any] = attrs.field(factory=dict, validator=_learner_kwargs)
    optimizer: dict[str, Any] = attrs.field(
        factory=lambda: {"name": "adam", "lr": 3e-4}, validator=_optimizer_config
    )
    buffer: str = attrs.field(default="reservoir", validator=checks.one_of(*BUFFERS))
    trainer_kwargs: dict[str, Any] = attrs.field(factory=dict, validator=_trainer_kwargs)
    metadata: dict[str, Any] = attrs.field(factory=dict, validator=_json_object)
    input_state_folder: str | os.PathLike[str] | None = attrs.field(default=None, validator=_folder)
    output_state_folder: str | os.PathLike[str] | None = attrs.field(
        default=None, validator=_folder
    )
    in_place: bool = attrs.field(default=False, validator=checks.boolean)
    lock_timeout: float = attrs.field(default=60.0, validator=checks.real_in_range(0.0))

    _learner: BaseExperienceReplayLearner | None = attrs.field(init=False, default=None)
    _manifest: dict[str, Any] | None = attrs.field(init=False, default=None)
    _seen: dict[str, str | None] = attrs.field(init=False, factory=dict)

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
        """Train on one new chunk of data and, if configured, write the output state folder.

        The output folder is checked before training and again, under its lock, before it is
        replaced (see the class and module docstrings).
        """
        _check_task_id(task_id)
        learner = self.learner_instance
        expected = self._expected_output()
        result = learner.fit(train_dataset, val_dataset)
        manifest = self._manifest_now()
        manifest["updates"] += 1
        manifest["task_ids"].append(task_id)
        self._manifest = manifest
        if self.output_state_folder is not None:
            staged = self.stage_state(self.output_state_folder, expected=expected)
            staged.commit()
            self._seen[staged.folder] = staged.token
        return result

    def stage_state(
        self, folder: str | os.PathLike[str], *, expected: str | None
    ) -> StagedStateFolder:
        """Write the current state beside ``folder``, ready to be swapped in.

        Holds ``folder``'s exclusive lock until :meth:`StagedStateFolder.commit` or
        :meth:`StagedStateFolder.abort`: several folders can be staged first and committed
        together once all of them were written.

        Args:
            folder: The state folder to replace (or create).
            expected: What ``folder`` must still hold: :func:`state_token`'s answer from before
                the update started (None: nothing, or an empty folder).

        Raises:
            StateFolderConflictError: ``folder`` holds something else now.
            StateFolderError: ``folder`` may not be replaced (see :func:`state_token`).
            StateFolderBusyError: Another process held the lock for ``lock_timeout`` seconds.
            trainer.CheckpointError: The folder could not be written (disk full, file-size
                limit, permissions); nothing was changed and nothing is left behind.
        """
        manifest = self._manifest_now()
        return _stage(_key(folder), self.learner_instance, manifest, expected, self.lock_timeout)

    # -- building and loading ------------------------------------------------------------------

    def _build(self) -> BaseExperienceReplayLearner:
        learner = self._make_learner()
        if self.input_state_folder is not None:
            folder = _key(self.input_state_folder)

            def load() -> tuple[dict[str, Any], str]:
                manifest, token = _read_verified(folder)
                self._check_compatible(manifest)
                learner.load_checkpoint(os.path.join(folder, _CHECKPOINT))
                return manifest, token

            self._manifest, self._seen[folder] = _read(folder, self.lock_timeout, load)
        return learner

    def _make_learner(self) -> BaseExperienceReplayLearner:
        options = dict(self.optimizer)
        factory = OPTIMIZERS[options.pop("name", "adam")]
        kwargs = dict(self.learner_kwargs)
        learner_class = LEARNERS[self.learner]
        memory_size = kwargs.get(
            "memory_size", attrs.fields_dict(learner_class)["memory_size"].default
        )
        checks.check_int("ModelUpdater.learner_kwargs['memory_size']", memory_size, 0)
        if memory_size > 0 and learner_class is not JointLearner:
            kwargs["buffer"] = BUFFERS[self.buffer](
                max_size=memory_size, seed=kwargs.get("seed", 0)
            )
        return learner_class(
            model=self.model,
            optimizer=functools.partial(factory, **options),
            trainer=Trainer(**self.trainer_kwargs),
            **kwargs,
        )

    def _expected_output(self) -> str | None:
        """Check the output folder before training; remember what it holds now."""
        if self.output_state_folder is None:
            return None
        output = _key(self.output_state_folder)
        source = None if self.input_state_folder is None else _key(self.input_state_folder)
        if output == source and not self.in_place:
            raise StateFolderError(
                f"output_state_folder {output} is the input_state_folder; pass in_place=True "
                "(renate-events update --in-place) to replace the input, or choose another folder"
            )
        if source is not None and output.startswith(source + os.sep):
            raise StateFolderError(
                f"output_state_folder {output} is inside the input_state_folder {source}"
            )
        if output not in self._seen:
            self._seen[output] = state_token(output, timeout=self.lock_timeout)
        return self._seen[output]

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
        mine = self._config()
        differences = [
            f"{key}: the folder has {manifest[key]!r}, this updater {mine[key]!r}"
            for key in ("learner", "learner_kwargs", "optimizer", "buffer")
            if manifest[key] != mine[key]
        ]
        differences += _model_differences(manifest["model"], mine["model"])
        if differences:
            raise StateFolderError(
                f"the state folder {self.input_state_folder} was written by a different "
                "configuration: " + "; ".join(differences)
            )


def _model_differences(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    differences = []
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
    return differences


def _model_signature(model: nn.Module) -> dict[str, list[Any]]:
    return {
        name: [list(tensor.shape), str(tensor.dtype).replace("torch.", "")]
        for name, tensor in model.state_dict().items()
    }


# -- locks -------------------------------------------------------------------------------------


def _acquire(folder: str, *, shared: bool, timeout: float) -> FileLock:
    """Take ``folder``'s lock; a busy lock is a :class:`StateFolderBusyError`."""
    lock = FileLock(lock_path(folder), shared=shared, timeout=timeout)
    try:
        lock.acquire()
    except TimeoutError as exc:
        raise StateFolderBusyError(
            f"{folder} is locked by another update ({exc}); try again when it has finished, or "
            "wait longer (lock_timeout, renate-events update --lock-timeout)"
        ) from None
    return lock


def _reader_lock(folder: str, timeout: float) -> FileLock | None:
    """The shared lock, or None where there is nothing to lock or the lock cannot be made."""
    try:
        return _acquire(folder, shared=True, timeout=timeout)
    except OSError as exc:  # no parent folder, or a read-only one without a lock file
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS):
            return None
        raise


@contextmanager
def _reading(folder: str, timeout: float) -> Iterator[None]:
    """Hold ``folder``'s shared lock, first finishing a swap that a dead writer left half done.

    A live writer holds the exclusive lock from staging to the end of its swap, so a half-done
    swap seen under the shared lock is a dead writer's, and it is repaired under the exclusive
    lock (the reader waits for that like any writer).
    """
    lock = _reader_lock(folder, timeout)
    try:
        if lock is not None and _interrupted_swap(folder):
            lock.release()
            repair = _acquire(folder, shared=False, timeout=timeout)
            try:
                _recover(folder)
            finally:
                repair.release()
            lock = _acquire(folder, shared=True, timeout=timeout)
        yield
    finally:
        if lock is not None:
            lock.release()


def _read(folder: str, timeout: float, read: Callable[[], _T]) -> _T:
    """``read()``, with no writer swapping ``folder`` meanwhile; readers create no lock file.

    A writer creates the lock file before anything else. So without one, no writer has started
    here; and if none appeared by the end of an unlocked read, none disturbed it. Otherwise (and
    to repair a swap that a dead writer left half done) the read runs under the shared lock.
    """
    lock = lock_path(folder)
    if not os.path.exists(lock) and not _interrupted_swap(folder):
        try:
            result = read()
        except Exception:
            if not os.path.exists(lock):
                raise
        else:
            if not os.path.exists(lock):
                return result
    with _reading(folder, timeout):
        return read()


# -- what is at a path -------------------------------------------------------------------------


def state_token(folder: str | os.PathLike[str], *, timeout: float = 60.0) -> str | None:
    """What is at ``folder`` now, for :meth:`ModelUpdater.stage_state`'s ``expected``.

    Returns:
        None when nothing (or an empty folder) is there, else the SHA-256 of its manifest, which
        changes with every update written there.

    Raises:
        StateFolderError: ``folder`` may not be replaced: it is a file or a link, or a folder that
            is not a state folder (it holds other files, or no renate_events manifest).
    """
    folder = _key(folder)
    return _read(folder, timeout, lambda: _token(folder))


def _token(folder: str) -> str | None:
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
    others = [entry for entry in entries if entry not in (_MANIFEST, *_FILES)]
    if others or _MANIFEST not in entries:
        shown = others[:5] + (["..."] if len(others) > 5 else [])
        raise StateFolderError(
            f"{folder} is not a state folder (it holds {shown or entries}); refusing to replace "
            "it: choose another output folder"
        )
    raw = _read_manifest_bytes(os.path.join(folder, _MANIFEST))
    manifest = _parse_manifest(os.path.join(folder, _MANIFEST), raw)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise StateFolderError(
            f"{folder} is not a state folder (its {_MANIFEST} is not a renate_events state "
            "manifest); refusing to replace it: choose another output folder"
        )
    return hashlib.sha256(raw).hexdigest()


# -- reading -----------------------------------------------------------------------------------


def read_manifest(folder: str | os.PathLike[str], *, timeout: float = 60.0) -> dict[str, Any]:
    """Read and verify a state folder's manifest: its schema and every file's checksum.

    Waits (up to ``timeout`` seconds) for a writer that is swapping the folder, and finishes a
    swap that a killed writer left half done.

    Raises:
        StateFolderError: When the folder or a file is missing, a checksum differs, or the
            manifest breaks the schema (the message names the file and the key).
        StateFolderBusyError: When a writer held the folder's lock for ``timeout`` seconds.
    """
    folder = _key(folder)
    return _read(folder, timeout, lambda: _read_verified(folder)[0])


def _read_verified(folder: str) -> tuple[dict[str, Any], str]:
    """The manifest, checked against the schema and the files' checksums, and its token."""
    path = os.path.join(folder, _MANIFEST)
    if not os.path.isfile(path):
        raise StateFolderError(
            f"{folder} is not a state folder (no {_MANIFEST}); pass the output_state_folder of a "
            "previous update"
        )
    raw = _read_manifest_bytes(path)
    manifest = _parse_manifest(path, raw)
    _check_manifest(path, manifest)
    for name, checksum in manifest["files"].items():
        file = os.path.join(folder, name)
        if os.path.islink(file) or not os.path.isfile(file):
            raise StateFolderError(f"{folder} lacks the plain file {name} that its manifest lists")
        if sha256_of_file(file) != checksum:
            raise StateFolderError(f"{file} does not match the checksum in its manifest")
    return manifest, hashlib.sha256(raw).hexdigest()


def _read_manifest_bytes(path: str) -> bytes:
    with open(path, "rb") as handle:
        raw = handle.read(_MAX_MANIFEST_BYTES + 1)
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise StateFolderError(f"{path} is larger than {_MAX_MANIFEST_BYTES >> 20} MiB")
    return raw


_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def _too_deep(text: str) -> bool:
    """Whether JSON ``text`` nests arrays and objects deeper than the manifest ever needs."""
    depth = 0
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > _MAX_JSON_DEPTH:
                return True
        elif token in "]}":
            depth -= 1
    return False


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"the key {key!r} appears twice in one object")
        result[key] = value
    return result


def _parse_manifest(path: str, raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StateFolderError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    if _too_deep(text):
        raise StateFolderError(f"{path} nests deeper than {_MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise StateFolderError(f"{path} is not valid JSON: {exc}") from None


# -- the manifest schema -----------------------------------------------------------------------


def _check_manifest(path: str, manifest: Any) -> None:
    """Refuse anything but what :class:`ModelUpdater` writes, naming the file and the key."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise StateFolderError(f"{path} is not a renate_events state manifest")
    version = manifest.get("format_version")
    if not checks.is_int(version) or version != FORMAT_VERSION:
        raise StateFolderError(
            f"{path} has format version {version!r}; this release reads version {FORMAT_VERSION}"
        )
    missing, unknown = _MANIFEST_KEYS - set(manifest), set(manifest) - _MANIFEST_KEYS
    if missing or unknown:
        raise StateFolderError(
            f"{path}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}"
        )
    try:
        for check in (_check_learner, _check_model, _check_progress, _check_files):
            check(f"{path}: key", manifest)
    except ValueError as exc:  # the shared checks raise ValueError (and WrongTypeError)
        raise StateFolderError(str(exc)) from None


def _check_dict(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise checks.WrongTypeError(f"{name} must be a JSON object, got {value!r}")


def _check_learner(key: str, manifest: dict[str, Any]) -> None:
    checks.check_one_of(f"{key} 'learner'", manifest["learner"], sorted(LEARNERS))
    checks.check_one_of(f"{key} 'buffer'", manifest["buffer"], sorted(BUFFERS))
    for name in ("learner_kwargs", "optimizer", "trainer", "metadata"):
        _check_dict(f"{key} {name!r}", manifest[name])
    known = _learner_arguments(LEARNERS[manifest["learner"]])
    _unknown_keys(f"{key} 'learner_kwargs'", manifest["learner_kwargs"], known)
    _unknown_keys(f"{key} 'trainer'", manifest["trainer"], _trainer_arguments())
    _check_optimizer(f"{key} 'optimizer'", manifest["optimizer"])


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


def _check_files(key: str, manifest: dict[str, Any]) -> None:
    files = manifest["files"]
    _check_dict(f"{key} 'files'", files)
    if sorted(files) != sorted(_FILES):
        raise ValueError(f"{key} 'files' must list exactly {list(_FILES)}, got {sorted(files)}")
    for name, checksum in files.items():
        if not (isinstance(checksum, str) and re.fullmatch(r"[0-9a-f]{64}", checksum)):
            raise ValueError(f"{key} 'files.{name}' must be a SHA-256 in hex, got {checksum!r}")


# -- interrupted swaps and leftovers (under the exclusive lock only) ---------------------------


def _siblings(folder: str, tag: str) -> list[str]:
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


def _interrupted_swap(folder: str) -> bool:
    return not os.path.lexists(folder) and any(
        os.path.isfile(os.path.join(old, _MANIFEST)) for old in _siblings(folder, "old")
    )


def _recover(folder: str) -> None:
    """Move back the old folder of a swap whose writer died; remove its other leftovers.

    :func:`_stage` and :meth:`StagedStateFolder.commit` run under the exclusive lock, so when the
    caller holds it, no live writer owns anything named ``.<name>.staging.*`` or ``.<name>.old.*``.
    """
    if _interrupted_swap(folder):
        retired = [old for old in _siblings(folder, "old") if os.path.isfile(f"{old}/{_MANIFEST}")]
        os.rename(max(retired, key=lambda old: os.stat(old).st_mtime_ns), folder)
        fsync_folder(os.path.dirname(folder))
    for leftover in _siblings(folder, "staging") + _siblings(folder, "old"):
        shutil.rmtree(leftover, ignore_errors=True)


# -- writing -----------------------------------------------------------------------------------

_WRITE_ERRORS = (OSError, CheckpointError, SafetensorError)


def _write_failed(folder: str, exc: BaseException) -> CheckpointError:
    reason = " ".join(str(exc).split())
    return CheckpointError(
        f"could not write the state folder {folder}: {reason}; what was there is unchanged"
    )


@attrs.define(eq=False)
class StagedStateFolder:
    """A new state folder written beside its destination, not yet swapped in.

    Made by :meth:`ModelUpdater.stage_state`, which holds the destination's exclusive lock until
    :meth:`commit` or :meth:`abort` releases it.

    Attributes:
        folder: The destination.
        staging: Where the new folder is now (``.<name>.staging.<hex>`` beside ``folder``).
        token: The new folder's :func:`state_token`.
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


def _stage(
    folder: str,
    learner: BaseExperienceReplayLearner,
    manifest: dict[str, Any],
    expected: str | None,
    timeout: float,
) -> StagedStateFolder:
    """Take the exclusive lock, check the destination, write the new folder beside it."""
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        lock = _acquire(folder, shared=False, timeout=timeout)
    except OSError as exc:
        raise _write_failed(folder, exc) from exc
    staging = temporary_sibling(folder, "staging")
    try:
        _recover(folder)
        found = _token(folder)
        if found != expected:
            raise StateFolderConflictError(
                f"{folder} was changed by another update after this one looked at it; writing "
                "would discard that update: run this update again from the folder's current state"
            )
        os.mkdir(staging)
        token = _write_contents(staging, learner, manifest)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        lock.release()
        if isinstance(exc, _WRITE_ERRORS):
            raise _write_failed(folder, exc) from exc
        raise
    return StagedStateFolder(folder, staging, token, lock)


def _write_contents(staging: str, learner: BaseExperienceReplayLearner, manifest: dict) -> str:
    """Write the checkpoint and the manifest into ``staging``; return the manifest's token."""
    checkpoint = os.path.join(staging, _CHECKPOINT)
    learner.save_checkpoint(checkpoint)
    manifest = {**manifest, "files": {_CHECKPOINT: sha256_of_file(checkpoint)}}
    _check_manifest(os.path.join(staging, _MANIFEST), manifest)
    raw = json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False).encode("utf-8")
    with open(os.path.join(staging, _MANIFEST), "xb") as handle:
        handle.write(raw)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_folder(staging)
    return hashlib.sha256(raw).hexdigest()


def _write_state_folder(
    folder: str | os.PathLike[str],
    learner: BaseExperienceReplayLearner,
    manifest: dict[str, Any],
    *,
    timeout: float = 60.0,
) -> None:
    """Replace ``folder`` with the learner's state, whatever state folder is there now."""
    folder = _key(folder)
    expected = _read(folder, timeout, lambda: _token(folder))
    _stage(folder, learner, manifest, expected, timeout).commit()
