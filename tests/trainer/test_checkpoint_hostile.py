"""Hostile and broken checkpoint files: each is refused with a precise CheckpointFormatError.

Every refusal names the file and, where there is one, the offending key; nothing in a file ever
runs. A hypothesis test mutates a valid checkpoint (byte flips, truncations, insertions, header
JSON edits): each mutant either loads to the original tree or is refused cleanly.
"""

from __future__ import annotations

import json
import math
import pathlib
import pickle
import random
import re
import sys

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trainer.checkpoint as checkpoint_module
from tests.helpers import (
    StatefulCounter,
    assert_same_tensors,
    classification_step,
    make_data,
    make_loader,
    make_model,
    parameters_of,
)
from trainer import (
    CheckpointError,
    CheckpointFormatError,
    NonFiniteLossError,
    Trainer,
    read_checkpoint,
    write_checkpoint,
)

# Every test here feeds a hostile or broken file (`pytest -m hostile` runs them with the others).
pytestmark = pytest.mark.hostile

# -- building files -------------------------------------------------------------------------------


def _tree():
    """A small tree with every kind of value: dtypes, a tied tensor, int keys, scalars."""
    weight = torch.arange(6.0).reshape(2, 3)
    return {
        "model": {"0.weight": weight, "0.bias": torch.tensor([0.5, -1.0, float("inf")])},
        "tied": weight,
        "ints": torch.tensor([3, -7], dtype=torch.int64),
        "half": torch.tensor([1.5, 2.0], dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(7, dtype=torch.int16),
        "empty": torch.zeros(0, 2),
        "counter": {3: 2, 1: 1},
        "values": [1, "x", None, True, 2.5, float("-inf")],
        "nested": {"names": ["a", "b"], "step": 12},
    }


def _split(raw: bytes) -> tuple[dict, bytes]:
    """The parsed header and the data section of safetensors bytes."""
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _assemble(header: dict, data: bytes) -> bytes:
    """Safetensors bytes from a header and a data section, padded as safetensors pads."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def _edit_header(raw: bytes, edit) -> bytes:
    header, data = _split(raw)
    edit(header)
    return _assemble(header, data)


def _edit_tree(raw: bytes, edit, *, drop_checksums: bool = True) -> bytes:
    """Edit the JSON tree; by default also drop the checksums, so that the edit is what is seen."""

    def apply(header):
        metadata = header["__metadata__"]
        tree = json.loads(metadata["tree"])
        metadata["tree"] = json.dumps(edit(tree), separators=(",", ":"))
        if drop_checksums:
            del metadata["checksums"]

    return _edit_header(raw, apply)


def _tensor_span(raw: bytes, name: str) -> tuple[int, int]:
    """Absolute file offsets of a tensor's bytes."""
    header, _ = _split(raw)
    start = 8 + int.from_bytes(raw[:8], "little")
    begin, end = header[name]["data_offsets"]
    return start + begin, start + end


@pytest.fixture
def valid(tmp_path) -> bytes:
    path = tmp_path / "valid.safetensors"
    write_checkpoint(path, _tree())
    return path.read_bytes()


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _refused(tmp_path, raw: bytes, *fragments: str, name: str = "bad.safetensors") -> str:
    """Write ``raw``, read it, and check the refusal names the file and every fragment."""
    path = tmp_path / name
    path.write_bytes(raw)
    with pytest.raises(CheckpointFormatError) as info:
        read_checkpoint(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def _same(a, b) -> bool:
    """Structural equality: same types, tensors with equal dtype, shape and bytes, NaN == NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


# -- code must never run --------------------------------------------------------------------------


class _Exploit:
    """Unpickling this object creates ``marker``: proof that code in a file ran."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _live_payload(tmp_path) -> bytes:
    """Payload bytes, after checking on a probe that unpickling them really runs code."""
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Exploit(probe)))
    assert probe.exists()
    return pickle.dumps(_Exploit(tmp_path / "marker"))


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_pt_file_is_refused_and_nothing_runs(tmp_path, zipped):
    probe = tmp_path / "probe"
    torch.save(
        {"w": torch.ones(2), "x": _Exploit(probe)},
        tmp_path / "probe.pt",
        _use_new_zipfile_serialization=zipped,
    )
    torch.load(tmp_path / "probe.pt", weights_only=False)
    assert probe.exists()  # the file is live: loading it the unsafe way runs code

    marker = tmp_path / "marker"
    path = tmp_path / "model.pt"
    torch.save(
        {"w": torch.ones(2), "x": _Exploit(marker)}, path, _use_new_zipfile_serialization=zipped
    )
    kind = "a zip archive" if zipped else "a Python object-serialization stream"
    with pytest.raises(CheckpointFormatError, match=re.escape(kind)) as info:
        read_checkpoint(path)
    assert str(path) in str(info.value) and "never opens them" in str(info.value)
    model = make_model()
    trainer = Trainer(device="cpu")
    with pytest.raises(CheckpointFormatError):
        trainer.load_checkpoint(
            path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
        )
    assert not marker.exists()


def test_a_safetensors_file_claiming_a_serialized_payload_is_refused(tmp_path):
    payload = _live_payload(tmp_path)
    size = len(payload)
    for dtype in ("PICKLE", "O", "object", "pt"):
        header = {
            "__metadata__": {"format": "trainer.checkpoint", "format_version": "1", "tree": "{}"},
            "state": {"dtype": dtype, "shape": [size], "data_offsets": [0, size]},
        }
        _refused(tmp_path, _assemble(header, payload), "tensor 'state'", f"dtype {dtype!r}")
    header = {"__metadata__": {"format": "pickle"}, "state": {"dtype": "U8", "shape": [size]}}
    header["state"]["data_offsets"] = [0, size]
    _refused(tmp_path, _assemble(header, payload), "not a trainer checkpoint", "'pickle'")
    _refused(tmp_path, payload, "not a readable safetensors checkpoint")
    assert not (tmp_path / "marker").exists()


