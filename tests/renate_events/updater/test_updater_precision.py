"""The precision switches through :class:`ModelUpdater`: ``trainer_kwargs`` give the trainer its
precision, TF32 and channels-last; the state folder records them; a bad value is refused before
anything is written."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.state_folder import read_manifest
from renate_events.updater import ModelUpdater
from trainer.validators import WrongTypeError


def _conv_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 3),
    )


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(16, 3, 6, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    )


def test_the_switches_reach_the_trainer_and_the_manifest(tmp_path):
    switches = {"precision": "bf16-mixed", "tf32": True, "channels_last": True}
    updater = ModelUpdater(
        _conv_model(),
        learner="er",
        max_epochs=1,
        trainer_kwargs={"device": "cpu", **switches},
        output_state_folder=str(tmp_path / "state"),
    )
    trainer = updater.learner_instance.trainer
    assert (trainer.precision, trainer.tf32, trainer.channels_last) == tuple(switches.values())
    updater.update(_data(), task_id=0)
    model = updater.model
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert (
        read_manifest(str(tmp_path / "state"))["trainer"] | switches
        == read_manifest(str(tmp_path / "state"))["trainer"]
    )
    again = ModelUpdater(
        _conv_model(),
        learner="er",
        input_state_folder=str(tmp_path / "state"),
        max_epochs=1,
        trainer_kwargs={"device": "cpu", **switches},
    )
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.learner_instance.model.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tf32": "on"}, "Trainer.tf32 must be True, False or None, got 'on'"),
        ({"channels_last": 1}, "Trainer.channels_last must be a bool (True or False), got 1"),
        ({"precision": "bf16"}, "Trainer.precision must be one of"),
    ],
)
def test_a_bad_switch_is_refused_before_anything_is_written(tmp_path, kwargs, message):
    with pytest.raises(WrongTypeError if "precision" not in kwargs else ValueError) as refused:
        updater = ModelUpdater(
            _conv_model(),
            learner="er",
            trainer_kwargs={"device": "cpu", **kwargs},
            output_state_folder=str(tmp_path / "state"),
        )
        updater.learner_instance  # noqa: B018 - builds the trainer
    assert message in str(refused.value)
    assert not (tmp_path / "state").exists()
