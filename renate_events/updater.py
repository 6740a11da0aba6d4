"""Production-style continual updates: one model update per new chunk of data, state in folders.

A *state folder* holds everything an update needs to continue where the previous one stopped:

``manifest.json``
    ``{"format": "renate_events.state", "format_version": 2, "learner": "der", "learner_kwargs":
    {...}, "optimizer": {...}, "buffer": "reservoir", "trainer": {...}, "model": {"<parameter>":
    [shape, dtype], ...}, "architecture": "...", "updates": 3, "task_ids": [...], "history":
    [{...}, ...], "config": {...} | null, "validation_memory": true, "metadata": {...}, "files":
    {"learner.safetensors": "<sha256>", ...}}``. ``history`` has one record per update: its task
    id, steps, logged metrics, hyperparameters, the names of the functions it used, the sample
    shapes of its data and the best-model selection. ``config`` is the config file's name, SHA-256
    and text (kept to say what changed when a later update uses another).
``learner.safetensors``
    the learner's trainer checkpoint (model, optimizer, buffer, components, validation memory,
    RNG; see :mod:`trainer.checkpoint`).
``model.safetensors``
    the model alone, loadable with ``safetensors.torch.load_file`` and ``load_state_dict``
    without this library (the deployable artifact).
``model.json``
    a short card: the architecture's name, the config file's SHA-256, the parameters' shapes and
    the update history (task id, steps, metrics of each update).

Folders of format version 1 (``manifest.json`` and ``learner.safetensors`` only) are read as
well; the next update writes them as version 2.

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
import math
import os
import re
import resource
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, TypeVar, cast

import attrs
import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from renate_events.config import ConfigFile, load_config
from renate_events.inference import forward, model_device, takes_task_id
from renate_events.learners import (
    BaseExperienceReplayLearner,
)
from renate_events.memory import (
    DataBuffer,
    GreedyClassBalancingBuffer,
    HerdingBuffer,
    InfiniteBuffer,
    ReservoirBuffer,
    SlidingWindowBuffer,
)
from renate_events.memory.mapped import (
    MappedFileError,
    MappedGreedyClassBalancingBuffer,
    MappedReservoirBuffer,
    MappedSlidingWindowBuffer,
)
from renate_events.methods import LEARNERS, METHODS, learner_arguments, method
from trainer import CheckpointError, FitResult, Trainer
from trainer import validators as checks
from trainer.data import to_device
from trainer.exceptions import ListenerError
from trainer.files import (
    FileLock,
    fsync_folder,
    is_temporary_sibling,
    lock_path,
    sha256_of_file,
    temporary_sibling,
)
from trainer.listeners import EarlyStopping

__all__ = [
    "BUFFERS",
    "BUFFER_STORAGES",
    "OPTIMIZERS",
    "TRANSFORMS",
    "ModelUpdater",
    "StagedStateFolder",
    "StateFolderBusyError",
    "StateFolderConflictError",
    "StateFolderError",
    "UpdateInputError",
    "check_config_file",
    "dataset_tensors",
    "default_buffer",
    "read_manifest",
    "state_token",
]

BUFFERS: dict[str, type[DataBuffer]] = {
    "reservoir": ReservoirBuffer,
    "sliding-window": SlidingWindowBuffer,
    "greedy-class-balancing": GreedyClassBalancingBuffer,
    "herding": HerdingBuffer,
}
"""Buffer names for :class:`ModelUpdater` and the command line (built with the learner's
``memory_size`` and ``seed``)."""

BUFFER_STORAGES = ("memory", "mapped")
"""Where :class:`ModelUpdater` keeps the buffer: ``"memory"`` (tensors, saved inside
``learner.safetensors``) or ``"mapped"`` (memory-mapped files, saved as files of the state folder:
see :mod:`renate_events.memory.mapped` and the docs' "Buffers beyond RAM")."""


def default_buffer(learner: str) -> str:
    """The buffer ``learner`` gets when none is named: its method spec's ``default_buffer``.

    Example:
        >>> default_buffer("icarl"), default_buffer("der")
        ('herding', 'reservoir')
    """
    spec = METHODS.get(learner)  # an unknown name is the learner field's error, not this one's
    return "reservoir" if spec is None else spec.default_buffer


_MAPPED_BUFFERS: dict[str, type[DataBuffer]] = {
    "reservoir": MappedReservoirBuffer,
    "sliding-window": MappedSlidingWindowBuffer,
    "greedy-class-balancing": MappedGreedyClassBalancingBuffer,
}
_BUFFER_FILE = re.compile(r"buffer\.g[0-9]{1,18}\.[0-9]{1,4}\.bin")  # a mapped buffer's snapshot

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}

FORMAT_NAME = "renate_events.state"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_CHECKPOINT = "learner.safetensors"
_MODEL = "model.safetensors"
_MODEL_CARD = "model.json"
_MANIFEST = "manifest.json"
_FILES = (_CHECKPOINT, _MODEL, _MODEL_CARD)  # the files a state folder holds besides its manifest
_FILES_V1 = (_CHECKPOINT,)
_OPTIONAL_FILES = ("search.csv",)  # the trials table of a hyperparameter search
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
_MAX_CONFIG_TEXT = 1 << 20  # a config file's text is kept in the manifest up to this size
TRANSFORMS = (
    "train_transform",
    "train_target_transform",
    "buffer_transform",
    "buffer_target_transform",
    "test_transform",
)
"""The transform arguments of :class:`ModelUpdater` (Renate's names), passed to the learner."""
_CALLABLES = ("loss_fn", "learning_rate_scheduler", "collate_fn", *TRANSFORMS)
_STRUCTURAL = ("memory_size", "feature_modules")  # learner_kwargs that shape the stored state
_VALIDATION_MEMORY = "validation_memory"  # the listener's name in the learner's checkpoint
_T = TypeVar("_T")


class StateFolderError(ValueError):
    """Raised when a state folder is missing, damaged, written by another configuration, or when
    a path may not be written (a file, a link, a folder that is not a state folder)."""


class StateFolderBusyError(StateFolderError):
    """Raised when another process held a state folder's lock for longer than ``lock_timeout``."""


class UpdateInputError(ValueError):
    """Raised before training when the data does not fit the model or the state folder (sample
    shapes or dtypes, labels, a model that refuses the inputs), when a config file differs from
    the one the state folder was written with, or when the best-model metric is not reported."""


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