def test_payload_bytes_in_a_tensor_are_only_data(tmp_path):
    payload = _live_payload(tmp_path)
    blob = torch.tensor(list(payload), dtype=torch.uint8)
    write_checkpoint(tmp_path / "c.safetensors", {"blob": blob, "note": payload.hex()})
    back = read_checkpoint(tmp_path / "c.safetensors")
    assert bytes(back["blob"].tolist()) == payload and back["note"] == payload.hex()
    assert not (tmp_path / "marker").exists()


# -- broken containers ----------------------------------------------------------------------------


def test_truncated_files_are_refused(tmp_path, valid):
    length = int.from_bytes(valid[:8], "little")
    begin, end = _tensor_span(valid, "model.0.weight")
    cases = {
        0: "the file is 0 bytes long",
        5: "the file is 5 bytes long, shorter than the 8-byte header length",
        8: f"its header should be {length} bytes long, but only 0 bytes follow",
        8 + length // 2: "(the file is truncated)",
        begin + 3: "tensor 'model.0.weight' ends at byte",
        len(valid) - 1: "(the file is truncated)",
    }
    for cut, fragment in cases.items():
        _refused(tmp_path, valid[:cut], "not a readable safetensors checkpoint", fragment)
    assert end <= len(valid)


@pytest.fixture(params=["one thread", "threads"])
def hashing(request, monkeypatch):
    """Checksums computed in the caller's thread, and on a thread pool (as for large states)."""
    if request.param == "threads":
        monkeypatch.setattr(checkpoint_module, "_PARALLEL_HASH_BYTES", 0)
    return request.param


def test_flipped_data_bytes_are_refused_naming_the_tensor(tmp_path, hashing):
    path = tmp_path / "valid.safetensors"
    write_checkpoint(path, _tree())
    valid = path.read_bytes()
    assert read_checkpoint(path).keys() == _tree().keys()
    for name in ("model.0.weight", "ints", "half", "mask", "scalar"):
        begin, end = _tensor_span(valid, name)
        damaged = bytearray(valid)
        damaged[(begin + end) // 2] ^= 0x10
        _refused(
            tmp_path, bytes(damaged), f"the bytes of tensor {name!r} do not match its checksum"
        )


def test_flipped_header_bytes_are_refused(tmp_path, valid):
    length = int.from_bytes(valid[:8], "little")
    header = valid[8 : 8 + length]

    def flip_at(needle: bytes, offset: int, mask: int = 0x01) -> bytes:
        damaged = bytearray(valid)
        damaged[8 + header.index(needle) + offset] ^= mask
        return bytes(damaged)

    _refused(tmp_path, flip_at(b'"F32"', 2, 0x02), "dtype 'F12'")  # a dtype that does not exist
    _refused(tmp_path, flip_at(b'"I64"', 1, 0x02), "tensor 'ints' has dtype 'K64'")
    _refused(tmp_path, flip_at(b'"I16"', 3, 0x02), "tensor 'scalar' has dtype 'I14'")
    message = _refused(tmp_path, flip_at(b'\\"step\\":12', 10), "'tree' does not match")
    assert "restore it from a copy" in message
    _refused(tmp_path, flip_at(b"format_version", 0, 0x20), "'format_version' is missing")
    _refused(tmp_path, flip_at(b"{", 0, 0x02), "its header starts with 'y")
    _refused(tmp_path, flip_at(b'"tree"', 1, 0x80), "not UTF-8 text")


def test_absurd_header_lengths_are_refused(tmp_path, valid):
    for length in (2**64 - 1, 2**40, 100_000_001):
        raw = length.to_bytes(8, "little") + valid[8:]
        _refused(tmp_path, raw, f"header length of {length} bytes, over the 100000000-byte limit")
    raw = (len(valid)).to_bytes(8, "little") + valid[8:]
    _refused(tmp_path, raw, f"its header should be {len(valid)} bytes long")
    _refused(tmp_path, (1).to_bytes(8, "little") + b"{", "too short for a JSON object")


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (b'{"a": ', "its header is not valid JSON"),
        (b"{'a': 1}", "its header is not valid JSON"),
        (b'{"a": NaN}', "NaN is not allowed"),
        (b"[1, 2, 3]", "its header starts with '[1, 2, 3]'"),
        (b'{"__metadata__": {}} trailing', "its header is not valid JSON"),
        (b'{"a": 1, "a": 2}', "its header names the key 'a' twice"),
        (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"x": "\xff\xfe"}', "its header is not UTF-8 text (byte 7 of it)"),
    ],
    ids=["cut", "quotes", "nan", "list", "trailing", "duplicate", "deep", "utf8"],
)
def test_a_header_that_is_not_json_is_refused(tmp_path, header, fragment):
    raw = len(header).to_bytes(8, "little") + header
    _refused(tmp_path, raw, "not a readable safetensors checkpoint", fragment)


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (lambda e: e.update(dtype="F31"), ["tensor 'ints' has dtype 'F31'", "BF16"]),
        (lambda e: e.update(dtype=8), ["tensor 'ints' has dtype 8"]),
        (lambda e: e.update(dtype="F32"), ["tensor 'ints' of dtype F32 and shape [2] takes 8"]),
        (lambda e: e.update(shape=[-2]), ["tensor 'ints' has shape [-2]; a shape is a list"]),
        (lambda e: e.update(shape=[2.0]), ["tensor 'ints' has shape [2.0]"]),
        (lambda e: e.update(shape="2"), ["tensor 'ints' has shape '2'"]),
        (lambda e: e.update(shape=[True, 2]), ["tensor 'ints' has shape [True, 2]"]),
        (lambda e: e.update(shape=[1] * 65), ["at most 64 non-negative integers"]),
        (lambda e: e.update(shape=[2**70]), ["takes 9444732965739290427392 bytes"]),
        (lambda e: e.update(shape=_nested(500)), ["tensor 'ints' has shape [[[[...]]]]; a shape"]),
        (lambda e: e.update(data_offsets=[16, 0]), ["data_offsets [16, 0]; expected [begin"]),
        (lambda e: e.update(data_offsets=[-16, 0]), ["data_offsets [-16, 0]"]),
        (lambda e: e.update(data_offsets=[0]), ["data_offsets [0]"]),
        (lambda e: e.update(data_offsets=None), ["data_offsets None"]),
        (lambda e: e.update(extra=1), ["tensor 'ints' should be described by a JSON object"]),
        (lambda e: e.pop("shape"), ["exactly the keys 'dtype', 'shape' and 'data_offsets'"]),
    ],
)
def test_bad_tensor_entries_are_refused_naming_the_tensor(tmp_path, valid, edit, fragments):
    raw = _edit_header(valid, lambda header: edit(header["ints"]))
    _refused(tmp_path, raw, "not a readable safetensors checkpoint", *fragments)


