"""ModelUpdater's ``max_epochs`` (Renate's name): one default with the command line's
``--epochs``, recorded in the manifest, kept by a later update of the command line, and the
deprecated ``trainer_kwargs['max_epochs']``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.cli import main
from renate_events.settings import setting
from renate_events.state_folder import read_manifest
from renate_events.updater import ModelUpdater

ONE_BATCH = {"memory_size": 8, "memory_batch_size": 4, "batch_size": 8}


def _task() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))


def _updater(**kwargs) -> ModelUpdater:
    kwargs.setdefault("trainer_kwargs", {"device": "cpu"})
    return ModelUpdater(torch.nn.Linear(4, 2), learner="er", learner_kwargs=ONE_BATCH, **kwargs)


def test_the_default_is_the_command_lines_and_trains_that_many_epochs(tmp_path):
    updater = _updater(output_state_folder=tmp_path / "s")
    assert updater.max_epochs == setting("epochs").default == 10
    result = updater.update(_task(), task_id=0)  # one batch per epoch
    assert (result.epochs, result.steps) == (10, 10)
    assert read_manifest(tmp_path / "s")["trainer"] == {"device": "cpu", "max_epochs": 10}


def test_max_epochs_sets_the_epochs_of_each_update(tmp_path):
    updater = _updater(max_epochs=2, output_state_folder=tmp_path / "s")
    assert updater.update(_task(), task_id=0).steps == 2
    assert updater.update(_task(), task_id=1).steps == 2
    assert read_manifest(tmp_path / "s")["trainer"]["max_epochs"] == 2


def test_max_epochs_none_leaves_the_trainers_rule_one_epoch_or_max_steps():
    assert _updater(max_epochs=None).update(_task()).steps == 1
    steps = _updater(max_epochs=None, trainer_kwargs={"device": "cpu", "max_steps": 3})
    assert steps.update(_task()).steps == 3


def test_trainer_kwargs_max_epochs_still_works_with_a_deprecation_warning(tmp_path):
    given = {"device": "cpu", "max_epochs": 3}
    with pytest.warns(DeprecationWarning, match=r"trainer_kwargs\['max_epochs'\] is deprecated; "
                      r"pass max_epochs=3 instead") as caught:  # fmt: skip
        updater = _updater(trainer_kwargs=given)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert given == {"device": "cpu", "max_epochs": 3}  # the caller's dict is left alone
    assert (updater.max_epochs, updater.trainer_kwargs) == (3, {"device": "cpu"})
    assert updater.update(_task()).steps == 3
    with pytest.warns(DeprecationWarning):  # the same value both ways: no contradiction
        assert _updater(max_epochs=3, trainer_kwargs=given).max_epochs == 3
    config = tmp_path / "config.py"
    config.write_text(CONFIG)
    with pytest.warns(DeprecationWarning, match="pass max_epochs=3") as caught:
        ModelUpdater.from_config(str(config), trainer_kwargs=given)
    assert caught[0].filename == __file__  # from_config's caller, too


def test_max_epochs_given_two_ways_with_two_values_is_refused():
    given = {"device": "cpu", "max_epochs": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any warning
        with pytest.raises(ValueError) as refused:
            _updater(max_epochs=2, trainer_kwargs=given)
    assert str(refused.value) == (
        "ModelUpdater: max_epochs=2 and trainer_kwargs['max_epochs']=3 disagree; give the epochs "
        "once, as max_epochs (trainer_kwargs['max_epochs'] is deprecated)"
    )
    assert given == {"device": "cpu", "max_epochs": 3}


@pytest.mark.parametrize(
    ("value", "message"),
    [(0, "must be a positive int or None, got 0"), ("3", "must be a positive int or None")],
)
def test_a_bad_max_epochs_is_refused(value, message):
    with pytest.raises(ValueError, match=rf"ModelUpdater.max_epochs {message}"):
        _updater(max_epochs=value)


CONFIG = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Linear(4, 2)


def data_fn(chunk_id, seed):
    g = torch.Generator().manual_seed(chunk_id)
    x = torch.randn(32, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long()), None
"""


def _cli_update(config, source, target, *more: str) -> dict:
    argv = ["update", "--config-file", str(config), "--input-state", str(source)]
    argv += ["--output-state", str(target), "--device", "cpu", "--no-progress"]
    assert main([*argv, *more]) == 0
    return read_manifest(target)


def test_the_command_line_keeps_the_input_states_epochs_unless_given(tmp_path):
    # epochs is a later=True setting: --epochs may change between updates; left out, a later
    # update keeps the input state's, here one written from Python.
    config = tmp_path / "config.py"
    config.write_text(CONFIG)
    updater = ModelUpdater.from_config(
        str(config),
        max_epochs=2,
        trainer_kwargs={"device": "cpu"},
        output_state_folder=tmp_path / "a",
    )
    updater.update(*updater.config_file.data(0, 0), task_id=0)
    kept = _cli_update(config, tmp_path / "a", tmp_path / "b", "--chunk-id", "1")
    assert kept["trainer"]["max_epochs"] == 2 and kept["history"][-1]["epochs"] == 2
    given = _cli_update(config, tmp_path / "b", tmp_path / "c", "--chunk-id", "2", "--epochs", "3")
    assert given["trainer"]["max_epochs"] == 3 and given["history"][-1]["epochs"] == 3


def test_a_folder_that_recorded_no_epochs_keeps_one_epoch_per_update(tmp_path):
    # Written from Python before ModelUpdater recorded max_epochs: its updates trained one epoch
    # each (Trainer(max_epochs=None)), which the command line's "the input state's" keeps.
    config = tmp_path / "config.py"
    config.write_text(CONFIG)
    updater = ModelUpdater.from_config(
        str(config),
        max_epochs=None,
        trainer_kwargs={"device": "cpu"},
        output_state_folder=tmp_path / "a",
    )
    updater.update(*updater.config_file.data(0, 0), task_id=0)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    del manifest["trainer"]["max_epochs"]
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(manifest))
    kept = _cli_update(config, tmp_path / "a", tmp_path / "b", "--chunk-id", "1")
    assert kept["trainer"]["max_epochs"] is None and kept["history"][-1]["epochs"] == 1


@pytest.mark.parametrize(
    ("max_epochs", "words"),
    [
        (
            10,
            "pass max_epochs=2 instead (the 2 given there is used, as max_epochs is at its default",
        ),
        (2, "pass max_epochs=2 instead (max_epochs is 2 too: give the epochs once)"),
    ],
)
def test_the_deprecation_warning_says_what_happens_when_max_epochs_is_given_too(max_epochs, words):
    given = {"device": "cpu", "max_epochs": 2}
    with pytest.warns(DeprecationWarning) as caught:
        updater = _updater(max_epochs=max_epochs, trainer_kwargs=given)
    assert words in str(caught[0].message) and "left out" not in str(caught[0].message)
    assert updater.max_epochs == 2


@pytest.mark.parametrize(
    ("value", "error"), [(0, "got 0"), (-1, "got -1"), ("2", "got '2'"), (2.0, "got 2.0")]
)
def test_a_bad_trainer_kwargs_max_epochs_is_refused_before_it_is_compared(value, error):
    given = {"device": "cpu", "max_epochs": value}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError) as refused:
            _updater(max_epochs=2, trainer_kwargs=given)
    assert str(refused.value) == (
        "ModelUpdater: trainer_kwargs['max_epochs'] must be a positive int or None, " + error
    )
