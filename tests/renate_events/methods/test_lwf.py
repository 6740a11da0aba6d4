"""Tests for LwF: the distillation loss by hand, the frozen copy, class masking, checkpoints."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.methods import LEARNERS, ICaRLLearner, LearningWithoutForgettingLearner
from renate_events.methods.lwf import LearningWithoutForgettingComponent, distillation_loss
from tests.helpers import small_mlp, two_class_task
from trainer import Trainer
from trainer.exceptions import NonFiniteLossError


def test_distillation_loss_by_hand() -> None:
    new = torch.tensor([[0.0, 0.0]])
    old = torch.tensor([[2.0 * math.log(3.0), 0.0]])  # at T = 2: q = (3/4, 1/4)
    # KL(q || (1/2, 1/2)) = 3/4 log(3/2) + 1/4 log(1/2)
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert float(distillation_loss(new, old, 2.0)) == pytest.approx(expected)


def test_masked_classes_drop_out_of_both_softmaxes() -> None:
    new = torch.tensor([[0.0, 0.0, 50.0]])
    old = torch.tensor([[math.log(3.0), 0.0, -7.0]])  # over classes 0, 1 at T = 1: (3/4, 1/4)
    mask = torch.tensor([True, True, False])
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    loss = distillation_loss(new, old, 1.0, mask)
    assert float(loss) == pytest.approx(expected)
    assert torch.isfinite(loss)


def test_first_update_has_no_term_then_the_copy_is_frozen_at_train_start() -> None:
    model = torch.nn.Linear(2, 3)
    lwf = LearningWithoutForgettingComponent(alpha=0.5, temperature=2.0)
    inputs, targets = torch.randn(4, 2), torch.tensor([0, 1, 0, 1])
    lwf.on_train_start(model=model)
    assert lwf.new_data_loss(model(inputs), (inputs, targets), []) is None
    lwf.on_train_start(model=model)  # the second update: copy of the model as it is now
    old_outputs = model(inputs).detach()
    with torch.no_grad():
        model.weight.add_(1.0)
    outputs = model(inputs)
    loss = lwf.new_data_loss(outputs, (inputs, torch.tensor([2, 2, 2, 2])), [])
    mask = torch.tensor([True, True, False])  # class 2 is new in this update
    expected = 0.5 * distillation_loss(outputs, old_outputs, 2.0, mask)
    torch.testing.assert_close(loss, expected)
    assert all(not p.requires_grad for p in lwf._old_model.parameters())


def _data(classes: tuple[int, int]) -> TensorDataset:
    generator = torch.Generator().manual_seed(classes[0])
    targets = torch.tensor(classes).repeat(16)
    return TensorDataset(torch.randn(32, 4, generator=generator) + targets[:, None], targets)


def test_learner_step_and_checkpoint_round_trip(tmp_path) -> None:
    assert LEARNERS["lwf"] is LearningWithoutForgettingLearner
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    learner = LearningWithoutForgettingLearner(
        model=model, batch_size=8, trainer=Trainer(max_epochs=1, device="cpu")
    )
    learner.fit(_data((0, 1)))
    learner.fit(_data((2, 3)))
    lwf = learner.components["lwf"]
    assert lwf._old_model is not None and lwf._old_classes.tolist() == [True, True, False, False]
    path = tmp_path / "lwf.ckpt"
    learner.save_checkpoint(path)
    clone = LearningWithoutForgettingLearner(
        model=torch.nn.Linear(4, 4), trainer=Trainer(max_epochs=1, device="cpu")
    )
    clone.load_checkpoint(path)
    restored = clone.components["lwf"]
    for a, b in zip(lwf._old_model.parameters(), restored._old_model.parameters()):
        torch.testing.assert_close(a, b)
    assert restored._seen.tolist() == [True] * 4


def test_bad_values_and_checkpoints_are_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        LearningWithoutForgettingComponent(temperature=0.0)
    with pytest.raises(ValueError, match="alpha"):
        LearningWithoutForgettingLearner(
            model=torch.nn.Linear(2, 2), alpha=-1.0, trainer=Trainer(max_epochs=1)
        )
    model = torch.nn.Linear(2, 2)
    lwf = LearningWithoutForgettingComponent()
    with pytest.raises(ValueError, match="old_model"):
        lwf.on_load_checkpoint(
            checkpoint={"updates": 2, "old_model": {"weight": torch.zeros(3, 2)}}, model=model
        )
    with pytest.raises(ValueError, match="updates"):
        lwf.on_load_checkpoint(checkpoint={"updates": -1}, model=model)


@pytest.mark.all_or_nothing
@pytest.mark.parametrize("cls", [LearningWithoutForgettingLearner, ICaRLLearner])
def test_a_first_update_that_fails_leaves_no_old_model_to_distil_from(cls: Any) -> None:
    # The frozen copy's count of updates and the classes noted in the failed step survived a
    # first update that failed before its first optimizer step, so the retried first update
    # distilled from the untrained model over those classes.
    kwargs = {"feature_modules": ["1"], "memory_size": 8, "memory_batch_size": 4}
    learner = cls(
        model=small_mlp(),
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
        **(kwargs if cls is ICaRLLearner else {}),
    )
    (component,) = learner.components.values()
    nan = TensorDataset(torch.full((16, 8), float("nan")), torch.arange(16) % 2)
    with pytest.raises(NonFiniteLossError):
        learner.fit(nan)
    learner.fit(two_class_task(0))
    assert component._old_model is None and component._old_classes is None