def test_offsets_must_tile_the_data_section(tmp_path, valid):
    def shift(name, delta):
        def edit(header):
            header[name]["data_offsets"] = [o + delta for o in header[name]["data_offsets"]]

        return edit

    header, data = _split(valid)
    spans = {n: e["data_offsets"] for n, e in header.items() if n != "__metadata__"}
    last = max((n for n in spans if spans[n][0] < spans[n][1]), key=lambda n: spans[n][1])
    _refused(tmp_path, _edit_header(valid, shift(last, 8)), f"tensor {last!r} ends at byte")
    _refused(tmp_path, _edit_header(valid, shift(last, -2)), f"tensor {last!r} starts at", "overl")
    _refused(tmp_path, valid + b"\x00" * 4, f"its tensors take {len(data)} bytes, but")

    def entry_is(header, value):
        header["entry"] = value

    raw = _edit_header(valid, lambda h: entry_is(h, [1, 2]))
    _refused(tmp_path, raw, "tensor 'entry' should be described by a JSON object", "a list")


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("../../etc/passwd", "has a '..' path component"),
        ("model/../../x", "has a '..' path component"),
        ("model\\..\\x", "has a '..' path component"),
        ("..", "has a '..' path component"),
        ("/etc/passwd", "starts with a path separator"),
        ("\\\\server\\share", "starts with a path separator"),
        ("model.0\nweight", "holds the unprintable character '\\n'"),
        ("nul\x00byte", "holds the unprintable character '\\x00'"),
        ("escape\x1b[31m", "holds the unprintable character '\\x1b'"),
        ("zero\u200bwidth", "holds the unprintable character '\\u200b'"),
        ("\ud800", "holds the unprintable character"),
        ("", "is empty"),
    ],
)
def test_tensor_names_with_path_tricks_or_odd_characters_are_refused(
    tmp_path, valid, name, problem
):
    raw = _edit_header(valid, lambda header: header.update({name: header.pop("ints")}))
    _refused(tmp_path, raw, f"the tensor name {name!r} {problem}")


def test_the_writer_stores_odd_keys_under_sane_names(tmp_path):
    tree = {"..": torch.ones(1), "a": {"/b": torch.ones(2), "..": {"\n": torch.zeros(3)}}}
    tree["/"] = torch.ones(4)
    tree[""] = {"": torch.ones(5)}
    write_checkpoint(tmp_path / "odd.safetensors", tree)
    back = read_checkpoint(tmp_path / "odd.safetensors")
    assert _same(back, tree)
    with safetensors.safe_open(str(tmp_path / "odd.safetensors"), "pt") as handle:
        names = sorted(handle.keys())
    assert names == [".", "_", "a...._", "a./b", "tensor"]


# -- the tree and the metadata --------------------------------------------------------------------


def test_tree_entries_referring_to_missing_tensors_are_refused(tmp_path, valid):
    def dangle(tree):
        tree["nested"]["ghost"] = {"$tensor": "ghost"}
        return tree

    raw = _edit_tree(valid, dangle)
    _refused(tmp_path, raw, "the tree entry 'nested.ghost' refers to tensor 'ghost', which the")
    raw = _edit_tree(valid, lambda tree: {**tree, "ints": {"$tensor": 3}})
    _refused(tmp_path, raw, "the tree entry 'ints' refers to tensor 3")
    raw = _edit_tree(valid, lambda tree: {**tree, "ints": {"$tensor": "ints", "x": 1}})
    _refused(tmp_path, raw, "the tree entry 'ints' mixes '$tensor' with the keys ['x']")


def test_unreferenced_tensors_are_refused(tmp_path, valid):
    def forget(tree):
        del tree["ints"]
        return tree

    _refused(tmp_path, _edit_tree(valid, forget), "tensors ['ints'] are not referenced by its tree")


@pytest.mark.parametrize("tree", ["[]", "3", "null", '"tree"'])
def test_a_tree_that_is_not_a_dict_is_refused(tmp_path, valid, tree):
    raw = _edit_header(valid, lambda header: header["__metadata__"].update(tree=tree))
    kind = {"[]": "list", "3": "number", "null": "null", '"tree"': "string"}[tree]
    _refused(tmp_path, raw, f"its tree is a {kind}, not a JSON object")


@pytest.mark.parametrize(
    ("tree", "fragment"),
    [
        ("{", "its metadata entry 'tree' is not valid JSON"),
        ('{"a": 1, "a": 1}', "its metadata entry 'tree' names the key 'a' twice"),
        (
            '{"c": {"$intkeys": [[1, 2], [1, 3]]}}',
            "the tree entry 'c' holds the integer key 1 twice",
        ),
        ('{"c": {"$intkeys": [["1", 2]]}}', "the tree entry 'c' is malformed: ['1', 2] is not"),
        ('{"c": {"$intkeys": {"1": 2}}}', "the tree entry 'c' is malformed: expected"),
        ("[" * 50_000 + "]" * 50_000, "nested too deeply"),
        ('{"a": ' + "[" * 800 + "]" * 800 + "}", "its tree is nested too deeply"),
    ],
    ids=["json", "duplicate", "intkeys-twice", "intkeys-str", "intkeys-dict", "deep", "deeper"],
)
def test_malformed_trees_are_refused(tmp_path, valid, tree, fragment):
    def edit(header):
        header["__metadata__"]["tree"] = tree
        del header["__metadata__"]["checksums"]

    _refused(tmp_path, _edit_header(valid, edit), fragment)


