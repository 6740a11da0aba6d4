"""Experience-replay learners: step semantics, presets, buffer updates, checkpoints, learning."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from renate_events.components import (
    Component,
    WeightedCustomLossComponent,
    WeightedMeanSquaredErrorLossComponent,
    WeightedPooledOutputDistillationLossComponent,
)
from renate_events.learners import BaseExperienceReplayLearner
from renate_events.methods import (
    CLSExperienceReplayLearner,
    DarkExperienceReplayLearner,
    ExperienceReplayLearner,
    FineTuningLearner,
    JointLearner,
    PooledOutputDistillationExperienceReplayLearner,
    SuperExperienceReplayLearner,
)
from tests.helpers import assert_same_tensors, assert_same_tree, parameters_of
from trainer import Trainer, read_checkpoint


def _data(n=64, features=6, classes=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, features, generator=generator),
        torch.randint(0, classes, (n,), generator=generator),
    )


def _model(features=6, classes=4, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(features, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes)
    )


@attrs.define(eq=False)
class RecordingComponent(Component):
    """Logs its loss calls and hooks into a shared list."""

    log: list = attrs.field(factory=list)
    tag: int = 0

    def loss(self, outputs_memory, batch_memory, intermediate_representation_memory):
        (_, _), metadata = batch_memory
        self.log.append(("loss", self.tag, metadata["idx"].clone()))
        return outputs_memory.sum() * 0.0

    def on_train_start(self, model):
        self.log.append(("train_start", self.tag))

    def on_train_batch_end(self, model):
        self.log.append(("batch_end", self.tag))


@settings(max_examples=25)
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=5),
    weights=st.data(),
    mode=st.sampled_from(["separate", "concatenated"]),
)
def test_components_run_in_order_and_memory_forwards_match_sampling_flags(flags, weights, mode):
    log: list = []
    components = {
        f"c{i}": RecordingComponent(
            weight=weights.draw(st.sampled_from([0.0, 0.5])),
            sample_new_memory_batch=flag,
            log=log,
            tag=i,
        )
        for i, flag in enumerate(flags)
    }
    model = _model()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(len(args[0])))
    learner = BaseExperienceReplayLearner(
        model=model,
        components=components,
        memory_size=16,
        memory_batch_size=4,
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
        memory_forward=mode,
    )
    learner.fit(_data(n=32))
    assert log[: len(flags)] == [("train_start", i) for i in range(len(flags))]
    per_step = [entry for entry in log[len(flags) :]]
    # First two steps: buffer holds 0 then 8 samples (>= 4 from the second step on).
    order = [entry[:2] for entry in per_step]
    with_memory = [("loss", i) for i in range(len(flags))]
    ends = [("batch_end", i) for i in range(len(flags))]
    assert order == ends + (with_memory + ends) * 3
    samples = sum(flags) + (0 if flags[0] else 1)
    if mode == "separate":  # Renate's: new batch, then each memory batch, one pass each
        assert forwards == [1, 8] + ([8] + [4] * samples) * 3  # 1: fit checks the labels
    else:  # the first memory batch rides with the new batch; later ones get their own pass
        assert forwards == [1, 8] + ([8 + 4] + [4] * (samples - 1)) * 3
    # Components that did not ask for a new batch see the previous component's batch.
    losses = [entry for entry in per_step if entry[0] == "loss"][: len(flags)]
    for i in range(1, len(flags)):
        if not flags[i]:
            assert torch.equal(losses[i][2], losses[i - 1][2])


def test_presets_have_renates_components_and_defaults():
    model = _model()
    der = DarkExperienceReplayLearner(model=model, trainer=Trainer(device="cpu"))
    assert list(der.components) == ["memory_loss", "mse_loss"]
    assert [c.weight for c in der.components.values()] == [1.0, 1.0]
    assert [c.sample_new_memory_batch for c in der.components.values()] == [True, False]
    er = ExperienceReplayLearner(model=_model(), alpha=0.3, trainer=Trainer(device="cpu"))
    assert list(er.components) == ["memory_loss"] and er.components["memory_loss"].weight == 0.3
    cls = CLSExperienceReplayLearner(model=_model(), trainer=Trainer(device="cpu"))
    assert [c.weight for c in cls.components.values()] == [0.5, 0.1]
    pod = PooledOutputDistillationExperienceReplayLearner(
        model=_model(), feature_modules=["1"], trainer=Trainer()
    )
    assert pod.components["pod_loss"].distillation_type == "spatial"
    sup = SuperExperienceReplayLearner(
        model=_model(), feature_modules=["1"], trainer=Trainer(device="cpu")
    )
    assert list(sup.components) == [
        "mse_loss",
        "memory_loss",
        "cls_loss",
        "shrink_perturb",
        "pod_loss",
    ]
    assert FineTuningLearner(model=_model(), trainer=Trainer()).buffer is None
    keys = [key for key, _ in der.trainer.listeners]
    assert keys == ["learner", "memory_loss", "mse_loss"]


def test_invalid_arguments_name_the_field():
    with pytest.raises(ValueError, match="memory_size must be an int >= 0"):
        ExperienceReplayLearner(model=_model(), memory_size=-1)
    with pytest.raises(ValueError, match=r"ema_memory_update_gamma must be a number in \(0, 1\]"):
        ExperienceReplayLearner(model=_model(), ema_memory_update_gamma=0)
    with pytest.raises(ValueError, match="both must be >= 1"):
        ExperienceReplayLearner(model=_model(), batch_memory_frac=0.01, batch_size=10)
    with pytest.raises(TypeError, match="not a Component"):
        BaseExperienceReplayLearner(model=_model(), components={"x": object()})
    with pytest.raises(ValueError, match="component name 'learner'"):
        BaseExperienceReplayLearner(
            model=_model(), components={"learner": WeightedMeanSquaredErrorLossComponent()}
        )


def test_batch_memory_frac_splits_the_batch_as_renate_documents():
    sizes = []
    model = _model()
    model.register_forward_pre_hook(lambda module, args: sizes.append(len(args[0])))
    learner = ExperienceReplayLearner(
        model=model,
        memory_size=10,
        batch_size=16,
        batch_memory_frac=0.5,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    assert learner.memory_batch_size == 8
    learner.fit(_data(n=32))
    assert sizes[0] == 1  # the label check probes the number of outputs with one sample
    # New data alone (16 - 8), then new data and memory in one pass of batch_size samples.
    assert sizes[1:4] == [8, 16, 16]


def test_buffer_is_updated_after_each_step_with_unmasked_logits():
    learner = DarkExperienceReplayLearner(
        model=_model(),
        memory_size=100,
        batch_size=8,
        mask_unused_classes=True,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    data = TensorDataset(torch.randn(16, 6), torch.zeros(16, dtype=torch.int64))  # class 0 only
    learner.fit(data)
    assert len(learner.buffer) == 16
    (_, targets), metadata = learner.buffer.sample(16)
    assert torch.isfinite(metadata["logits"]).all()  # Renate stored -inf here
    assert set(targets.tolist()) == {0}


def test_ema_update_of_stored_logits():
    learner = DarkExperienceReplayLearner(
        model=_model(),
        memory_size=8,
        memory_batch_size=8,
        ema_memory_update_gamma=0.25,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    inputs = torch.randn(8, 6)
    learner.buffer.update(inputs, torch.zeros(8, dtype=torch.int64), {"logits": torch.ones(8, 4)})
    learner.training_step((torch.randn(8, 6), torch.zeros(8, dtype=torch.int64)))
    expected = 0.25 * torch.ones(8, 4) + 0.75 * learner.model(inputs).detach()
    torch.testing.assert_close(learner.buffer.get_metadata("logits", torch.arange(8)), expected)


def test_pod_without_features_is_an_error_naming_what_to_configure():
    with pytest.raises(ValueError, match="feature_modules is empty"):
        PooledOutputDistillationExperienceReplayLearner(model=_model())
    pod = WeightedPooledOutputDistillationLossComponent()
    learner = BaseExperienceReplayLearner(
        model=_model(),
        components={"pod": pod},
        feature_modules=["1"],
        memory_size=8,
        memory_batch_size=4,
        batch_size=4,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    learner._recorder.remove()
    learner._recorder = None  # features no longer recorded: the component itself refuses
    with pytest.raises(ValueError, match="IntermediateRepresentations"):
        learner.fit(_data(n=16))


def test_pod_with_feature_modules_trains():
    learner = PooledOutputDistillationExperienceReplayLearner(
        model=_model(),
        memory_size=8,
        memory_batch_size=4,
        batch_size=4,
        feature_modules=["1"],
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    learner.fit(_data(n=16))
    assert "intermediate_representation_0" in learner.buffer.metadata_keys


def _resume_setup(cls, trainer=None):
    torch.manual_seed(0)
    return cls(
        model=_model(seed=1),
        memory_size=20,
        memory_batch_size=4,
        batch_size=8,
        seed=4,
        feature_modules=["1"],
        ema_memory_update_gamma=0.9,
        mask_unused_classes=True,
        trainer=trainer or Trainer(max_epochs=2, device="cpu"),
    )


def _final_state(learner, path):
    learner.save_checkpoint(path)
    tree = read_checkpoint(path)
    return {"model": tree["model"], "listeners": tree["listeners"]}


class SaveThenCrash:
    """Saves at the batch_end of step 7 and dies at the next batch_start."""

    def __init__(self, path):
        self.path = path
        self.armed = False

    def on_batch_end(self, trainer, state):
        if self.armed and state.global_step == 7:
            trainer.save_checkpoint(self.path)

    def on_batch_start(self, state):
        if self.armed and state.global_step == 7:
            raise KeyboardInterrupt


@pytest.mark.parametrize(
    "cls", [SuperExperienceReplayLearner, CLSExperienceReplayLearner, JointLearner]
)
def test_checkpoint_mid_update_and_resume_is_bit_identical(tmp_path, cls):
    tasks = [_data(n=40, seed=10), _data(n=40, seed=11)]
    learner = _resume_setup(cls)
    for task in tasks:
        learner.fit(task)
    reference = _final_state(learner, tmp_path / "reference.safetensors")
    reference_sample = learner.buffer.sample(4)

    # The crashing checkpointer is subscribed before the learner and its components, with a high
    # priority: the file must still hold the state after every listener handled the batch.
    trainer = Trainer(max_epochs=2, device="cpu")
    crash = SaveThenCrash(tmp_path / "mid.safetensors")
    trainer.subscribe(crash, priority=10, name="crash")
    learner = _resume_setup(cls, trainer)
    learner.fit(tasks[0])
    crash.armed = True
    with pytest.raises(KeyboardInterrupt):
        learner.fit(tasks[1])

    resumed = _resume_setup(cls)
    resumed.fit(tasks[1], resume_from=tmp_path / "mid.safetensors")
    assert_same_tree(reference, _final_state(resumed, tmp_path / "resumed.safetensors"))
    sample = resumed.buffer.sample(4)
    assert torch.equal(reference_sample[1]["idx"], sample[1]["idx"])


def _digits_tasks():
    sklearn = pytest.importorskip("sklearn.datasets")
    digits = sklearn.load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    split = int(0.75 * len(y))
    tasks = []
    for first in range(0, 10, 2):
        train = (y[:split] == first) | (y[:split] == first + 1)
        test = (y[split:] == first) | (y[split:] == first + 1)
        tasks.append(
            (
                TensorDataset(x[:split][train], y[:split][train]),
                TensorDataset(x[split:][test], y[split:][test]),
            )
        )
    return tasks


def _average_accuracy(cls, **kwargs):
    tasks = _digits_tasks()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    learner = cls(
        model=model,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        batch_size=32,
        seed=0,
        trainer=Trainer(max_epochs=10, device="cpu"),
        **kwargs,
    )
    for train, _ in tasks:
        learner.fit(train)
    accuracies = []
    with torch.no_grad():
        for _, test in tasks:
            x, y = test.tensors
            accuracies.append((model(x).argmax(1) == y).float().mean().item())
    return sum(accuracies) / len(accuracies)


@pytest.mark.slow
def test_replay_beats_fine_tuning_on_split_digits():
    fine_tuning = _average_accuracy(FineTuningLearner)
    er = _average_accuracy(ExperienceReplayLearner, memory_size=200, memory_batch_size=32)
    der = _average_accuracy(DarkExperienceReplayLearner, memory_size=200, memory_batch_size=32)
    # Fine-tuning forgets: it keeps roughly the last task (1 of 5), about 0.2 on average.
    assert fine_tuning < 0.3, fine_tuning
    # Replay must keep most of the old tasks: at least 0.4 more average accuracy (measured with
    # seed 0: fine-tuning 0.15, ER 0.79, DER++ 0.91).
    assert er > fine_tuning + 0.4, (er, fine_tuning)
    assert der > fine_tuning + 0.4, (der, fine_tuning)


def test_mask_unused_classes_masks_classes_absent_from_this_update():
    model = _model()
    learner = FineTuningLearner(
        model=model, mask_unused_classes=True, trainer=Trainer(max_epochs=1, device="cpu")
    )
    learner.fit(TensorDataset(torch.randn(8, 6), torch.tensor([0, 1] * 4)))
    learner.on_train_start()  # the next update starts (the trainer calls this at train_start)
    x, y = torch.randn(8, 6), torch.tensor([2, 3] * 4)
    loss = learner.training_step((x, y))["loss"]
    logits = model(x).detach()
    logits[:, [0, 1]] = float("-inf")
    torch.testing.assert_close(loss.detach(), torch.nn.functional.cross_entropy(logits, y))


def test_batches_that_are_not_pairs_get_a_clear_error():
    learner = FineTuningLearner(model=_model(), trainer=Trainer(max_epochs=1, device="cpu"))
    with pytest.raises(TypeError, match=r"\(inputs, targets, task_ids\); got a list of 4 items"):
        learner.fit([[torch.randn(2, 6), torch.tensor([0, 1]), torch.zeros(2), torch.zeros(2)]])


def test_bad_input_is_refused_before_any_parameter_changes():
    model = _model()
    learner = SuperExperienceReplayLearner(
        model=model,
        feature_modules=["1"],
        memory_size=16,
        memory_batch_size=4,
        batch_size=4,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    before = parameters_of(model)
    with pytest.raises(ValueError, match="empty training set"):
        learner.fit(TensorDataset(torch.zeros(0, 6), torch.zeros(0, dtype=torch.int64)))
    with pytest.raises(
        ValueError, match=r"labels range over \[2, 9\], but the model has 4 outputs"
    ):
        learner.fit(TensorDataset(torch.randn(8, 6), torch.arange(8) + 2))
    assert_same_tensors(before, parameters_of(model))  # shrink-and-perturb never ran
    flat = torch.nn.Sequential(torch.nn.Flatten(), _model())
    learner = DarkExperienceReplayLearner(
        model=flat,
        memory_size=16,
        memory_batch_size=4,
        batch_size=4,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    learner.fit(_data(n=16))  # the buffer now stores inputs of shape (6,)
    before = parameters_of(flat)
    sampling = learner.buffer.state_dict()["sample_generator_state"]
    with pytest.raises(ValueError, match=r"inputs.*\(6,\).*\(3, 2\)"):
        learner.fit(TensorDataset(torch.randn(8, 3, 2), torch.randint(0, 4, (8,))))
    assert_same_tensors(before, parameters_of(flat))
    # The refused step had drawn a memory batch: the sampling generator is put back.
    assert torch.equal(learner.buffer.state_dict()["sample_generator_state"], sampling)
    with pytest.raises(ValueError, match="memory_batch_size=32 is larger than memory_size=10"):
        ExperienceReplayLearner(model=_model(), memory_size=10)


# -- one forward pass over new and memory batches --------------------------------------------------


def _forward_sizes(model):
    sizes = []
    model.register_forward_pre_hook(lambda module, args: sizes.append(len(args[0])))
    return sizes


@pytest.mark.parametrize(
    ("make_model", "feature_modules", "expected"),
    [
        (lambda: _model(), (), [16]),  # no batch-norm, no features: one pass of 8 + 8
        (
            lambda: torch.nn.Sequential(
                torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)
            ),
            (),
            [8, 8],
        ),
        (lambda: _model(), ("1",), [8, 8]),
    ],
    ids=["plain", "batch-norm", "features"],
)
def test_auto_concatenates_unless_batch_norm_or_features(make_model, feature_modules, expected):
    model = make_model()
    sizes = _forward_sizes(model)
    learner = DarkExperienceReplayLearner(
        model=model,
        memory_size=32,
        memory_batch_size=8,
        batch_size=8,
        feature_modules=feature_modules,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    learner.fit(_data(n=32))
    # The label check (1), the first step without memory (8), then three replaying steps.
    assert sizes == [1, 8] + expected * 3


def _record_losses(trainer):
    losses = []
    trainer.connect("batch_end", lambda loss: losses.append(loss.item()))
    return losses


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_concatenated_and_separate_passes_train_the_same_model(gamma):
    """For a model whose samples do not interact, one pass over [new; memory] gives the losses,
    gradients and stored logits of two passes (up to floating-point rounding)."""
    results = {}
    for mode in ("separate", "concatenated"):
        learner = DarkExperienceReplayLearner(
            model=_model(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            memory_size=24,
            memory_batch_size=8,
            batch_size=8,
            ema_memory_update_gamma=gamma,
            trainer=Trainer(max_epochs=2, device="cpu"),
            memory_forward=mode,
        )
        losses = _record_losses(learner.trainer)
        learner.fit(_data(n=48))
        learner.fit(_data(n=48, seed=1))
        stored = learner.buffer.sample(24)[1]["logits"]
        results[mode] = (losses, parameters_of(learner.model), stored)
    (losses_a, params_a, stored_a), (losses_b, params_b, stored_b) = results.values()
    assert len(losses_a) == len(losses_b) == 24
    assert losses_b == pytest.approx(losses_a, rel=1e-5, abs=1e-6)
    for name in params_a:
        torch.testing.assert_close(params_b[name], params_a[name], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stored_b, stored_a, rtol=1e-4, atol=1e-5)


def test_a_feature_without_the_batch_first_is_refused_before_training():
    class Transpose(torch.nn.Module):
        def forward(self, x):
            return x.t()

    class BatchSecondInside(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.flip = torch.nn.Linear(6, 4), Transpose()

        def forward(self, x):
            return self.flip(self.body(x)).t()  # "flip" outputs (features, batch)

    learner = ExperienceReplayLearner(
        model=BatchSecondInside(),
        memory_size=16,
        memory_batch_size=4,
        batch_size=8,
        feature_modules=["flip"],
        trainer=Trainer(max_epochs=1, device="cpu"),
        memory_forward="concatenated",
    )
    before = parameters_of(learner.model)
    # The buffer refuses the feature on the first batch, before anything trains or concatenates.
    with pytest.raises(ValueError, match=r"intermediate_representation_0.*batch size 8"):
        learner.fit(_data(n=32))
    assert_same_tensors(parameters_of(learner.model), before)


def test_memory_forward_is_validated():
    with pytest.raises(ValueError, match="memory_forward"):
        ExperienceReplayLearner(model=_model(), trainer=Trainer(device="cpu"), memory_forward="x")


# -- ExperienceReplayLearner's loss as one cross-entropy --------------------------------------


def _count_component_losses(monkeypatch):
    calls = []
    loss = WeightedCustomLossComponent.loss

    def counting(self, *args):
        calls.append(1)
        return loss(self, *args)

    monkeypatch.setattr(WeightedCustomLossComponent, "loss", counting)
    return calls


@pytest.mark.parametrize(
    ("options", "soft"),
    [
        ({}, False),  # Renate's defaults: equal weights, equal batches, one mean
        ({"alpha": 0.3, "loss_weight": 2.0}, False),
        ({"memory_batch_size": 4}, False),
        ({"batch_size": 10, "batch_memory_frac": 0.3}, False),
        ({"alpha": 0.5, "loss_normalization": False}, False),
        ({"loss_weight": 0.0}, False),
        ({"ema_memory_update_gamma": 0.5}, False),
        ({"alpha": 2.0}, True),  # probability targets
    ],
    ids=[
        "defaults",
        "weights",
        "memory-batch",
        "frac",
        "no-normalization",
        "new-0",
        "ema",
        "soft",
    ],
)
def test_er_cross_entropy_over_both_batches_matches_the_components_loss(monkeypatch, options, soft):
    """With one pass over [new; memory], ExperienceReplayLearner computes its loss as one
    (weighted) cross-entropy; losses, parameters and stored logits are those of the component
    path up to rounding, and the component's loss() is not called."""
    calls = _count_component_losses(monkeypatch)
    results, counted = {}, {}
    for mode in ("separate", "concatenated"):
        calls.clear()
        learner = ExperienceReplayLearner(
            model=_model(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            **{"memory_size": 24, "memory_batch_size": 8, "batch_size": 8, **options},
            trainer=Trainer(max_epochs=2, device="cpu"),
            memory_forward=mode,
        )
        losses = _record_losses(learner.trainer)
        for seed in (0, 1):
            data = _data(n=48, seed=seed)
            if soft:
                targets = torch.softmax(torch.randn(48, 4, generator=torch.Generator()), -1)
                data = TensorDataset(data.tensors[0], targets)
            learner.fit(data)
        stored = learner.buffer.sample(24)[1]["logits"]
        results[mode] = (losses, parameters_of(learner.model), stored)
        counted[mode] = len(calls)
    (losses_a, params_a, stored_a), (losses_b, params_b, stored_b) = results.values()
    assert counted["separate"] > 0 and counted["concatenated"] == 0
    assert len(losses_a) == len(losses_b) > 0
    assert losses_b == pytest.approx(losses_a, rel=1e-5, abs=1e-6)
    for name in params_a:
        torch.testing.assert_close(params_b[name], params_a[name], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stored_b, stored_a, rtol=1e-4, atol=1e-5)


@attrs.define(eq=False)
class HalvedLoss(WeightedCustomLossComponent):
    def _component_loss(self, outputs_memory, batch_memory, intermediate_representation_memory):
        return super()._component_loss(outputs_memory, batch_memory, None) / 2


@pytest.mark.parametrize(
    "options",
    [
        {"components": {"memory_loss": HalvedLoss(torch.nn.functional.cross_entropy)}},
        {"loss_fn": lambda outputs, targets: torch.nn.functional.cross_entropy(outputs, targets)},
        {"mask_unused_classes": True},
        {"memory_forward": "separate"},
        {"alpha": 0.0},  # the component returns a zero without computing a cross-entropy
        {"memory_forward": "concatenated", "feature_modules": ["1"]},
    ],
    ids=["component-subclass", "other-loss-fn", "masked", "separate", "alpha-0", "features"],
)
def test_the_component_computes_the_loss_unless_it_is_plain_cross_entropy(monkeypatch, options):
    calls = _count_component_losses(monkeypatch)
    learner = ExperienceReplayLearner(
        model=_model(),
        **{"memory_size": 16, "memory_batch_size": 4, "batch_size": 8, **options},
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    learner.fit(_data(n=32))
    assert len(calls) == 3  # every step once the buffer holds a memory batch
    (_, _), metadata = learner.buffer.sample(4)
    recorded = [f"intermediate_representation_{i}" for i in range(len(learner.feature_modules))]
    assert sorted(metadata) == sorted(["idx", "logits", *recorded])


class PerPosition(torch.nn.Module):
    """Logits per position: inputs (N, L, 6) -> outputs (N, 4, L), as cross_entropy takes them."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 4)

    def forward(self, x):
        return self.linear(x).transpose(1, 2)


@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_outputs_with_more_dimensions_keep_the_components_loss(monkeypatch, alpha):
    """(N, C, L) outputs: cross_entropy also averages over positions, which per-sample weights
    would not; such steps go through the component (the losses of two passes)."""
    calls = _count_component_losses(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 5, 6, generator=generator), torch.randint(0, 4, (32, 5)))
    losses = {}
    for mode in ("separate", "concatenated"):
        torch.manual_seed(0)
        learner = ExperienceReplayLearner(
            model=PerPosition(),
            alpha=alpha,
            memory_size=16,
            memory_batch_size=4,
            batch_size=8,
            trainer=Trainer(max_epochs=1, device="cpu"),
            memory_forward=mode,
        )
        losses[mode] = _record_losses(learner.trainer)
        learner.fit(data)
    assert len(calls) == 6
    assert losses["concatenated"] == pytest.approx(losses["separate"], rel=1e-5, abs=1e-6)


# -- components given to a preset ------------------------------------------------------------------


def test_components_given_to_a_preset_run_after_its_own():
    extra = WeightedMeanSquaredErrorLossComponent(weight=0.5)
    learner = ExperienceReplayLearner(
        model=_model(),
        alpha=0.7,
        components={"mse": extra},
        memory_size=16,
        memory_batch_size=4,
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    assert list(learner.components) == ["memory_loss", "mse"]
    assert learner.components["memory_loss"].weight == 0.7 and learner.components["mse"] is extra
    assert [key for key, _ in learner.trainer.listeners] == ["learner", "memory_loss", "mse"]
    listed = DarkExperienceReplayLearner(
        model=_model(), components=[extra], trainer=Trainer(device="cpu")
    )
    assert list(listed.components) == [
        "memory_loss",
        "mse_loss",
        "weighted_mean_squared_error_loss_component_0",
    ]


def test_a_component_under_a_preset_name_takes_its_place(monkeypatch):
    calls = _count_component_losses(monkeypatch)
    mine = HalvedLoss(torch.nn.functional.cross_entropy)
    learner = DarkExperienceReplayLearner(
        model=_model(),
        components={"memory_loss": mine},
        memory_size=16,
        memory_batch_size=4,
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    assert list(learner.components) == ["memory_loss", "mse_loss"]
    assert learner.components["memory_loss"] is mine
    learner.fit(_data(n=32))
    assert len(calls) == 3  # the replacement replays on every step that has a memory batch


# -- Renate's metadata key -------------------------------------------------------------------------


@attrs.define(eq=False)
class RenateStyleMSE(Component):
    """Reads the stored logits as Renate's components do: ``batch_memory[1]["outputs"]``."""

    aliased: list = attrs.field(factory=list)

    def loss(self, outputs_memory, batch_memory, intermediate_representation_memory):
        _, meta_data = batch_memory
        self.aliased.append(meta_data["outputs"] is meta_data["logits"])
        return self.weight * torch.nn.functional.mse_loss(outputs_memory, meta_data["outputs"])


@pytest.mark.parametrize("mode", ["separate", "concatenated"])
def test_memory_batches_offer_the_stored_logits_under_renates_key(mode):
    renate = RenateStyleMSE(weight=1.0, sample_new_memory_batch=True)
    learner = BaseExperienceReplayLearner(
        model=_model(),
        components={"renate_mse": renate, "mse": WeightedMeanSquaredErrorLossComponent()},
        memory_size=16,
        memory_batch_size=4,
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
        memory_forward=mode,
    )
    learner.fit(_data(n=32))
    assert renate.aliased == [True] * 3  # the same tensor: nothing stored or copied twice
    assert learner.buffer.metadata_keys == ("logits",)


# -- a failed update leaves no trace ---------------------------------------------------------------


def _nan_data(n=16):
    return TensorDataset(torch.full((n, 6), float("nan")), torch.zeros(n, dtype=torch.int64))


def _replayer(cls, **options):
    return cls(
        model=_model(),
        memory_size=24,
        memory_batch_size=8,
        batch_size=8,
        seed=3,
        trainer=Trainer(max_epochs=1, device="cpu"),
        **options,
    )


@pytest.mark.all_or_nothing
@pytest.mark.parametrize(
    ("cls", "options"),
    [
        (ExperienceReplayLearner, {}),  # one pass, one cross-entropy
        (DarkExperienceReplayLearner, {"ema_memory_update_gamma": 0.5}),  # stored logits change
        (DarkExperienceReplayLearner, {"memory_forward": "separate", "mask_unused_classes": True}),
    ],
    ids=["er", "der-ema", "der-separate-masked"],
)
def test_an_update_failing_at_its_first_batch_leaves_no_trace(tmp_path, cls, options):
    from trainer import NonFiniteLossError

    def run(with_failure):
        learner = _replayer(cls, **options)
        learner.fit(_data(n=32, seed=1))
        if with_failure:
            with pytest.raises(NonFiniteLossError, match="step 0"):
                learner.fit(_nan_data())
        learner.fit(_data(n=32, seed=2))
        return _final_state(learner, tmp_path / f"{with_failure}.safetensors")

    assert_same_tree(run(True), run(False))


def test_a_joint_update_failing_at_its_first_batch_takes_its_data_back():
    from trainer import NonFiniteLossError

    learner = JointLearner(
        model=_model(), batch_size=8, reset_model=False, trainer=Trainer(max_epochs=1)
    )
    learner.fit(_data(n=16))
    before = learner.buffer.state_dict()
    with pytest.raises(NonFiniteLossError):
        learner.fit(_nan_data())
    assert_same_tree(learner.buffer.state_dict(), before)
    assert learner.fit(_data(n=16, seed=1)).steps == 4  # 32 samples: the NaN ones are gone
