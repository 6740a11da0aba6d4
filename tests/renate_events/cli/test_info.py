"""renate-events info: a state folder described from its manifest and checkpoint, as text and as
JSON with the documented keys, and one line for a missing or damaged folder."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("sklearn")

from renate_events.cli import main
from renate_events.cli._info import INFO_KEYS


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    out = tmp_path_factory.mktemp("info") / "out"
    args = ["run", "--epochs", "1", "--output-dir", str(out), "--no-progress", "--hidden", "16"]
    assert main([*args, "--learner", "er", "--memory-size", "40"]) == 0
    return out / "state" / "seed-0"


def test_json_has_the_documented_keys(state, capsys):
    assert main(["info", "--state", str(state), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert tuple(described) == INFO_KEYS
    assert described["format"] == {"name": "renate_events.state", "version": 2}
    assert described["learner"]["name"] == "er"
    assert described["learner"]["hyperparameters"]["memory_size"] == 40
    assert described["model"]["parameters"] == 64 * 16 + 16 + 16 * 10 + 10
    assert described["buffer"]["size"] == 40 and described["buffer"]["fill"] == 40
    assert described["buffer"]["seen"] >= 40
    assert len(described["updates"]) == 5
    first = described["updates"][0]
    assert set(first) == {"task_id", "steps", "epochs", "samples", "seconds", "metrics"}
    assert first["steps"] > 0 and "train_loss" in first["metrics"]
    assert described["config"] is None


def test_text_is_readable(state, capsys):
    assert main(["info", "--state", str(state)]) == 0
    text = capsys.readouterr().out
    assert "learner: er" in text and "1,210 parameters" in text
    assert "40 of 40 slots filled" in text and "updates: 5" in text


@pytest.mark.parametrize("damage", ["missing", "manifest", "checkpoint"])
def test_a_missing_or_damaged_folder_is_one_line(state, tmp_path, capsys, damage):
    folder = tmp_path / "state"
    if damage != "missing":
        shutil.copytree(state, folder)
    if damage == "manifest":
        (folder / "manifest.json").write_text("{")
    elif damage == "checkpoint":
        with open(folder / "learner.safetensors", "r+b") as handle:
            handle.truncate(100)
    assert main(["info", "--state", str(folder)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1


def test_output_into_a_closed_pipe_is_no_traceback(state):
    """``renate-events info --state S --json | head -c 10``: the reader leaves early."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "renate_events.cli", "info", "--state", str(state), "--json"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    process.stdout.close()  # the reader is gone before the command writes (it starts first)
    err = process.stderr.read().decode()
    assert process.wait() == 1 and "Traceback" not in err, err
