"""Issue 15: a refused learner load leaves the learner, its buffer and its trainer as they were."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.methods import CLSExperienceReplayLearner
from trainer import Trainer, read_checkpoint, write_checkpoint

# `pytest -m all_or_nothing` runs this with the other tests of refusals that change nothing.
pytestmark = pytest.mark.all_or_nothing


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_a_component_refusing_its_state_leaves_the_buffer_and_optimizer(tmp_path):
    torch.manual_seed(0)
    learner = CLSExperienceReplayLearner(
        model=torch.nn.Linear(4, 3),
        memory_size=100,
        memory_batch_size=8,
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    learner.fit(_data(40, 0))
    path = str(tmp_path / "cls.safetensors")
    learner.save_checkpoint(path)
    learner.fit(_data(24, 1))
    tree = read_checkpoint(path)
    plastic = tree["listeners"]["cls_loss"]["plastic_model"]
    first = next(iter(plastic))
    plastic[first] = torch.zeros(99)  # the component refuses a model of another shape
    write_checkpoint(path, tree)
    seen, optimizer = learner.buffer.num_seen, learner.trainer.optimizer
    weights = learner.model.weight.detach().clone()
    with pytest.raises(Exception, match="cls_loss"):
        learner.load_checkpoint(path)
    assert learner.buffer.num_seen == seen == 64
    assert learner.trainer.optimizer is optimizer
    assert torch.equal(learner.model.weight, weights)
