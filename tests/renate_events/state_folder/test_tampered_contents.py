"""Tampered state folders whose every checksum was recomputed (as an attacker who can write the
folder would): each content that does not fit the model and the learner is refused when the
folder is read, with one line naming the file and the key, and nothing written or changed.

One real state folder is written once (a small MLP, a learner storing logits in its buffer);
every case copies it, changes one thing and rewrites the checksums.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from renate_events.cli import main
from renate_events.state_folder import StateFolderError
from renate_events.updater import ModelUpdater
from trainer import read_checkpoint, write_checkpoint

pytestmark = pytest.mark.hostile

FEATURES, HIDDEN, CLASSES = 8, 16, 10
LEARNER = "der"  # a learner whose buffer stores the model's logits beside the samples
MODEL_META = {"classes": CLASSES, "hidden": [HIDDEN], "inputs": FEATURES, "kind": "mlp"}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def _updater(**kwargs: Any) -> ModelUpdater:
    return ModelUpdater(
        kwargs.pop("model", None) or _model(),
        learner=LEARNER,
        learner_kwargs={"memory_size": 12, "memory_batch_size": 4, "batch_size": 8},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        metadata={"model": MODEL_META},
        **kwargs,
    )


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(24, FEATURES, generator=g), torch.arange(24) % CLASSES


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: Any) -> pathlib.Path:
    root = tmp_path_factory.mktemp("tampered")
    first = root / "first"
    _updater(output_state_folder=first).update(_data(0), _data(1), task_id="a")
    state = root / "state"
    _updater(input_state_folder=first, output_state_folder=state).update(
        _data(2), _data(3), task_id="b"
    )
    inputs, targets = _data(4)
    np.savez(root / "data.npz", inputs=inputs.numpy(), targets=targets.numpy())
    return state


# -- tampering, with the checksums recomputed ----------------------------------------------------


def _rehash(state: pathlib.Path, name: str) -> None:
    path = state / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][name] = hashlib.sha256((state / name).read_bytes()).hexdigest()
    path.write_text(json.dumps(manifest))


def _tree(edit: Callable[[dict[str, Any]], Any]) -> Callable[[pathlib.Path], None]:
    """Edit the learner's checkpoint tree; its checksums and the manifest's rewritten."""

    def tamper(state: pathlib.Path) -> None:
        path = state / "learner.safetensors"
        tree = read_checkpoint(path)
        edit(tree)
        path.unlink()
        write_checkpoint(path, tree)
        _rehash(state, "learner.safetensors")

    return tamper


def _buffer(key: str, change: Callable[[Any], Any]) -> Callable[[pathlib.Path], None]:
    def edit(tree: dict[str, Any]) -> None:
        buffer = tree["listeners"]["learner"]["buffer"]
        if key == "inputs":
            buffer["inputs"][0] = change(buffer["inputs"][0])
        elif key == "logits":
            buffer["metadata"]["logits"] = change(buffer["metadata"]["logits"])
        else:
            buffer[key] = change(buffer[key])

    return _tree(edit)


def _at(index: tuple[Any, ...], value: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        tensor[index] = value
        return tensor

    return change


def _width(width: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: torch.zeros(t.shape[0], width, dtype=t.dtype)


def _dtype(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype)


def _optimizer(param: str, key: str, value: float) -> Callable[[pathlib.Path], None]:
    def edit(tree: dict[str, Any]) -> None:
        tensor = tree["optimizer"]["state"][param][key].clone()
        tensor.view(-1)[0] = value
        tree["optimizer"]["state"][param][key] = tensor

    return _tree(edit)


def _weights(name: str, value: float) -> Callable[[pathlib.Path], None]:
    def edit(tree: dict[str, Any]) -> None:
        tensor = tree["model"][name].clone()
        tensor.view(-1)[0] = value
        tree["model"][name] = tensor

    return _tree(edit)


def _model_file(edit: Callable[[bytes], bytes]) -> Callable[[pathlib.Path], None]:
    """Replace ``model.safetensors`` by ``edit`` of its bytes; the manifest's checksum fixed."""

    def tamper(state: pathlib.Path) -> None:
        path = state / "model.safetensors"
        path.write_bytes(edit(path.read_bytes()))
        _rehash(state, "model.safetensors")

    return tamper


