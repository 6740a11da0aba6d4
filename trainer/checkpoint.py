"""The checkpoint file format: the only module that reads or writes checkpoint files.

A checkpoint is one ``.safetensors`` file. Everything in it comes from one nested *tree* of
dicts, lists, JSON scalars and tensors (the trainer builds it from the model, optimizer,
scheduler, grad scaler, progress, RNG states and every listener's state):

* every tensor of the tree is stored as a safetensors tensor named by its dotted path in the tree
  (``model.0.weight``, ``optimizer.state.0.exp_avg``, ``listeners.my_logger_0.total``);
* the tree itself, with each tensor replaced by ``{"$tensor": "<name>"}`` (and each dict with
  integer keys written as ``{"$intkeys": [[key, value], ...]}``), is stored as JSON in the
  safetensors metadata under ``"tree"``, next to ``"format"`` (always ``"trainer.checkpoint"``),
  ``"format_version"`` and ``"checksums"`` (SHA-256 digests of the tree and of every tensor, so
  that a damaged file is refused instead of loaded with wrong values; files written before
  checksums existed have none and load without that check).

Tensors that are the same tensor (tied weights: the same storage, offset, shape and strides) are
written once and referenced twice; safetensors itself refuses shared memory. A path that would
make a misleading tensor name (an unprintable character, a leading ``/``, a ``..`` component) is
stored under a cleaned name; the tree still holds the original keys.

Reading never runs code: the file holds raw tensor bytes and JSON, nothing executable. Before
safetensors sees the file, the reader checks its layout itself: the 8-byte header length (at most
100 MB), the header JSON, every tensor entry (known dtype, shape, offsets back to back and in
bounds, byte length equal to shape times dtype size) and every tensor name. Anything wrong raises
:class:`~trainer.exceptions.CheckpointFormatError` naming the file and the offending key. The
checksums detect accidental damage, not deliberate tampering: whoever can write the file can
recompute them. A checkpoint can be read with ``safetensors.safe_open`` alone::

    from safetensors import safe_open
    with safe_open("ckpt.safetensors", "pt") as f:
        tree = json.loads(f.metadata()["tree"])
        weight = f.get_tensor("model.0.weight")

Writes are atomic: the file is written under a temporary name in the target folder, flushed to
disk with ``fsync`` and moved into place with ``os.replace``, so a crash during a save leaves the
previous file intact.

Distributed checkpoints (``world_size`` processes, see :mod:`trainer.distributed`) are one file
per rank next to the main file: rank zero writes ``path`` (model, optimizer, scheduler, grad
scaler, progress: the state every rank shares, with ``trainer.world_size`` set and an empty
``listeners`` section), and every rank ``r`` writes :func:`rank_path` ``(path, r)``, e.g.
``ckpt.rank1.safetensors``, with its own listener states (a replay buffer of what that rank saw),
its RNG states and the progress it was written at. :func:`merge_rank_state` joins the two when
reading and refuses a rank file from another save. The rank files are written first; after every
rank has written its file, rank zero replaces the main file, so a crash in between leaves a main
file older than the rank files, which :func:`merge_rank_state` refuses with a clear error.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import os
import re
import reprlib
import tempfile
from collections.abc import Mapping
from typing import Any

import attrs
import safetensors
import torch
from safetensors.torch import save_file

from trainer.exceptions import CheckpointError, CheckpointFormatError
from trainer.files import (
    fsync_file,
    fsync_folder,
    remove_dead_writers_temporaries,
    set_usual_mode,
    writer_temporary_prefix,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "check_value",
    "json_too_deep",
    "read_checkpoint",
    "write_checkpoint",
]

FORMAT_NAME = "trainer.checkpoint"
"""Value of the ``"format"`` metadata entry of every checkpoint."""

FORMAT_VERSION = 1
"""Version of the layout described in this module; stored as ``"format_version"``."""

_TENSOR = "$tensor"
_INT_KEYS = "$intkeys"

_MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself applies
# Nesting bounds, counted here before parsing (the parser's own limit is the interpreter's
# recursion limit, which differs between versions and settings): a header is 3 levels deep,
# a tree as deep as its listeners' states; both far below what any interpreter parses.
_MAX_HEADER_DEPTH, _MAX_TREE_DEPTH = 512, 200
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')

_METADATA_KEYS = ("format", "format_version", "tree", "checksums")
_TENSOR_FIELDS = ("data_offsets", "dtype", "shape")
_MAX_DIMS = 64
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_PATH_SEPARATORS = re.compile(r"[/\\]")

# safetensors dtype codes this reader accepts, and the torch dtypes they load as. Newer codes that
# torch cannot load (F8_E8M0, the packed 4- and 6-bit floats) are left out on purpose.
_DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name)
    for code, name in {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "U16": "uint16",
        "I16": "int16",
        "F16": "float16",
        "BF16": "bfloat16",
        "U32": "uint32",
        "I32": "int32",
        "F32": "float32",
        "U64": "uint64",
        "I64": "int64",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
    }.items()
    if hasattr(torch, name)
}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}


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
        if value.dtype not in _DTYPE_CODES:
            known = ", ".join(str(dtype) for dtype in _DTYPE_CODES)
            raise TypeError(
                f"cannot store the {value.dtype} tensor at {where}: checkpoints hold tensors of "
                f"{known}; store a converted tensor (for example `tensor.to(torch.float64)` or "
                "`torch.view_as_real(tensor)`) instead"
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
        name = _clean_name(".".join(path))
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


def _name_problem(name: str) -> str | None:
    """Why ``name`` is not acceptable as a tensor name, or None when it is."""
    if not name:
        return "is empty"
    odd = next((c for c in name if not c.isprintable()), None)
    if odd is not None:
        return f"holds the unprintable character {odd!r}"
    if name[0] in "/\\":
        return "starts with a path separator"
    if ".." in _PATH_SEPARATORS.split(name):
        return "has a '..' path component"
    return None


def _clean_name(name: str) -> str:
    """``name`` when it is a sane tensor name, else a cleaned version (the tree keeps the keys)."""
    if _name_problem(name) is None:
        return name
    cleaned = "".join("_" if c in "/\\" or not c.isprintable() else c for c in name)
    return "tensor" if cleaned in ("", "..") else cleaned


def _tensor_digest(code: str, shape: tuple[int, ...], tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype code, shape and little-endian bytes (as safetensors stores)."""
    digest = hashlib.sha256(json.dumps([code, list(shape)]).encode())
    if tensor.numel() > 0:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest.update(data)  # type: ignore[arg-type]  # numpy arrays are buffers
    return digest.hexdigest()


