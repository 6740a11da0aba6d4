"""The checkpoint file format: the only module that reads or writes checkpoint files.

A checkpoint is one ``.safetensors`` file. Everything in it comes from one nested *tree* of
dicts, lists, JSON scalars and tensors (the trainer builds it from the model, optimizer,
scheduler, grad scaler, progress, RNG states and every listener's state):

* every tensor of the tree is stored as a safetensors tensor named by its dotted path in the tree
  (``model.0.weight``, ``optimizer.state.0.exp_avg``, ``listeners.my_logger_0.total``);
* the tree itself, with each tensor replaced by ``{"$tensor": "<name>"}`` (and each dict with
  integer keys written as ``{"$intkeys": [[key, value], ...]}``), is stored as JSON in the
  safetensors metadata under ``"tree"``, next to ``"format"`` (always ``"trainer.checkpoint"``) and
  ``"format_version"``.

Tensors that are the same tensor (tied weights: the same storage, offset, shape and strides) are
written once and referenced twice; safetensors itself refuses shared memory. Nothing is pickled,
so reading a checkpoint cannot run code. A checkpoint can be read with ``safetensors.safe_open``
alone::

    from safetensors import safe_open
    with safe_open("ckpt.safetensors", "pt") as f:
        tree = json.loads(f.metadata()["tree"])
        weight = f.get_tensor("model.0.weight")

Writes are atomic: the file is written under a temporary name in the target folder, flushed to
disk with ``fsync`` and moved into place with ``os.replace``, so a crash during a save leaves the
previous file intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import safetensors
import safetensors.torch
import torch

from trainer.exceptions import CheckpointError, CheckpointFormatError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ListenerState",
    "ListenerStates",
    "check_value",
    "read_checkpoint",
    "write_checkpoint",
]

FORMAT_NAME = "trainer.checkpoint"
"""Value of the ``"format"`` metadata entry of every checkpoint."""

FORMAT_VERSION = 1
"""Version of the layout described in this module; stored as ``"format_version"``."""

_TENSOR = "$tensor"
_INT_KEYS = "$intkeys"


def _is_int_key(key: Any) -> bool:
    return isinstance(key, int) and not isinstance(key, bool)


_JSON_SCALARS = (bool, int, float, str, type(None))


def check_value(value: Any, where: str) -> None:
    """Check that ``value`` can be stored in a checkpoint.

    Allowed: tensors, JSON scalars (``None``, bools, ints, floats, strings) and lists, tuples and
    dicts with string keys nesting those.

    Args:
        value: The value to check.
        where: How to name the value in an error message.

    Raises:
        TypeError: When something in ``value`` is not storable; the message names the offending
            part and what to store instead.
    """
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided:
            raise TypeError(
                f"cannot store the {value.layout} tensor at {where}: checkpoints hold dense "
                "tensors; store `tensor.to_dense()` instead"
            )
        return
    if isinstance(value, _JSON_SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        if value and all(_is_int_key(key) for key in value):
            for key, item in value.items():  # e.g. MultiStepLR's Counter of milestones
                check_value(item, f"{where}[{key!r}]")
            return
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"cannot store the dict at {where}: its key {key!r} is a "
                    f"{type(key).__name__}; checkpoint dicts have all-string or all-int keys, "
                    "use str(key)"
                )
            if key in (_TENSOR, _INT_KEYS):
                raise TypeError(f"cannot store the dict at {where}: key {key!r} is reserved")
            check_value(item, f"{where}[{key!r}]")
        return
    hint = "a tensor (torch.as_tensor(...)) or a JSON-able value"
    if type(value).__module__ == "numpy":
        hint = "torch.from_numpy(array) for arrays, or int()/float() for numpy scalars"
    raise TypeError(
        f"cannot store a {type(value).__module__}.{type(value).__qualname__} at {where}: "
        "checkpoint values must be tensors, numbers, strings, bools, None, or lists/dicts of "
        f"those; "
        f"store {hint} instead"
    )


class ListenerState(MutableMapping[str, Any]):
    """The part of a checkpoint that belongs to one listener.

    Listeners receive it as the ``checkpoint`` keyword of ``on_save_checkpoint`` (writable) and
    ``on_load_checkpoint`` (read-only). Keys are strings; values are checked with
    :func:`check_value` when they are set.

    Example:
        >>> state = ListenerState("counter_0")
        >>> state["seen"] = 3
        >>> dict(state)
        {'seen': 3}
    """

    def __init__(
        self, key: str, data: Mapping[str, Any] | None = None, *, readonly: bool = False
    ) -> None:
        self.key = key
        self.readonly = readonly
        self._data: dict[str, Any] = dict(data or {})

    def __getitem__(self, name: str) -> Any:
        try:
            return self._data[name]
        except KeyError:
            raise KeyError(
                f"listener {self.key!r} has no {name!r} in this checkpoint; "
                f"it holds {sorted(self._data)}"
            ) from None

    def __setitem__(self, name: str, value: Any) -> None:
        if self.readonly:
            raise TypeError(
                f"the checkpoint of listener {self.key!r} is read-only while loading; "
                "write state in on_save_checkpoint"
            )
        if not isinstance(name, str) or not name:
            raise TypeError(f"checkpoint keys must be non-empty strings, got {name!r}")
        check_value(value, f"checkpoint[{name!r}] of listener {self.key!r}")
        self._data[name] = value

    def __delitem__(self, name: str) -> None:
        if self.readonly:
            raise TypeError(f"the checkpoint of listener {self.key!r} is read-only while loading")
        del self._data[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"ListenerState({self.key!r}, keys={sorted(self._data)})"


class ListenerStates:
    """The ``checkpoint`` payload of the checkpoint events: one :class:`ListenerState` per listener.

    The dispatcher hands each receiver ``for_listener(key)``, so a listener sees only its own
    namespace.
    """

    def __init__(self, saved: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.readonly = saved is not None
        self._states = {
            key: ListenerState(key, value, readonly=True) for key, value in (saved or {}).items()
        }

    def for_listener(self, key: str) -> ListenerState | None:
        """The namespace of listener ``key``: created empty when saving, None when loading a file
        without state for ``key`` (the listener is then not called)."""
        if key not in self._states:
            if self.readonly:
                return None
            self._states[key] = ListenerState(key)
        return self._states[key]

    def to_tree(self) -> dict[str, dict[str, Any]]:
        """Every namespace as a plain dict, for :func:`write_checkpoint`."""
        return {key: dict(state) for key, state in self._states.items()}


class _Encoder:
    """Splits a tree into named tensors and a JSON skeleton; writes shared tensors once."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._names: dict[tuple[Any, ...], str] = {}
        self._storages: set[int] = set()

    def encode(self, value: Any, path: list[str]) -> Any:
        if isinstance(value, torch.Tensor):
            return {_TENSOR: self._add_tensor(value, path)}
        if isinstance(value, dict):
            if value and all(_is_int_key(key) for key in value):
                items = [[key, self.encode(item, [*path, str(key)])] for key, item in value.items()]
                return {_INT_KEYS: items}
            return {key: self.encode(item, [*path, key]) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.encode(item, [*path, str(i)]) for i, item in enumerate(value)]
        return value  # JSON scalars; NaN and infinities use Python json's extension

    def _add_tensor(self, tensor: torch.Tensor, path: list[str]) -> str:
        tensor = tensor.detach()
        identity = None
        if tensor.numel() > 0:
            identity = (
                tensor.device,
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tuple(tensor.stride()),
                tensor.dtype,
            )
            if identity in self._names:
                return self._names[identity]
        name = ".".join(path) or "tensor"
        base, n = name, 1
        while name in self.tensors:
            name, n = f"{base}#{n}", n + 1
        stored = tensor.to("cpu").contiguous()
        if stored.numel() > 0:
            pointer = stored.untyped_storage().data_ptr()
            if pointer in self._storages:
                stored = stored.clone()
                pointer = stored.untyped_storage().data_ptr()
            self._storages.add(pointer)
        else:
            stored = torch.empty(stored.shape, dtype=stored.dtype)
        self.tensors[name] = stored
        if identity is not None:
            self._names[identity] = name
        return name


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], used: set[str], path: str) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value:
            name = value[_TENSOR]
            if len(value) != 1 or not isinstance(name, str) or name not in tensors:
                raise CheckpointFormatError(
                    f"the tree entry {path or '<root>'} refers to tensor {name!r}, "
                    "which the file does not hold"
                )
            used.add(name)
            return tensors[name]
        if _INT_KEYS in value:
            items = value[_INT_KEYS]
            if len(value) != 1 or not isinstance(items, list):
                raise CheckpointFormatError(f"the tree entry {path or '<root>'} is malformed")
            decoded = {}
            for item in items:
                if not (isinstance(item, list) and len(item) == 2 and _is_int_key(item[0])):
                    raise CheckpointFormatError(f"the tree entry {path or '<root>'} is malformed")
                decoded[item[0]] = _decode(item[1], tensors, used, f"{path}.{item[0]}")
            return decoded
        return {
            k: _decode(v, tensors, used, f"{path}.{k}" if path else k) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_decode(v, tensors, used, f"{path}.{i}") for i, v in enumerate(value)]
    return value


