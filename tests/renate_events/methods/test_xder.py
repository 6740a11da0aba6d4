"""X-DER (Boschini et al., TPAMI 2022): a step against a bare hand-written X-DER step, the
future-past update of stored logits (at each step and at the end of an update), the logit
transplant against the reference code's, and the method's registration."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from renate_events.hyperparameters import hyperparameters
from renate_events.memory import GreedyClassBalancingBuffer, ReservoirBuffer
from renate_events.methods import LEARNERS, ExtendedDarkExperienceReplayLearner, method
from renate_events.methods.xder import transplant_logits
from renate_events.updater import ModelUpdater
from tests.helpers import (
    SaveThenCrash,
    assert_next_update_steps_do_not_sync,
    assert_same_tree,
    labelled,
    make_model,
    model_and_listeners,
    parameters_of,
)
from trainer import Trainer, read_checkpoint
from trainer.exceptions import ListenerError

CLASSES = 6


def _model(seed: int = 0) -> torch.nn.Module:
    return make_model(classes=CLASSES, seed=seed)


def _learner(model: torch.nn.Module, **options) -> ExtendedDarkExperienceReplayLearner:
    settings = {
        "memory_size": 12,
        "memory_batch_size": 4,
        "batch_size": 8,
        "trainer": Trainer(max_epochs=1, device="cpu"),
        **options,
    }
    return ExtendedDarkExperienceReplayLearner(
        model=model, optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1), **settings
    )


def _next_memory_batches(learner):
    """The two memory batches the learner's next step draws (its generator left as it was)."""
    state = learner.buffer.sampling_state()
    batches = [learner.buffer.sample(learner.memory_batch_size) for _ in range(2)]
    learner.buffer.set_sampling_state(state)
    return batches


def _mammoth_update_logits(old, new, gt, start, end, gamma):
    """The reference code's ``update_logits`` (Mammoth, models/xder.py), on the columns
    ``start:end``, written out with its in-place row scaling."""
    old, new = old.clone(), new.clone()
    transplant = new[:, start:end]
    gt_values = old[torch.arange(len(gt)), gt]
    max_values = transplant.max(1).values
    coeff = (gamma * gt_values / max_values).unsqueeze(1).repeat(1, end - start)
    mask = (max_values > gt_values).unsqueeze(1).repeat(1, end - start)
    transplant[mask] *= coeff[mask]
    old[:, start:end] = transplant
    return old


def _mammoth_past_constraint(outputs, past_end, present_end, eta, margin):
    """The reference code's past logits constraint (Mammoth, models/xder.py) with past classes
    ``0:past_end`` and present ones ``past_end:present_end``, written out."""
    chead = F.softmax(outputs[:, :present_end], 1)
    good_head, bad_head = chead[:, past_end:present_end], chead[:, :past_end]
    loss_constr = bad_head.max(1)[0].detach() + margin - good_head.max(1)[0]
    mask = loss_constr > 0
    return eta * loss_constr[mask].mean() if mask.any() else torch.tensor(0.0)


def _xder_loss(model, batch, memory, alpha=1.0, beta=1.0, eta=0.1, margin=0.3, past_term=True):
    """X-DER's loss after a first update of classes 0 and 1, written out: the new batch's
    cross-entropy over its own classes, alpha * MSE of the first memory batch's logits, beta *
    the second memory batch's cross-entropy over the past classes 0 and 1, eta * the mean
    positive margin of the future classes' largest logit over the own classes' largest, and
    (``past_term``, the batch showing both 2 and 3) the reference's past constraint."""
    (inputs, targets), ((inputs_1, _), meta_1), ((inputs_2, targets_2), _) = batch, *memory
    present = torch.zeros(CLASSES, dtype=torch.bool)
    present[targets.unique()] = True
    past = torch.zeros(CLASSES, dtype=torch.bool)
    past[:2] = True
    future = ~(past | present)
    outputs, outputs_1, outputs_2 = model(inputs), model(inputs_1), model(inputs_2)
    stream = F.cross_entropy(outputs.masked_fill(~present, float("-inf")), targets)
    der = alpha * F.mse_loss(outputs_1, meta_1["logits"])
    derpp = beta * F.cross_entropy(outputs_2.masked_fill(~past, float("-inf")), targets_2)
    margins = torch.cat(
        [
            outputs[:, future].max(1).values + margin - outputs[:, present].max(1).values,
            outputs_1[:, future].max(1).values + margin - outputs_1[:, past].max(1).values,
            outputs_2[:, future].max(1).values + margin - outputs_2[:, past].max(1).values,
        ]
    )
    constraint = eta * margins[margins > 0].mean() if (margins > 0).any() else 0.0
    past_constraint = _mammoth_past_constraint(outputs, 2, 4, eta, margin) if past_term else 0.0
    return stream + der + derpp + constraint + past_constraint


