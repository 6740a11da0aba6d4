"""The paper recipes, examples/recipes/*.toml: every file (a new one is picked up by the glob)
holds only options that `run` and `update` accept for its learner, and its values reach the
learner through the command line, alone and with a config file."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from renate_events import cli
from renate_events.cli import _results, main
from renate_events.cli._options import (
    RunOptions,
    UpdateOptions,
    check_options,
    hyperparameter_values,
    read_toml,
)
from renate_events.cli._parser import parse
from renate_events.methods import LEARNERS
from tests.helpers import ROOT

RECIPES = sorted((ROOT / "examples" / "recipes").glob("*.toml"))
TINY = ["--epochs", "1", "--hidden", "16", "--device", "cpu", "--no-progress"]
OPTIMIZER_KEYS = ("lr", "momentum", "weight_decay")

CONFIG = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def data_fn(chunk_id, seed):
    generator = torch.Generator().manual_seed(100 * chunk_id + seed)
    inputs = torch.randn(64, 8, generator=generator)
    targets = (inputs[:, 0] > 0).long() + 2 * (inputs[:, 1] > 0).long()
    return TensorDataset(inputs, targets), None
"""


def _recipe(path: pathlib.Path) -> dict:
    return read_toml(str(path))  # the command line's reader (tomli on Python 3.10)


def _check_with_the_cli(path: pathlib.Path, command: str) -> frozenset[str]:
    """The command line's own reading of ``--config path``: unknown options, values of the wrong
    type and hyperparameters of another learner raise :class:`cli.UsageError`. Returns the
    names taken from the file."""
    extra = ["--output-state", "unused"] if command == "update" else []
    _, values, from_file = parse([command, "--config", str(path), *extra])
    schema = RunOptions if command == "run" else UpdateOptions
    options = check_options(schema, values, from_file)
    hyperparameter_values(values, options.learner, from_file, str(path))
    return from_file


def _reached(recipe: dict, manifest: dict, epochs: int) -> None:
    """Every value of ``recipe`` is in the state folder's manifest (``epochs`` overridden)."""
    assert manifest["learner"] == recipe["learner"]
    for key, value in recipe.items():
        if key == "learner":
            continue
        if key == "optimizer":
            assert manifest["optimizer"]["name"] == value
        elif key in OPTIMIZER_KEYS:
            assert manifest["optimizer"][key] == value, key
        elif key == "buffer":
            assert manifest["buffer"] == value
        elif key == "epochs":
            assert manifest["trainer"]["max_epochs"] == epochs
        else:
            assert manifest["learner_kwargs"][key] == value, key


def test_there_are_recipes():
    assert {"der.toml", "er.toml"} <= {path.name for path in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_every_key_is_an_option_of_run_and_update_for_its_learner(path):
    recipe = _recipe(path)
    assert recipe.get("learner") in LEARNERS, "a recipe names its learner"
    for command in ("run", "update"):
        assert _check_with_the_cli(path, command) == set(recipe)
    header = path.read_text(encoding="utf-8").split("\n\n", 1)[0]
    assert header.startswith("#") and "renate-events run --config" in header


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("alpah = 0.5", "unknown options ['alpah']"),
        ("ewc_lambda = 1.0", "has no hyperparameter 'ewc_lambda'"),
        ('lr = "fast"', "--lr must be"),
    ],
)
def test_a_misspelt_or_foreign_key_fails_the_check(tmp_path, line, message):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'learner = "der"\nalpha = 0.2\n{line}\n')
    with pytest.raises(cli.UsageError, match=re.escape(message)):
        _check_with_the_cli(bad, "run")


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_each_recipe_runs_and_its_values_reach_the_learner(tmp_path, monkeypatch, path):
    pytest.importorskip("sklearn")  # the embedded digits
    monkeypatch.setattr(_results, "heatmap", lambda options, runs: None)  # matplotlib: 1 s a run
    out = tmp_path / "out"
    assert main(["run", "--config", str(path), *TINY, "--output-dir", str(out)]) == 0
    recipe = _recipe(path)
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["learner"] == recipe["learner"]
    assert results["config"]["epochs"] == 1 and results["config"]["config"] == str(path)
    manifest = json.loads((out / "state" / "seed-0" / "manifest.json").read_text())
    _reached(recipe, manifest, epochs=1)


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_each_recipe_with_a_config_file_over_two_updates(tmp_path, path):
    config = tmp_path / "my_config.py"
    config.write_text(CONFIG)
    recipe = _recipe(path)
    extra = ["--epochs", "1", "--device", "cpu", "--no-progress"]
    if recipe["learner"] in ("pod-er", "super-er", "icarl"):
        extra += ["--feature-modules", '["1"]']
    first, second = tmp_path / "s0", tmp_path / "s1"
    common = ["update", "--config-file", str(config), "--config", str(path), *extra]
    assert main([*common, "--output-state", str(first)]) == 0
    assert main([*common, "--input-state", str(first), "--output-state", str(second)]) == 0
    manifest = json.loads((second / "manifest.json").read_text())
    assert manifest["updates"] == 2
    _reached(recipe, manifest, epochs=1)


def test_a_recipe_and_a_config_files_optimizer_fn_exclude_each_other(tmp_path, capsys):
    config = tmp_path / "my_config.py"
    config.write_text(
        CONFIG + "\n\ndef optimizer_fn(params):\n    import torch\n"
        "    return torch.optim.SGD(params, lr=0.1)\n"
    )
    recipe = ROOT / "examples" / "recipes" / "der.toml"
    args = ["update", "--config-file", str(config), "--config", str(recipe)]
    assert main([*args, "--output-state", str(tmp_path / "s0")]) == 2
    err = capsys.readouterr().err
    assert "defines optimizer_fn" in err and err.count("\n") == 1
    assert not (tmp_path / "s0").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--momentum", "0.9"], "--momentum is an option of sgd, not of adam"),
        (["--optimizer", "rmsprop"], "invalid choice: 'rmsprop'"),
        (["--optimizer", "sgd", "--weight-decay", "-1"], "--weight-decay must be"),
    ],
)
def test_bad_optimizer_options_are_one_line_and_write_nothing(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert main(["run", *TINY, *flags, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()


def test_the_optimizer_options_reach_the_state_and_a_later_update_keeps_them(tmp_path):
    config = tmp_path / "my_config.py"
    config.write_text(CONFIG)
    first, second = tmp_path / "s0", tmp_path / "s1"
    args = ["update", "--config-file", str(config), "--epochs", "1", "--no-progress"]
    sgd = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.5", "--weight-decay", "0.01"]
    assert main([*args, *sgd, "--output-state", str(first)]) == 0
    assert main([*args, "--input-state", str(first), "--output-state", str(second)]) == 0
    manifest = json.loads((second / "manifest.json").read_text())
    expected = {"name": "sgd", "lr": 0.05, "momentum": 0.5, "weight_decay": 0.01}
    assert manifest["optimizer"] == expected