@pytest.mark.parametrize("limit", [250, 100_000], ids=["low", "high"])
def test_nesting_depth_is_counted_whatever_the_recursion_limit(tmp_path, valid, limit):
    """The depth check is the reader's own count, not the interpreter's recursion limit (which
    moved in Python 3.12): the same refusal at a lowered and a raised limit, before parsing."""

    def deep(depth: int):
        def edit(header):
            header["__metadata__"]["tree"] = '{"a": ' + "[" * depth + "]" * depth + "}"
            del header["__metadata__"]["checksums"]

        return _edit_header(valid, edit)

    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        for depth in (200, 800, 50_000):
            _refused(tmp_path, deep(depth), "its tree is nested too deeply to read (over 200)")
        header = b'{"x": ' + b"[" * 600 + b"]" * 600 + b"}"
        raw = len(header).to_bytes(8, "little") + header
        _refused(tmp_path, raw, "its header is nested too deeply to read (over 512)")
    finally:
        sys.setrecursionlimit(before)


def test_a_tree_too_deep_to_read_back_is_refused_when_written(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    write_checkpoint(path, {"a": _nested(198)})  # 199 lists in the tree's object: 200 levels
    assert read_checkpoint(path)["a"] == _nested(198)
    with pytest.raises(ValueError, match="cannot store the checkpoint: it nests over 200 levels"):
        write_checkpoint(tmp_path / "deep.safetensors", {"a": _nested(199)})
    assert not (tmp_path / "deep.safetensors").exists()


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda m: m.update(format_version=1), "metadata entry 'format_version' is a number, not"),
        (lambda m: m.update(tree={}), "its metadata entry 'tree' is a JSON object, not a string"),
        (lambda m: m.update(format=None), "its metadata entry 'format' is a null, not a string"),
        (lambda m: m.update(checksums=["x"]), "its metadata entry 'checksums' is a list, not a"),
        (
            lambda m: m.update(extra="1"),
            "its metadata entries ['extra'] are not part of checkpoint",
        ),
        (lambda m: m.pop("tree"), "its metadata entry 'tree' is missing"),
        (lambda m: m.pop("format"), "not a trainer checkpoint (its metadata 'format' is missing"),
        (lambda m: m.update(format="x"), "not a trainer checkpoint (its metadata 'format' is 'x'"),
        (lambda m: m.update(checksums="{}"), "its metadata entry 'checksums' is malformed"),
        (lambda m: m.update(checksums="sha"), "its metadata entry 'checksums' is not valid JSON"),
        (lambda m: m.update({"\ud800": "x"}), "its metadata key '\\ud800' is not valid Unicode"),
        (lambda m: m.update(tree="\udfff"), "its metadata entry 'tree' is not valid Unicode"),
    ],
)
def test_wrong_metadata_types_are_refused(tmp_path, valid, edit, fragment):
    _refused(tmp_path, _edit_header(valid, lambda header: edit(header["__metadata__"])), fragment)


def test_metadata_that_is_not_a_dict_is_refused(tmp_path, valid):
    raw = _edit_header(valid, lambda header: header.update(__metadata__=["format"]))
    _refused(tmp_path, raw, "its '__metadata__' is a list, not a JSON object of strings")


@pytest.mark.parametrize("version", ["2", "0", "", "1.0", " 1", "01"])
def test_an_unknown_format_version_is_refused(tmp_path, valid, version):
    raw = _edit_header(valid, lambda header: header["__metadata__"].update(format_version=version))
    _refused(tmp_path, raw, f"has checkpoint format version {version!r}; this release reads")


def test_checksums_that_do_not_list_the_tensors_are_refused(tmp_path, valid):
    def edit_checksums(change):
        def edit(header):
            checksums = json.loads(header["__metadata__"]["checksums"])
            change(checksums["tensors"])
            header["__metadata__"]["checksums"] = json.dumps(checksums)

        return _edit_header(valid, edit)

    _refused(tmp_path, edit_checksums(lambda t: t.pop("ints")), "tensor 'ints' has no checksum")
    raw = edit_checksums(lambda t: t.update(ghost="0" * 64))
    _refused(tmp_path, raw, "its checksums list tensor 'ghost', which the file does not hold")
    raw = edit_checksums(lambda t: t.update(ints="0" * 64))
    _refused(tmp_path, raw, "the bytes of tensor 'ints' do not match its checksum")


def test_files_without_checksums_still_load(tmp_path):
    """Files written before checksums existed hold only format, format_version and tree."""
    tree = {"w": {"$tensor": "w"}, "c": {"$intkeys": [[2, 1]]}, "n": [1, None]}
    metadata = {"format": "trainer.checkpoint", "format_version": "1", "tree": json.dumps(tree)}
    safetensors.torch.save_file({"w": torch.ones(3)}, str(tmp_path / "old.safetensors"), metadata)
    back = read_checkpoint(tmp_path / "old.safetensors")
    assert _same(back, {"w": torch.ones(3), "c": {2: 1}, "n": [1, None]})


def test_a_tensor_of_an_unloadable_dtype_is_refused_when_written(tmp_path):
    with pytest.raises(TypeError, match=r"cannot store the torch.complex128 tensor at .*'z'"):
        write_checkpoint(tmp_path / "c.safetensors", {"z": torch.zeros(2, dtype=torch.complex128)})
    assert not (tmp_path / "c.safetensors").exists()


def test_an_unreadable_file_is_a_checkpoint_error(tmp_path, valid, monkeypatch):
    path = tmp_path / "locked.safetensors"
    path.write_bytes(valid)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint_module, "open", refuse, raising=False)
    with pytest.raises(CheckpointError, match=r"could not read checkpoint .*Permission denied"):
        read_checkpoint(path)


# -- mutation: every mutant loads unchanged or is refused cleanly ---------------------------------

_BASE: dict[str, bytes] = {}


def _base_bytes(folder: pathlib.Path) -> bytes:
    if "raw" not in _BASE:
        write_checkpoint(folder / "base.safetensors", _tree())
        _BASE["raw"] = (folder / "base.safetensors").read_bytes()
    return _BASE["raw"]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


