"""Mid-update checkpoints: an interrupted update continues where it stopped.

With ``checkpoint_every=N`` an update writes the learner's whole trainer checkpoint (model,
optimizer, scheduler, RNG states and the data order, buffer, components, validation memory, best
weights, early stopping) every ``N`` optimizer steps into the hidden folder ``.<name>.resume``
beside the output state folder ``<name>``. The folder holds ``checkpoint.<steps>.safetensors``
and ``update.json``, which names the checkpoint with its SHA-256 and records what update it
belongs to: digests of the input state, of the updater's arguments and functions, of the
training and validation data, and the task id. Each checkpoint is written atomically (a temporary
file, then a rename) before the record that names it, so a kill at any point leaves the last
complete checkpoint and its record, or none.

Running the same update again continues from the checkpoint; a record that does not match this
update, a malformed one, or a checkpoint whose digest differs is refused
(:class:`~renate_events.updater.MidUpdateCheckpointError`) before anything changes, unless the
update is asked to start again from the input state (``restart=True``, ``--restart``). A
finished update removes the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from renate_events.state_folder import folder_key
from renate_events.updater._errors import MidUpdateCheckpointError
from renate_events.updater._records import UpdateFunctions, updater_config
from trainer import FitResult, Trainer
from trainer.checkpoint import json_too_deep
from trainer.files import fsync_file, fsync_folder, sha256_of_file

__all__ = [
    "MidUpdateCheckpoints",
    "MidUpdateWriter",
    "check_checkpoint_every",
    "checkpoints_written",
    "data_digest",
    "mid_update_folder",
    "resumed_result",
    "update_checkpoints",
]

RECORD = "update.json"
FORMAT = "renate_events.mid_update"
VERSION = 1
_MAX_RECORD_DEPTH = 8  # a record is 2 levels deep (the record, its "update" digests)
_PARTS = {
    "input_state": "the input state folder",
    "arguments": "the updater's arguments and functions",
    "task_id": "the task id",
    "train_data": "the training data",
    "val_data": "the validation data",
}
_ADVICE = (
    "run the same update again (same input state, arguments and data) to continue it, or pass "
    "restart=True to start again from the input state"
)


def mid_update_folder(output: str | os.PathLike[str]) -> str:
    """Where the mid-update checkpoints of an update writing ``output`` are kept:
    ``.<name>.resume`` beside it."""
    parent, name = os.path.split(folder_key(output))
    return os.path.join(parent, f".{name}.resume")


def _sha256_json(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def data_digest(data: Any) -> str:
    """A digest of an update's data: every tensor's dtype, shape and bytes for a dataset of
    tensors (``TensorDataset``); its type and length for any other data (not read sample by
    sample: a changed dataset of another kind is not noticed)."""
    if data is None:
        return "none"
    tensors = getattr(data, "tensors", None)
    digest = hashlib.sha256()
    if isinstance(tensors, tuple) and all(isinstance(t, torch.Tensor) for t in tensors):
        for tensor in tensors:
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{flat.dtype}{tuple(tensor.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().data)
        return digest.hexdigest()
    try:
        size = len(data)
    except TypeError:
        size = None
    digest.update(f"{type(data).__module__}.{type(data).__qualname__}:{size}".encode())
    return digest.hexdigest()


@attrs.define(eq=False)
class MidUpdateCheckpoints:
    """The mid-update checkpoints of one update (see the module's docstring).

    Args:
        folder: The ``.<name>.resume`` folder (:func:`mid_update_folder`).
        parts: Digests of what the update is, by part (``input_state``, ``arguments``,
            ``task_id``, ``train_data``, ``val_data``).
        restart: Start from the input state even if a checkpoint of an interrupted update is
            there (it is replaced by this update's first one, or removed at its end).
    """

    folder: str
    parts: dict[str, str]
    restart: bool = False
    _fresh: bool = attrs.field(init=False, default=True)  # nothing of this update written yet

    @classmethod
    def of_update(
        cls, output: str | os.PathLike[str], parts: Mapping[str, Any], restart: bool
    ) -> MidUpdateCheckpoints:
        """The checkpoints of an update writing ``output``, identified by ``parts`` (anything
        JSON-able per part; only their digests are kept)."""
        digests = {name: _sha256_json(value) for name, value in parts.items()}
        return cls(mid_update_folder(output), digests, restart)

    @property
    def record_path(self) -> str:
        """The record of the checkpoint to continue from, ``update.json``."""
        return os.path.join(self.folder, RECORD)

    def start(self) -> str | None:
        """The checkpoint this update continues from, or None to start from the input state.

        Raises:
            MidUpdateCheckpointError: The folder holds a checkpoint of another update, a
                malformed record, or a checkpoint that is not the one recorded.
        """
        if self.restart or not os.path.lexists(self.folder):
            return None
        if os.path.islink(self.folder) or not os.path.isdir(self.folder):
            raise MidUpdateCheckpointError(
                f"{self.folder} is not a folder of mid-update checkpoints; remove it, or pass "
                "restart=True to start again from the input state"
            )
        if not os.path.lexists(self.record_path):
            return None  # killed before its first checkpoint was complete: nothing to continue
        record = self._read_record()
        differing = [_PARTS[name] for name in _PARTS if record["update"][name] != self.parts[name]]
        if differing:
            raise MidUpdateCheckpointError(
                f"{self.record_path}: the mid-update checkpoint of an interrupted update belongs "
                f"to another update ({', '.join(differing)} differ); {_ADVICE}"
            )
        path = os.path.join(self.folder, record["checkpoint"])
        try:
            sha256 = sha256_of_file(path)
        except OSError as exc:
            raise MidUpdateCheckpointError(
                f"{self.record_path}: key 'checkpoint': cannot read {path} ({exc.strerror}); "
                f"{_ADVICE}"
            ) from None
        if sha256 != record["checkpoint_sha256"]:
            raise MidUpdateCheckpointError(
                f"{path}: its SHA-256 is not the one {RECORD} records (key 'checkpoint_sha256'); "
                f"it was changed after it was written; {_ADVICE}"
            )
        self._fresh = False
        return path

    def _read_record(self) -> dict[str, Any]:
        """``update.json``, checked: the format, the parts and a checkpoint in this folder."""
        try:
            with open(self.record_path, "rb") as file:
                text = file.read(1 << 20).decode("utf-8")
            # counted before parsing: json's own limit is the interpreter's and varies by version
            if json_too_deep(text, _MAX_RECORD_DEPTH):
                raise ValueError(f"it nests deeper than {_MAX_RECORD_DEPTH} levels")
            record = json.loads(text)
        except (OSError, ValueError) as exc:
            raise MidUpdateCheckpointError(
                f"{self.record_path}: not a readable record of a mid-update checkpoint ({exc}); "
                f"{_ADVICE}"
            ) from None
        problem = _record_problem(record)
        if problem is not None:
            raise MidUpdateCheckpointError(f"{self.record_path}: {problem}; {_ADVICE}")
        return record

    def checkpoint_path(self, steps: int) -> str:
        """The file of the checkpoint after ``steps`` optimizer steps (its folder made; a
        restarted update's first checkpoint clears what the interrupted one left)."""
        if self._fresh and os.path.lexists(self.folder):
            _remove(self.folder)
        self._fresh = False
        os.makedirs(self.folder, exist_ok=True)
        return os.path.join(self.folder, f"checkpoint.{steps}.safetensors")

    def commit(self, path: str, steps: int) -> None:
        """Record ``path`` (written completely) as the checkpoint to continue from, atomically,
        then remove the earlier checkpoints."""
        record = {
            "format": FORMAT,
            "format_version": VERSION,
            "update": self.parts,
            "optimizer_steps": steps,
            "checkpoint": os.path.basename(path),
            "checkpoint_sha256": sha256_of_file(path),
        }
        temporary = os.path.join(self.folder, f".{RECORD}.{os.getpid()}.tmp")
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(record, file, indent=1, sort_keys=True)
        fsync_file(temporary)
        os.replace(temporary, self.record_path)
        fsync_folder(self.folder)
        for entry in os.listdir(self.folder):
            if entry.startswith("checkpoint.") and entry != record["checkpoint"]:
                os.unlink(os.path.join(self.folder, entry))

    def finish(self) -> None:
        """The update is done: its checkpoints go (and an interrupted one it restarted)."""
        if os.path.lexists(self.folder):
            _remove(self.folder)


def _record_problem(record: Any) -> str | None:
    """What is wrong with a parsed ``update.json``, naming the key; None if nothing."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return f"key 'format' is not {FORMAT!r}"
    if record.get("format_version") != VERSION:
        return f"key 'format_version' is not {VERSION}"
    update = record.get("update")
    if not isinstance(update, dict) or sorted(update) != sorted(_PARTS):
        return f"key 'update' must have exactly the keys {sorted(_PARTS)}"
    if not all(isinstance(value, str) for value in update.values()):
        return "key 'update' must hold digests (strings)"
    name = record.get("checkpoint")
    if not (isinstance(name, str) and name.startswith("checkpoint.") and os.sep not in name):
        return "key 'checkpoint' must name a checkpoint.<steps>.safetensors file of this folder"
    if name in (".", "..") or (os.altsep and os.altsep in name):
        return "key 'checkpoint' must name a file of this folder"
    if not isinstance(record.get("checkpoint_sha256"), str):
        return "key 'checkpoint_sha256' must be a SHA-256 (a string)"
    return None


def _remove(folder: str) -> None:
    if os.path.islink(folder) or not os.path.isdir(folder):
        os.unlink(folder)
    else:
        shutil.rmtree(folder)
    fsync_folder(os.path.dirname(folder))


@attrs.define(eq=False)
class MidUpdateWriter:
    """A listener that writes a mid-update checkpoint every ``every`` optimizer steps, once the
    step's ``batch_end`` reached every listener (so the buffer holds that step's samples)."""

    checkpoints: MidUpdateCheckpoints
    trainer: Trainer
    every: int
    _last: int = attrs.field(init=False, default=-1)

    def on_batch_end(self, state: Any) -> None:
        steps = state.optimizer_steps
        if steps == self._last or steps % self.every:
            return
        self._last = steps
        path = self.checkpoints.checkpoint_path(steps)
        self.trainer.save_checkpoint(path)  # deferred to the end of this event, then:
        self.trainer.events.defer(lambda: self.checkpoints.commit(path, steps))


def check_checkpoint_every(every: int | None, output: Any, buffer_storage: str) -> None:
    """Mid-update checkpoints need an output folder (they are kept beside it) and a buffer in
    memory (a mapped buffer's working files do not outlive the process)."""
    if every is None:
        return
    if output is None:
        raise ValueError(
            "ModelUpdater: checkpoint_every needs an output_state_folder (the mid-update "
            "checkpoints are kept beside it)"
        )
    if buffer_storage != "memory":
        raise ValueError(
            f"ModelUpdater: checkpoint_every with buffer_storage={buffer_storage!r} is not "
            "supported (a mapped buffer's working files do not outlive the process); use "
            "buffer_storage='memory' or leave checkpoint_every unset"
        )


def update_checkpoints(
    updater: Any, task_id: Any, train_data: Any, val_data: Any
) -> MidUpdateCheckpoints | None:
    """The mid-update checkpoints of ``updater``'s next update (a
    :class:`~renate_events.updater.ModelUpdater`), or None when it has none: no output folder,
    or neither ``checkpoint_every`` nor a checkpoint left by an interrupted update."""
    output = updater.output_state_folder
    if output is None:
        return None
    if updater.checkpoint_every is None and not os.path.lexists(mid_update_folder(output)):
        return None
    functions = UpdateFunctions.of(updater)
    arguments = {
        "config": updater_config(updater),
        "trainer": updater.trainer_arguments,
        "metadata": updater.metadata,
        "functions": [functions.names(), functions.sha256s()],
        "config_sha256": None if updater.config_file is None else updater.config_file.sha256,
        "output": folder_key(output),
        **{name: getattr(updater, name) for name in _SETTINGS},
    }
    source = updater.input_state_folder
    parts = {
        "input_state": [None if source is None else folder_key(source), updater.history],
        "arguments": arguments,
        "task_id": task_id,
        "train_data": data_digest(train_data),
        "val_data": data_digest(val_data),
    }
    return MidUpdateCheckpoints.of_update(output, parts, updater.restart)


_SETTINGS = (
    "buffer_storage",
    "learning_rate_scheduler_interval",
    "metric",
    "mode",
    "early_stopping_enabled",
    "early_stopping_patience",
    "validation_memory",
    "validation_memory_size",
    "in_place",
)
"""The updater's settings besides its configuration that change what an update trains."""


@contextmanager
def checkpoints_written(
    trainer: Trainer, checkpoints: MidUpdateCheckpoints | None, every: int | None
) -> Iterator[None]:
    """A :class:`MidUpdateWriter` subscribed to ``trainer`` (after every other listener) for the
    duration of one update, when it writes checkpoints."""
    if checkpoints is None or every is None:
        yield
        return
    writer = MidUpdateWriter(checkpoints, trainer, every)
    with trainer.subscribed(writer, priority=-(2**30), name="_mid_update_checkpoints"):
        yield


def resumed_result(result: FitResult, state: Any) -> FitResult:
    """The result of a fit that continued a checkpoint as the uninterrupted fit reports it: the
    epochs counted from the first (the resumed fit counts its own)."""
    return attrs.evolve(result, epochs=int(state.epoch) + 1)
