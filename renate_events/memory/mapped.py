"""Replay buffers whose storage is memory-mapped files: memories larger than RAM.

:class:`MappedReservoirBuffer`, :class:`MappedSlidingWindowBuffer`,
:class:`MappedGreedyClassBalancingBuffer` and :class:`MappedInfiniteBuffer` are the in-memory
buffers with one difference: every storage tensor (input leaves, targets, metadata) is a file in
``folder`` mapped into memory (``torch.from_file(..., shared=True)``), so the operating system
pages it in and out and the process's anonymous memory does not grow with the buffer. Slot
choice, sampling and generator streams are those of the in-memory classes, so both draw exactly
the same batches.

Files and crash safety (snapshot on checkpoint, "write a new file and swap"):

* the buffer works on ``<name>.work.<i>.bin``; updates write there in place. With
  ``unlinked=True`` the work files have no name at all (``O_TMPFILE``): the system frees them
  when the buffer goes, so even a killed process leaves nothing in ``folder``;
* :meth:`state_dict` (the learner calls it when a checkpoint is written) copies the filled rows
  to new files ``<name>.g<generation>.<i>.bin`` (written under a temporary name, flushed to disk,
  then renamed), and returns only their names, shapes, dtypes and the generation counter, never
  the data. The copy is file to file: a reflink (``FICLONE``: shared blocks, copied when either
  side is written) where the file system has them and the buffer is full, else an in-kernel
  ``copy_file_range``. A killed update can only damage the work files: every snapshot a
  checkpoint names stays intact. In ``folder`` the two newest generations are kept (an older one
  is deleted when a newer one is written), so the checkpoint on disk and the one being written
  both find their files. Within ``snapshots_to(folder)`` the files go to another
  folder (a state folder being written); an ``unlinked`` buffer outside it (the trainer's
  rollback snapshots) holds them unnamed, open, for :meth:`load_state_dict`;
* :meth:`load_state_dict` checks the snapshot files (names, sizes, dtypes) before anything
  changes and copies them into fresh work files, reading them through a private mapping
  (``shared=False``), so that nothing this buffer does can write to them. Within
  ``snapshots_from(folder)`` they are read from another folder. A ``lazy=True`` buffer makes
  no work files there: it reads the snapshot files in place (the same private mapping, so a
  state on read-only or full storage can be read) and copies them into work files only before
  its first write (:meth:`update`, :meth:`set_metadata`, or :meth:`make_writable`, which an
  update calls before training so that a full disk refuses it before anything changes).

A hard link of a work file into a state folder would share its blocks with a file that the next
update writes in place, so the folder would change under its checksum: the snapshot is always a
copy (or a reflink, which the file system copies on write). Only CPU storage.
:class:`~renate_events.updater.ModelUpdater` uses these buffers with ``buffer_storage="mapped"``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

from renate_events.memory.buffers import (
    GreedyClassBalancingBuffer,
    InfiniteBuffer,
    ReservoirBuffer,
    SlidingWindowBuffer,
)
from renate_events.memory.state import Expect
from trainer import validators
from trainer.files import fsync_folder

__all__ = [
    "MAPPED_STATE_VERSION",
    "MappedFileError",
    "MappedGreedyClassBalancingBuffer",
    "MappedInfiniteBuffer",
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


class MappedFileError(ValueError):
    """A buffer file cannot be made, written or used: the disk is full, read-only or over a
    limit, or a snapshot file is missing or of the wrong size. Raised before any slot changes."""


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


_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "the file-size limit is reached",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
}


def _disk_error(exc: OSError, path: pathlib.Path, size: int, what: str) -> MappedFileError:
    reason = _REASONS.get(exc.errno, exc.strerror) if exc.errno else str(exc)
    return MappedFileError(
        f"{what}: cannot write the {size}-byte buffer file {str(path)!r}: {reason}; give the "
        "buffer a folder on a writable disk with room for it"
    )


def _reserve(fd: int, size: int) -> None:
    """Reserve the blocks of ``size`` bytes (so a full disk fails here, not at a later write
    through the mapping, which would be a SIGBUS)."""
    if size > 0:
        os.posix_fallocate(fd, 0, size)


def _create(path: pathlib.Path, size: int, what: str) -> None:
    """A file of ``size`` bytes with its blocks reserved."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _reserve(fd, size)
        finally:
            os.close(fd)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise _disk_error(exc, path, size, what) from exc