_PARALLEL_HASH_BYTES = 16 * 2**20
"""Above this many tensor bytes in a file, tensors are hashed on several threads (hashlib releases
the GIL while it hashes a large buffer; SHA-256 is most of the time of a large save or load)."""


def _tensor_digests(
    items: Mapping[str, tuple[str, tuple[int, ...], torch.Tensor]],
) -> dict[str, str]:
    """``_tensor_digest`` of every ``name: (code, shape, tensor)``; on threads for large states."""
    total = sum(t.numel() * t.element_size() for _, _, t in items.values())
    workers = min(len(items), os.cpu_count() or 1, 8)
    if total < _PARALLEL_HASH_BYTES or workers < 2:
        return {name: _tensor_digest(*item) for name, item in items.items()}
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(_tensor_digest, *item) for name, item in items.items()}
        return {name: future.result() for name, future in futures.items()}


def _tree_digest(metadata: Mapping[str, str]) -> str:
    """SHA-256 of the format, format version and tree entries of the metadata."""
    fields = [metadata.get(key) for key in ("format", "format_version", "tree")]
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).hexdigest()


def _checksums(metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str:
    digests = _tensor_digests(
        {name: (_DTYPE_CODES[t.dtype], tuple(t.shape), t) for name, t in sorted(tensors.items())}
    )
    entry = {"algorithm": "sha256", "tree": _tree_digest(metadata), "tensors": digests}
    return json.dumps(entry, separators=(",", ":"))


def write_checkpoint(path: str | os.PathLike[str], tree: Mapping[str, Any]) -> None:
    """Write ``tree`` to ``path`` atomically.

    Args:
        path: Target file; its folder is created if missing.
        tree: Dicts with string keys, lists, JSON scalars and tensors (see :func:`check_value`).

    Raises:
        TypeError: When the tree holds something that cannot be stored.
        ValueError: When the tree nests deeper than 200 levels (as JSON).
        CheckpointError: When the file cannot be written; any previous file at ``path`` is intact.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
        >>> write_checkpoint(path, {"step": 3, "w": torch.ones(2)})
        >>> read_checkpoint(path)["step"]
        3
    """
    check_value(dict(tree), "the checkpoint")
    encoder = _Encoder()
    skeleton = encoder.encode(dict(tree), [])
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "tree": json.dumps(skeleton, separators=(",", ":")),
    }
    if json_too_deep(metadata["tree"], _MAX_TREE_DEPTH):  # refused now, not when read back
        raise ValueError(f"cannot store the checkpoint: it nests over {_MAX_TREE_DEPTH} levels")
    metadata["checksums"] = _checksums(metadata, encoder.tensors)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        remove_dead_writers_temporaries(path)
        fd, tmp = tempfile.mkstemp(prefix=writer_temporary_prefix(path), suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError as exc:  # no space or inodes left, no permission
        raise CheckpointError(f"could not write checkpoint {path}: {exc}") from exc
    try:
        save_file(encoder.tensors, tmp, metadata=metadata)
        set_usual_mode(tmp)  # mkstemp (and save_file) leave 0600
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, (OSError, RuntimeError, ValueError, safetensors.SafetensorError)):
            raise CheckpointError(f"could not write checkpoint {path}: {exc}") from exc
        raise
    fsync_folder(folder)


