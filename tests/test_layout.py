"""The layout rules of CONTRIBUTING.md, as tests: layers, no pickle, one registry, complexity."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "renate_events")


def test_trainer_imports_nothing_from_renate_events():
    # Import every trainer module in a fresh interpreter and look at what came along.
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in (ROOT / "trainer").rglob("*.py")
    )
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'renate_events'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    pattern = re.compile(r"^\s*(from|import)\s+renate_events\b", re.MULTILINE)
    importers = [p for p in (ROOT / "trainer").rglob("*.py") if pattern.search(p.read_text())]
    assert importers == []


def test_no_pickle_or_code_loading_anywhere_in_the_packages():
    # Checkpoints and state folders go through safetensors + JSON; nothing may unpickle, and
    # nothing may run code it reads (model.eval() is fine: it is not the builtin).
    pattern = re.compile(
        r"\b(torch\.load|torch\.save|pickle|cPickle|dill|marshal)\b|(?<![.\w])(eval|exec)\("
    )
    offenders = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_signals_keep_one_registry_and_blinker_reports_it():
    trainer = Trainer(device="cpu")
    calls = []

    def first(state):
        calls.append("first")

    def second(state):
        calls.append("second")

    trainer.connect("epoch_end", second)
    trainer.connect("epoch_end", first, priority=1)
    signal = trainer.events.epoch_end
    assert signal.has_receivers_for(trainer) and not trainer.events.epoch_start.has_receivers_for(1)
    assert list(signal.receivers_for(trainer)) == [first, second]
    assert not signal.receivers  # blinker's own mapping is not a second registry
    trainer.unsubscribe(first)
    assert list(signal.receivers_for(trainer)) == [second]
    signal.send(trainer, state=trainer.state)
    assert calls == ["second"]


def test_ruff_complexity_rule_is_on():
    config = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'select = \[[^\]]*"C90"', config)
    assert re.search(r"max-complexity = 15", config)


def test_the_state_folder_and_the_choices_never_import_the_updater():
    # The updater uses the state folder and the registries of choices, never the other way round.
    pattern = re.compile(r"^\s*(from|import)\s+renate_events\.(updater|cli)\b", re.MULTILINE)
    lower = [*(ROOT / "renate_events" / "state_folder").rglob("*.py")]
    lower.append(ROOT / "renate_events" / "choices.py")
    importers = [str(p.relative_to(ROOT)) for p in lower if pattern.search(p.read_text())]
    assert importers == []
