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
