"""``buffer_filling``: every learner can fill its buffer at the end of an update, with the final
model's logits and features, once, and not at all when the update fails."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.hyperparameters import hyperparameters
from renate_events.memory import GreedyClassBalancingBuffer
from renate_events.methods import (
    CLSExperienceReplayLearner,
    DarkExperienceReplayLearner,
    ExperienceReplayLearner,
    GDumbLearner,
    ICaRLLearner,
    JointLearner,
    OfflineExperienceReplayLearner,
    PooledOutputDistillationExperienceReplayLearner,
    SuperExperienceReplayLearner,
)
from renate_events.updater import ModelUpdater
from tests.helpers import SaveThenCrash, assert_same_tree, model_and_listeners
from trainer import Trainer


def _data(n=16, seed=0, classes=(0, 1, 2, 3)):
    g = torch.Generator().manual_seed(seed)
    targets = torch.tensor(classes)[torch.randint(0, len(classes), (n,), generator=g)]
    return TensorDataset(torch.randn(n, 6, generator=g), targets)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def _learner(cls=DarkExperienceReplayLearner, trainer=None, **kwargs):
    options = {
        "memory_size": 20,
        "memory_batch_size": 4,
        "batch_size": 8,
        "seed": 3,
        "buffer_filling": "end",
        **kwargs,
    }
    return cls(model=_model(), trainer=trainer or Trainer(max_epochs=1, device="cpu"), **options)


class _Lengths:
    """Records the buffer's length at every batch_end."""

    def __init__(self, learner):
        self.learner, self.seen = learner, []

    def on_batch_end(self):
        self.seen.append(len(self.learner.buffer))


PRESETS = [
    (ExperienceReplayLearner, {}),
    (DarkExperienceReplayLearner, {}),
    (PooledOutputDistillationExperienceReplayLearner, {"feature_modules": ["0"]}),
    (CLSExperienceReplayLearner, {}),
    (SuperExperienceReplayLearner, {"feature_modules": ["0"]}),
]


@pytest.mark.parametrize(("cls", "kwargs"), PRESETS, ids=lambda p: getattr(p, "__name__", ""))
def test_every_preset_fills_at_the_end_with_the_final_models_outputs(cls, kwargs):
    learner = _learner(cls, **kwargs)
    lengths = _Lengths(learner)
    learner.trainer.subscribe(lengths, name="lengths")
    data = _data(n=16, seed=0)
    learner.fit(data)
    assert lengths.seen == [0, 0]  # nothing stored during the first update
    state = learner.buffer.state_dict()
    assert torch.equal(state["inputs"][0], data.tensors[0])
    with torch.no_grad():
        hidden = learner.model[0](data.tensors[0])
        logits = learner.model(data.tensors[0])
    torch.testing.assert_close(state["metadata"]["logits"], logits)
    if "feature_modules" in kwargs:
        torch.testing.assert_close(state["metadata"]["intermediate_representation_0"], hidden)
    learner.fit(_data(n=16, seed=1))
    assert lengths.seen[2:] == [16, 16]  # the second update sees the first one's data only
    assert len(learner.buffer) == 20 and learner.buffer.num_seen == 32


def test_logits_are_of_the_test_transformed_inputs_and_raw_inputs_are_stored():
    calls = []

    def buffer_transform(x):
        calls.append(x.clone())
        return x + 100.0

    learner = _learner(
        ExperienceReplayLearner,
        memory_size=32,
        test_transform=lambda x: x * 2.0,
        buffer_transform=buffer_transform,
    )
    data = _data(n=16)
    learner.fit(data)
    assert calls == [] or all(len(c) == 1 for c in calls)  # only the probe of the first batch
    state = learner.buffer.state_dict()
    assert torch.equal(state["inputs"][0], data.tensors[0])  # raw, in the data's order
    assert torch.equal(state["targets"], data.tensors[1])
    weight0, bias0 = learner.model[0].weight.detach(), learner.model[0].bias.detach()
    weight2, bias2 = learner.model[2].weight.detach(), learner.model[2].bias.detach()
    by_hand = torch.relu((data.tensors[0] * 2.0) @ weight0.T + bias0) @ weight2.T + bias2
    torch.testing.assert_close(state["metadata"]["logits"], by_hand)
    # The next update replays the stored raw inputs through the buffer transform.
    calls.clear()
    learner.fit(_data(n=16, seed=1))
    replayed = [c for c in calls if len(c) == 4]
    assert replayed and all(
        (c.unsqueeze(1) == data.tensors[0].unsqueeze(0)).all(-1).any(-1).all() for c in replayed
    )