def _containers(value, path=()):
    """Paths of every dict and list inside a JSON value."""
    if isinstance(value, (dict, list)):
        yield path
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            yield from _containers(item, (*path, key))


@st.composite
def _json_edit(draw, document):
    """``document`` with one JSON edit: a value replaced, a key deleted, or a key added."""
    paths = list(_containers(document))
    path = draw(st.sampled_from(paths))
    target = document
    for key in path:
        target = target[key]
    keys = list(target) if isinstance(target, dict) else list(range(len(target)))
    operation = draw(st.sampled_from(["replace", "delete", "add"] if keys else ["add"]))
    if operation == "add":
        if isinstance(target, dict):
            target[draw(st.text(max_size=8))] = draw(_JSON)
        else:
            target.insert(draw(st.integers(0, len(target))), draw(_JSON))
    else:
        key = draw(st.sampled_from(keys))
        if operation == "delete":
            del target[key]
        else:
            target[key] = draw(_JSON | st.sampled_from(["F32", "I64", "BOOL", "U8", [0, 0], [1]]))
    return document


@st.composite
def _mutants(draw, raw: bytes) -> bytes:
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "length", "header"]))
    data = bytearray(raw)
    if kind == "flip":
        for _ in range(draw(st.integers(1, 3))):
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    elif kind == "truncate":
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif kind == "insert":
        at = draw(st.integers(0, len(data)))
        data[at:at] = draw(st.binary(min_size=1, max_size=16))
    elif kind == "delete":
        at = draw(st.integers(0, len(data) - 1))
        del data[at : at + draw(st.integers(1, 16))]
    elif kind == "length":
        length = int.from_bytes(raw[:8], "little")
        new = draw(
            st.integers(-16, 16).map(lambda d: max(0, length + d)) | st.integers(0, 2**64 - 1)
        )
        data[:8] = new.to_bytes(8, "little")
    else:
        header, body = _split(raw)
        metadata = header["__metadata__"]
        document = draw(st.sampled_from(["header", "tree", "checksums"]))
        if document == "header":
            header = draw(_json_edit(header))
        else:
            metadata[document] = json.dumps(
                draw(_json_edit(json.loads(metadata[document]))), separators=(",", ":")
            )
        data = bytearray(_assemble(header, body))
    return bytes(data)


@settings(max_examples=400)
@given(data=st.data())
def test_every_mutant_loads_unchanged_or_is_refused(tmp_path_factory, data):
    folder = tmp_path_factory.getbasetemp()
    raw = _base_bytes(folder)
    mutant = data.draw(_mutants(raw), label="mutant")
    path = folder / "mutant.safetensors"
    path.write_bytes(mutant)
    try:
        tree = read_checkpoint(path)
    except CheckpointFormatError as exc:
        assert str(path) in str(exc)
    else:
        assert _same(tree, read_checkpoint(folder / "base.safetensors"))


def test_the_mutation_base_round_trips(tmp_path):
    write_checkpoint(tmp_path / "c.safetensors", _tree())
    back = read_checkpoint(tmp_path / "c.safetensors")
    assert _same(back, _tree())
    assert back["tied"] is back["model"]["0.weight"]


# -- end to end: a broken file leaves the live objects as they were -------------------------------


@pytest.mark.all_or_nothing
def test_loading_a_broken_file_leaves_the_trainer_untouched(tmp_path):
    model = make_model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = Trainer(max_epochs=1, device="cpu")
    counter = StatefulCounter()
    trainer.subscribe(counter, name="counter")
    loader = make_loader(make_data(n=24), batch_size=8)
    trainer.fit(model, optimizer, loader, classification_step(model))
    good = tmp_path / "good.safetensors"
    trainer.save_checkpoint(good)
    trainer.fit(model, optimizer, loader, classification_step(model))  # live state moves on
    raw = good.read_bytes()

    begin, end = _tensor_span(raw, "model.0.weight")
    flipped = bytearray(raw)
    flipped[(begin + end) // 2] ^= 0x40
    broken = {
        "flipped": bytes(flipped),
        "truncated": raw[: len(raw) - 7],
        "absurd": (2**62).to_bytes(8, "little") + raw[8:],
        "dangling": _edit_tree(raw, lambda tree: {**tree, "pending_grads": {"$tensor": "nope"}}),
    }
    assert counter.count == 6  # the file holds 3
    before = (
        parameters_of(model),
        {k: v.clone() for k, v in optimizer.state[model[0].weight].items()},
        counter.count,
        trainer.state.global_step,
    )
    for label, content in broken.items():
        path = tmp_path / f"{label}.safetensors"
        path.write_bytes(content)
        with pytest.raises(CheckpointFormatError, match=re.escape(str(path))):
            trainer.load_checkpoint(path)
        assert_same_tensors(before[0], parameters_of(model))
        assert_same_tensors(before[1], optimizer.state[model[0].weight])
        assert (counter.count, trainer.state.global_step) == before[2:]
    trainer.load_checkpoint(good)  # the intact file still loads
    assert counter.count == 3


# -- values no optimizer or scheduler can run (issue 26.3) ----------------------------------------
#
# Each case edits one value of a valid trainer checkpoint and writes it again with valid checksums:
# `load_checkpoint` and `fit(resume_from=...)` must refuse it with a CheckpointError naming the
# file and the key, and leave the model and the optimizer exactly as they were.

_HOSTILE_OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}
_lr = torch.optim.lr_scheduler
_HOSTILE_SCHEDULERS = {
    None: lambda optimizer: None,
    "step": lambda optimizer: _lr.StepLR(optimizer, 2),
    "multistep": lambda optimizer: _lr.MultiStepLR(optimizer, [2, 4]),
    "exponential": lambda optimizer: _lr.ExponentialLR(optimizer, 0.9),
    "cosine": lambda optimizer: _lr.CosineAnnealingLR(optimizer, 5),
    "linear": lambda optimizer: _lr.LinearLR(optimizer),
    "constant": lambda optimizer: _lr.ConstantLR(optimizer),
    "lambda": lambda optimizer: _lr.LambdaLR(optimizer, lambda epoch: 0.9**epoch),
    "onecycle": lambda optimizer: _lr.OneCycleLR(optimizer, 1.0, total_steps=50),
    "cyclic": lambda optimizer: _lr.CyclicLR(optimizer, 0.01, 0.1, step_size_up=3),
    "sequential": lambda optimizer: _lr.SequentialLR(
        optimizer, [_lr.ConstantLR(optimizer), _lr.ExponentialLR(optimizer, 0.9)], milestones=[2]
    ),
}


