"""Repeated Distillation: the expert, the distillation loss by hand, re-initialisation, the
logits kept in the buffer, all-or-nothing updates, exact resume and bad input."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.components import WeightedCustomLossComponent
from renate_events.methods import LEARNERS, RepeatedDistillationLearner
from renate_events.methods.repeated_distill import DistillationData, double_distillation_loss
from renate_events.updater import ModelUpdater
from tests.helpers import SaveThenCrash, assert_same_tree, model_and_listeners, parameters_of
from trainer import Trainer, read_checkpoint


def _data(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _learner(model=None, trainer=None, **kwargs):
    options = {"memory_size": 20, "batch_size": 8, "seed": 2, **kwargs}
    return RepeatedDistillationLearner(
        model=model or _model(),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        trainer=trainer or Trainer(max_epochs=2, device="cpu"),
        **options,
    )


def test_double_distillation_loss_by_hand():
    predicted = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    target = torch.tensor([[3.0, 6.0, 0.0], [1.0, 1.0, 1.0]])
    # Row 0: target mean 3, centred (0, 3, -3); differences (1, -1, 3): 0.5 * (1+1+9)/3.
    # Row 1: centred (0, 0, 0); differences 0.
    expected = torch.tensor([0.5 * 11 / 3, 0.0])
    torch.testing.assert_close(double_distillation_loss(predicted, target), expected)


def test_the_step_loss_is_the_distillation_loss_on_a_buffer_batch_by_hand():
    learner = _learner()
    learner.fit(_data())
    batch = DistillationData(learner.buffer).__getitems__([0, 3, 5])
    loss = float(learner.training_step(batch)["loss"].detach())
    inputs, _, stored = batch
    with torch.no_grad():
        outputs = learner.model(inputs).tolist()
    total = 0.0
    for row, target in zip(outputs, stored.tolist()):
        mean = sum(target) / len(target)
        total += 0.5 * sum((o - (t - mean)) ** 2 for o, t in zip(row, target)) / len(row)
    assert loss == pytest.approx(total / 3, rel=1e-5)


class _Targets:
    """The distillation targets stored in the buffer when the distillation starts."""

    def __init__(self, learner):
        self.learner, self.logits = learner, None

    def on_train_start(self):
        self.logits = self.learner.buffer.state_dict()["metadata"]["logits"]


def test_the_targets_are_an_experts_logits_trained_on_the_new_data_from_scratch():
    from renate_events.learners import BaseExperienceReplayLearner, derived_seed

    data = _data()
    learner = _learner()
    targets = _Targets(learner)
    learner.trainer.subscribe(targets, name="targets")
    learner.fit(data)
    # The expert by hand: a fresh copy of the model, re-initialised, fine-tuned on the data alone.
    expert = _model(seed=99)  # its initial weights are replaced by the re-initialisation
    torch.manual_seed(derived_seed(2, 3))
    for module in expert.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    BaseExperienceReplayLearner(
        model=expert,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        memory_size=0,
        batch_size=8,
        seed=2,
        trainer=Trainer(max_epochs=2, device="cpu", seed=2),
    ).fit(data)
    with torch.no_grad():
        torch.testing.assert_close(targets.logits, expert(data.tensors[0]))
    # At the end the buffer keeps the consolidated model's logits instead.
    state = learner.buffer.state_dict()
    with torch.no_grad():
        torch.testing.assert_close(state["metadata"]["logits"], learner.model(state["inputs"][0]))


def test_the_model_is_reinitialised_every_update():
    first, second = _learner(model=_model(seed=0)), _learner(model=_model(seed=1))
    assert not torch.equal(first.model[0].weight, second.model[0].weight)
    first.fit(_data())
    second.fit(_data())
    assert torch.equal(first.model[0].weight, second.model[0].weight)
    assert torch.equal(first.model[2].bias, second.model[2].bias)


def test_the_buffer_trains_on_old_and_new_samples():
    learner = _learner(memory_size=24)
    learner.fit(_data(n=16, seed=0))
    lengths = []
    learner.trainer.subscribe(
        type("Probe", (), {"on_train_start": lambda self: lengths.append(len(learner.buffer))})(),
        name="probe",
    )
    result = learner.fit(_data(n=16, seed=1))
    assert lengths == [24] and learner.buffer.num_seen == 32
    assert result.steps == 2 * 3  # two epochs of 24 buffered samples in batches of 8


class _Fail:
    def __init__(self, event):
        self.event = event

    def on_batch_end(self, state):
        if self.event == "batch_end" and state.global_step == 2:
            raise RuntimeError("boom")

    def on_train_end(self):
        if self.event == "train_end":
            raise RuntimeError("boom")


@pytest.mark.all_or_nothing
@pytest.mark.parametrize("phase", ["expert", "batch_end", "train_end"])
def test_a_failed_update_leaves_model_and_buffer_unchanged(phase):
    learner = _learner()
    learner.fit(_data())
    model, buffer = parameters_of(learner.model), learner.buffer.state_dict()
    if phase == "expert":
        calls = []

        def transform(x):
            calls.append(1)
            if len(calls) == 3:  # the check's probe, the expert's first batch, then fails
                raise RuntimeError("boom")
            return x

        learner.train_transform = transform
    else:
        learner.trainer.subscribe(_Fail(phase), name="fail")
    with pytest.raises(Exception, match="boom"):
        learner.fit(_data(seed=1))
    assert_same_tree(model, parameters_of(learner.model))
    assert_same_tree(buffer, learner.buffer.state_dict())


def test_a_checkpoint_of_the_distillation_resumes_bit_identically(tmp_path):
    tasks = [_data(n=16, seed=0), _data(n=24, seed=1)]
    reference = _learner()
    for task in tasks:
        reference.fit(task)
    expected = model_and_listeners(reference, tmp_path / "reference.safetensors")

    trainer = Trainer(max_epochs=2, device="cpu")
    crash = SaveThenCrash(tmp_path / "mid.safetensors", 4)
    trainer.subscribe(crash, priority=10, name="crash")
    learner = _learner(trainer=trainer)
    learner.fit(tasks[0])
    crash.armed = True
    with pytest.raises(KeyboardInterrupt):
        learner.fit(tasks[1])  # killed in epoch 2 of the distillation (3 steps an epoch)

    resumed = _learner()
    resumed.fit(tasks[1], resume_from=tmp_path / "mid.safetensors")
    assert_same_tree(expected, model_and_listeners(resumed, tmp_path / "resumed.safetensors"))


def test_updates_through_state_folders(tmp_path):
    def update(folder_in, folder_out, seed):
        updater = ModelUpdater(
            _model(),
            learner="repeated-distill",
            learner_kwargs={"memory_size": 12, "batch_size": 8},
            max_epochs=1,
            trainer_kwargs={"device": "cpu"},
            input_state_folder=folder_in,
            output_state_folder=folder_out,
        )
        updater.update(_data(seed=seed))
        return updater

    assert LEARNERS["repeated-distill"] is RepeatedDistillationLearner
    update(None, tmp_path / "a", 0)
    update(tmp_path / "a", tmp_path / "b", 1)
    tree = read_checkpoint(tmp_path / "b" / "learner.safetensors")
    assert int(tree["listeners"]["learner"]["buffer"]["num_seen"]) == 32


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"memory_size": 0}, ValueError, "memory_size must be an int >= 1"),
        ({"buffer_filling": "end"}, ValueError, "buffer_filling` must be 'step'"),
        ({"feature_modules": ["0"]}, ValueError, "feature_modules` must be empty"),
        (
            {"components": [WeightedCustomLossComponent(loss_fn=torch.nn.functional.mse_loss)]},
            ValueError,
            "components` must be empty",
        ),
    ],
)
def test_bad_settings_are_refused_when_the_learner_is_built(kwargs, error, message):
    with pytest.raises(error, match=message):
        _learner(**kwargs)


def test_an_optimizer_instance_is_refused():
    model = _model()
    with pytest.raises(TypeError, match="optimizer` must be a factory"):
        RepeatedDistillationLearner(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1))