def _first_update(**options):
    model = _model()
    learner = _learner(model, **options)
    learner.fit(labelled([0, 1] * 8, seed=0))  # the end fill: 6 samples of each of 0 and 1
    return model, learner


@pytest.mark.parametrize("options", [{}, {"alpha": 0.3, "beta": 0.8, "constraint_margin": 1.0}])
def test_an_update_is_a_bare_hand_written_xder_step(options):
    model, learner = _first_update(**options)
    start = copy.deepcopy(model)
    second = labelled([2, 3, 3, 2, 3, 2, 2, 3], seed=1)  # one batch of two new classes
    memory = _next_memory_batches(learner)
    losses = []
    learner.trainer.connect("batch_end", lambda loss: losses.append(loss.detach().item()))
    learner.fit(second)
    names = {"alpha": "alpha", "beta": "beta", "constraint_margin": "margin"}
    weights = {names[k]: v for k, v in options.items()}
    by_hand = copy.deepcopy(start)
    loss = _xder_loss(by_hand, second.tensors, memory, **weights)
    loss.backward()
    with torch.no_grad():
        for parameter in by_hand.parameters():
            parameter -= 0.1 * parameter.grad
    assert losses == pytest.approx([loss.item()], rel=1e-5)
    expected = parameters_of(by_hand)
    for name, value in parameters_of(model).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("past_constraint", [True, False])
def test_the_past_constraint_is_the_reference_term(past_constraint):
    """X-DER's loss with and without the past constraint differs by the reference code's term
    (a margin of softmax probabilities over the past and present classes, the past side
    detached), here large enough to be positive for every sample (margin 1.0)."""
    options = {"constraint_margin": 1.0, "past_constraint": past_constraint}
    model, learner = _first_update(**options)
    start = copy.deepcopy(model)
    second = labelled([2, 3, 3, 2, 3, 2, 2, 3], seed=1)
    memory = _next_memory_batches(learner)
    losses = []
    learner.trainer.connect("batch_end", lambda loss: losses.append(loss.detach().item()))
    learner.fit(second)
    by_hand = copy.deepcopy(start)
    loss = _xder_loss(by_hand, second.tensors, memory, margin=1.0, past_term=past_constraint)
    loss.backward()
    with torch.no_grad():
        for parameter in by_hand.parameters():
            parameter -= 0.1 * parameter.grad
    assert losses == pytest.approx([loss.item()], rel=1e-5)
    expected = parameters_of(by_hand)
    for name, value in parameters_of(model).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        term = _mammoth_past_constraint(start(second.tensors[0]), 2, 4, 0.1, 1.0)
    assert term.item() > 0.05  # the term is there to be missed


def test_the_past_constraint_needs_past_classes():
    """In the first update (no past class) the past constraint adds nothing."""
    losses = {True: [], False: []}
    for past_constraint, found in losses.items():
        learner = _learner(_model(), past_constraint=past_constraint)
        learner.trainer.connect("batch_end", _recorder(found))
        learner.fit(labelled([0, 1] * 4, seed=0))
    assert losses[True] == losses[False] and len(losses[True]) == 1


def test_without_present_classes_the_past_constraint_adds_nothing():
    """With mask_unused_classes=False the step notes no present class: the past constraint
    adds nothing (and no NaN) in the second update."""
    losses = {True: [], False: []}
    for past_constraint, found in losses.items():
        _, learner = _first_update(mask_unused_classes=False, past_constraint=past_constraint)
        learner.trainer.connect("batch_end", _recorder(found))
        learner.fit(labelled([2, 3] * 4, seed=1))
    assert losses[True] == losses[False] and torch.isfinite(torch.tensor(losses[True])).all()


def _recorder(found):
    """A batch_end listener appending each step's loss to ``found``."""
    return lambda loss: found.append(loss.item())