def _group(key, value):
    return lambda tree: tree["optimizer"]["param_groups"][0].__setitem__(key, value)


def _moment(key, value):
    """Per-parameter state of parameter 0, the [16, 6] weight of the first layer."""
    return lambda tree: tree["optimizer"]["state"]["0"].__setitem__(key, value)


def _schedule(key, value):
    return lambda tree: tree["scheduler"].__setitem__(key, value)


def _inner_schedule(key, value):
    return lambda tree: tree["scheduler"]["_schedulers"][1].__setitem__(key, value)


def _progress_is(**values):
    return lambda tree: tree["trainer"]["progress"].update(values)


def _trainer_entry(key, value):
    return lambda tree: tree["trainer"].__setitem__(key, value)


def _nan_like(shape):
    return torch.full(shape, math.nan)


# (id, optimizer, scheduler, edit, a fragment of the refusal naming the key)
_HOSTILE_VALUES = [
    *(
        case
        for name in ("adam", "adamw")
        for case in [
            (f"{name}-betas-2-3", name, None, _group("betas", [2, 3]), "betas"),
            (f"{name}-beta1-1", name, None, _group("betas", [1.0, 0.999]), "betas"),
            (f"{name}-beta-negative", name, None, _group("betas", [-0.1, 0.999]), "betas"),
            (f"{name}-betas-one", name, None, _group("betas", [0.9]), "betas"),
            (f"{name}-lr-negative", name, None, _group("lr", -1), "lr"),
            (f"{name}-lr-inf", name, None, _group("lr", math.inf), "lr"),
            (f"{name}-lr-overflows-float32", name, None, _group("lr", 1e300), "lr"),
            (f"{name}-eps-negative", name, None, _group("eps", -1e-8), "eps"),
            (f"{name}-eps-inf", name, None, _group("eps", math.inf), "eps"),
            (f"{name}-weight-decay-negative", name, None, _group("weight_decay", -0.1), "weight"),
            (f"{name}-weight-decay-inf", name, None, _group("weight_decay", math.inf), "weight"),
            (f"{name}-capturable-on-cpu", name, None, _group("capturable", True), "capturable"),
            (f"{name}-differentiable", name, None, _group("differentiable", True), "different"),
            (f"{name}-exp-avg-0-dim", name, None, _moment("exp_avg", torch.tensor(1.0)), "exp_avg"),
            (f"{name}-exp-avg-1-elem", name, None, _moment("exp_avg", torch.ones(1)), "exp_avg"),
            (
                f"{name}-exp-avg-sq-transposed",
                name,
                None,
                _moment("exp_avg_sq", torch.ones(6, 16)),
                "exp_avg_sq",
            ),
            (f"{name}-exp-avg-nan", name, None, _moment("exp_avg", _nan_like((16, 6))), "exp_avg"),
            (
                f"{name}-exp-avg-sq-inf",
                name,
                None,
                _moment("exp_avg_sq", torch.full((16, 6), math.inf)),
                "exp_avg_sq",
            ),
            (f"{name}-step-two-elements", name, None, _moment("step", torch.ones(2)), "step"),
            (f"{name}-step-negative", name, None, _moment("step", torch.tensor(-3.0)), "step"),
            (f"{name}-step-nan", name, None, _moment("step", torch.tensor(math.nan)), "step"),
            (f"{name}-step-huge", name, None, _moment("step", torch.tensor(1e30)), "step"),
            (
                f"{name}-unknown-state",
                name,
                None,
                _moment("velocity", torch.ones(16, 6)),
                "velocity",
            ),
        ]
    ),
    ("adam-eps-huge-int", "adam", None, _group("eps", 2**70), "eps"),
    ("adam-exp-avg-sq-null", "adam", None, _moment("exp_avg_sq", None), "exp_avg_sq"),
    ("adam-fused-a-tensor", "adam", None, _group("fused", torch.ones(2)), "fused"),
    ("adamw-foreach-a-string", "adamw", None, _group("foreach", "yes"), "foreach"),
    ("sgd-momentum-huge-int", "sgd", None, _group("momentum", 2**70), "momentum"),
    ("sgd-unknown-huge-value", "sgd", None, _group("extra", -1e300), "extra"),
    ("sgd-lr-negative", "sgd", None, _group("lr", -1), "lr"),
    ("sgd-lr-overflows-float32", "sgd", None, _group("lr", 1e300), "lr"),
    ("sgd-momentum-negative", "sgd", None, _group("momentum", -0.5), "momentum"),
    ("sgd-momentum-inf", "sgd", None, _group("momentum", math.inf), "momentum"),
    ("sgd-dampening-inf", "sgd", None, _group("dampening", math.inf), "dampening"),
    ("sgd-weight-decay-negative", "sgd", None, _group("weight_decay", -1.0), "weight_decay"),
    (
        "sgd-nesterov-without-momentum",
        "sgd",
        None,
        lambda tree: tree["optimizer"]["param_groups"][0].update(nesterov=True, momentum=0.0),
        "nesterov",
    ),
    (
        "sgd-buffer-0-dim",
        "sgd",
        None,
        _moment("momentum_buffer", torch.tensor(1.0)),
        "momentum_buffer",
    ),
    (
        "sgd-buffer-wrong-shape",
        "sgd",
        None,
        _moment("momentum_buffer", torch.ones(96)),
        "momentum_buffer",
    ),
    (
        "sgd-buffer-nan",
        "sgd",
        None,
        _moment("momentum_buffer", _nan_like((16, 6))),
        "momentum_buffer",
    ),
    ("sgd-initial-lr-negative", "sgd", "step", _group("initial_lr", -0.1), "initial_lr"),
    ("step-gamma-huge", "sgd", "step", _schedule("gamma", 1e308), "gamma"),
    ("step-gamma-negative", "adam", "step", _schedule("gamma", -0.5), "gamma"),
    ("step-size-0", "adam", "step", _schedule("step_size", 0), "step_size"),
    ("step-last-epoch-huge", "adam", "step", _schedule("last_epoch", 2**70), "last_epoch"),
    ("step-last-epoch-negative", "adam", "step", _schedule("last_epoch", -5), "last_epoch"),
    ("step-step-count-negative", "adam", "step", _schedule("_step_count", -1), "_step_count"),
    ("step-base-lrs-negative", "adam", "step", _schedule("base_lrs", [-0.01]), "base_lrs"),
    ("step-base-lrs-huge", "adam", "step", _schedule("base_lrs", [1e300]), "base_lrs"),
    ("step-last-lr-inf", "adam", "step", _schedule("_last_lr", [math.inf]), "_last_lr"),
    ("multistep-gamma-huge", "adam", "multistep", _schedule("gamma", 1e308), "gamma"),
    ("multistep-gamma-inf", "sgd", "multistep", _schedule("gamma", math.inf), "gamma"),
    (
        "multistep-milestone-negative",
        "adam",
        "multistep",
        _schedule("milestones", {-2: 1}),
        "milestones",
    ),
    (
        "multistep-milestone-count-0",
        "adam",
        "multistep",
        _schedule("milestones", {2: 0}),
        "milestones",
    ),
    ("exponential-gamma-huge", "adam", "exponential", _schedule("gamma", 1e308), "gamma"),
    ("exponential-gamma-inf", "adamw", "exponential", _schedule("gamma", math.inf), "gamma"),
    ("cosine-t-max-0", "adam", "cosine", _schedule("T_max", 0), "T_max"),
    ("cosine-eta-min-negative", "adam", "cosine", _schedule("eta_min", -1.0), "eta_min"),
    ("cosine-eta-min-inf", "sgd", "cosine", _schedule("eta_min", math.inf), "eta_min"),
    ("linear-start-factor-0", "adam", "linear", _schedule("start_factor", 0.0), "start_factor"),
    ("linear-end-factor-2", "adam", "linear", _schedule("end_factor", 2.0), "end_factor"),
    ("linear-total-iters-negative", "adam", "linear", _schedule("total_iters", -1), "total_iters"),
    ("constant-factor-2", "adam", "constant", _schedule("factor", 2.0), "factor"),
    (
        "constant-total-iters-negative",
        "sgd",
        "constant",
        _schedule("total_iters", -3),
        "total_iters",
    ),
    ("lambda-last-epoch-huge", "adam", "lambda", _schedule("last_epoch", 2**70), "last_epoch"),
    ("lambda-lr-lambdas-false", "adam", "lambda", _schedule("lr_lambdas", [False]), "lr_lambdas"),
    (
        "lambda-lr-lambdas-state",
        "adam",
        "lambda",
        _schedule("lr_lambdas", [{"x": 1}]),
        "lr_lambdas",
    ),
    ("onecycle-base-momentum", "sgd", "onecycle", _group("base_momentum", -1e308), "base_momentum"),
    ("onecycle-past-its-end", "adam", "onecycle", _schedule("last_epoch", 10**9), "last_epoch"),
    ("cyclic-adam-momentum-1", "adam", "cyclic", _schedule("max_momentums", [1.0]), "momentums"),
    ("cyclic-scale-fn-state", "sgd", "cyclic", _schedule("_scale_fn_custom", 3), "_scale_fn"),
    ("onecycle-total-steps-0", "sgd", "onecycle", _schedule("total_steps", 0), "total_steps"),
    (
        "onecycle-anneal-unknown",
        "sgd",
        "onecycle",
        _schedule("_anneal_func_type", "sine"),
        "_anneal_func_type",
    ),
    ("cyclic-mode-unknown", "sgd", "cyclic", _schedule("mode", "zigzag"), "mode"),
    ("cyclic-max-lrs-negative", "sgd", "cyclic", _schedule("max_lrs", [-1.0]), "max_lrs"),
    ("cyclic-gamma-huge", "sgd", "cyclic", _schedule("gamma", 1e308), "gamma"),
    (
        "sequential-milestone-negative",
        "adam",
        "sequential",
        _schedule("_milestones", [-1]),
        "_milestones",
    ),
    ("sequential-inner-gamma-huge", "adam", "sequential", _inner_schedule("gamma", 1e308), "gamma"),
    ("progress-epoch-2-70", "adam", None, _progress_is(epoch=2**70), "trainer.progress.epoch"),
    ("progress-epoch-past-steps", "adam", None, _progress_is(epoch=50), "trainer.progress.epoch"),
    ("progress-batch-1e9", "adam", None, _progress_is(batch=10**9), "trainer.progress.batch"),
    (
        "progress-global-step-2-70",
        "adam",
        None,
        _progress_is(global_step=2**70),
        "trainer.progress.global_step",
    ),
    (
        "progress-accumulated-1e6",
        "adam",
        None,
        _progress_is(accumulated=10**6),
        "trainer.progress.accumulated",
    ),
    (
        "progress-accumulated-without-gradients",
        "sgd",
        None,
        _progress_is(batch=2, accumulated=1),
        "trainer.progress.accumulated",
    ),
    (
        "precision-sixty-four",
        "adam",
        None,
        _trainer_entry("precision", "sixty-four"),
        "trainer.precision",
    ),
    (
        "listener-order-garbage",
        "adam",
        None,
        _trainer_entry("listener_order", {"x": 3}),
        "trainer.listener_order",
    ),
    (
        "listener-order-numbers",
        "adam",
        None,
        _trainer_entry("listener_order", [3, 4]),
        "trainer.listener_order",
    ),
    (
        "listener-order-twice",
        "adam",
        None,
        _trainer_entry("listener_order", ["counter"] * 2),
        "trainer.listener_order",
    ),
    (
        "listener-order-without-a-stateful-one",
        "adam",
        None,
        _trainer_entry("listener_order", []),
        "trainer.stateful_listeners",
    ),
    (
        "stateful-listeners-garbage",
        "adam",
        None,
        _trainer_entry("stateful_listeners", "counter"),
        "trainer.stateful_listeners",
    ),
]


