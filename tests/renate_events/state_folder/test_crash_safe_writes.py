"""A writer killed at a random moment leaves the previous state folder / checkpoint loadable."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from renate_events.state_folder import read_manifest
from tests.helpers import ROOT
from trainer import read_checkpoint

SCRIPT = ROOT / "tests" / "scripts" / "write_forever.py"


def _kill_while_writing(tmp_path, kind, delay):
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path), kind],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    process.stdout.readline()  # one complete write exists
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    return process


def _uniform_weights(tree):
    values = torch.cat([t.flatten() for t in tree["model"].values()])
    assert torch.all(values == values[0]), "a mixture of two writes"
    return values[0].item()


@pytest.mark.all_or_nothing
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["folder", "file"])
def test_killed_writer_leaves_the_previous_state_loadable(tmp_path, kind):
    rng = random.Random(7)
    for attempt in range(2):
        target = tmp_path / f"attempt{attempt}"
        target.mkdir()
        _kill_while_writing(target, kind, rng.uniform(0.05, 0.6))
        if kind == "folder":
            manifest = read_manifest(target)  # verifies checksums; repairs an interrupted swap
            assert "learner.safetensors" in manifest["files"]
            tree = read_checkpoint(target / "learner.safetensors")
        else:
            tree = read_checkpoint(target / "checkpoint.safetensors")
        assert _uniform_weights(tree) >= 0
        assert len(tree["listeners"]["learner"]["buffer"]["targets"]) == 6000
