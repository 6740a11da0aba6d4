"""The typed schema of the learners' hyperparameters, and the flags and TOML keys built from it."""

from __future__ import annotations

import json

import pytest

from renate_events.hyperparameters import HyperparameterError, check_value, hyperparameters
from renate_events.methods import LEARNERS


@pytest.mark.parametrize("learner", sorted(LEARNERS))
def test_every_learner_accepts_its_own_defaults(learner):
    for name, entry in hyperparameters(learner).items():
        assert check_value(learner, name, entry.default) == entry.default


@pytest.mark.parametrize(
    ("learner", "name", "value", "message"),
    [
        ("der", "alpha", "0.5", "alpha must be a number, got '0.5'"),
        ("der", "alpha", True, "alpha must be a number, got True"),
        ("der", "memory_size", 2.5, "memory_size must be an int, got 2.5"),
        ("der", "loss_normalization", 1, "loss_normalization must be true or false, got 1"),
        ("pod-er", "feature_modules", "layer1", "feature_modules must be a list of strings"),
        ("pod-er", "feature_modules", [1], "feature_modules must be a list of strings"),
        ("er", "beta", 0.5, "the learner 'er' has no hyperparameter 'beta'; its hyperparameters"),
        ("der", "loss_fn", None, "the learner 'der' has no hyperparameter 'loss_fn'"),
    ],
)
def test_values_of_the_wrong_kind_are_refused(learner, name, value, message):
    with pytest.raises(HyperparameterError, match=message.replace("[", r"\[").replace("(", r"\(")):
        check_value(learner, name, value)


def test_an_int_for_a_number_becomes_a_float():
    assert check_value("der", "alpha", 2) == 2.0 and isinstance(
        check_value("der", "alpha", 2), float
    )
    assert check_value("der", "batch_memory_frac", None) is None


def test_digits_run_takes_hyperparameter_flags_and_toml_keys(tmp_path, capsys):
    pytest.importorskip("sklearn")
    from renate_events.cli import main

    options = tmp_path / "exp.toml"
    options.write_text('learner = "der"\nalpha = 0.25\nepochs = 1\nhidden = [16]\n')
    out = tmp_path / "out"
    args = ["run", "--config", str(options), "--beta", "0.75", "--output-dir", str(out)]
    assert main([*args, "--no-progress", "--device", "cpu"]) == 0
    kwargs = json.loads((out / "state" / "seed-0" / "manifest.json").read_text())["learner_kwargs"]
    assert (kwargs["alpha"], kwargs["beta"]) == (0.25, 0.75)
    options.write_text('learner = "er"\nbeta = 0.5\n')
    assert main(["run", "--config", str(options), "--output-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert (
        "--beta: the learner 'er' has no hyperparameter 'beta'" in err and f"(in {options})" in err
    )
    assert not (tmp_path / "x").exists()