def _hostile_run(tmp_path, optimizer: str, scheduler):
    """A trainer after one epoch (saved to a file) and a second (the live state moved on)."""
    model = make_model()
    live = _HOSTILE_OPTIMIZERS[optimizer](model.parameters())
    schedule = _HOSTILE_SCHEDULERS[scheduler](live)
    trainer = Trainer(max_epochs=1, device="cpu", seed=0)
    trainer.subscribe(StatefulCounter(), name="counter")
    loader = make_loader(make_data(n=24), batch_size=8)
    step = classification_step(model)
    trainer.fit(model, live, loader, step, scheduler=schedule, scheduler_interval="step")
    path = tmp_path / "hostile.safetensors"
    trainer.save_checkpoint(path)
    trainer.fit(model, live, loader, step, scheduler=schedule, scheduler_interval="step")
    return trainer, model, live, schedule, loader, path


def _optimizer_copy(optimizer: torch.optim.Optimizer) -> dict:
    state = optimizer.state_dict()
    return {
        "state": {k: {n: _clone(v) for n, v in s.items()} for k, s in state["state"].items()},
        "param_groups": [dict(group) for group in state["param_groups"]],
    }


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


@pytest.mark.all_or_nothing
@pytest.mark.parametrize(
    ("optimizer", "scheduler", "edit", "key"),
    [case[1:] for case in _HOSTILE_VALUES],
    ids=[case[0] for case in _HOSTILE_VALUES],
)
def test_values_no_optimizer_or_scheduler_can_run_are_refused(
    tmp_path, optimizer, scheduler, edit, key
):
    trainer, model, live, schedule, loader, path = _hostile_run(tmp_path, optimizer, scheduler)
    tree = read_checkpoint(path)
    edit(tree)
    write_checkpoint(path, tree)
    before = (parameters_of(model), _optimizer_copy(live), trainer.state.global_step)
    schedule_before = None if schedule is None else schedule.state_dict()
    with pytest.raises(CheckpointError) as info:
        trainer.load_checkpoint(path)
    assert str(path) in str(info.value) and key in str(info.value), str(info.value)
    assert_same_tensors(before[0], parameters_of(model))
    assert _same(before[1], _optimizer_copy(live))
    assert trainer.state.global_step == before[2]
    if schedule is not None:
        assert schedule.state_dict() == schedule_before

    resumed = Trainer(max_epochs=3, device="cpu")
    resumed.subscribe(StatefulCounter(), name="counter")
    started = []
    resumed.connect("train_start", lambda: started.append(True))
    with pytest.raises(CheckpointError) as info:
        resumed.fit(
            model,
            live,
            loader,
            classification_step(model),
            scheduler=schedule,
            scheduler_interval="step",
            resume_from=path,
        )
    assert str(path) in str(info.value) and key in str(info.value), str(info.value)
    assert started == []
    assert_same_tensors(before[0], parameters_of(model))
    assert _same(before[1], _optimizer_copy(live))