def _unnamed(folder: pathlib.Path, size: int, what: str) -> tuple[int, str]:
    """A file of ``size`` bytes in ``folder`` without a name (``O_TMPFILE``): the system frees it
    when the last descriptor and mapping go, so even a killed process leaves nothing behind.
    Returns its descriptor and a path that opens it (``/proc/self/fd/<fd>``)."""
    try:
        try:
            fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError as exc:  # a file system without O_TMPFILE: name it, then unlink it
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            fd, name = tempfile.mkstemp(".bin", ".unnamed.", folder)
            os.unlink(name)
    except OSError as exc:
        raise _disk_error(exc, folder / "<unnamed>", size, what) from exc
    try:
        _reserve(fd, size)
    except OSError as exc:
        os.close(fd)
        raise _disk_error(exc, folder / "<unnamed>", size, what) from exc
    return fd, f"/proc/self/fd/{fd}"


def _map(
    path: pathlib.Path | str, shape: tuple[int, ...], dtype: torch.dtype, *, shared: bool = True
) -> torch.Tensor:
    """``path`` as a tensor; ``shared=False`` maps it copy-on-write and read-only on disk
    (writes to the tensor never reach the file)."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(str(path), shared=shared, size=numel, dtype=dtype).view(shape)


_FICLONE = 0x40049409  # Linux ioctl: make the destination share the source's blocks (reflink)
_COPY_BLOCK = 64 << 20


def _copy_prefix(source: int, destination: int, nbytes: int) -> None:
    """The first ``nbytes`` of the file ``source`` into the empty file ``destination``: a reflink
    (shared blocks, copied on write) where the file system has them and the whole file is
    copied, else an in-kernel copy (``copy_file_range``), else reads and writes."""
    if nbytes == 0:
        return
    if sys.platform.startswith("linux") and os.fstat(source).st_size == nbytes:
        try:
            fcntl.ioctl(destination, _FICLONE, source)
            return
        except OSError:
            pass  # ext4, tmpfs, another file system: copy
    offset = 0
    while offset < nbytes:
        count = min(_COPY_BLOCK, nbytes - offset)
        try:
            copied = os.copy_file_range(source, destination, count, offset, offset)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            copied = os.pwrite(destination, os.pread(source, count, offset), offset)
        if copied <= 0:
            raise OSError(errno.EIO, "the copy of a buffer file stopped short")
        offset += copied


@attrs.define(eq=False)
class _WorkFiles:
    """A buffer's open files: its work files, the unnamed snapshots it holds (both closed when
    the buffer goes), and where snapshots are written and read now (None: the default)."""

    descriptors: list[int] = attrs.field(factory=list)
    paths: list[str] = attrs.field(factory=list)  # what maps each file again (when it grows)
    write_folder: pathlib.Path | None = None
    read_folder: pathlib.Path | None = None
    held: dict[str, tuple[int, int]] = attrs.field(factory=dict)  # name: (descriptor, generation)
    pinned: set[str] = attrs.field(factory=set)  # held snapshots an undo still needs
    # lazy loads: the snapshot tensors the next storage is (None: make work files), and whether
    # the storage is now such snapshot files (read-only descriptors: copied before a write)
    adopted: list[tuple[torch.Tensor, str]] | None = None
    borrowed: bool = False

    def replace(self, descriptors: list[int], paths: list[str], *, borrowed: bool = False) -> None:
        old, self.descriptors, self.paths = self.descriptors, descriptors, paths
        self.borrowed = borrowed
        for fd in old:
            os.close(fd)  # the mappings stay valid without their descriptor

    def release(self, names: list[str]) -> None:
        for name in names:
            self.pinned.discard(name)
            os.close(self.held.pop(name)[0])

    def release_up_to(self, generation: int) -> None:
        """Close the held snapshots of ``generation`` and before, but the pinned ones."""
        old = [n for n, (_, g) in self.held.items() if g <= generation and n not in self.pinned]
        self.release(old)

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Any:
        raise TypeError(
            "a mapped buffer cannot be copied (its files are open, and a copy would close them "
            "twice): make another one and give it this one's state_dict()"
        )

    __copy__ = __deepcopy__

    def __del__(self) -> None:
        self.replace([], [])
        self.release(list(self.held))


class _MappedStorage:
    """The storage option: every storage tensor a memory-mapped file in ``folder`` (methods
    only; each buffer class declares the fields ``folder``, ``name``, ``unlinked``, ``lazy``,
    ``_generation`` and ``_files``)."""

    __slots__ = ()
    folder: pathlib.Path
    name: str
    unlinked: bool
    lazy: bool
    _generation: int
    _files: _WorkFiles

    def _new_storage(
        self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]
    ) -> list[torch.Tensor]:
        if torch.device(self.device).type != "cpu":  # type: ignore[attr-defined]
            raise ValueError(f"{type(self).__name__} keeps its storage on the CPU (mapped files)")
        if self._files.adopted is not None:
            return self._borrow(self._files.adopted)
        sizes = [_nbytes(shape, dtype) for shape, dtype in zip(shapes, dtypes)]
        if self.unlinked:
            return self._unnamed_storage(shapes, dtypes, sizes)
        for i, size in enumerate(sizes):
            _create(self._work_path(i, ".new"), size, type(self).__name__)
        storage, descriptors, paths = [], [], []
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            os.replace(self._work_path(i, ".new"), self._work_path(i))
            descriptors.append(os.open(self._work_path(i), os.O_RDWR))
            paths.append(str(self._work_path(i)))
            storage.append(_map(self._work_path(i), shape, dtype))
        self._files.replace(descriptors, paths)
        return storage

    def _unnamed_storage(
        self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], sizes: list[int]
    ) -> list[torch.Tensor]:
        descriptors: list[int] = []
        paths: list[str] = []
        try:
            storage = []
            for shape, dtype, size in zip(shapes, dtypes, sizes):
                fd, path = _unnamed(self.folder, size, type(self).__name__)
                descriptors.append(fd)
                paths.append(path)
                storage.append(_map(path, shape, dtype))
        except BaseException:
            for fd in descriptors:
                os.close(fd)
            raise
        self._files.replace(descriptors, paths)
        return storage

    def _borrow(self, snapshot: list[tuple[torch.Tensor, str]]) -> list[torch.Tensor]:
        """The snapshot files being loaded as the storage itself (a lazy load): their private
        mappings, and read-only descriptors (what :meth:`state_dict` copies from). The base's
        copy of the loaded rows into this storage is then a copy onto itself, which torch skips.
        """
        descriptors: list[int] = []
        for _, path in snapshot:
            try:
                descriptors.append(os.open(path, os.O_RDONLY))
            except OSError as exc:
                for fd in descriptors:
                    os.close(fd)
                raise MappedFileError(
                    f"{type(self).__name__}: cannot open the buffer file {path!r}: {exc.strerror}"
                ) from exc
        self._files.replace(descriptors, [path for _, path in snapshot], borrowed=True)
        return [tensor for tensor, _ in snapshot]

    def make_writable(self) -> None:
        """Copy a lazily loaded state into work files in ``folder`` (nothing to do otherwise);
        raises :class:`MappedFileError` (the disk is full, read-only, ...) with nothing changed.
        """
        if not self._files.borrowed:
            return
        if self._spec is None:  # type: ignore[attr-defined]
            self._files.replace([], [])
            return
        n, current = self._length, self._storage()  # type: ignore[attr-defined]
        shapes = [(self._capacity, *t.shape[1:]) for t in current]  # type: ignore[attr-defined]
        with torch.inference_mode(False):
            new = self._new_storage(shapes, [t.dtype for t in current])
            for stored, saved in zip(new, current):
                stored[:n].copy_(saved[:n])
        num_inputs = len(self._inputs)  # type: ignore[attr-defined]
        self._inputs = new[:num_inputs]
        self._targets = new[num_inputs]
        self._metadata = dict(zip(self._metadata, new[num_inputs + 1 :]))  # type: ignore[has-type]

    def update(self, inputs: Any, targets: torch.Tensor, metadata: Any = None) -> None:
        self.make_writable()
        super().update(inputs, targets, metadata)  # type: ignore[misc]

    def set_metadata(
        self, key: str, idx: torch.Tensor, values: torch.Tensor, *, distinct: bool = False
    ) -> None:
        self.make_writable()
        super().set_metadata(key, idx, values, distinct=distinct)  # type: ignore[misc]

    def _work_path(self, i: int, suffix: str = "") -> pathlib.Path:
        return self.folder / f"{self.name}.work.{i}.bin{suffix}"

    def _snapshot_name(self, generation: int, i: int) -> str:
        return f"{self.name}.g{generation}.{i}.bin"

    def snapshots_to(self, folder: str | os.PathLike[str]) -> contextlib.AbstractContextManager:
        """A context in which :meth:`state_dict` writes its snapshot files to ``folder`` (a state
        folder being written: :class:`~renate_events.updater.ModelUpdater` does so); older
        generations there are left alone."""
        return self._redirected("write_folder", folder)

    def snapshots_from(self, folder: str | os.PathLike[str]) -> contextlib.AbstractContextManager:
        """A context in which :meth:`load_state_dict` reads the snapshot files from ``folder``
        (a state folder being read); they are only read, through a private mapping."""
        return self._redirected("read_folder", folder)

    @contextlib.contextmanager
    def _redirected(self, which: str, folder: str | os.PathLike[str]) -> Iterator[Any]:
        previous = getattr(self._files, which)
        setattr(self._files, which, pathlib.Path(folder))
        try:
            yield self
        finally:
            setattr(self._files, which, previous)

    def to(self, device: str | torch.device) -> Any:
        if torch.device(device).type != "cpu":
            raise ValueError(f"{type(self).__name__} keeps its storage on the CPU (mapped files)")
        return self

    def state_dict(self) -> dict[str, Any]:
        """As the in-memory buffer's, but ``inputs``, ``targets`` and ``metadata`` are left empty
        and ``"mapped"`` names the snapshot files written now (see the module's docstring).

        The rows are copied file to file (a reflink where the file system can, else in the
        kernel), never through this process's memory.
        """
        n = self._length  # type: ignore[attr-defined]
        self._length = 0  # the in-memory state without copies of the rows: those go to files
        try:
            state = super().state_dict()  # type: ignore[misc]
        finally:
            self._length = n
        state["length"] = n
        storage = [] if state["inputs_structure"] is None else self._storage()  # type: ignore[attr-defined]
        generation = self._generation + 1
        folder = self._files.write_folder or (None if self.unlinked else self.folder)
        files: list[dict[str, Any]] = []
        try:
            for i, (tensor, fd) in enumerate(zip(storage, self._files.descriptors)):
                shape = (n, *tensor.shape[1:])
                name = self._snapshot_name(generation, i)
                if folder is None:
                    self._hold_snapshot(name, generation, fd, _nbytes(shape, tensor.dtype))
                else:
                    self._write_snapshot(folder / name, fd, _nbytes(shape, tensor.dtype))
                files.append({"file": name, "shape": list(shape), "dtype": str(tensor.dtype)})
        except BaseException:
            if folder is None:
                self._files.release([r["file"] for r in files])
            for record in files if folder is not None else []:
                (folder / record["file"]).unlink(missing_ok=True)
            raise
        self._generation = generation
        if folder is None:
            self._files.release_up_to(generation - _KEPT_GENERATIONS)
        else:
            fsync_folder(folder)
        if folder == self.folder:
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

    def _hold_snapshot(self, name: str, generation: int, source: int, nbytes: int) -> None:
        """An unnamed snapshot file (``unlinked`` buffers, outside :meth:`snapshots_to`: the
        trainer's rollback snapshots), held open under ``name`` for :meth:`load_state_dict`."""
        fd, path = _unnamed(self.folder, 0, type(self).__name__)
        try:
            _copy_prefix(source, fd, nbytes)
        except OSError as exc:
            os.close(fd)
            raise _disk_error(exc, pathlib.Path(path), nbytes, type(self).__name__) from exc
        self._files.held[name] = (fd, generation)

    def _write_snapshot(self, final: pathlib.Path, source: int, nbytes: int) -> None:
        """``nbytes`` of the work file ``source`` into ``final`` (a temporary name, flushed to
        disk, then renamed)."""
        temporary = final.with_name(final.name + ".tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _copy_prefix(source, fd, nbytes)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, final)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise _disk_error(exc, final, nbytes, type(self).__name__) from exc

    def pin_snapshot(self, state: Mapping[str, Any]) -> None:
        """Keep the held snapshot files of :meth:`state_dict`'s ``state`` open until
        :meth:`release_snapshot`, however many later snapshots are taken (an update's undo copy
        outlives the mid-update checkpoints, which otherwise close all but the last two)."""
        names = [record["file"] for record in state["mapped"]["files"]]
        self._files.pinned.update(name for name in names if name in self._files.held)

    def release_snapshot(self, state: Mapping[str, Any]) -> None:
        """Let go of the snapshot files of :meth:`state_dict`'s ``state``, taken outside
        :meth:`snapshots_to` and named by no checkpoint (an update's undo copy, no longer
        needed): held files are closed, named ones deleted, and if no later snapshot was taken
        the generation counter steps back, so that the next snapshot has the name it would have
        had without this one."""
        generation = state["mapped"]["generation"]
        names = [record["file"] for record in state["mapped"]["files"]]
        self._files.release([name for name in names if name in self._files.held])
        if not self.unlinked:
            for name in names:
                (self.folder / name).unlink(missing_ok=True)
        if self._generation == generation:
            self._generation = generation - 1

    def _drop_old_snapshots(self, up_to: int) -> None:
        pattern = re.compile(rf"{re.escape(self.name)}\.g([0-9]+)\.[0-9]+\.bin")
        for path in self.folder.iterdir():
            match = pattern.fullmatch(path.name)
            if match and int(match.group(1)) <= up_to:
                path.unlink(missing_ok=True)

    def load_state_dict(self, state: Mapping[str, Any], *, expect: Expect | None = None) -> None:
        """Restore :meth:`state_dict`'s state: its snapshot files are checked (names inside the
        folder, sizes, dtypes, shapes against the state's length, ``expect``) before anything
        changes, then copied into fresh work files."""
        if not isinstance(state, Mapping) or "mapped" not in state:
            raise ValueError(
                f"state['mapped']: missing; not a {type(self).__name__} state (an in-memory "
                "buffer's state cannot be loaded into a mapped buffer)"
            )
        mapped = state["mapped"]
        snapshot = self._open_snapshot(mapped, state.get("length"))
        tensors = [tensor for tensor, _ in snapshot]
        keys = mapped["metadata_keys"]
        structure = state.get("inputs_structure")
        num_inputs = len(tensors) - len(keys) - (0 if structure is None else 1)
        full = {k: v for k, v in state.items() if k != "mapped"}
        full["inputs"] = tensors[:num_inputs]
        full["targets"] = None if structure is None else tensors[num_inputs]
        full["metadata"] = dict(zip(keys, tensors[num_inputs + 1 :]))
        self._files.adopted = snapshot if self.lazy else None
        try:
            super().load_state_dict(full, expect=expect)  # type: ignore[misc]
        finally:
            self._files.adopted = None
        # never back: a later snapshot must not take the name of one that a checkpoint names
        self._generation = max(self._generation, mapped["generation"])

    def _open_snapshot(self, mapped: Any, length: Any) -> list[tuple[torch.Tensor, str]]:
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

    def _open_file(self, where: str, record: Any, length: int) -> tuple[torch.Tensor, str]:
        """The snapshot file of ``record`` as a private mapping, checked, and its path."""
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
        expected = _nbytes(tuple(shape), _DTYPES[dtype])
        path: pathlib.Path | str = (self._files.read_folder or self.folder) / name
        if self._files.read_folder is None and name in self._files.held:
            path = f"/proc/self/fd/{self._files.held[name][0]}"  # an unnamed snapshot
        if not os.path.isfile(path) or os.stat(path).st_size != expected:
            size = os.stat(path).st_size if os.path.isfile(path) else "missing"
            raise MappedFileError(
                f"{where}: the buffer file {str(path)!r} must hold {expected} bytes, got {size}; "
                "the folder does not hold this checkpoint's buffer files"
            )
        if expected == 0:
            return torch.empty(tuple(shape), dtype=_DTYPES[dtype]), str(path)
        return _map(path, tuple(shape), _DTYPES[dtype], shared=False), str(path)  # never written


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
    unlinked: bool = attrs.field(
        default=False, kw_only=True, validator=validators.boolean, on_setattr=attrs.setters.frozen
    )
    lazy: bool = attrs.field(
        default=False, kw_only=True, validator=validators.boolean, on_setattr=attrs.setters.frozen
    )
    _generation: int = attrs.field(init=False, default=0, repr=False)
    _files: _WorkFiles = attrs.field(init=False, factory=_WorkFiles, repr=False)


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
    unlinked: bool = attrs.field(
        default=False, kw_only=True, validator=validators.boolean, on_setattr=attrs.setters.frozen
    )
    lazy: bool = attrs.field(
        default=False, kw_only=True, validator=validators.boolean, on_setattr=attrs.setters.frozen
    )
    _generation: int = attrs.field(init=False, default=0, repr=False)
    _files: _WorkFiles = attrs.field(init=False, factory=_WorkFiles, repr=False)


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
    unlinked: bool = attrs.field(
        default=False, kw_only=True, validator=validators.boolean, on_setattr=attrs.setters.frozen
    )
    lazy: bool = attrs.field(
        default=False, kw_only=True, validator=validators.boolean, on_setattr=attrs.setters.frozen
    )
    _generation: int = attrs.field(init=False, default=0, repr=False)
    _files: _WorkFiles = attrs.field(init=False, factory=_WorkFiles, repr=False)


@attrs.define(eq=False)
class MappedInfiniteBuffer(_MappedStorage, InfiniteBuffer):
    """:class:`~renate_events.memory.InfiniteBuffer` on memory-mapped files in ``folder``.

    When the storage runs out, every file grows in place (its capacity at least doubles, as the
    in-memory buffer's): the blocks are reserved first, for every file, so that a full disk
    refuses the update before any row changes, and the rows already stored are not copied.

    Example:
        >>> import tempfile, torch
        >>> buffer = MappedInfiniteBuffer(initial_capacity=4, folder=tempfile.mkdtemp())
        >>> for _ in range(3):
        ...     buffer.update(torch.zeros(3, 2), torch.arange(3))
        >>> len(buffer), buffer.capacity
        (9, 16)
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
    unlinked: bool = attrs.field(
        default=False, kw_only=True, validator=validators.boolean, on_setattr=attrs.setters.frozen
    )
    lazy: bool = attrs.field(
        default=False, kw_only=True, validator=validators.boolean, on_setattr=attrs.setters.frozen
    )
    _generation: int = attrs.field(init=False, default=0, repr=False)
    _files: _WorkFiles = attrs.field(init=False, factory=_WorkFiles, repr=False)

    def _ensure_capacity(self, length: int) -> None:
        if length <= self._capacity:
            return
        capacity = max(length, 2 * self._capacity)
        storage = self._storage()
        shapes = [(capacity, *tensor.shape[1:]) for tensor in storage]
        for tensor, shape, fd, path in zip(
            storage, shapes, self._files.descriptors, self._files.paths
        ):
            size = _nbytes(shape, tensor.dtype)
            try:
                _reserve(fd, size)
            except OSError as exc:
                raise _disk_error(exc, pathlib.Path(path), size, type(self).__name__) from exc
        grown = [
            _map(path, shape, tensor.dtype)
            for tensor, shape, path in zip(storage, shapes, self._files.paths)
        ]
        num_inputs = len(self._inputs)
        self._inputs = grown[:num_inputs]
        self._targets = grown[num_inputs]
        self._metadata = dict(zip(self._metadata, grown[num_inputs + 1 :]))
        self._capacity = capacity
