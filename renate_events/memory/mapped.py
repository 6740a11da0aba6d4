"""Replay buffers whose storage is memory-mapped files: memories larger than RAM.

:class:`MappedReservoirBuffer`, :class:`MappedSlidingWindowBuffer` and
:class:`MappedGreedyClassBalancingBuffer` are the in-memory buffers with one difference: every
storage tensor (input leaves, targets, metadata) is a file in ``folder`` mapped into memory
(``torch.from_file(..., shared=True)``), so the operating system pages it in and out and the
process's anonymous memory does not grow with the buffer. Slot choice, sampling and generator
streams are those of the in-memory classes, so both draw exactly the same batches.

Files and crash safety (snapshot on checkpoint, "write a new file and swap"):

* the buffer works on ``<name>.work.<i>.bin``; updates write there in place;
* :meth:`state_dict` (the learner calls it when a checkpoint is written) copies the filled rows
  to new files ``<name>.g<generation>.<i>.bin`` (written under a temporary name, flushed to disk,
  then renamed), and returns only their names, shapes, dtypes, sizes and the generation counter,
  never the data. A killed update can only damage the work files: every snapshot a checkpoint
  names stays intact. The two newest generations are kept (an older one is deleted when a newer
  one is written), so the checkpoint on disk and the one being written both find their files;
* :meth:`load_state_dict` checks the snapshot files (names, sizes, dtypes) before anything
  changes and copies them into fresh work files.

The folder is the user's (the lead points it into the state folder). Only CPU storage.
"""

from __future__ import annotations

import errno
import math
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from renate_events.memory.buffers import (
    GreedyClassBalancingBuffer,
    ReservoirBuffer,
    SlidingWindowBuffer,
)
from trainer import validators
from trainer.files import fsync_file, fsync_folder

__all__ = [
    "MAPPED_STATE_VERSION",
    "MappedGreedyClassBalancingBuffer",
    "MappedReservoirBuffer",
    "MappedSlidingWindowBuffer",
]

MAPPED_STATE_VERSION = 1
"""Version of the ``"mapped"`` section of a mapped buffer's state dict."""

_KEPT_GENERATIONS = 2
_DTYPES = {
    str(dtype): dtype
    for dtype in (
        torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
    )
}  # fmt: skip
_FILE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\.g[0-9]{1,18}\.[0-9]{1,4}\.bin")


def _check_folder(instance: Any, attribute: attrs.Attribute[Any], value: pathlib.Path) -> None:
    name = validators.field_name(instance, attribute)
    if not value.is_dir():
        raise ValueError(f"{name} must be an existing folder, got {str(value)!r}")
    if not os.access(value, os.W_OK | os.X_OK):
        raise ValueError(f"{name} must be a writable folder, got read-only {str(value)!r}")


