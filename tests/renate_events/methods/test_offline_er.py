"""Tests for Offline-ER: end-of-update filling, the convex loss by hand, dynamic weights, input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from renate_events.methods import OfflineExperienceReplayLearner
from tests.helpers import small_mlp, two_class_task
from trainer import Trainer


def _data(classes: tuple[int, int], n: int = 32) -> TensorDataset:
    generator = torch.Generator().manual_seed(classes[0])
    targets = torch.tensor(classes).repeat(n // 2)
    return TensorDataset(torch.randn(n, 4, generator=generator) + targets[:, None], targets)


def _learner(**kwargs) -> OfflineExperienceReplayLearner:
    torch.manual_seed(0)
    return OfflineExperienceReplayLearner(
        model=torch.nn.Linear(4, 4),
        memory_size=16,
        memory_batch_size=8,
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
        **kwargs,
    )


def test_buffer_is_filled_at_the_end_of_the_update_with_final_logits() -> None:
    learner = _learner()
    seen = []

    class Probe:
        def on_batch_end(self) -> None:
            seen.append(len(learner.buffer))

    learner.trainer.subscribe(Probe(), name="probe")
    data = _data((0, 1))
    learner.fit(data)
    assert seen == [0, 0, 0, 0]  # nothing stored during the update
    assert len(learner.buffer) == 16
    ((inputs, _), metadata) = learner.buffer.sample(16)
    with torch.no_grad():
        torch.testing.assert_close(metadata["logits"], learner.model(inputs))


def test_first_update_uses_the_new_loss_alone_then_the_dynamic_weight() -> None:
    learner = _learner()
    assert learner.loss_weight_new_data is None
    learner.fit(_data((0, 1)))  # buffer empty at the start: w = 1
    assert learner.loss_weight == 1.0
    second = _data((2, 3), n=48)
    learner.fit(second)
    w = 48 / (48 + 16)  # N_t / (N_t + N_memory)
    assert learner.loss_weight == pytest.approx(w)
    assert learner.components["memory_loss"].weight == pytest.approx(1 - w)


@pytest.mark.parametrize("memory_forward", ["separate", "auto"])  # "auto": one fused pass
def test_step_loss_is_the_convex_combination_by_hand(memory_forward) -> None:
    learner = _learner(loss_weight_new_data=0.3, memory_forward=memory_forward)
    learner.fit(_data((0, 1)))
    learner._set_weights(_data((2, 3)))  # as fit() does at the start of an update
    inputs, targets = _data((2, 3)).tensors
    state = learner.buffer.sampling_state()
    loss = learner.training_step((inputs[:8], targets[:8]))["loss"].detach()
    learner.buffer.set_sampling_state(state)
    ((memory_inputs, memory_targets), _) = learner.buffer.sample(8)
    model = learner.model
    with torch.no_grad():
        expected = 0.3 * F.cross_entropy(model(inputs[:8]), targets[:8]) + 0.7 * F.cross_entropy(
            model(memory_inputs), memory_targets
        )
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("weight", [-0.1, 1.5])
def test_loss_weight_new_data_outside_unit_interval_is_refused(weight) -> None:
    with pytest.raises(ValueError, match="loss_weight_new_data"):
        _learner(loss_weight_new_data=weight)


@pytest.mark.all_or_nothing
def test_a_refused_offline_er_update_keeps_the_loss_weights() -> None:
    learner = OfflineExperienceReplayLearner(
        model=small_mlp(),
        memory_size=16,
        memory_batch_size=4,
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    for task in range(2):
        learner.fit(two_class_task(task))
    memory_loss = learner.components["memory_loss"]
    # Renate's dynamic weight of the second update: N_t / (N_t + N_M) = 32 / (32 + 16).
    assert learner.loss_weight == pytest.approx(2 / 3)
    assert memory_loss.weight == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="per-sample shape"):
        learner.fit(two_class_task(2, n=64, width=5))  # refused: inputs of another shape
    assert learner.loss_weight == pytest.approx(2 / 3)
    assert memory_loss.weight == pytest.approx(1 / 3)