def test_a_step_updates_the_stored_future_logits_of_the_replayed_samples():
    """At its first replay in an update a sample's logits of the present and future classes
    (2..5) are those of the current model, scaled below its label's stored logit; its past
    logits (0, 1) and every sample not replayed stay as they were."""
    model, learner = _first_update()
    before = learner.buffer.get_metadata("logits", torch.arange(12))
    learner.on_train_start()  # the next update starts (the trainer calls this at train_start)
    memory = _next_memory_batches(learner)
    with torch.no_grad():
        current = [model(inputs) for (inputs, _), _ in memory]
    learner.training_step(labelled([2, 3] * 4, seed=1).tensors)
    after = learner.buffer.get_metadata("logits", torch.arange(12))
    expected = before.clone()
    for ((_, targets), meta), outputs in zip(memory, current):
        idx = meta["idx"]
        expected[idx] = _mammoth_update_logits(expected[idx], outputs, targets, 2, CLASSES, 0.85)
    torch.testing.assert_close(after, expected)
    replayed = torch.cat([meta["idx"] for _, meta in memory]).unique()
    assert not torch.allclose(after[replayed][:, 2:], before[replayed][:, 2:])
    torch.testing.assert_close(after[:, :2], before[:, :2])


def test_the_end_of_an_update_updates_every_stored_sample():
    """After the second update every sample of 0 and 1 holds the final model's logits of 2..5
    (transplanted), every new sample of 2 and 3 its past logits scaled below its label's."""
    model, learner = _first_update(logit_update_gamma=0.2)
    learner.fit(labelled([2, 3] * 8, seed=1))
    slots = torch.arange(len(learner.buffer))
    inputs, targets = learner.buffer.dataset().__getitems__(slots.tolist())
    stored = learner.buffer.get_metadata("logits", slots)
    with torch.no_grad():
        current = model(inputs)
    old = targets < 2
    torch.testing.assert_close(
        stored[old],
        _mammoth_update_logits(stored[old], current[old], targets[old], 2, CLASSES, 0.2),
    )
    assert not torch.allclose(stored[old][:, 2:], current[old][:, 2:])  # scaled: gamma 0.2
    new = ~old  # filled with the final model's logits, then their past logits scaled
    torch.testing.assert_close(
        stored[new],
        _mammoth_update_logits(current[new], current[new], targets[new], 0, 2, 0.2),
    )
    torch.testing.assert_close(stored[new][:, 2:], current[new][:, 2:])
    assert not torch.allclose(stored[new][:, :2], current[new][:, :2])


def test_transplant_logits_is_the_reference_update_logits():
    generator = torch.Generator().manual_seed(0)
    old, new = torch.randn(32, 10, generator=generator), torch.randn(32, 10, generator=generator)
    targets = torch.randint(0, 4, (32,), generator=generator)
    block = torch.zeros(10, dtype=torch.bool)
    block[4:] = True
    torch.testing.assert_close(
        transplant_logits(old, new, targets, block, 0.85),
        _mammoth_update_logits(old, new, targets, 4, 10, 0.85),
    )
    empty = torch.zeros(10, dtype=torch.bool)
    torch.testing.assert_close(transplant_logits(old, new, targets, empty, 0.85), old)


@pytest.mark.parametrize("reservoir", [False, True])
def test_the_past_classes_are_those_in_the_buffer_when_an_update_starts(reservoir):
    _, learner = _first_update(buffer=ReservoirBuffer(12, seed=0) if reservoir else None)
    learner.on_train_start()
    assert learner.past_cross_entropy(torch.zeros(1, CLASSES), torch.tensor([0])) == pytest.approx(
        torch.log(torch.tensor(2.0)).item()
    )  # two past classes, 0 and 1


def test_buffer_filling_at_each_step_is_refused():
    with pytest.raises(ValueError, match="buffer_filling"):
        _learner(_model(), buffer_filling="step")


def test_a_failed_update_leaves_the_buffer_and_the_model_as_they_were():
    model, learner = _first_update()
    state = learner.buffer.state_dict()
    before = parameters_of(model)
    calls = []

    def fail_on_second(loss):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")

    learner.trainer.connect("batch_end", fail_on_second)
    with pytest.raises(ListenerError, match="boom"):
        learner.fit(labelled([2, 3] * 8, seed=1))
    for key, value in learner.buffer.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, state[key]), key
    for name, value in parameters_of(model).items():
        assert torch.equal(value, before[name])


