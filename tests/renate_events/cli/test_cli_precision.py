"""The precision switches on the command line: ``--tf32/--no-tf32``, ``--channels-last`` and
``--precision bf16-mixed`` reach the trainer, are kept by a later update, and a bad value is one
line."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from renate_events.cli import main
from tests.helpers import one_line_cli_error

_CONV_CONFIG = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 3),
    )


def data_fn(chunk_id, seed):
    g = torch.Generator().manual_seed(10 * chunk_id + seed)
    x = torch.randn(24, 3, 6, 6, generator=g)
    return TensorDataset(x, torch.randint(0, 3, (24,), generator=g)), None
"""

_FAST = ["--device", "cpu", "--no-progress", "--epochs", "1", "--batch-size", "8"]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "conv.py"
    path.write_text(_CONV_CONFIG)
    return path


def _trainer(state) -> dict:
    return json.loads((state / "manifest.json").read_text())["trainer"]


def test_the_switches_reach_the_trainer_and_a_later_update_keeps_them(tmp_path, config):
    first, second, third = (tmp_path / name for name in ("a", "b", "c"))
    argv = ["update", "--config-file", str(config), *_FAST]
    switches = ["--tf32", "--channels-last", "--precision", "bf16-mixed"]
    assert main([*argv, "--output-state", str(first), *switches]) == 0
    assert _trainer(first) | {"tf32": True, "channels_last": True} == _trainer(first)
    assert _trainer(first)["precision"] == "bf16-mixed"
    later = [*argv, "--input-state", str(first), "--chunk-id", "1"]
    assert main([*later, "--output-state", str(second)]) == 0
    assert {k: _trainer(second)[k] for k in ("tf32", "channels_last", "precision")} == {
        "tf32": True,
        "channels_last": True,
        "precision": "bf16-mixed",
    }
    turned_off = [*later[:-1], "2", "--input-state", str(second), "--no-tf32"]
    assert main([*turned_off, "--no-channels-last", "--output-state", str(third)]) == 0
    assert (_trainer(third)["tf32"], _trainer(third)["channels_last"]) == (False, False)
    # the weights are stored in the usual layout, whatever the model's was
    weights = safetensors.torch.load_file(str(second / "model.safetensors"))
    assert all(tensor.is_contiguous() for tensor in weights.values())


def test_a_state_trained_with_the_defaults_records_no_switch(tmp_path, config):
    argv = ["update", "--config-file", str(config), *_FAST]
    assert main([*argv, "--output-state", str(tmp_path / "a")]) == 0
    assert not {"tf32", "channels_last"} & set(_trainer(tmp_path / "a"))


def test_channels_last_gives_the_weights_of_the_usual_layout(tmp_path, config):
    argv = ["update", "--config-file", str(config), *_FAST]
    assert main([*argv, "--output-state", str(tmp_path / "plain")]) == 0
    assert main([*argv, "--output-state", str(tmp_path / "last"), "--channels-last"]) == 0
    plain = safetensors.torch.load_file(str(tmp_path / "plain" / "model.safetensors"))
    last = safetensors.torch.load_file(str(tmp_path / "last" / "model.safetensors"))
    for name, tensor in plain.items():
        torch.testing.assert_close(last[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        ('tf32 = "yes"', "--tf32 must be true or false, got 'yes' (in "),
        ("channels-last = 1", "--channels-last must be true or false, got 1 (in "),
    ],
)
def test_a_bad_switch_value_is_one_line(tmp_path, capsys, config, toml, words):
    path = tmp_path / "options.toml"
    path.write_text(toml + "\n")
    argv = ["update", "--config", str(path), "--config-file", str(config)]
    one_line_cli_error(capsys, [*argv, "--output-state", str(tmp_path / "a")], words)
    assert not (tmp_path / "a").exists()


def test_a_switch_takes_no_value(tmp_path, capsys, config):
    argv = ["update", "--config-file", str(config), "--output-state", str(tmp_path / "a")]
    one_line_cli_error(capsys, [*argv, "--tf32", "yes"], "unrecognized arguments: yes")
