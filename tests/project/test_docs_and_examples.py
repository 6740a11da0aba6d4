"""The README's code and the examples run as written."""

from __future__ import annotations

import re
import runpy

import pytest

from tests.helpers import ROOT


def test_readme_starts_with_the_install_and_test_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```bash") + 3]
    assert block[0].endswith("&& renate-events run")
    assert block[1].endswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    assert block[1] in ci.splitlines()


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    assert (tmp_path / "run.safetensors").exists()


def test_quickstart_learns_digits(capsys):
    pytest.importorskip("sklearn")
    main = runpy.run_path(str(ROOT / "examples" / "quickstart.py"))["main"]
    metrics = main(["--epochs", "3"])
    assert metrics["val_accuracy"] > 0.8
    assert "epoch 3/3" in capsys.readouterr().out


def _example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["main"]


def test_custom_listener_state_survives_a_checkpoint(capsys):
    tracker = _example("custom_listener")()
    assert tracker.best_epoch >= 0 and tracker.best < float("inf")


def test_custom_component_runs_after_the_preset_components():
    names = _example("custom_component")()
    assert names == ["learner", "memory_loss", "mse_loss", "l2_pull"]


def test_embedding_example_resumes(capsys):
    loss = _example("embed_in_existing_loop")()
    assert loss < 0.2
    assert "epoch 2 done" in capsys.readouterr().out


def test_continual_updates_example_chains_three_folders():
    assert _example("continual_updates")() == ["day-0", "day-1", "day-2"]