def test_der_with_end_filling_into_a_class_balanced_buffer():
    buffer = GreedyClassBalancingBuffer(max_size=8, seed=0)
    learner = _learner(DarkExperienceReplayLearner, memory_size=8, buffer=buffer)
    learner.fit(_data(n=24, classes=(0, 1)))
    assert buffer.class_counts() == {0: 4, 1: 4}
    lengths = _Lengths(learner)
    learner.trainer.subscribe(lengths, name="lengths")
    learner.fit(_data(n=24, seed=1, classes=(2, 3)))
    assert lengths.seen == [8, 8, 8]
    assert buffer.class_counts() == {0: 2, 1: 2, 2: 2, 3: 2}


def test_step_filling_is_unchanged_and_the_default():
    learner = _learner(DarkExperienceReplayLearner, buffer_filling="step")
    lengths = _Lengths(learner)
    learner.trainer.subscribe(lengths, name="lengths")
    learner.fit(_data(n=16))
    assert lengths.seen == [8, 16]
    assert DarkExperienceReplayLearner(model=_model()).buffer_filling == "step"
    assert OfflineExperienceReplayLearner(model=_model()).buffer_filling == "end"


def test_a_resumed_update_fills_once_at_its_end_like_an_uninterrupted_one(tmp_path):
    tasks = [_data(n=24, seed=0), _data(n=24, seed=1)]
    reference = _learner(trainer=Trainer(max_epochs=2, device="cpu"))
    for task in tasks:
        reference.fit(task)
    expected = model_and_listeners(reference, tmp_path / "reference.safetensors")

    trainer = Trainer(max_epochs=2, device="cpu")
    crash = SaveThenCrash(tmp_path / "mid.safetensors", step=4)  # mid-epoch 2 of update 2
    trainer.subscribe(crash, priority=10, name="crash")
    learner = _learner(trainer=trainer)
    learner.fit(tasks[0])
    before = learner.buffer.state_dict()
    crash.armed = True
    with pytest.raises(KeyboardInterrupt):
        learner.fit(tasks[1])
    after = learner.buffer.state_dict()  # interrupted: not filled; its draws are kept
    for key in ("num_seen", "inputs", "targets", "metadata", "generator_state"):
        assert_same_tree(before[key], after[key], key)

    resumed = _learner(trainer=Trainer(max_epochs=2, device="cpu"))
    resumed.fit(tasks[1], resume_from=tmp_path / "mid.safetensors")
    assert resumed.buffer.num_seen == 48
    assert_same_tree(expected, model_and_listeners(resumed, tmp_path / "resumed.safetensors"))

    # Resuming from a checkpoint written after the fill does not fill a second time.
    again = _learner(trainer=Trainer(max_epochs=2, device="cpu"))
    with pytest.warns(UserWarning, match="finished run"):
        again.fit(tasks[1], resume_from=tmp_path / "resumed.safetensors")
    assert again.buffer.num_seen == 48
    final = model_and_listeners(again, tmp_path / "again.safetensors")
    assert_same_tree(expected["listeners"], final["listeners"])


class _Raise:
    def __init__(self, event):
        self.event = event

    def on_batch_end(self, state):
        if self.event == "batch_end" and state.global_step == 2:
            raise RuntimeError("boom")

    def on_train_end(self):
        if self.event == "train_end":
            raise RuntimeError("boom")


@pytest.mark.all_or_nothing
@pytest.mark.parametrize("event", ["batch_end", "train_end"])
def test_a_failed_update_leaves_the_buffer_unchanged(event):
    learner = _learner(trainer=Trainer(max_epochs=2, device="cpu"))
    learner.fit(_data(n=16))
    before = learner.buffer.state_dict()
    # Subscribed after the learner: at train_end it raises once the buffer has been filled.
    learner.trainer.subscribe(_Raise(event), name="raise")
    with pytest.raises(Exception, match="boom"):
        learner.fit(_data(n=16, seed=1))
    assert_same_tree(before, learner.buffer.state_dict())