def read_checkpoint(path: str | os.PathLike[str], *, tensors_only: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by :func:`write_checkpoint`.

    Tensors come back on the CPU. Nothing in the file is executed. The file's layout is checked
    before safetensors reads it, and its checksums (when it has them) after, so that a truncated,
    damaged or hostile file raises instead of loading wrong values.

    Args:
        path: The checkpoint file.
        tensors_only: Read any safetensors file (a model's weights, no tree): its tensors by name,
            its layout checked as a checkpoint's.

    Returns:
        The tree that was written (tuples come back as lists).

    Raises:
        FileNotFoundError: When ``path`` does not exist.
        CheckpointFormatError: When the file is not a readable checkpoint of a known version; the
            message names the file and, where there is one, the offending key.
        CheckpointError: When the file exists but cannot be opened (permissions, I/O errors).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
        >>> write_checkpoint(path, {"w": torch.ones(2)})
        >>> read_checkpoint(path)["w"]
        tensor([1., 1.])
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {path}")
    layout = _read_layout(path)
    if tensors_only:
        return _load_tensors(path, layout)
    metadata = _check_metadata(path, layout.metadata)
    skeleton = _parse_json(path, metadata["tree"], "its metadata entry 'tree'", deep="its tree")
    if not isinstance(skeleton, dict):
        raise CheckpointFormatError(
            f"{path}: its tree is a {_json_type(skeleton)}, not a JSON object"
        )
    digests = _check_tree_checksum(path, metadata, layout)
    tensors = _load_tensors(path, layout)
    actual = _tensor_digests({name: (*layout.tensors[name], tensors[name]) for name in digests})
    for name, digest in digests.items():
        if actual[name] != digest:
            raise CheckpointFormatError(
                f"{path}: the bytes of tensor {show(name)} do not match its checksum: the file "
                "was damaged or edited after it was written; restore it from a copy"
            )
    decoder = _Decoder(path, tensors)
    tree = decoder.decode(skeleton, "")  # at most _MAX_TREE_DEPTH levels: _parse_json counted
    unused = sorted(set(tensors) - decoder.used)
    if unused:
        raise CheckpointFormatError(
            f"{path}: tensors {show(unused)} are not referenced by its tree; the file was "
            "edited or damaged"
        )
    return tree


# -- reading: every check below raises CheckpointFormatError naming the file ---------------------


@attrs.frozen
class _Layout:
    """What the safetensors header of a file declares, checked."""

    metadata: dict[str, str] | None
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype code, shape)


def _short_repr() -> reprlib.Repr:
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict = 3, 8, 4
    short.maxstring, short.maxlong, short.maxother = 80, 40, 80
    return short


_SHORT_REPR = _short_repr()


def show(value: Any) -> str:
    """A short ``repr`` (bounded length and depth): messages quote values from untrusted files."""
    return _SHORT_REPR.repr(value)


def _json_type(value: Any) -> str:
    names = {dict: "JSON object", list: "list", str: "string", bool: "boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "number")


def _unreadable(path: str, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{path} is not a readable safetensors checkpoint: {why}")


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return result


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed here")


def json_too_deep(text: str, limit: int) -> bool:
    """Whether JSON ``text`` nests arrays and objects more than ``limit`` levels deep, counted
    without recursion (strings skipped): checked before parsing untrusted JSON, so that the
    answer does not depend on the interpreter's recursion limit."""
    depth = 0
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return True
        elif token in "]}":
            depth -= 1
    return False


def _parse_json(path: str, text: str, what: str, *, header: bool = False, deep: str = "") -> Any:
    """Parse untrusted JSON (``deep``: what a refusal of its depth calls it, ``what`` if empty)."""
    limit = _MAX_HEADER_DEPTH if header else _MAX_TREE_DEPTH
    if json_too_deep(text, limit):
        raise CheckpointFormatError(
            f"{path}: {deep or what} is nested too deeply to read (over {limit})"
        )
    try:
        if header:
            return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constants)
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise CheckpointFormatError(
            f"{path}: {what} names the key {show(exc.key)} twice in one object"
        ) from None
    except ValueError as exc:
        raise CheckpointFormatError(f"{path}: {what} is not valid JSON ({exc})") from exc


def _foreign_kind(prefix: bytes) -> str | None:
    """What a file that cannot be a safetensors file starts like, for a precise message."""
    if prefix.startswith(b"PK\x03\x04"):
        return "a zip archive (the container of PyTorch's own .pt/.pth format)"
    if len(prefix) >= 2 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5:
        return "a Python object-serialization stream (the older PyTorch .pt format)"
    return None


def _read_layout(path: str) -> _Layout:
    """Read and check the header: length, JSON, metadata types, names, dtypes, shapes, offsets."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            kind = _foreign_kind(prefix)
            if kind is not None:
                raise _unreadable(
                    path,
                    f"it starts like {kind}. Loading such files can run code, so this reader "
                    "never opens them; checkpoints are written by write_checkpoint or "
                    "Trainer.save_checkpoint (convert a file you trust outside this library)",
                )
            if len(prefix) < 8:
                raise _unreadable(
                    path,
                    f"the file is {size} bytes long, shorter than the 8-byte header length that "
                    "starts every safetensors file",
                )
            length = int.from_bytes(prefix, "little")
            if length > _MAX_HEADER_BYTES:
                raise _unreadable(
                    path,
                    f"its first 8 bytes give a header length of {length} bytes, over the "
                    f"{_MAX_HEADER_BYTES}-byte limit (the file is damaged or not a safetensors "
                    "file)",
                )
            if length > size - 8:
                raise _unreadable(
                    path,
                    f"its header should be {length} bytes long, but only {size - 8} bytes follow "
                    "the header length (the file is truncated)",
                )
            raw = handle.read(length)
    except OSError as exc:
        raise CheckpointError(f"could not read checkpoint {path}: {exc}") from exc
    if len(raw) != length:
        raise CheckpointFormatError(f"{path} changed while it was being read; read it again")
    header = _parse_header(path, raw)
    metadata = header.pop("__metadata__", None)
    if metadata is not None:
        _check_metadata_types(path, metadata)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans = []
    for name, entry in header.items():
        code, shape, (begin, end) = _check_entry(path, name, entry)
        tensors[name] = (code, shape)
        spans.append((begin, end, name))
    _check_spans(path, sorted(spans), size - 8 - length)
    return _Layout(metadata, tensors)


def _parse_header(path: str, raw: bytes) -> dict[str, Any]:
    if len(raw) < 2:
        raise _unreadable(path, f"its header is {len(raw)} bytes long, too short for a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _unreadable(path, f"its header is not UTF-8 text (byte {exc.start} of it)") from None
    if not text.startswith("{"):
        raise _unreadable(
            path,
            f"its header starts with {show(text[:10])}; a safetensors header is a JSON object",
        )
    try:
        header = _parse_json(path, text, "its header", header=True)
    except CheckpointFormatError as exc:
        raise _unreadable(path, str(exc).removeprefix(f"{path}: ")) from exc.__cause__
    if not isinstance(header, dict):  # pragma: no cover - guaranteed by the '{' check
        raise _unreadable(path, "its header is not a JSON object")
    return header


def _is_text(value: Any) -> bool:
    """A string that safetensors' own (strict UTF-8) parser also reads: no lone surrogates."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_metadata_types(path: str, metadata: Any) -> None:
    if not isinstance(metadata, dict):
        raise _unreadable(
            path,
            f"its '__metadata__' is a {_json_type(metadata)}, not a JSON object of strings",
        )
    for key, value in metadata.items():
        if not _is_text(key):
            raise _unreadable(path, f"its metadata key {show(key)} is not valid Unicode")
        if not _is_text(value):
            what = f"a {_json_type(value)}" if not isinstance(value, str) else "not valid Unicode"
            raise _unreadable(
                path,
                f"its metadata entry {show(key)} is {what}, not a string (safetensors metadata "
                "maps strings to strings)",
            )


def _check_entry(path: str, name: str, entry: Any) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    problem = _name_problem(name)
    if problem is not None:
        raise _unreadable(path, f"the tensor name {show(name)} {problem}")
    where = f"tensor {show(name)}"
    if not isinstance(entry, dict) or sorted(entry) != list(_TENSOR_FIELDS):
        got = sorted(entry) if isinstance(entry, dict) else f"a {_json_type(entry)}"
        raise _unreadable(
            path,
            f"{where} should be described by a JSON object with exactly the keys 'dtype', "
            f"'shape' and 'data_offsets', not {show(got)}",
        )
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str) or code not in _DTYPES:
        raise _unreadable(
            path,
            f"{where} has dtype {show(code)}, which is not a tensor dtype this reader loads "
            f"(it loads {', '.join(_DTYPES)})",
        )
    if not (
        isinstance(shape, list)
        and len(shape) <= _MAX_DIMS
        and all(_is_int_key(dim) and dim >= 0 for dim in shape)
    ):
        raise _unreadable(
            path,
            f"{where} has shape {show(shape)}; a shape is a list of at most {_MAX_DIMS} "
            "non-negative integers",
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_int_key(offset) for offset in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise _unreadable(
            path,
            f"{where} has data_offsets {show(offsets)}; expected [begin, end] with "
            "0 <= begin <= end",
        )
    nbytes = math.prod(shape) * _DTYPES[code].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _unreadable(
            path,
            f"{where} of dtype {code} and shape {show(shape)} takes {show(nbytes)} bytes, but "
            f"its data_offsets {show(offsets)} span {show(offsets[1] - offsets[0])}",
        )
    return code, tuple(shape), (offsets[0], offsets[1])


def _check_spans(path: str, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """Tensors must tile the data section exactly: from byte 0, back to back, to its end."""
    end = 0
    for begin, stop, name in spans:
        if stop > data_size:
            raise _unreadable(
                path,
                f"tensor {show(name)} ends at byte {stop} of the data section, which holds only "
                f"{data_size} bytes (the file is truncated)",
            )
        if begin != end:
            how = "overlaps the tensor before it" if begin < end else f"leaves {begin - end} bytes"
            raise _unreadable(
                path,
                f"tensor {show(name)} starts at byte {begin} of the data section, but the data "
                f"before it ends at byte {end}: it {how} (tensors are stored back to back)",
            )
        end = stop
    if end != data_size:
        raise _unreadable(
            path,
            f"its tensors take {end} bytes, but {data_size} bytes follow the header (bytes were "
            "added to the file)",
        )


def _check_metadata(path: str, metadata: Mapping[str, str] | None) -> dict[str, str]:
    metadata = dict(metadata or {})
    if metadata.get("format") != FORMAT_NAME:
        found = (
            f"is {show(metadata['format'])}"
            if "format" in metadata
            else f"is missing; its entries are {show(sorted(metadata))}"
        )
        raise CheckpointFormatError(
            f"{path} is a safetensors file but not a trainer checkpoint (its metadata 'format' "
            f"{found}, expected {FORMAT_NAME!r})"
        )
    version = metadata.get("format_version")
    if version is None:
        raise CheckpointFormatError(
            f"{path}: its metadata entry 'format_version' is missing (its entries are "
            f"{show(sorted(metadata))}); the file was edited or damaged"
        )
    if version != str(FORMAT_VERSION):
        raise CheckpointFormatError(
            f"{path} has checkpoint format version {show(version)}; this release reads version "
            f"{FORMAT_VERSION}. Load it with the release that wrote it."
        )
    unknown = sorted(set(metadata) - set(_METADATA_KEYS))
    if unknown:
        raise CheckpointFormatError(
            f"{path}: its metadata entries {show(unknown)} are not part of checkpoint format "
            f"version {FORMAT_VERSION} (it has {', '.join(_METADATA_KEYS)}); the file was edited "
            "or damaged"
        )
    if "tree" not in metadata:
        raise CheckpointFormatError(f"{path}: its metadata entry 'tree' is missing")
    return metadata


def _check_tree_checksum(path: str, metadata: Mapping[str, str], layout: _Layout) -> dict[str, str]:
    """Check the tree against its checksum; return the tensor checksums (none for old files)."""
    if "checksums" not in metadata:
        return {}
    entry = _parse_json(path, metadata["checksums"], "its metadata entry 'checksums'")
    valid = (
        isinstance(entry, dict)
        and sorted(entry) == ["algorithm", "tensors", "tree"]
        and entry["algorithm"] == "sha256"
        and isinstance(entry["tree"], str)
        and _HEX_DIGEST.fullmatch(entry["tree"]) is not None
        and isinstance(entry["tensors"], dict)
        and all(
            isinstance(digest, str) and _HEX_DIGEST.fullmatch(digest)
            for digest in entry["tensors"].values()
        )
    )
    if not valid:
        raise CheckpointFormatError(
            f"{path}: its metadata entry 'checksums' is malformed; expected "
            '{"algorithm": "sha256", "tree": <hex digest>, "tensors": {<name>: <hex digest>}}'
        )
    digests: dict[str, str] = entry["tensors"]
    missing = sorted(set(layout.tensors) - set(digests))
    if missing:
        raise CheckpointFormatError(
            f"{path}: tensor {show(missing[0])} has no checksum: the file was damaged or edited "
            "after it was written"
        )
    extra = sorted(set(digests) - set(layout.tensors))
    if extra:
        raise CheckpointFormatError(
            f"{path}: its checksums list tensor {show(extra[0])}, which the file does not hold: "
            "the file was damaged or edited after it was written"
        )
    if _tree_digest(metadata) != entry["tree"]:
        raise CheckpointFormatError(
            f"{path}: its metadata entry 'tree' does not match its checksum: the file was "
            "damaged or edited after it was written; restore it from a copy"
        )
    return digests


def _load_tensors(path: str, layout: _Layout) -> dict[str, torch.Tensor]:
    """Let safetensors read the tensors of a file whose layout was checked; check it agrees."""
    changed = CheckpointFormatError(f"{path} changed while it was being read; read it again")
    try:
        with safetensors.safe_open(path, "pt", device="cpu") as handle:
            if set(handle.keys()) != set(layout.tensors) or (handle.metadata() or {}) != (
                layout.metadata or {}
            ):
                raise changed
            # safetensors maps the file; copies own their memory, so that nothing read from the
            # file changes (or faults, if the file is truncated) after it was checked.
            tensors = {name: handle.get_tensor(name).clone() for name in layout.tensors}
    except CheckpointFormatError:
        raise
    except Exception as exc:  # safetensors raises several types for unreadable files
        raise _unreadable(path, f"safetensors refused it ({type(exc).__name__}: {exc})") from exc
    for name, (code, shape) in layout.tensors.items():
        if tensors[name].dtype != _DTYPES[code] or tuple(tensors[name].shape) != shape:
            raise changed
    return tensors


class _Decoder:
    """Rebuilds the tree from its JSON skeleton and the tensors; records the tensors it used."""

    def __init__(self, path: str, tensors: Mapping[str, torch.Tensor]) -> None:
        self.path = path
        self.tensors = tensors
        self.used: set[str] = set()

    def decode(self, value: Any, where: str) -> Any:
        if isinstance(value, dict):
            if _TENSOR in value:
                return self._tensor(value, where)
            if _INT_KEYS in value:
                return self._int_keys(value, where)
            return {key: self.decode(item, _join(where, key)) for key, item in value.items()}
        if isinstance(value, list):
            return [self.decode(item, _join(where, str(i))) for i, item in enumerate(value)]
        return value

    def _fail(self, where: str, problem: str) -> CheckpointFormatError:
        entry = show(where) if where else "<root>"
        return CheckpointFormatError(f"{self.path}: the tree entry {entry} {problem}")

    def _tensor(self, value: dict[str, Any], where: str) -> torch.Tensor:
        if len(value) != 1:
            others = sorted(set(value) - {_TENSOR})
            raise self._fail(where, f"mixes {_TENSOR!r} with the keys {show(others)}")
        name = value[_TENSOR]
        if not isinstance(name, str) or name not in self.tensors:
            raise self._fail(where, f"refers to tensor {show(name)}, which the file does not hold")
        self.used.add(name)
        return self.tensors[name]

    def _int_keys(self, value: dict[str, Any], where: str) -> dict[int, Any]:
        items = value[_INT_KEYS]
        if len(value) != 1 or not isinstance(items, list):
            raise self._fail(
                where, f"is malformed: expected {{{_INT_KEYS!r}: [[key, value], ...]}}"
            )
        decoded: dict[int, Any] = {}
        for item in items:
            if not (isinstance(item, list) and len(item) == 2 and _is_int_key(item[0])):
                raise self._fail(
                    where, f"is malformed: {show(item)} is not an [integer key, value] pair"
                )
            if item[0] in decoded:
                raise self._fail(where, f"holds the integer key {item[0]} twice")
            decoded[item[0]] = self.decode(item[1], _join(where, str(item[0])))
        return decoded


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