def write_checkpoint(path: str | os.PathLike[str], tree: Mapping[str, Any]) -> None:
    """Write ``tree`` to ``path`` atomically.

    Args:
        path: Target file; its folder is created if missing.
        tree: Dicts with string keys, lists, JSON scalars and tensors (see :func:`check_value`).

    Raises:
        TypeError: When the tree holds something that cannot be stored.
        CheckpointError: When the file cannot be written; any previous file at ``path`` is intact.
    """
    check_value(dict(tree), "the checkpoint")
    encoder = _Encoder()
    skeleton = encoder.encode(dict(tree), [])
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "tree": json.dumps(skeleton, separators=(",", ":")),
    }
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
    try:
        safetensors.torch.save_file(encoder.tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, (OSError, RuntimeError, ValueError)):
            raise CheckpointError(f"could not write checkpoint {path}: {exc}") from exc
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`write_checkpoint`.

    Tensors come back on the CPU. Nothing in the file is executed.

    Args:
        path: The checkpoint file.

    Returns:
        The tree that was written (tuples come back as lists).

    Raises:
        FileNotFoundError: When ``path`` does not exist.
        CheckpointFormatError: When the file is not a readable checkpoint of a known version.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {path}")
    try:
        with safetensors.safe_open(path, "pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            _check_header(path, metadata)
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except CheckpointFormatError:
        raise
    except Exception as exc:  # safetensors raises several types for unreadable files
        raise CheckpointFormatError(
            f"{path} is not a readable safetensors checkpoint ({type(exc).__name__}: {exc})"
        ) from exc
    try:
        skeleton = json.loads(metadata["tree"])
    except (KeyError, ValueError) as exc:
        raise CheckpointFormatError(
            f"{path}: its metadata entry 'tree' is missing or not JSON"
        ) from exc
    if not isinstance(skeleton, dict):
        raise CheckpointFormatError(f"{path}: its tree is a {type(skeleton).__name__}, not a dict")
    used: set[str] = set()
    try:
        tree = _decode(skeleton, tensors, used, "")
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"{path}: {exc}") from None
    unused = sorted(set(tensors) - used)
    if unused:
        raise CheckpointFormatError(f"{path}: tensors {unused} are not referenced by its tree")
    return tree


def _check_header(path: str, metadata: Mapping[str, str]) -> None:
    if metadata.get("format") != FORMAT_NAME:
        raise CheckpointFormatError(
            f"{path} is a safetensors file but not a trainer checkpoint (its metadata 'format' is "
            f"{metadata.get('format')!r}, expected {FORMAT_NAME!r})"
        )
    version = metadata.get("format_version")
    if version != str(FORMAT_VERSION):
        raise CheckpointFormatError(
            f"{path} has checkpoint format version {version!r}; this release reads version "
            f"{FORMAT_VERSION}. Load it with the release that wrote it."
        )
