"""Bugs found by a trial user of issue 17 (images, transforms, mapped buffers), one test each."""

from __future__ import annotations

import safetensors.torch
import torch

from renate_events.cli import main


def _one_line_error(capsys, argv, *words) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


def test_a_data_file_whose_inputs_and_targets_differ_in_length_is_one_line(tmp_path, capsys):
    data = tmp_path / "data.safetensors"
    inputs = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    safetensors.torch.save_file({"inputs": inputs, "targets": torch.arange(5)}, str(data))
    argv = ["evaluate", "--state", str(tmp_path / "state"), "--data", str(data)]
    _one_line_error(capsys, argv, "same length", "6 and 5")
