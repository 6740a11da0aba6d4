"""The README's code and the examples run as written."""

from __future__ import annotations

import pathlib
import re
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