def _trainer_arguments() -> frozenset[str]:
    return frozenset(inspect.signature(Trainer).parameters)


def _unknown_keys(name: str, given: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{name} has unknown arguments {unknown}; known are {sorted(known)}")


def _learner_kwargs(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _json_object(instance, attribute, value)
    if instance.learner in LEARNERS:
        known = learner_arguments(LEARNERS[instance.learner])
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


def _existing_folder(path: str) -> str:
    """``path``, or its nearest existing ancestor (on the disk where a folder made there goes)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _optimizer_config(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if callable(value) and not isinstance(value, Mapping):
        return  # a factory f(params), recorded by name
    _json_object(instance, attribute, value)
    _check_optimizer(checks.field_name(instance, attribute), value)


def _optional_callable(signature: str) -> Any:
    return attrs.validators.optional(checks.is_callable(signature))


def _metrics_mapping(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise checks.WrongTypeError(
            f"ModelUpdater.metrics must be a mapping {{name: fn(outputs, targets)}}, got {value!r}"
        )
    return dict(value)


def _listeners(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    for listener in value:
        if listener is None or isinstance(listener, (str, bytes, int, float)):
            raise checks.WrongTypeError(
                f"{checks.field_name(instance, attribute)} must be listener objects, got "
                f"{listener!r}"
            )


def _transforms(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    name = checks.field_name(instance, attribute)
    for key, function in value.items():
        if key not in TRANSFORMS:
            raise ValueError(f"{name} has the unknown key {key!r}; known are {list(TRANSFORMS)}")
        if not callable(function):
            raise checks.WrongTypeError(f"{name}[{key!r}] must be a callable, got {function!r}")


def _describe(function: Any) -> str:
    """What a state folder records of a callable: where it is defined and its name."""
    if isinstance(function, functools.partial):
        return f"partial({_describe(function.func)})"
    if isinstance(function, _ConfigFunction):
        return f"{os.path.basename(function.config.path)}:{function.name}"
    module = getattr(function, "__module__", None) or "?"
    if module.startswith("_renate_events_config_"):  # defined in a config file
        module = "config"
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}"


# -- the updater -------------------------------------------------------------------------------


@attrs.define(eq=False)
class _BestWeights:
    """Keeps a CPU copy of the model's weights at its best validation of one update."""

    model: nn.Module
    metric: str
    mode: str
    best: float | None = None
    epoch: int | None = None
    weights: dict[str, torch.Tensor] | None = None

    def on_validation_end(self, state: Any, metrics: Mapping[str, float]) -> None:
        value = float(metrics[self.metric])
        if value != value:  # NaN is never the best
            return
        if self.best is None or (value < self.best if self.mode == "min" else value > self.best):
            self.best, self.epoch = value, int(state.epoch)
            self.weights = {
                key: tensor.detach().to("cpu", copy=True)
                for key, tensor in self.model.state_dict().items()
            }


@attrs.define(eq=False)
class _ValidationMemory:
    """Validation data of earlier updates, kept in the learner's checkpoint (Renate keeps all of
    it; ``max_size`` bounds it with reservoir sampling)."""

    buffer: DataBuffer

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        checkpoint["buffer"] = self.buffer.state_dict()

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        if "buffer" not in checkpoint:
            raise ValueError("the validation memory's state has no 'buffer'")
        self.buffer.load_state_dict(checkpoint["buffer"])

    def data(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if len(self.buffer) == 0:
            return None
        inputs, targets = self.buffer.dataset().__getitems__(list(range(len(self.buffer))))
        return inputs, targets


def dataset_tensors(data: Dataset[Any], collate_fn: Any, what: str) -> tuple[torch.Tensor, ...]:
    """All of ``data`` as ``(inputs, targets)`` tensors, read batch by batch (``what`` names it
    in errors)."""
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 2:
        return tensors
    parts: list[Any] = []
    for batch in DataLoader(data, batch_size=512, shuffle=False, collate_fn=collate_fn):
        if not (
            isinstance(batch, (tuple, list))
            and len(batch) == 2
            and all(isinstance(part, torch.Tensor) for part in batch)
        ):
            raise UpdateInputError(
                f"{what}: the validation memory keeps (inputs, targets) tensor batches, got "
                f"{type(batch).__name__}; pass validation_memory=False "
                "(renate-events --no-validation-memory) for other data"
            )
        parts.append(batch)
    if not parts:
        raise UpdateInputError(f"{what} is empty; pass None for no validation data")
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _sample_signature(inputs: Any, targets: Any) -> dict[str, Any]:
    """The per-sample shape and dtype of a batch, as the manifest records them."""

    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return [list(value.shape[1:]), str(value.dtype).replace("torch.", "")]
        return type(value).__name__

    return {"inputs": one(inputs), "targets": one(targets)}


def _check_buffer_room(learner: BaseExperienceReplayLearner, signature: Any) -> None:
    """A mapped buffer without storage yet (a first update) makes its files only once training
    has begun: refuse now a disk without room for ``max_size`` samples of ``signature`` (their
    metadata, such as DER's logits, not counted: a lower bound)."""
    buffer = getattr(learner, "buffer", None)
    if not isinstance(buffer, _MAPPED_TYPES) or buffer.capacity > 0 or not signature:
        return
    pairs = [signature["inputs"], signature["targets"]]
    if not all(isinstance(pair, list) and hasattr(torch, pair[1]) for pair in pairs):
        return  # inputs that are not one tensor: their size is known at the first batch
    rows = [
        math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        for shape, dtype in pairs
    ]
    row = sum(rows)
    needed = row * cast(int, buffer.max_size)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]  # per file: the inputs' is the largest
    if limit != resource.RLIM_INFINITY and max(rows) * cast(int, buffer.max_size) > limit:
        raise UpdateInputError(
            f"the mapped buffer's inputs file needs {max(rows) * cast(int, buffer.max_size)} bytes "
            f"({buffer.max_size} samples of {max(rows)} bytes), but the process's file-size "
            f"limit is {limit} bytes; raise it (ulimit -f) or lower memory_size"
        )
    stats = os.statvfs(buffer.folder)
    free = stats.f_bavail * stats.f_frsize
    if free < needed:
        raise UpdateInputError(
            f"the mapped buffer needs at least {needed} bytes in {buffer.folder} ({buffer.max_size}"
            f" samples of {row} bytes), but its disk has {free} bytes free; free space there or "
            "pass buffer_folder on another disk"
        )


def _first_difference(old: str, new: str) -> str:
    """``line 12: 'a' became 'b'`` for the first lines that differ between two texts."""
    import difflib

    old_lines, new_lines = old.splitlines(), new.splitlines()
    matcher = difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False)
    for tag, i1, _, j1, _ in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag == "delete":
            return f"the line {old_lines[i1].strip()!r} before line {j1 + 1} was removed"
        if tag == "insert":
            return f"line {j1 + 1}, {new_lines[j1].strip()!r}, was added"
        return f"line {j1 + 1}: {old_lines[i1].strip()!r} became {new_lines[j1].strip()!r}"
    return "only whitespace at the ends of lines differs"


@attrs.define(eq=False)
class ModelUpdater:
    """Runs one continual-learning update per call, carrying all state through folders.

    Args:
        model: The model to update; its architecture must match the input state folder's.
        learner: A name from :data:`renate_events.methods.LEARNERS`.
        learner_kwargs: Keyword arguments of the learner (JSON-able: ``memory_size``,
            ``alpha``, ``batch_size``, ``seed``, ...). A later update may change them, except
            ``memory_size`` and ``feature_modules`` (they shape the stored buffer).
        optimizer: ``{"name": "adam" | "adamw" | "sgd", **kwargs}``, or a factory
            ``f(params)`` returning a ``torch.optim.Optimizer``; a fresh optimizer is made for
            every update (Renate's behaviour).
        buffer: A name from :data:`BUFFERS` (used by learners with a memory); by default the
            learner's (:func:`default_buffer`: ``"greedy-class-balancing"`` for ``"gdumb"``,
            which needs it, ``"herding"`` for ``"icarl"``, which needs it, else
            ``"reservoir"``).
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
        loss_fn: ``(outputs, targets) -> losses`` (default: the learner's cross-entropy).
        learning_rate_scheduler: ``f(optimizer)`` returning a scheduler, made for every update.
        learning_rate_scheduler_interval: ``"epoch"`` or ``"step"``.
        listeners: Listeners subscribed to the learner's trainer (their checkpoint state, if any,
            is kept in the state folder, so later updates must subscribe the same ones).
        metrics: ``{name: fn(outputs, targets)}``, reported by validation as ``val_<name>``.
        collate_fn: The ``DataLoader`` collate function for datasets that are not tensors.
        transforms: Functions on whole batches under Renate's names (:data:`TRANSFORMS`),
            passed to the learner.
        metric: A validation metric (``"val_loss"``, ``"val_accuracy"``, ``"val_<name>"``): the
            output state holds the model's weights from the validation where it was best, and
            early stopping watches it. None: the weights after the last epoch.
        mode: ``"min"`` or ``"max"``: whether a lower or a higher ``metric`` is better; None
            (default): ``"max"`` for a metric named ``*accuracy``, else ``"min"`` (Renate's
            default is always ``"min"``).
        early_stopping_enabled: Stop an update once ``metric`` has not improved for
            ``early_stopping_patience`` validations.
        early_stopping_patience: See ``early_stopping_enabled``.
        validation_memory: Validate each update on its own validation data and on all earlier
            updates' (Renate's validation memory), kept in the state folder.
        validation_memory_size: At most this many validation samples are kept (reservoir
            sampling); None keeps all of them.
        config_file: The config file the functions came from (see :meth:`from_config`); its
            SHA-256 and text are recorded, and a later update from a different file is refused
            unless ``accept_config_change``.
        accept_config_change: Allow a config file that differs from the state folder's.
        architecture: The model's name for ``model.json`` (default: the model's
            ``architecture`` attribute, or its class name).
        buffer_storage: A name from :data:`BUFFER_STORAGES`. ``"mapped"`` keeps the buffer in
            memory-mapped files (for buffers larger than RAM); the state folder then holds the
            buffer's snapshot files ``buffer.g<generation>.<i>.bin`` beside the checkpoint. The
            choice is recorded, and a later update must make the same one.
        buffer_folder: Where a mapped buffer's working files are made while it is in use
            (default: the output state folder's parent, or its nearest existing ancestor, else
            the input's, else the system's temporary folder); they have no name there, so
            nothing is left when the process ends, killed or not. Best on the disk of the state
            folders.

    Raises:
        StateFolderError: From :meth:`update`, before training, when the output folder may not
            be written; after training, :class:`StateFolderConflictError` when it changed.
        UpdateInputError: From :meth:`update`, before training, when the data does not fit.

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
    optimizer: dict[str, Any] | Callable[..., torch.optim.Optimizer] = attrs.field(
        factory=lambda: {"name": "adam", "lr": 1e-3}, validator=_optimizer_config
    )
    buffer: str = attrs.field(
        default=attrs.Factory(lambda self: default_buffer(self.learner), takes_self=True),
        validator=checks.one_of(*BUFFERS),
    )
    trainer_kwargs: dict[str, Any] = attrs.field(factory=dict, validator=_trainer_kwargs)
    metadata: dict[str, Any] = attrs.field(factory=dict, validator=_json_object)
    input_state_folder: str | os.PathLike[str] | None = attrs.field(default=None, validator=_folder)
    output_state_folder: str | os.PathLike[str] | None = attrs.field(
        default=None, validator=_folder
    )
    in_place: bool = attrs.field(default=False, validator=checks.boolean)
    lock_timeout: float = attrs.field(default=60.0, validator=checks.real_in_range(0.0))
    loss_fn: Callable[..., torch.Tensor] | None = attrs.field(
        default=None, kw_only=True, validator=_optional_callable("(outputs, targets) -> losses")
    )
    learning_rate_scheduler: Callable[[torch.optim.Optimizer], Any] | None = attrs.field(
        default=None, kw_only=True, validator=_optional_callable("(optimizer) -> scheduler")
    )
    learning_rate_scheduler_interval: str = attrs.field(
        default="epoch", kw_only=True, validator=checks.one_of("epoch", "step")
    )
    listeners: Sequence[Any] = attrs.field(
        factory=tuple, kw_only=True, converter=tuple, validator=_listeners
    )
    metrics: Mapping[str, Callable[..., Any]] = attrs.field(
        factory=dict, kw_only=True, converter=_metrics_mapping
    )
    collate_fn: Callable[[list[Any]], Any] | None = attrs.field(
        default=None, kw_only=True, validator=_optional_callable("(samples) -> batch")
    )
    transforms: Mapping[str, Callable[..., Any]] = attrs.field(
        factory=dict, kw_only=True, converter=dict, validator=_transforms
    )
    metric: str | None = attrs.field(
        default=None, kw_only=True, validator=checks.non_empty_string("a name", optional=True)
    )
    mode: str | None = attrs.field(
        default=None, kw_only=True, validator=attrs.validators.optional(checks.one_of("min", "max"))
    )
    early_stopping_enabled: bool = attrs.field(
        default=False, kw_only=True, validator=checks.boolean
    )
    early_stopping_patience: int = attrs.field(
        default=3, kw_only=True, validator=checks.int_at_least(1)
    )
    validation_memory: bool = attrs.field(default=True, kw_only=True, validator=checks.boolean)
    validation_memory_size: int | None = attrs.field(
        default=None, kw_only=True, validator=checks.int_at_least(1, optional=True)
    )
    config_file: ConfigFile | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(attrs.validators.instance_of(ConfigFile)),
    )
    accept_config_change: bool = attrs.field(default=False, kw_only=True, validator=checks.boolean)
    architecture: str | None = attrs.field(
        default=None, kw_only=True, validator=checks.non_empty_string("a name", optional=True)
    )
    buffer_storage: str = attrs.field(
        default="memory", kw_only=True, validator=checks.one_of(*BUFFER_STORAGES)
    )
    buffer_folder: str | os.PathLike[str] | None = attrs.field(
        default=None, kw_only=True, validator=_folder
    )

    _learner: BaseExperienceReplayLearner | None = attrs.field(init=False, default=None)
    _manifest: dict[str, Any] | None = attrs.field(init=False, default=None)
    _seen: dict[str, str | None] = attrs.field(init=False, factory=dict)
    _memory: _ValidationMemory | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.mode is None:  # an accuracy is better when higher; anything else (a loss) lower
            accuracy = self.metric is not None and self.metric.endswith("accuracy")
            self.mode = "max" if accuracy else "min"
        if self.early_stopping_enabled and self.metric is None:
            raise ValueError(
                "ModelUpdater.early_stopping_enabled needs a metric to watch: pass metric="
                "'val_loss' (and mode='min') or another validation metric"
            )
        spec = method(self.learner)
        if self.buffer not in spec.buffers:
            raise ValueError(
                f"ModelUpdater: learner={self.learner!r} cannot use buffer={self.buffer!r}: its "
                f"buffers are {list(spec.buffers)}; use ModelUpdater: buffer="
                f"{spec.default_buffer!r} (its default: leave buffer unset; on the command line: "
                f"--buffer {spec.default_buffer})"
            )
        if self.buffer_storage == "mapped" and self.buffer not in _MAPPED_BUFFERS:
            raise ValueError(
                f"ModelUpdater: buffer_storage='mapped' has no {self.buffer!r} buffer; mapped "
                f"buffers are {sorted(_MAPPED_BUFFERS)}: pick one of them or buffer_storage="
                "'memory' (renate-events: --buffer-storage memory)"
            )

    @classmethod
    def from_config(
        cls, config: ConfigFile | str | os.PathLike[str], **kwargs: Any
    ) -> ModelUpdater:
        """An updater whose model and functions come from a config file (see
        :mod:`renate_events.config`); ``kwargs`` are the other arguments of the class.

        ``model_fn`` makes the model (unless ``model`` is given), and ``loss_fn``,
        ``optimizer_fn``, ``lr_scheduler_fn``, ``listeners``, ``metrics_fn``, ``collate_fn`` and
        the transform functions, where the file defines them, give the arguments of the same
        meaning. The file's SHA-256 and text are recorded in the state folder.
        """
        if not isinstance(config, ConfigFile):
            config = load_config(config)
        functions: dict[str, Any] = {"config_file": config, "model": kwargs.pop("model", None)}
        if functions["model"] is None:
            functions["model"] = config.model()
        if config.has("loss_fn"):
            functions["loss_fn"] = config.loss()
        if config.has("optimizer_fn"):
            functions["optimizer"] = _ConfigFunction(config, "optimizer_fn")
        if config.has("lr_scheduler_fn"):
            functions["learning_rate_scheduler"] = _ConfigFunction(config, "lr_scheduler_fn")
            functions["learning_rate_scheduler_interval"] = _scheduler_interval(config)
        functions["listeners"] = config.listeners()
        functions["metrics"] = config.metrics()
        functions["collate_fn"] = config.collate()
        functions["transforms"] = {
            name: function
            for name in TRANSFORMS
            if (function := config.transform(name)) is not None
        }
        return cls(**{**functions, **kwargs})

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
        *,
        write: bool = True,
    ) -> FitResult:
        """Train on one new chunk of data and, if configured, write the output state folder.

        Before training, the data is checked against the model (one forward pass on a sample)
        and against the samples of earlier updates, the best-model metric against what the
        update reports, and the output folder against what may be written (see the class and
        module docstrings). With ``metric``, the model ends with its best validation's weights.
        ``write=False`` leaves the output folder to :meth:`write_output` (a search writes only
        its best trial's).
        """
        _check_task_id(task_id)
        train_dataset = _pair_as_dataset(train_dataset, "train_dataset")
        val_dataset = _pair_as_dataset(val_dataset, "val_dataset")
        learner = self.learner_instance
        self._expected_output()  # checks the output folder, remembers what it holds now
        signature = self._check_inputs(learner, train_dataset, "the training data")
        _check_buffer_room(learner, signature)
        current, validation = self._validation_data(val_dataset)
        self._check_metric(validation is not None)
        best = None if self.metric is None else _BestWeights(learner.model, self.metric, self.mode)
        started = time.time()
        with ExitStack() as stack:
            if best is not None:
                stack.enter_context(learner.trainer.subscribed(best, name="_best_weights"))
            if self.early_stopping_enabled:
                stopper = EarlyStopping(
                    monitor=self.metric, mode=self.mode, patience=self.early_stopping_patience
                )
                stack.enter_context(learner.trainer.subscribed(stopper, name="_early_stopping"))
            result = learner.fit(train_dataset, validation)
        if best is not None and best.weights is not None:
            learner.model.load_state_dict(best.weights)
        if current is not None and self._memory is not None:
            self._memory.buffer.update(*current)
        record = self._record(task_id, result, signature, best, time.time() - started)
        manifest = self._manifest_now()
        manifest["updates"] += 1
        manifest["task_ids"].append(task_id)
        manifest["history"].append(record)
        self._manifest = manifest
        if write and self.output_state_folder is not None:
            self.write_output()
        return result

    def write_output(self, files: Mapping[str, bytes] | None = None) -> None:
        """Write the state to ``output_state_folder`` if it still holds what it held when the
        last update started (else :class:`StateFolderConflictError`); ``files`` adds optional
        files (``search.csv``)."""
        if self.output_state_folder is None:
            raise ValueError("ModelUpdater.write_output: no output_state_folder is set")
        expected = self._expected_output()
        staged = _stage(
            _key(self.output_state_folder),
            self.learner_instance,
            self._manifest_now(),
            expected,
            self.lock_timeout,
            files,
        )
        staged.commit()
        self._seen[staged.folder] = staged.token

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

    @property
    def history(self) -> list[dict[str, Any]]:
        """One record per update so far (of this updater and the folders it continued)."""
        return list(self._manifest_now()["history"])

    # -- checks before training ----------------------------------------------------------------

    def _check_inputs(
        self, learner: BaseExperienceReplayLearner, data: Any, what: str
    ) -> dict[str, Any] | None:
        """One forward pass on a sample, and the sample shapes against the earlier updates'."""
        if not isinstance(data, Dataset):
            return None  # a loader or iterable: checked batch by batch by the trainer
        inputs, targets, task_ids = _first_batch(data, self.collate_fn, what)
        signature = _sample_signature(inputs, targets)
        earlier = [r["data"] for r in self._manifest_now()["history"] if r.get("data")]
        if earlier and earlier[-1] != signature:
            raise UpdateInputError(
                f"{what}: its samples are {_shown(signature)}, but the state was trained on "
                f"samples of {_shown(earlier[-1])}; give data of the same shape and dtype"
            )
        if task_ids is not None or takes_task_id(learner.model):
            # Task ids (or their absence) first: the learner checks them against the model, the
            # heads (fit adds those of new ids) and the buffer, and the labels.
            self._check_data(learner, data, what)
        if task_ids is None:
            self._probe(learner, inputs, targets, what, data)
        return signature

    @staticmethod
    def _check_data(learner: BaseExperienceReplayLearner, data: Any, what: str) -> None:
        try:
            learner.check_data(data)  # empty data, labels outside the outputs, task ids
        except ValueError as exc:
            raise UpdateInputError(f"{what}: {exc}") from None

    def _probe(
        self, learner: BaseExperienceReplayLearner, inputs: Any, targets: Any, what: str, data: Any
    ) -> None:
        """The model on two samples, the labels against its outputs, then the loss and every
        metric on the outputs: a mismatch is said now, with both shapes, instead of as an error
        deep inside training."""
        model = learner.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                outputs = self._forward_probe(model, inputs, what)
                self._check_data(learner, data, what)
                targets = to_device(targets, outputs.device)
                target_transform = self.transforms.get("train_target_transform")
                if target_transform is not None:  # the loss sees the transformed labels
                    targets = target_transform(targets)
                self._call_probe("loss_fn", learner.loss_fn, outputs, targets, what, "the loss")
                for name, metric in self.metrics.items():
                    self._call_probe(name, metric, outputs, targets, what, f"the metric {name!r}")
        finally:
            model.train(was_training)

    def _forward_probe(self, model: nn.Module, inputs: Any, what: str) -> torch.Tensor:
        transform = self.transforms.get("train_transform")
        device = model_device(model)
        try:
            batch = to_device(inputs, device)
            if transform is not None:
                batch = transform(batch)
            return forward(model, batch)
        except Exception as exc:
            shape = _shown(_sample_signature(inputs, None))
            raise UpdateInputError(
                f"{what}: the model does not accept its samples ({shape}){_first_layer(model)}; "
                f"it raised {type(exc).__name__}: {' '.join(str(exc).split())}{self._frame(exc)}"
                ". Make model_fn's first layer fit the data (or reshape the data)"
            ) from None

    def _call_probe(
        self, name: str, function: Any, outputs: Any, targets: Any, what: str, role: str
    ) -> None:
        try:
            torch.as_tensor(function(outputs, targets)).float().mean()
        except Exception as exc:
            shapes = (
                f"outputs {_tensor_text(outputs)} and targets {_tensor_text(targets)} of two "
                "samples"
            )
            raise UpdateInputError(
                f"{what}: {role} ({name}) fails on the model's {shapes}: {type(exc).__name__}: "
                f"{' '.join(str(exc).split())}{self._frame(exc)}"
            ) from None

    def _frame(self, exc: BaseException) -> str:
        """`` (my_config.py, line 12: ...)`` where the error was raised inside the config file."""
        if self.config_file is None:
            return ""
        from renate_events.config import _own_frame

        return _own_frame(self.config_file.path, exc)

    def _check_metric(self, validating: bool) -> None:
        if self.metric is None:
            return
        reported = ["val_loss", "val_accuracy", *(f"val_{name}" for name in self.metrics)]
        if not validating:
            raise UpdateInputError(
                f"the metric {self.metric!r} needs validation data: pass val_dataset "
                "(data_fn returning (train, validation)) or leave metric unset"
            )
        if self.metric not in reported:
            raise UpdateInputError(
                f"the metric {self.metric!r} is not reported by validation; it reports {reported}"
            )

    def _validation_data(self, val_dataset: Any) -> tuple[tuple[torch.Tensor, ...] | None, Any]:
        """This update's validation tensors (to keep afterwards) and what it validates on."""
        if self._memory is None:
            return None, val_dataset
        current = None
        if val_dataset is not None:
            current = dataset_tensors(val_dataset, self.collate_fn, "the validation data")
            self._memory.buffer.check_batch(*current)
        kept = self._memory.data()
        if kept is None:
            return current, None if current is None else TensorDataset(*current)
        if current is None:
            return None, TensorDataset(*kept)
        return current, TensorDataset(*(torch.cat(pair) for pair in zip(kept, current)))

    def _callables(self) -> dict[str, Any]:
        """Every function this updater was given, by its argument's name."""
        given = {
            "loss_fn": self.loss_fn,
            "learning_rate_scheduler": self.learning_rate_scheduler,
            "collate_fn": self.collate_fn,
            **self.transforms,
            **{f"metrics.{name}": metric for name, metric in self.metrics.items()},
        }
        if not isinstance(self.optimizer, Mapping):
            given["optimizer"] = self.optimizer
        return {name: function for name, function in given.items() if function is not None}

    def _record(
        self,
        task_id: Any,
        result: FitResult,
        signature: dict[str, Any] | None,
        best: _BestWeights | None,
        seconds: float,
    ) -> dict[str, Any]:
        metrics = {
            name: float(value)
            for name, value in result.metrics.items()
            if isinstance(value, (int, float)) and value == value and abs(value) != float("inf")
        }
        functions: dict[str, Any] = {
            name: _describe(getattr(self, name))
            for name in ("loss_fn", "learning_rate_scheduler", "collate_fn")
            if getattr(self, name) is not None
        }
        functions.update({name: _describe(f) for name, f in self.transforms.items()})
        hashes = {
            name: digest
            for name, function in self._callables().items()
            if (digest := _source_sha256(function)) is not None
        }
        functions["metrics"] = sorted(self.metrics)
        functions["listeners"] = [type(listener).__name__ for listener in self.listeners]
        return {
            "task_id": task_id,
            "steps": int(result.steps),
            "epochs": int(result.epochs),
            "stopped_early": bool(result.stopped_early),
            "seconds": round(seconds, 3),
            "metrics": metrics,
            "learner_kwargs": dict(self.learner_kwargs),
            "optimizer": self._optimizer_record(),
            "functions": functions,
            "functions_sha256": hashes,
            "data": signature,
            "best": None
            if best is None or best.best is None
            else {
                "metric": best.metric,
                "mode": best.mode,
                "value": best.best,
                "epoch": best.epoch,
            },
            "config_sha256": None if self.config_file is None else self.config_file.sha256,
        }

    # -- building and loading ------------------------------------------------------------------

    def _build(self) -> BaseExperienceReplayLearner:
        learner = self._make_learner()
        if self.input_state_folder is not None:
            folder = _key(self.input_state_folder)

            def load() -> tuple[dict[str, Any], str]:
                manifest, token = _read_verified(folder)
                manifest = _upgraded(manifest)
                self._check_compatible(manifest)
                if manifest["validation_memory"]:
                    self._subscribe_memory(learner)
                with _mapped_files(learner, "snapshots_from", folder):
                    learner.load_checkpoint(os.path.join(folder, _CHECKPOINT))
                return manifest, token

            try:
                self._manifest, self._seen[folder] = _read(folder, self.lock_timeout, load)
            except BaseException:
                if self._memory is not None:
                    learner.trainer.unsubscribe(self._memory)
                    self._memory = None
                raise
        if self.validation_memory and self._memory is None:
            self._subscribe_memory(learner)
        elif not self.validation_memory and self._memory is not None:
            learner.trainer.unsubscribe(self._memory)  # dropped: the next state has none
            self._memory = None
        return learner

    def _subscribe_memory(self, learner: BaseExperienceReplayLearner) -> None:
        seed = self.learner_kwargs.get("seed", 0)
        size = self.validation_memory_size
        buffer = (
            InfiniteBuffer(seed=seed) if size is None else ReservoirBuffer(max_size=size, seed=seed)
        )
        self._memory = _ValidationMemory(buffer)
        learner.trainer.subscribe(self._memory, name=_VALIDATION_MEMORY)

    def _make_learner(self) -> BaseExperienceReplayLearner:
        kwargs = dict(self.learner_kwargs)
        spec = method(self.learner)
        learner_class = spec.learner
        fields = attrs.fields_dict(learner_class)
        memory_size = kwargs.get("memory_size", fields["memory_size"].default)
        checks.check_int("ModelUpdater.learner_kwargs['memory_size']", memory_size, 0)
        if memory_size > 0 and not spec.own_buffer:
            kwargs["buffer"] = self._make_buffer(memory_size, kwargs.get("seed", 0))
        given = {
            "loss_fn": self.loss_fn,
            "learning_rate_scheduler": self.learning_rate_scheduler,
            "collate_fn": self.collate_fn,
            "metrics": self.metrics or None,
            **self.transforms,
        }
        given = {name: value for name, value in given.items() if value is not None}
        unsupported = sorted(name for name in given if name not in fields)
        if unsupported:
            raise ValueError(
                f"ModelUpdater: the learner {self.learner!r} takes no {unsupported}; leave them "
                "out for this learner"
            )
        if self.learning_rate_scheduler is not None:
            given["learning_rate_scheduler_interval"] = self.learning_rate_scheduler_interval
        trainer = Trainer(**self.trainer_kwargs)
        for listener in self.listeners:
            trainer.subscribe(listener)
        return learner_class(
            model=self.model,
            optimizer=self._optimizer_factory(),
            trainer=trainer,
            **given,
            **kwargs,
        )

    def _make_buffer(self, memory_size: int, seed: int) -> DataBuffer:
        if self.buffer_storage == "memory":
            return BUFFERS[self.buffer](max_size=memory_size, seed=seed)
        folder = self.buffer_folder
        if folder is None:
            given = (self.output_state_folder, self.input_state_folder)
            parents = [_existing_folder(os.path.dirname(_key(f))) for f in given if f is not None]
            folder = parents[0] if parents else tempfile.gettempdir()
        try:
            return _MAPPED_BUFFERS[self.buffer](
                max_size=memory_size, seed=seed, folder=folder, unlinked=True
            )
        except ValueError as exc:
            raise ValueError(
                f"ModelUpdater.buffer_folder: {exc} (the mapped buffer's working files go there)"
            ) from None

    def _optimizer_factory(self) -> Callable[..., torch.optim.Optimizer]:
        if not isinstance(self.optimizer, Mapping):
            return self.optimizer
        options = dict(self.optimizer)
        return functools.partial(OPTIMIZERS[options.pop("name", "adam")], **options)

    def _optimizer_record(self) -> dict[str, Any]:
        if isinstance(self.optimizer, Mapping):
            return dict(self.optimizer)
        return {"function": _describe(self.optimizer)}

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
            "optimizer": self._optimizer_record(),
            "buffer": self.buffer,
            "model": _model_signature(self.model),
        }

    def _config_record(self) -> dict[str, Any] | None:
        config = self.config_file
        if config is None:
            return None
        text = None
        if os.path.getsize(config.path) <= _MAX_CONFIG_TEXT:
            with open(config.path, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        return {"file": os.path.basename(config.path), "sha256": config.sha256, "text": text}

    def _manifest_now(self) -> dict[str, Any]:
        manifest = dict(self._manifest) if self._manifest is not None else {}
        manifest.update(
            format=FORMAT_NAME,
            format_version=FORMAT_VERSION,
            trainer=self.trainer_kwargs,
            metadata=self.metadata,
            architecture=self.architecture or _architecture(self.model),
            validation_memory=self._memory is not None,
            **self._config(),
        )
        if self.config_file is not None or "config" not in manifest:
            manifest["config"] = self._config_record()
        manifest.pop("buffer_storage", None)
        if self.buffer_storage != "memory":  # absent: in memory (as in every earlier folder)
            manifest["buffer_storage"] = self.buffer_storage
        manifest.setdefault("updates", 0)
        manifest["task_ids"] = list(manifest.get("task_ids", []))
        manifest["history"] = list(manifest.get("history", []))
        return manifest

    def _check_compatible(self, manifest: Mapping[str, Any]) -> None:
        mine = self._config()
        differences = [
            f"{key}: the folder has {manifest[key]!r}, this updater {mine[key]!r}"
            for key in ("learner", "buffer")
            if manifest[key] != mine[key]
        ]
        saved_optimizer, live_optimizer = manifest["optimizer"], mine["optimizer"]
        if saved_optimizer.get("name", "adam") != live_optimizer.get("name", "adam") and not (
            "function" in saved_optimizer or "function" in live_optimizer
        ):  # the checkpoint's optimizer state is checked against one of the same class
            differences.append(
                f"optimizer: the folder has {saved_optimizer.get('name', 'adam')!r}, this "
                f"updater {live_optimizer.get('name', 'adam')!r} (its options may change)"
            )
        for key in _STRUCTURAL:
            saved = manifest["learner_kwargs"].get(key)
            live = self.learner_kwargs.get(key)
            if saved != live:
                differences.append(
                    f"learner_kwargs[{key!r}]: the folder has {saved!r}, this updater {live!r}"
                )
        saved_storage = manifest.get("buffer_storage", "memory")
        if saved_storage != self.buffer_storage:
            differences.append(
                f"buffer_storage: the folder has {saved_storage!r}, this updater "
                f"{self.buffer_storage!r} (renate-events update --buffer-storage {saved_storage})"
            )
        differences += _model_differences(manifest["model"], mine["model"])
        if differences:
            raise StateFolderError(
                f"the state folder {self.input_state_folder} was written by a different "
                "configuration: " + "; ".join(differences)
            )
        self._check_config_file(manifest["config"])

    def _check_config_file(self, saved: Mapping[str, Any] | None) -> None:
        if self.config_file is not None and not self.accept_config_change:
            check_config_file(self.input_state_folder, saved, self.config_file)


def check_config_file(
    folder: str | os.PathLike[str] | None, saved: Mapping[str, Any] | None, config: ConfigFile
) -> None:
    """Refuse ``config`` when the state folder (its manifest's ``config`` record, ``saved``)
    was written with another config file, saying which line changed.

    Raises:
        UpdateInputError: The files differ.
    """
    if saved is None or saved["sha256"] == config.sha256:
        return
    change = "its text was not kept"
    if saved.get("text") is not None:
        with open(config.path, encoding="utf-8", errors="replace") as handle:
            change = _first_difference(saved["text"], handle.read())
    raise UpdateInputError(
        f"the state folder {folder} was written with another config file ({saved['file']}, "
        f"SHA-256 {saved['sha256'][:12]}...; {config.path} is {config.sha256[:12]}...): "
        f"{change}. Use the same file, or accept the change (accept_config_change=True, "
        "renate-events update --accept-config-change)"
    )


@attrs.frozen
class _ConfigFunction:
    """A config file's ``optimizer_fn`` or ``lr_scheduler_fn``, called through its checks."""

    config: ConfigFile
    name: str

    def __call__(self, argument: Any) -> Any:
        if self.name == "optimizer_fn":
            return self.config.optimizer(argument)
        scheduler = self.config.scheduler(argument)
        return None if scheduler is None else scheduler[0]


def _scheduler_interval(config: ConfigFile) -> str:
    """The interval ``lr_scheduler_fn`` asks for, from a call on a stand-in optimizer."""
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = config.scheduler(stand_in)
    return "epoch" if scheduler is None else scheduler[1]


def _first_batch(data: Dataset[Any], collate_fn: Any, what: str) -> tuple[Any, Any, Any]:
    """Two samples' inputs and targets, and their task ids for a ``TensorDataset`` of three
    tensors (task-incremental data; None otherwise)."""
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) in (2, 3):
        return tensors[0][:2], tensors[1][:2], (tensors[2][:2] if len(tensors) == 3 else None)
    try:
        batch = next(iter(DataLoader(data, batch_size=2, shuffle=False, collate_fn=collate_fn)))
    except StopIteration:
        raise UpdateInputError(f"{what} is empty; pass data for the update") from None
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise UpdateInputError(
            f"{what}: batches must be (inputs, targets) pairs, got {type(batch).__name__}"
        )
    return batch[0], batch[1], None


def _pair_as_dataset(value: Any, name: str) -> Any:
    """An ``(inputs, targets)`` pair of tensors as a ``TensorDataset``; anything else as it is."""
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        return value
    if not all(isinstance(part, torch.Tensor) for part in value):
        return value
    if value[0].dim() == 0 or len(value[0]) != len(value[1]):
        raise UpdateInputError(
            f"ModelUpdater.update: {name} as (inputs, targets) needs one target per input, got "
            f"shapes {tuple(value[0].shape)} and {tuple(value[1].shape)}"
        )
    return TensorDataset(*value)


def _source_sha256(function: Any) -> str | None:
    """The SHA-256 of a function's source (or of its bytecode), None for other callables."""
    target = function.func if isinstance(function, functools.partial) else function
    if isinstance(target, _ConfigFunction):
        target = target.config.functions[target.name]
    try:
        text = inspect.getsource(target).encode("utf-8")
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        if code is None:
            return None
        text = code.co_code
    return hashlib.sha256(text).hexdigest()


def _tensor_text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')} {tuple(value.shape)}"
    return type(value).__name__


def _first_layer(model: nn.Module) -> str:
    """`` (its first layer is Linear(10 -> 4))`` for the first linear or convolution layer."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            return f" (its first layer is Linear({module.in_features} -> {module.out_features}))"
        if isinstance(module, nn.modules.conv._ConvNd):
            kind = type(module).__name__
            return f" (its first layer is {kind} with {module.in_channels} input channels)"
    return ""


def _shown(signature: Mapping[str, Any]) -> str:
    inputs = signature.get("inputs")
    if isinstance(inputs, list):
        return f"{inputs[1]} {tuple(inputs[0])}"
    return str(inputs)


def _architecture(model: nn.Module) -> str:
    name = getattr(model, "architecture", None)
    return name if isinstance(name, str) and name else type(model).__name__


def _upgraded(manifest: dict[str, Any]) -> dict[str, Any]:
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
    known = (_MANIFEST, *_FILES, *_OPTIONAL_FILES)
    others = [e for e in entries if e not in known and not _BUFFER_FILE.fullmatch(e)]
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
    files = manifest["files"]
    for name, checksum in files.items():
        file = os.path.join(folder, name)
        if os.path.islink(file) or not os.path.isfile(file):
            raise StateFolderError(f"{folder} lacks the plain file {name} that its manifest lists")
        if sha256_of_file(file) != checksum:
            raise StateFolderError(f"{file} does not match the checksum in its manifest")
    unlisted = sorted(
        name for name in os.listdir(folder) if _BUFFER_FILE.fullmatch(name) and name not in files
    )
    if unlisted:  # a mapped buffer reads only files whose checksums were checked here
        raise StateFolderError(
            f"{os.path.join(folder, unlisted[0])}: a buffer file that {_MANIFEST}'s key 'files' "
            "does not list (so no checksum vouches for it); the folder was altered"
        )
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
    _unknown_keys(f"{key} 'learner_kwargs'", manifest["learner_kwargs"], known)
    _unknown_keys(f"{key} 'trainer'", manifest["trainer"], _trainer_arguments())
    optimizer = manifest["optimizer"]
    if set(optimizer) == {"function"}:  # a factory, recorded by name
        if not isinstance(optimizer["function"], str):
            raise checks.WrongTypeError(f"{key} 'optimizer.function' must be a string")
    else:
        _check_optimizer(f"{key} 'optimizer'", optimizer)


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
        "best",
        "config_sha256",
    ]
)


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
        for name in ("steps", "epochs"):
            if name in record:
                checks.check_int(f"{where}.{name}", record[name], 0)
        metrics = record.get("metrics", {})
        _check_dict(f"{where}.metrics", metrics)
        for name, value in metrics.items():
            if not checks.is_real(value):
                raise checks.WrongTypeError(f"{where}.metrics.{name} must be a number")
        data = record.get("data")
        if data is not None:
            _check_dict(f"{where}.data", data)


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
    expected = _FILES if manifest["format_version"] >= 2 else _FILES_V1
    optional = _OPTIONAL_FILES if manifest["format_version"] >= 2 else ()
    mapped = manifest.get("buffer_storage") == "mapped"
    listed = {name for name in files if not (mapped and _BUFFER_FILE.fullmatch(str(name)))}
    if not set(expected) <= listed <= set(expected) | set(optional):
        raise ValueError(
            f"{key} 'files' must list exactly {list(expected)} (and optionally "
            f"{list(optional)}{', and the buffer files buffer.g<n>.<i>.bin' if mapped else ''})"
            f", got {sorted(files)}"
        )
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
    extra: Mapping[str, bytes] | None = None,
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
        token = _write_contents(staging, learner, manifest, extra or {})
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        lock.release()
        if isinstance(exc, _WRITE_ERRORS):
            raise _write_failed(folder, exc) from exc
        raise
    return StagedStateFolder(folder, staging, token, lock)


def _write_contents(
    staging: str,
    learner: BaseExperienceReplayLearner,
    manifest: dict,
    extra: Mapping[str, bytes],
) -> str:
    """Write the checkpoint, the model alone, its card, the ``extra`` files (of
    ``_OPTIONAL_FILES``) and the manifest into ``staging``; return the manifest's token."""
    checkpoint = os.path.join(staging, _CHECKPOINT)
    with _mapped_files(learner, "snapshots_to", staging):  # a mapped buffer's files go there
        learner.save_checkpoint(checkpoint)
    buffer_files = sorted(name for name in os.listdir(staging) if _BUFFER_FILE.fullmatch(name))
    model_file = os.path.join(staging, _MODEL)
    weights = {  # copies: tied or non-contiguous tensors are saved whole, each under its name
        name: tensor.detach().to("cpu", copy=True).contiguous()
        for name, tensor in learner.model.state_dict().items()
    }
    safetensors.torch.save_file(weights, model_file, metadata={"format": "pt"})
    card = os.path.join(staging, _MODEL_CARD)
    _write_json(card, _model_card(manifest))
    for name, data in extra.items():
        if name not in _OPTIONAL_FILES:
            raise ValueError(
                f"a state folder holds no file {name!r}; it may hold {_OPTIONAL_FILES}"
            )
        with open(os.path.join(staging, name), "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    files = {
        name: sha256_of_file(os.path.join(staging, name))
        for name in (*_FILES, *extra, *buffer_files)
    }
    manifest = {**manifest, "files": files}
    _check_manifest(os.path.join(staging, _MANIFEST), manifest)
    raw = _write_json(os.path.join(staging, _MANIFEST), manifest)
    fsync_folder(staging)
    return hashlib.sha256(raw).hexdigest()


@contextmanager
def _mapped_files(learner: BaseExperienceReplayLearner, which: str, folder: str) -> Iterator[None]:
    """A context in which the learner's mapped buffer (if it has one) writes (``which`` is
    ``"snapshots_to"``) or reads (``"snapshots_from"``) its snapshot files in ``folder``; its
    file errors (a full disk, a file of the wrong size) come out as :class:`trainer.
    CheckpointError` (writing) or :class:`StateFolderError` (reading), not inside the trainer's
    ``ListenerError``. So does, reading, any listener refusing the state the folder's checkpoint
    holds for it (a component's key out of range): the folder is bad, not the program."""
    buffer = getattr(learner, "buffer", None)
    with getattr(buffer, which)(folder) if isinstance(buffer, _MAPPED_TYPES) else nullcontext():
        try:
            yield
        except ListenerError as exc:
            cause = exc.__cause__
            if isinstance(cause, MappedFileError):
                error = CheckpointError if which == "snapshots_to" else StateFolderError
                raise error(f"{folder}: {cause}") from exc
            if which == "snapshots_to" or exc.event != "load_checkpoint":
                raise
            raise StateFolderError(f"{os.path.join(folder, _CHECKPOINT)}: {exc}") from exc


_MAPPED_TYPES = tuple(_MAPPED_BUFFERS.values())


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
