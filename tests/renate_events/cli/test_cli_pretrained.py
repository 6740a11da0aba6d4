"""``renate-events run --pretrained PATH``: a Hugging Face ViT saved locally starts a run of a
prompt method, whose state folder then updates and evaluates like any zoo model's; a missing
path, a scenario without images, --model-args or an image shape the ViT does not take: one
line, exit 2."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from renate_events.cli import main
from tests.helpers import one_line_cli_error
from tests.renate_events.datasets.test_readers_cifar import write_cifar10

transformers = pytest.importorskip("transformers")

FAST = ["--epochs", "1", "--no-progress", "--device", "cpu", "--batch-size", "8"]


def _save_vit(folder, image_size: int = 32):
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=image_size,
        patch_size=8,
    )
    torch.manual_seed(0)
    transformers.ViTModel(config, add_pooling_layer=False).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cifar10(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar10")
    write_cifar10(root / "cifar-10-batches-bin", per_class=2, test_per_class=1)
    return root


@pytest.mark.slow
def test_a_pretrained_vit_runs_updates_and_evaluates(cifar10, tmp_path, capsys):
    hf = _save_vit(tmp_path / "hf")
    out = tmp_path / "out"
    argv = ["run", "--scenario", "seq-cifar10", "--data-dir", str(cifar10), "--pretrained"]
    argv += [str(hf), "--learner", "l2p", "--output-dir", str(out), *FAST]
    assert main(argv) == 0
    state = out / "state" / "seed-0"
    spec = json.loads((state / "manifest.json").read_text())["metadata"]["model"]
    assert spec["name"] == "vit" and spec["pretrained"] == str(hf)
    assert spec["args"]["layer_norm_eps"] == 1e-12 and spec["args"]["mlp_dim"] == 64
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    data = tmp_path / "new.safetensors"
    safetensors.torch.save_file({"inputs": images, "targets": torch.arange(8) % 10}, str(data))
    argv = ["update", "--input-state", str(state), "--data", str(data), "--no-progress"]
    assert main([*argv, "--output-state", str(tmp_path / "next")]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--state", str(tmp_path / "next"), "--data", str(data)]) == 0
    assert "task 0: accuracy" in capsys.readouterr().out


def test_bad_pretrained_inputs_are_one_line(cifar10, tmp_path, capsys):
    images = ["--scenario", "seq-cifar10", "--data-dir", str(cifar10)]
    run = ["run", "--learner", "l2p", "--output-dir", str(tmp_path / "out")]
    missing = str(tmp_path / "missing")
    one_line_cli_error(capsys, [*run, *images, "--pretrained", missing], "no such file or folder")
    one_line_cli_error(capsys, [*run, "--pretrained", missing], "use an image scenario")
    hf = str(_save_vit(tmp_path / "hf16", image_size=16))
    argv = [*run, *images, "--pretrained", hf]
    one_line_cli_error(capsys, [*argv, "--model-args", "{dim = 8}"], "leave --model-args")
    one_line_cli_error(capsys, [*argv, "--model", "resnet18"], "give --model vit")
    one_line_cli_error(capsys, argv, "takes images of shape [3, 16, 16]", "[3, 32, 32]")
