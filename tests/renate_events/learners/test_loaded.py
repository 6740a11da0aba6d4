"""The checks of a learner's loaded contents (``renate_events.learners.loaded``): a refused load
leaves the learner as it was; stored targets behind a target transform are not class ids."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.learners import BaseExperienceReplayLearner, LoadLimits, loading_limits
from trainer import Trainer, read_checkpoint, write_checkpoint
from trainer.exceptions import ListenerError


def _learner(**kwargs):
    torch.manual_seed(0)
    return BaseExperienceReplayLearner(
        model=torch.nn.Linear(4, 3),
        memory_size=8,
        memory_batch_size=4,
        batch_size=4,
        trainer=Trainer(max_epochs=1, device="cpu"),
        **kwargs,
    )


def _data(offset=0):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(12, 4, generator=g), torch.arange(12) % 3 + offset)


@pytest.mark.hostile
@pytest.mark.all_or_nothing
def test_a_refused_load_leaves_the_learner_as_it_was(tmp_path):
    good, path = tmp_path / "good.safetensors", tmp_path / "ckpt.safetensors"
    written = _learner()
    written.fit(_data())
    written.save_checkpoint(good)
    tree = read_checkpoint(good)
    tree["listeners"]["learner"]["buffer"]["targets"][0] = 7  # the model has 3 outputs
    write_checkpoint(path, tree)
    learner = _learner()
    learner.fit(_data())
    weights = {k: v.clone() for k, v in learner.model.state_dict().items()}
    buffer = learner.buffer.state_dict()
    with pytest.raises(ListenerError, match=r"state\['targets'\]: holds the class 7"):
        learner.load_checkpoint(path)
    assert all(torch.equal(weights[k], v) for k, v in learner.model.state_dict().items())
    assert learner.buffer.num_seen == buffer["num_seen"]
    assert torch.equal(learner.buffer.state_dict()["targets"], buffer["targets"])
    with (
        loading_limits(learner, LoadLimits(samples_seen=5)),
        pytest.raises(ListenerError, match="12 samples seen, more than the 5"),
    ):
        learner.load_checkpoint(good)
    assert learner.load_limits == LoadLimits()  # reset: a later load checks against the model only
    learner.load_checkpoint(good)


def test_targets_behind_a_target_transform_are_not_checked_as_classes(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    shift = {
        "train_target_transform": lambda t: t - 10,
        "buffer_target_transform": lambda t: t - 10,
    }
    written = _learner(**shift)
    written.fit(_data(offset=10))  # raw labels 10..12, the model's 3 outputs after the transform
    written.save_checkpoint(path)
    _learner(**shift).load_checkpoint(path)