def _model_tensors(edit: Callable[[dict[str, torch.Tensor]], Any]) -> Callable[[bytes], bytes]:
    def change(raw: bytes) -> bytes:
        import safetensors.torch

        tensors = safetensors.torch.load(raw)
        edit(tensors)
        return safetensors.torch.save(tensors, metadata={"format": "pt"})

    return change


def _pickled(raw: bytes) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {"0.weight": torch.zeros(2)}, buffer
    )  # a zip of pickles: what a reader must not open
    return buffer.getvalue()


def _history(key: str, value: Any, index: int = -1) -> Callable[[pathlib.Path], None]:
    """Set ``history[index][key]`` in the manifest (which has no checksum of its own)."""

    def tamper(state: pathlib.Path) -> None:
        path = state / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["history"][index][key] = value
        path.write_text(json.dumps(manifest))

    return tamper


# -- the cases: (id, tamper, file, key) ----------------------------------------------------------

CKPT, MODEL, MANIFEST = "learner.safetensors", "model.safetensors", "manifest.json"
SIGNATURE = {"inputs": [[FEATURES], "float32"], "targets": [[], "int64"]}
BAD = [float("nan"), float("inf"), float("-inf")]
CASES: list[tuple[str, Callable[[pathlib.Path], None], str, str]] = []
for value in (CLASSES, CLASSES + 1, 999, -1, -5, 2**31, 2**62, -(2**62)):
    CASES.append((f"target-{value}", _buffer("targets", _at((0,), value)), CKPT, "targets"))
for width in (1, 7, 9, 65):
    CASES.append((f"inputs-width-{width}", _buffer("inputs", _width(width)), CKPT, "inputs"))
CASES.append(("inputs-extra-dim", _buffer("inputs", lambda t: t.unsqueeze(-1)), CKPT, "inputs"))
CASES.append(("inputs-no-dim", _buffer("inputs", lambda t: t[:, 0]), CKPT, "inputs"))
for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8):
    name = str(dtype).replace("torch.", "")
    CASES.append((f"inputs-{name}", _buffer("inputs", _dtype(dtype)), CKPT, "inputs"))
for width in (1, 5, 9, 11, 20):
    CASES.append((f"logits-width-{width}", _buffer("logits", _width(width)), CKPT, "logits"))
CASES.append(("logits-extra-dim", _buffer("logits", lambda t: t.unsqueeze(-1)), CKPT, "logits"))
for dtype in (torch.float64, torch.int64):
    name = str(dtype).replace("torch.", "")
    CASES.append((f"logits-{name}", _buffer("logits", _dtype(dtype)), CKPT, "logits"))
for value in BAD:
    CASES.append((f"inputs-{value}", _buffer("inputs", _at((3, 2), value)), CKPT, "inputs"))
    CASES.append((f"logits-{value}", _buffer("logits", _at((5, 1), value)), CKPT, "logits"))
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        CASES.append((f"weights-{name}-{value}", _weights(name, value), CKPT, name))
    for param in ("0", "2"):
        for key in ("exp_avg", "exp_avg_sq"):
            CASES.append(
                (f"optimizer-{param}-{key}-{value}", _optimizer(param, key, value), CKPT, key)
            )
for value in (10**30, 2**64, 2**63 - 1, 10**15, 10**6):
    CASES.append((f"num-seen-{value}", _buffer("num_seen", lambda _, v=value: v), CKPT, "num_seen"))
for size in (0, 7, 8, 100, -1):
    CASES.append(
        (f"model-file-truncated-{size}", _model_file(lambda raw, n=size: raw[:n]), MODEL, MODEL)
    )
