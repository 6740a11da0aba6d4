"""Tests for GDumb: class-balanced memory, training from scratch on it, bad input, undo."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.memory import GreedyClassBalancingBuffer
from renate_events.methods import GDumbLearner
from renate_events.transforms import ToFloat
from renate_events.updater import ModelUpdater
from tests.helpers import small_mlp, two_class_task
from trainer import Trainer


def _data(classes: tuple[int, ...], per_class: int) -> TensorDataset:
    targets = torch.tensor(classes).repeat_interleave(per_class)
    generator = torch.Generator().manual_seed(len(targets))
    return TensorDataset(torch.randn(len(targets), 4, generator=generator), targets)


def _learner(memory_size: int = 8, classes: int = 4) -> GDumbLearner:
    torch.manual_seed(0)
    return GDumbLearner(
        model=torch.nn.Linear(4, classes),
        memory_size=memory_size,
        batch_size=4,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )


def test_memory_is_class_balanced_and_training_uses_it_only() -> None:
    learner = _learner()
    assert isinstance(learner.buffer, GreedyClassBalancingBuffer)
    result = learner.fit(_data((0, 1), per_class=10))  # 20 samples, 8 slots: 4 + 4
    assert result.steps == 2  # 8 buffered samples in batches of 4
    learner.fit(_data((2, 3), per_class=10))
    (_, targets), _ = learner.buffer.sample(8)
    assert torch.bincount(targets, minlength=4).tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize("reset_model", [True, False])
def test_model_is_trained_from_scratch_at_every_update(reset_model) -> None:
    torch.manual_seed(0)
    learner = GDumbLearner(
        model=torch.nn.Linear(4, 4),
        memory_size=8,
        batch_size=4,
        reset_model=reset_model,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    starts = []

    class Probe:
        def on_train_start(self, model) -> None:
            starts.append(model.weight.detach().clone())

    learner.trainer.subscribe(Probe(), name="probe")
    learner.fit(_data((0, 1), per_class=4))
    trained = learner.model.weight.detach().clone()
    learner.fit(_data((2, 3), per_class=4))
    assert torch.equal(starts[1], trained) is not reset_model


def test_buffer_smaller_than_the_number_of_classes_is_refused_before_training() -> None:
    learner = _learner(memory_size=3, classes=4)
    before = learner.model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"memory_size.*number of classes"):
        learner.fit(_data((0, 1), per_class=4))
    assert len(learner.buffer) == 0
    torch.testing.assert_close(learner.model.weight.detach(), before)
    with pytest.raises(ValueError, match="memory_size"):
        _learner(memory_size=0)


def test_update_failing_before_its_first_batch_gives_the_buffer_back() -> None:
    learner = _learner()
    learner.fit(_data((0, 1), per_class=4))
    state = learner.buffer.state_dict()

    class Fail:
        def on_train_start(self) -> None:
            raise RuntimeError("boom")

    learner.trainer.subscribe(Fail(), name="fail")
    with pytest.raises(Exception, match="boom"):
        learner.fit(_data((2, 3), per_class=4))
    after = learner.buffer.state_dict()
    assert after["length"] == state["length"]
    torch.testing.assert_close(after["targets"], state["targets"])


def test_another_kind_of_buffer_is_refused() -> None:
    from renate_events.memory import ReservoirBuffer

    with pytest.raises(ValueError, match="GreedyClassBalancingBuffer"):
        GDumbLearner(
            model=torch.nn.Linear(4, 4),
            buffer=ReservoirBuffer(max_size=8, seed=0),
            trainer=Trainer(max_epochs=1),
        )


def test_gdumb_checks_raw_uint8_images_through_the_train_transform():
    images = torch.randint(0, 256, (6, 3, 2, 2), dtype=torch.uint8)
    data = TensorDataset(images, torch.arange(6) % 3)
    for classes in (3, 8):
        learner = GDumbLearner(
            model=torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, classes)),
            memory_size=6,
            trainer=Trainer(max_epochs=1, device="cpu"),
            train_transform=ToFloat(),
            buffer_transform=ToFloat(),
        )
        if classes == 3:
            learner.check_data(data)  # the probe took the uint8 images to the model before
        else:
            with pytest.raises(ValueError, match=r"at least the model's number of classes \(8\)"):
                learner.check_data(data)


def test_gdumb_with_another_buffer_says_what_to_pass_to_model_updater() -> None:
    # ModelUpdater builds a reservoir unless told otherwise: "leave buffer unset" alone was no
    # help to a user who had left it unset.
    with pytest.raises(ValueError, match="ModelUpdater: buffer='greedy-class-balancing'"):
        ModelUpdater(
            model=small_mlp(),
            learner="gdumb",
            buffer="reservoir",
            learner_kwargs={"memory_size": 8},
        ).update(two_class_task(0))