def test_xder_is_registered_and_reaches_the_updater_and_the_schema(tmp_path):
    spec = method("xder")
    assert LEARNERS["xder"] is ExtendedDarkExperienceReplayLearner is spec.learner
    assert spec.uses_memory and spec.default_buffer == "greedy-class-balancing"
    assert "Boschini" in spec.summary and "TPAMI 2022" in spec.summary
    schema = hyperparameters("xder")
    assert schema["alpha"].default == 1.0 and schema["logit_update_gamma"].default == 0.85
    assert schema["past_constraint"].default is True
    assert schema["buffer_filling"].default == "end"
    assert schema["loss_normalization"].default is False
    updater = ModelUpdater(
        model=_model(),
        learner="xder",
        learner_kwargs={"memory_size": 12, "memory_batch_size": 4, "batch_size": 8},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        output_state_folder=str(tmp_path / "state"),
    )
    updater.update(labelled([0, 1] * 8, seed=0))
    learner = updater.learner_instance
    assert isinstance(learner, ExtendedDarkExperienceReplayLearner)
    assert isinstance(learner.buffer, GreedyClassBalancingBuffer)
    assert learner.buffer.class_counts() == {0: 6, 1: 6}
    # The next update from the state folder: the past classes come from the loaded buffer.
    following = ModelUpdater(
        model=_model(),
        learner="xder",
        learner_kwargs={"memory_size": 12, "memory_batch_size": 4, "batch_size": 8},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        input_state_folder=str(tmp_path / "state"),
        output_state_folder=str(tmp_path / "next"),
    )
    following.update(labelled([2, 3] * 8, seed=1))
    learner = following.learner_instance
    assert learner.buffer.class_counts() == {0: 3, 1: 3, 2: 3, 3: 3}
    assert learner._past is not None and learner._past.tolist()[:4] == [True, True, False, False]


@pytest.mark.gpu
def test_the_step_makes_no_host_sync_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    learner = ExtendedDarkExperienceReplayLearner(
        model=_model().cuda(),
        buffer=GreedyClassBalancingBuffer(64, seed=0, device="cuda"),
        memory_size=64,
        memory_batch_size=16,
        batch_size=16,
        trainer=Trainer(max_epochs=1, device="cuda", nonfinite_loss="off"),
    )
    first, batch = labelled([0, 1] * 32, seed=0), labelled([2, 3] * 8, seed=1).tensors
    assert_next_update_steps_do_not_sync(learner, first, batch)


def test_a_resumed_update_ends_as_the_uninterrupted_one(tmp_path):
    """The replay counts and the past classes survive a checkpoint in the middle of an update:
    a fresh learner resumed from it ends with the same model and the same stored logits."""
    first, second = labelled([0, 1] * 8, seed=0), labelled([2, 3] * 12, seed=1)

    def learner(trainer=None):
        return _learner(_model(), trainer=trainer or Trainer(max_epochs=2, device="cpu"))

    reference = learner()
    reference.fit(first)
    reference.fit(second)
    expected = model_and_listeners(reference, tmp_path / "reference.safetensors")

    trainer = Trainer(max_epochs=2, device="cpu")
    crash = SaveThenCrash(tmp_path / "mid.safetensors", step=4)  # in epoch 2 of update 2
    trainer.subscribe(crash, name="crash")
    interrupted = learner(trainer)
    interrupted.fit(first)
    crash.armed = True
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(second)
    assert "replay_counts" in read_checkpoint(tmp_path / "mid.safetensors")["listeners"]["learner"]

    resumed = learner()
    resumed.fit(second, resume_from=tmp_path / "mid.safetensors")
    assert_same_tree(expected, model_and_listeners(resumed, tmp_path / "resumed.safetensors"))


@pytest.mark.hostile
def test_replay_counts_of_the_wrong_kind_are_refused_on_load(tmp_path):
    trainer = Trainer(max_epochs=1, device="cpu")
    crash = SaveThenCrash(tmp_path / "mid.safetensors", step=2)
    trainer.subscribe(crash, name="crash")
    learner = _learner(_model(), trainer=trainer)
    learner.fit(labelled([0, 1] * 8, seed=0))
    crash.armed = True
    with pytest.raises(KeyboardInterrupt):
        learner.fit(labelled([2, 3] * 12, seed=1))
    tree = read_checkpoint(tmp_path / "mid.safetensors")
    counts = tree["listeners"]["learner"]["replay_counts"]
    fresh = _learner(_model())
    for bad in (counts[:2], -counts - 1, counts.double()):
        tree["listeners"]["learner"]["replay_counts"] = bad
        with pytest.raises(ValueError, match="'replay_counts' must be a 1-D float32 tensor"):
            fresh.on_load_checkpoint(tree["listeners"]["learner"])