CASES.append(("model-file-pickle", _model_file(_pickled), MODEL, MODEL))
CASES.append(
    ("model-file-text", _model_file(lambda raw: b"hello world, not tensors"), MODEL, MODEL)
)
for value in BAD:
    for name in ("0.weight", "2.bias"):
        edit = _model_tensors(lambda t, n=name, v=value: t[n].view(-1).__setitem__(0, v))
        CASES.append((f"model-file-{name}-{value}", _model_file(edit), MODEL, name))
CASES += [
    (
        "model-file-missing-key",
        _model_file(_model_tensors(lambda t: t.pop("2.bias"))),
        MODEL,
        "2.bias",
    ),
    (
        "model-file-extra-key",
        _model_file(_model_tensors(lambda t: t.__setitem__("9.weight", torch.zeros(2)))),
        MODEL,
        "9.weight",
    ),
    (
        "model-file-shape",
        _model_file(_model_tensors(lambda t: t.__setitem__("2.bias", torch.zeros(5)))),
        MODEL,
        "2.bias",
    ),
    (
        "model-file-dtype",
        _model_file(_model_tensors(lambda t: t.__setitem__("2.bias", t["2.bias"].double()))),
        MODEL,
        "2.bias",
    ),
]
for data in (
    5,
    "x",
    [],
    {},
    {"inputs": 5},
    {"inputs": [FEATURES]},
    {"inputs": [[FEATURES], 3]},
    {"inputs": [["a"], "float32"], "targets": SIGNATURE["targets"]},
    {"inputs": [[FEATURES], "no_dtype"], "targets": SIGNATURE["targets"]},
    {"inputs": [[-1], "float32"], "targets": SIGNATURE["targets"]},
    {"inputs": SIGNATURE["inputs"]},
    {**SIGNATURE, "extra": 1},
    {"inputs": [[65], "float32"], "targets": SIGNATURE["targets"]},
    {"inputs": [[FEATURES], "float64"], "targets": SIGNATURE["targets"]},
):
    CASES.append((f"history-data-{json.dumps(data)}", _history("data", data), MANIFEST, "data"))
for key, value in (
    ("steps", -1),
    ("samples", -1),
    ("samples", "24"),
    ("samples", 2.5),
    ("steps", "x"),
    ("epochs", 2.5),
    ("stopped_early", 3),
    ("seconds", "x"),
    ("seconds", -1),
    ("learner_kwargs", []),
    ("optimizer", 5),
    ("functions", "x"),
    ("functions_sha256", [1]),
    ("best", "x"),
    ("best", {"metric": 1}),
    ("config_sha256", 5),
    ("metrics", {"val_loss": "x"}),
    ("metrics", []),
):
    CASES.append((f"history-{key}-{value!r}", _history(key, value), MANIFEST, key))


# -- the test -------------------------------------------------------------------------------------


def _snapshot(root: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


@pytest.mark.parametrize(
    ("tamper", "file", "key"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_tampered_content_is_refused_naming_the_file_and_key(
    pristine: pathlib.Path, tmp_path: pathlib.Path, tamper: Any, file: str, key: str
) -> None:
    state = tmp_path / "state"
    shutil.copytree(pristine, state)
    tamper(state)
    before = _snapshot(state)
    model = _model()
    weights = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(StateFolderError) as info:
        _updater(model=model, input_state_folder=state).learner_instance  # noqa: B018
    message = str(info.value)
    assert str(state / file) in message and key in message, message
    assert all(torch.equal(weights[n], t) for n, t in model.state_dict().items())  # nothing applied
    data = str(pristine.parent / "data.npz")
    out = tmp_path / "out"
    for argv in (
        ["evaluate", "--state", str(state), "--data", data],
        ["update", "--input-state", str(state), "--data", data, "--output-state", str(out)],
    ):
        code, err = _cli([*argv, "--no-progress"] if argv[0] == "update" else argv)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and str(state / file) in lines[0], err
    assert not out.exists() and _snapshot(state) == before


def test_the_cases_are_many() -> None:
    assert len(CASES) >= 100