_ODD_VALUES = [
    -1, 0, 1, 2, 0.5, 1e308, -1e308, math.inf, -math.inf, 2**70, -(2**70), 10**9, True, None,
    "x", [], [1, 2], [2**70], {}, torch.tensor(2.0), torch.ones(3), torch.tensor(math.nan),
]  # fmt: skip


def _value_paths(node, path=()):
    """The path of every value in the optimizer, scheduler and trainer sections of a tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _value_paths(value, (*path, key))
    elif isinstance(node, list) and node and not all(isinstance(x, torch.Tensor) for x in node):
        for i, value in enumerate(node):
            yield from _value_paths(value, (*path, i))
    elif path and path[0] in ("optimizer", "scheduler", "trainer") and "params" not in path:
        yield path


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_a_value_replaced_anywhere_is_refused_or_runs(tmp_path, seed):
    """One value of the optimizer, scheduler or trainer section replaced by an odd one: the resume
    is refused with a CheckpointError naming the file, or it runs (at worst into the trainer's own
    NonFiniteLossError, for a finite but absurd value such as a learning rate of 1e9)."""
    rng = random.Random(seed)
    for trial in range(25):
        optimizer = rng.choice(sorted(_HOSTILE_OPTIMIZERS))
        scheduler = rng.choice(list(_HOSTILE_SCHEDULERS))
        folder = tmp_path / str(trial)
        folder.mkdir()
        _, model, live, schedule, loader, path = _hostile_run(folder, optimizer, scheduler)
        tree = read_checkpoint(path)
        where = rng.choice(list(_value_paths(tree)))
        node = tree
        for key in where[:-1]:
            node = node[key]
        node[where[-1]] = rng.choice(_ODD_VALUES)
        try:
            write_checkpoint(path, tree)
        except TypeError:
            continue  # a value the writer refuses (a dict key of another kind)
        resumed = Trainer(max_epochs=3, device="cpu")
        resumed.subscribe(StatefulCounter(), name="counter")
        try:
            resumed.fit(
                model, live, loader, classification_step(model), scheduler=schedule,
                scheduler_interval="step", resume_from=path,
            )  # fmt: skip
        except CheckpointError as exc:
            assert str(path) in str(exc), (where, str(exc))
        except NonFiniteLossError:
            pass


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.05, 2.0])
def test_a_growing_or_decaying_schedule_resumes(tmp_path, gamma):
    # A factor above 1 is a warm-up's choice, not a hostile value: its own checkpoint loads.
    model = make_model()
    live = torch.optim.SGD(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.ExponentialLR(live, gamma=gamma)
    trainer = Trainer(max_epochs=1, device="cpu", seed=0)
    loader = make_loader(make_data(n=24), batch_size=8)
    trainer.fit(model, live, loader, classification_step(model), scheduler=schedule)
    path = tmp_path / "schedule.safetensors"
    trainer.save_checkpoint(path)
    trainer.load_checkpoint(path)
    assert schedule.gamma == gamma