@pytest.mark.all_or_nothing
def test_the_fill_itself_failing_leaves_the_buffer_unchanged():
    calls = []

    def test_transform(x):
        calls.append(len(x))
        if len(calls) == 2:  # fails on the fill's second batch
            raise RuntimeError("transform failed")
        return x

    learner = _learner(memory_size=32)
    learner.fit(_data(n=16))
    before = learner.buffer.state_dict()
    learner.test_transform = test_transform
    with pytest.raises(Exception, match="transform failed"):
        learner.fit(_data(n=16, seed=1))
    assert_same_tree(before, learner.buffer.state_dict())


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (DarkExperienceReplayLearner, {"memory_size": 0}, "buffer_filling` is 'end'.*memory_size"),
        (OfflineExperienceReplayLearner, {"memory_size": 0}, "memory_size >= 1 or buffer_filling"),
        (ExperienceReplayLearner, {"buffer_filling": "epoch"}, r"one of \['step', 'end'\]"),
        (JointLearner, {}, "buffer_filling` must be 'step'"),
        (GDumbLearner, {}, "buffer_filling` must be 'step'"),
        (ICaRLLearner, {"feature_modules": ["0"]}, "buffer_filling` must be 'step'.*herding"),
    ],
)
def test_bad_buffer_filling_is_refused_when_the_learner_is_built(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _learner(cls, **kwargs)


def test_buffer_filling_is_a_hyperparameter_and_a_cli_flag(tmp_path, capsys):
    assert hyperparameters("der")["buffer_filling"].default == "step"
    assert hyperparameters("offline-er")["buffer_filling"].default == "end"
    from renate_events.cli import main

    out = tmp_path / "out"
    argv = ["run", "--learner", "der", "--buffer-filling", "end", "--memory-size", "0"]
    assert main([*argv, "--output-dir", str(out), "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "buffer_filling" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_buffer_filling_may_change_between_updates_of_a_state_folder(tmp_path):
    def update(folder_in, folder_out, filling, seed):
        updater = ModelUpdater(
            _model(),
            learner="der",
            learner_kwargs={"memory_size": 20, "memory_batch_size": 4, "buffer_filling": filling},
            max_epochs=1,
            trainer_kwargs={"device": "cpu"},
            input_state_folder=folder_in,
            output_state_folder=folder_out,
        )
        updater.update(_data(n=16, seed=seed))

    update(None, tmp_path / "a", "step", 0)
    update(tmp_path / "a", tmp_path / "b", "end", 1)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["learner_kwargs"]["buffer_filling"] == "end"


def test_a_memory_mapped_buffer_is_filled_without_an_extra_snapshot_generation(tmp_path):
    from renate_events.memory.mapped import MappedReservoirBuffer

    buffer = MappedReservoirBuffer(max_size=20, folder=tmp_path, seed=0)
    learner = _learner(ExperienceReplayLearner, buffer=buffer)
    learner.fit(_data(n=16))
    learner.save_checkpoint(tmp_path / "after-1.safetensors")  # snapshot generation 1
    learner.fit(_data(n=16, seed=1))  # an update writes no snapshot of its own
    assert len(buffer) == 20 and buffer.num_seen == 32
    assert sorted(p.name for p in tmp_path.glob("*.g*.bin")) == sorted(
        p.name for p in tmp_path.glob("*.g1.*.bin")
    )


def test_the_no_memory_refusal_suggests_only_a_filling_the_learner_takes():
    """X-DER fills its buffer only at the end: its refusal of memory_size=0 must not suggest
    buffer_filling='step', which it refuses in turn. Every learner's suggestion is tried."""
    from renate_events.methods import (
        LEARNERS,
        ExtendedDarkExperienceReplayLearner,
        PromptModelError,
    )

    suggested = 0
    for cls in LEARNERS.values():
        try:
            _learner(cls, memory_size=0)
        except PromptModelError:
            continue  # needs a ViT; its own tests build it
        except ValueError as error:
            if "buffer_filling='step'" in str(error):
                suggested += 1
                _learner(cls, memory_size=0, buffer_filling="step")  # the suggestion is taken
    assert suggested > 0
    with pytest.raises(ValueError, match="memory_size >= 1") as refused:
        _learner(ExtendedDarkExperienceReplayLearner, memory_size=0)
    assert "'step'" not in str(refused.value)
