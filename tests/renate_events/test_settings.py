"""The one schema of settings (renate_events.settings): every flag and TOML key of the command line
comes from it, every option schema is made from it, and each setting's default is the default of
the Python argument it sets, so the command line and Python give the same weights."""

from __future__ import annotations

import argparse
import importlib
import re

import attrs
import pytest
import safetensors.torch
import torch

from renate_events.cli import main
from renate_events.cli._options import hyperparameter_names, option_schema, read_config
from renate_events.cli._parser import build_parser
from renate_events.cli._updaters import selection_settings
from renate_events.learners import BaseExperienceReplayLearner
from renate_events.methods import METHODS, MethodSpec
from renate_events.settings import (
    COMMANDS,
    DERIVED,
    PRECISIONS,
    SETTINGS,
    commands_of,
    mapped_default,
    setting,
)
from renate_events.updater import ModelUpdater
from trainer import Trainer


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        action.dest: action
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._VersionAction))
    }


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_comes_from_a_setting_or_a_learner_hyperparameter(command):
    flags = _flags(build_parser().commands[command])
    hyperparameters = set(hyperparameter_names())
    for dest, action in flags.items():
        if dest in hyperparameters:
            assert dest not in SETTINGS and action.default is argparse.SUPPRESS, dest
            continue
        assert dest in COMMANDS[command], f"{command}: --{dest} is no setting of the command"
        entry = setting(dest, command)
        assert action.option_strings == entry.flags
        assert action.help == entry.help_text(command)
        assert action.required == entry.required
        if entry.kind != "flag":
            assert action.default == entry.flag_default(command), dest
            assert action.choices == (entry.choices if entry.parser_choices else None), dest
    assert set(COMMANDS[command]) <= set(flags), "a setting of the command has no flag"


@pytest.mark.parametrize("command", ["run", "update"])
def test_every_toml_key_is_a_setting_or_a_learner_hyperparameter(tmp_path, command):
    keys = [dest for dest in _flags(build_parser().commands[command]) if dest != "config"]
    path = tmp_path / "all.toml"
    path.write_text("".join(f"{key.replace('_', '-')} = 1\n" for key in keys))
    read = read_config(str(path), command)  # every flag is a key (values are checked later)
    assert set(read) == set(keys)
    assert set(read) <= set(SETTINGS) | set(hyperparameter_names())
    assert all(command in commands_of(key) for key in read if key in SETTINGS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_option_schemas_are_made_from_the_settings(command):
    schema = option_schema(command)
    fields = {field.name: field for field in attrs.fields(schema)}
    assert list(fields) == [*COMMANDS[command], *(["search_space"] if command == "update" else [])]
    for name in COMMANDS[command]:
        entry = setting(name, command)
        expected = attrs.NOTHING if entry.required else entry.flag_default(command)
        assert fields[name].default == expected, name


def _mappings() -> list[tuple[str, str]]:
    return [(entry.name, target) for entry in SETTINGS.values() for target in entry.maps_onto]


@pytest.mark.parametrize(
    ("name", "target"),
    [pytest.param(n, t, id=f"{n}->{t}") for n, t in _mappings()],
)
def test_each_default_is_the_default_of_the_python_argument_it_sets(name, target):
    default = mapped_default(target)
    if default is DERIVED:  # made from other arguments (the learner's buffer): never fixed
        assert SETTINGS[name].default is None
    else:
        assert SETTINGS[name].default == default


@pytest.mark.parametrize("owner", [ModelUpdater, BaseExperienceReplayLearner])
def test_a_python_argument_named_like_a_setting_is_mapped_onto(owner):
    # Enumerated from the Python side: a setting and an argument of the same name must agree.
    for field in attrs.fields(owner):
        if not field.init or field.alias not in SETTINGS or field.default is attrs.NOTHING:
            continue
        targets = [t.split("[")[0] for t in SETTINGS[field.alias].maps_onto]
        owners = [_owner(target) for target in targets if target.endswith("." + field.alias)]
        assert owner in owners, f"{field.alias} does not map onto {owner}"


def _owner(target):
    """The class or function a ``maps_onto`` target ``module:Owner.argument`` names."""
    module, _, path = target.partition(":")
    found = importlib.import_module(module)
    for part in path.split(".")[:-1]:
        found = getattr(found, part)
    return found


def test_the_precisions_are_the_trainers():
    with pytest.raises(ValueError, match="must be one of") as refused:
        Trainer(precision="64", device="cpu")
    assert re.search(r"one of (\[.*\])", str(refused.value)).group(1) == str(list(PRECISIONS))


def test_early_stopping_patience_is_the_updaters():
    options = option_schema("update")(output_state="out", metric="val_loss")
    patience = selection_settings(options)["early_stopping_patience"]
    assert patience == attrs.fields(ModelUpdater).early_stopping_patience.default


def test_help_names_methods_from_the_registry():
    usual = attrs.fields(MethodSpec).default_buffer.default
    buffer = setting("buffer").help_text("run")
    for name, spec in METHODS.items():
        own = f"{spec.default_buffer} for {name}"
        assert (own in buffer) == (spec.default_buffer != usual), name
    listed = re.search(r"--learner (.*)\)", setting("classifier").help_text("evaluate")).group(1)
    assert listed.split(" or ") == [n for n, spec in METHODS.items() if spec.classifier == "nme"]
    epilog = build_parser().epilog
    assert epilog.startswith("examples:\n  renate-events run")


CONFIG = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def data_fn(chunk_id, seed):
    g = torch.Generator().manual_seed(100 * chunk_id + seed)
    x = torch.randn(96, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()), None
"""


def test_cli_and_python_give_the_same_weights_for_one_config_file(tmp_path):
    # No optimizer_fn: the learning rate, the buffer, the batches and the epochs (10) are the
    # defaults of both.
    path = tmp_path / "config.py"
    path.write_text(CONFIG)
    argv = ["update", "--config-file", str(path), "--output-state", str(tmp_path / "cli")]
    assert main([*argv, "--device", "cpu", "--no-progress"]) == 0
    torch.manual_seed(0)  # as the command line does before model_fn (--seed 0)
    updater = ModelUpdater.from_config(
        str(path),
        trainer_kwargs={"device": "cpu"},
        output_state_folder=str(tmp_path / "python"),
    )
    train, val = updater.config_file.data(0, 0)
    updater.update(train, val, task_id=0)
    cli = safetensors.torch.load_file(str(tmp_path / "cli" / "model.safetensors"))
    python = safetensors.torch.load_file(str(tmp_path / "python" / "model.safetensors"))
    assert cli.keys() == python.keys()
    for name in cli:
        torch.testing.assert_close(cli[name], python[name], rtol=0, atol=0, msg=name)