def _check_name(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value):
        raise ValueError(
            f"{validators.field_name(instance, attribute)} must be 1 to 64 letters, digits, "
            f"'_' or '-', got {value!r}"
        )


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _create(path: pathlib.Path, size: int, what: str) -> None:
    """A file of ``size`` bytes with its blocks reserved (so a full disk fails here, not at a
    later write through the mapping, which would be a SIGBUS)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if size > 0:
                os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as exc:
        path.unlink(missing_ok=True)
        reason = {
            errno.ENOSPC: "the disk is full",
            errno.EDQUOT: "the disk quota is exhausted",
            errno.EROFS: "the file system is read-only",
            errno.EACCES: "permission denied",
        }.get(exc.errno, exc.strerror)
        raise ValueError(
            f"{what}: cannot create the {size}-byte buffer file {str(path)!r}: {reason}; give "
            "the buffer a folder on a writable disk with room for it"
        ) from exc


def _map(path: pathlib.Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)


class _MappedStorage:
    """The storage option: every storage tensor a memory-mapped file in ``folder`` (methods
    only; each buffer class declares the fields ``folder``, ``name`` and ``_generation``)."""

    __slots__ = ()
    folder: pathlib.Path
    name: str
    _generation: int

    def _new_storage(
        self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]
    ) -> list[torch.Tensor]:
        if torch.device(self.device).type != "cpu":  # type: ignore[attr-defined]
            raise ValueError(f"{type(self).__name__} keeps its storage on the CPU (mapped files)")
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            _create(self._work_path(i, ".new"), _nbytes(shape, dtype), f"{type(self).__name__}")
        storage = []
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            os.replace(self._work_path(i, ".new"), self._work_path(i))
            storage.append(_map(self._work_path(i), shape, dtype))
        return storage

    def _work_path(self, i: int, suffix: str = "") -> pathlib.Path:
        return self.folder / f"{self.name}.work.{i}.bin{suffix}"

    def _snapshot_name(self, generation: int, i: int) -> str:
        return f"{self.name}.g{generation}.{i}.bin"

    def to(self, device: str | torch.device) -> Any:
        if torch.device(device).type != "cpu":
            raise ValueError(f"{type(self).__name__} keeps its storage on the CPU (mapped files)")
        return self

    def state_dict(self) -> dict[str, Any]:
        """As the in-memory buffer's, but ``inputs``, ``targets`` and ``metadata`` are left empty
        and ``"mapped"`` names the snapshot files written now (see the module's docstring)."""
        state = super().state_dict()  # type: ignore[misc]
        n = state["length"]
        tensors = [*state["inputs"], *([] if state["targets"] is None else [state["targets"]])]
        tensors += list(state["metadata"].values())
        generation = self._generation + 1
        files = []
        for i, tensor in enumerate(tensors):
            final = self.folder / self._snapshot_name(generation, i)
            temporary = final.with_name(final.name + ".tmp")
            _create(temporary, tensor.numel() * tensor.element_size(), type(self).__name__)
            _map(temporary, tuple(tensor.shape), tensor.dtype).copy_(tensor)
            fsync_file(temporary)
            os.replace(temporary, final)
            files.append(
                {"file": final.name, "shape": list(tensor.shape), "dtype": str(tensor.dtype)}
            )
        fsync_folder(self.folder)
        self._generation = generation
        self._drop_old_snapshots(generation - _KEPT_GENERATIONS)
        state["mapped"] = {
            "version": MAPPED_STATE_VERSION,
            "generation": generation,
            "length": n,
            "metadata_keys": list(state["metadata"]),
            "files": files,
        }
        state["inputs"], state["targets"], state["metadata"] = [], None, {}
        return state

    def _drop_old_snapshots(self, up_to: int) -> None:
        pattern = re.compile(rf"{re.escape(self.name)}\.g([0-9]+)\.[0-9]+\.bin")
        for path in self.folder.iterdir():
            match = pattern.fullmatch(path.name)
            if match and int(match.group(1)) <= up_to:
                path.unlink(missing_ok=True)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state: its snapshot files are checked (names inside the
        folder, sizes, dtypes, shapes against the state's length) before anything changes, then
        copied into fresh work files."""
        if not isinstance(state, Mapping) or "mapped" not in state:
            raise ValueError(
                f"state['mapped']: missing; not a {type(self).__name__} state (an in-memory "
                "buffer's state cannot be loaded into a mapped buffer)"
            )
        mapped = state["mapped"]
        tensors = self._open_snapshot(mapped, state.get("length"))
        keys = mapped["metadata_keys"]
        structure = state.get("inputs_structure")
        num_inputs = len(tensors) - len(keys) - (0 if structure is None else 1)
        full = {k: v for k, v in state.items() if k != "mapped"}
        full["inputs"] = tensors[:num_inputs]
        full["targets"] = None if structure is None else tensors[num_inputs]
        full["metadata"] = dict(zip(keys, tensors[num_inputs + 1 :]))
        super().load_state_dict(full)  # type: ignore[misc]
        self._generation = mapped["generation"]

    def _open_snapshot(self, mapped: Any, length: Any) -> list[torch.Tensor]:
        where = "state['mapped']"
        if not isinstance(mapped, Mapping) or set(mapped) != {
            "version", "generation", "length", "metadata_keys", "files",
        }:  # fmt: skip
            raise ValueError(f"{where}: expected version, generation, length, metadata_keys, files")
        if mapped["version"] != MAPPED_STATE_VERSION:
            raise ValueError(f"{where}['version']: expected {MAPPED_STATE_VERSION}")
        validators.check_int(f"{where}['generation']", mapped["generation"], 1)
        if mapped["length"] != length:
            raise ValueError(f"{where}['length']: {mapped['length']!r} differs from {length!r}")
        keys, files = mapped["metadata_keys"], mapped["files"]
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"{where}['metadata_keys']: expected a list of str, got {keys!r}")
        if not isinstance(files, list) or len(files) < len(keys):
            raise ValueError(f"{where}['files']: expected a list of file records, got {files!r}")
        return [self._open_file(f"{where}['files'][{i}]", r, length) for i, r in enumerate(files)]

    def _open_file(self, where: str, record: Any, length: int) -> torch.Tensor:
        if not isinstance(record, Mapping) or set(record) != {"file", "shape", "dtype"}:
            raise ValueError(f"{where}: expected a dict with file, shape, dtype, got {record!r}")
        name, shape, dtype = record["file"], record["shape"], record["dtype"]
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name):
            raise ValueError(f"{where}['file']: not a snapshot file name of a buffer: {name!r}")
        if (
            not isinstance(shape, list)
            or not shape
            or not all(validators.is_int(d) and d >= 0 for d in shape)
            or shape[0] != length
        ):
            raise ValueError(f"{where}['shape']: expected {length} rows, got {shape!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"{where}['dtype']: unsupported {dtype!r}")
        path = self.folder / name
        expected = _nbytes(tuple(shape), _DTYPES[dtype])
        if not path.is_file() or path.stat().st_size != expected:
            size = path.stat().st_size if path.is_file() else "missing"
            raise ValueError(
                f"{where}: the buffer file {str(path)!r} must hold {expected} bytes, got {size}; "
                "the folder does not hold this checkpoint's buffer files"
            )
        if expected == 0:
            return torch.empty(tuple(shape), dtype=_DTYPES[dtype])
        return _map(path, tuple(shape), _DTYPES[dtype])  # read only: copied into work files


@attrs.define(eq=False)
class MappedReservoirBuffer(_MappedStorage, ReservoirBuffer):
    """:class:`~renate_events.memory.ReservoirBuffer` on memory-mapped files in ``folder``.

    Example:
        >>> import tempfile, torch
        >>> folder = tempfile.mkdtemp()
        >>> buffer = MappedReservoirBuffer(1000, folder=folder, seed=1)
        >>> buffer.update(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.arange(4))
        >>> buffer.sample(2)[0][0].dtype
        torch.uint8
    """

    folder: pathlib.Path = attrs.field(
        kw_only=True,
        converter=pathlib.Path,
        validator=_check_folder,
        on_setattr=attrs.setters.frozen,
    )
    name: str = attrs.field(
        default="buffer", kw_only=True, validator=_check_name, on_setattr=attrs.setters.frozen
    )
    _generation: int = attrs.field(init=False, default=0, repr=False)


@attrs.define(eq=False)
class MappedSlidingWindowBuffer(_MappedStorage, SlidingWindowBuffer):
    """:class:`~renate_events.memory.SlidingWindowBuffer` on memory-mapped files in ``folder``."""

    folder: pathlib.Path = attrs.field(
        kw_only=True,
        converter=pathlib.Path,
        validator=_check_folder,
        on_setattr=attrs.setters.frozen,
    )
    name: str = attrs.field(
        default="buffer", kw_only=True, validator=_check_name, on_setattr=attrs.setters.frozen
    )
    _generation: int = attrs.field(init=False, default=0, repr=False)


@attrs.define(eq=False)
class MappedGreedyClassBalancingBuffer(_MappedStorage, GreedyClassBalancingBuffer):
    """:class:`~renate_events.memory.GreedyClassBalancingBuffer` on memory-mapped files."""

    folder: pathlib.Path = attrs.field(
        kw_only=True,
        converter=pathlib.Path,
        validator=_check_folder,
        on_setattr=attrs.setters.frozen,
    )
    name: str = attrs.field(
        default="buffer", kw_only=True, validator=_check_name, on_setattr=attrs.setters.frozen
    )
    _generation: int = attrs.field(init=False, default=0, repr=False)
