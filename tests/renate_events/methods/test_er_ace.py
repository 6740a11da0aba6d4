"""ER-ACE (Caccia et al., ICLR 2022): the update against a bare hand-written ER-ACE step, the mask
of the classes of the incoming batch alone, and the method's registration."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from renate_events.hyperparameters import hyperparameters
from renate_events.memory import ReservoirBuffer
from renate_events.methods import LEARNERS, AsymmetricCrossEntropyExperienceReplayLearner, method
from renate_events.updater import ModelUpdater
from tests.helpers import (
    assert_next_update_steps_do_not_sync,
    labelled,
    make_model,
    parameters_of,
)
from trainer import Trainer

CLASSES = 5


def _model(seed: int = 0) -> torch.nn.Module:
    return make_model(classes=CLASSES, seed=seed)


def _learner(model: torch.nn.Module, **options) -> AsymmetricCrossEntropyExperienceReplayLearner:
    settings = {"memory_size": 16, "memory_batch_size": 8, "batch_size": 8, **options}
    return AsymmetricCrossEntropyExperienceReplayLearner(
        model=model,
        optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1),
        trainer=Trainer(max_epochs=1, device="cpu"),
        **settings,
    )


def _next_memory_batch(learner):
    """The memory batch the learner's next draw gives (its sampling generator left as it was)."""
    state = learner.buffer.sampling_state()
    (inputs, targets), _ = learner.buffer.sample(learner.memory_batch_size)
    learner.buffer.set_sampling_state(state)
    return inputs, targets


def _ace_loss(model, inputs, targets, inputs_memory, targets_memory, alpha=1.0, mask=True):
    """ER-ACE's loss, written out: the new batch's cross-entropy over its own classes, the memory
    batch's over all classes, averaged with the weights 1 and alpha (loss_normalization)."""
    logits = model(inputs)
    if mask:
        present = torch.zeros(CLASSES, dtype=torch.bool)
        present[targets.unique()] = True
        logits = logits.masked_fill(~present, float("-inf"))
    new = F.cross_entropy(logits, targets)
    memory = F.cross_entropy(model(inputs_memory), targets_memory)
    return (new + alpha * memory) / (1 + alpha)


def _sgd_step(model, batch, memory, alpha, mask):
    """One SGD step (learning rate 0.1) of ER-ACE's loss on a copy of ``model``: the loss and
    the copy's parameters after the step."""
    model = copy.deepcopy(model)
    loss = _ace_loss(model, *batch, *memory, alpha=alpha, mask=mask)
    loss.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= 0.1 * parameter.grad
    return loss.item(), parameters_of(model)


@pytest.mark.parametrize("options", [{}, {"alpha": 0.5, "memory_forward": "separate"}])
def test_an_update_is_a_bare_hand_written_er_ace_step(options):
    model = _model()
    learner = _learner(model, **options)
    learner.fit(labelled([0, 1] * 8, seed=0))  # the first update fills the memory with 0s and 1s
    start = copy.deepcopy(model)
    second = labelled([2, 3, 3, 2, 3, 2, 2, 3], seed=1)  # one batch of two new classes
    memory = _next_memory_batch(learner)
    losses = []
    learner.trainer.connect("batch_end", lambda loss: losses.append(loss.detach().item()))
    learner.fit(second)
    # The same step by hand: same model, same memory batch, SGD at 0.1; and, to show that the
    # comparison sees the mask, the step without it (plain ER).
    alpha = options.get("alpha", 1.0)
    loss, expected = _sgd_step(start, second.tensors, memory, alpha, mask=True)
    unmasked_loss, unmasked = _sgd_step(start, second.tensors, memory, alpha, mask=False)
    assert losses == pytest.approx([loss], rel=1e-5)
    assert unmasked_loss != pytest.approx(loss, rel=1e-3)
    trained = parameters_of(model)
    for name, value in trained.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
    assert any(
        not torch.allclose(value, unmasked[name], rtol=1e-5, atol=1e-6)
        for name, value in trained.items()
    )


def test_the_mask_is_the_classes_of_the_incoming_batch_alone():
    """Not every class of the update so far (the base learner's mask_unused_classes), not all
    classes (ER): the second batch's loss keeps the logits of its own classes 3 and 4 only."""
    model = _model()
    learner = _learner(model)
    learner.fit(labelled([0, 1] * 8, seed=0))
    learner.on_train_start()  # the next update starts (the trainer calls this at train_start)
    first, second = labelled([2, 3] * 4, seed=1), labelled([3, 4] * 4, seed=2)
    learner.training_step(first.tensors)
    memory = _next_memory_batch(learner)
    loss = learner.training_step(second.tensors)["loss"].detach()
    with torch.no_grad():
        by_hand = _ace_loss(model, *second.tensors, *memory)
        plain_er = _ace_loss(model, *second.tensors, *memory, mask=False)
    torch.testing.assert_close(loss, by_hand)
    assert abs(float(loss) - float(plain_er)) > 0.1


def test_the_memory_keeps_the_unmasked_logits():
    model = _model()
    learner = _learner(model, memory_size=8)
    data = labelled([2, 3] * 4, seed=3)
    learner.fit(data)
    _, metadata = learner.buffer.sample(8)
    stored = metadata["logits"]
    assert torch.isfinite(stored).all()  # the masked logits were -inf in the loss only
    assert stored.shape == (8, CLASSES)


def test_targets_that_are_not_class_labels_are_refused_before_training():
    model = _model()
    learner = _learner(model)
    before = parameters_of(model)
    soft = torch.softmax(torch.randn(8, CLASSES), dim=-1)
    with pytest.raises(ValueError, match=r"must be class labels.*mask_unused_classes=False"):
        learner.fit(TensorDataset(torch.randn(8, 6), soft))
    for name, value in parameters_of(model).items():
        assert torch.equal(value, before[name])
    _learner(_model(), mask_unused_classes=False).fit(TensorDataset(torch.randn(8, 6), soft))


def test_er_ace_is_registered_and_reaches_the_updater_and_the_schema(tmp_path):
    spec = method("er-ace")
    assert LEARNERS["er-ace"] is AsymmetricCrossEntropyExperienceReplayLearner is spec.learner
    assert spec.uses_memory and spec.default_buffer == "reservoir"
    assert "Caccia" in spec.summary and "ICLR 2022" in spec.summary
    schema = hyperparameters("er-ace")
    assert schema["mask_unused_classes"].default is True and schema["alpha"].default == 1.0
    updater = ModelUpdater(
        model=_model(),
        learner="er-ace",
        learner_kwargs={"memory_size": 16, "memory_batch_size": 8, "batch_size": 8},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        output_state_folder=str(tmp_path / "state"),
    )
    updater.update(labelled([0, 1] * 8, seed=0))
    assert isinstance(updater.learner_instance, AsymmetricCrossEntropyExperienceReplayLearner)
    assert len(updater.learner_instance.buffer) == 16


@pytest.mark.gpu
def test_the_step_makes_no_host_sync_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    learner = AsymmetricCrossEntropyExperienceReplayLearner(
        model=_model().cuda(),
        buffer=ReservoirBuffer(64, seed=0, device="cuda"),
        memory_size=64,
        memory_batch_size=16,
        batch_size=16,
        trainer=Trainer(max_epochs=1, device="cuda", nonfinite_loss="off"),
    )
    first, batch = labelled([0, 1] * 32, seed=0), labelled([2, 3] * 8, seed=1).tensors
    assert_next_update_steps_do_not_sync(learner, first, batch)
