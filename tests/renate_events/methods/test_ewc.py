"""Tests for EWC: the empirical Fisher, the penalty, online mode, checkpoints and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from renate_events.methods import LEARNERS, ElasticWeightConsolidationLearner
from renate_events.methods.ewc import ElasticWeightConsolidationComponent, empirical_fisher
from tests.helpers import SCALED_TRANSFORMS, scaled, small_mlp, uint8_task
from trainer import Trainer


def _linear(weight: list[list[float]]) -> torch.nn.Linear:
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight))
    return model


def test_empirical_fisher_is_the_mean_of_squared_batch_gradients_by_hand() -> None:
    model = _linear([[0.0, 0.0], [0.0, 0.0]])
    # Zero weights: softmax (1/2, 1/2); the gradient of CE for one sample x with label y is
    # (p - onehot(y)) x^T, i.e. rows +-1/2 * x.
    batches = [
        (torch.tensor([[1.0, 0.0]]), torch.tensor([0])),  # grad [[-1/2, 0], [1/2, 0]]
        (torch.tensor([[0.0, 2.0]]), torch.tensor([1])),  # grad [[0, 1], [0, -1]]
    ]
    fisher = empirical_fisher(model, batches)
    expected = torch.tensor([[0.25, 1.0], [0.25, 1.0]]) / 2
    torch.testing.assert_close(fisher["weight"], expected)
    assert model.weight.grad is None and model.training


def test_fisher_of_one_batch_squares_the_batch_mean_gradient_not_per_sample() -> None:
    model = _linear([[0.0, 0.0], [0.0, 0.0]])
    batch = (torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 1]))
    # The two per-sample gradients cancel: the batch gradient (and its square) is zero.
    assert empirical_fisher(model, [batch])["weight"].abs().max() == 0


def test_fisher_asked_before_any_data_is_refused() -> None:
    with pytest.raises(ValueError, match="no batch of data"):
        empirical_fisher(_linear([[0.0, 0.0], [0.0, 0.0]]), [])
    with pytest.raises(ValueError, match="no Fisher information yet"):
        ElasticWeightConsolidationComponent().fisher_information()


def test_penalty_by_hand() -> None:
    model = _linear([[0.0, 0.0], [0.0, 0.0]])
    ewc = ElasticWeightConsolidationComponent(ewc_lambda=3.0)
    batch = (torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    ewc.on_train_start(model=model, train_loader=[batch])
    ewc.on_train_end(model=model)  # F = [[1/4, 0], [1/4, 0]], anchor 0
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[2.0, 5.0], [-1.0, 1.0]]))
    # 3/2 * (1/4 * 4 + 1/4 * 1) = 1.875
    assert float(ewc.penalty(model).detach()) == pytest.approx(1.875)
    assert float(ewc.new_data_loss(torch.zeros(1, 2), batch, []).detach()) == pytest.approx(1.875)
    ewc.penalty(model).backward()  # d/dW = lambda * F * (W - W*)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[1.5, 0.0], [-0.75, 0.0]]))


def test_separate_mode_keeps_one_term_per_update_and_online_decays() -> None:
    x1 = (torch.tensor([[1.0, 0.0]]), torch.tensor([0]))  # F1 = [[1/4, 0], [1/4, 0]] at W = 0
    separate = ElasticWeightConsolidationComponent(ewc_lambda=2.0)
    online = ElasticWeightConsolidationComponent(ewc_lambda=2.0, mode="online", decay_factor=0.5)
    penalties = {}
    for ewc in (separate, online):
        model = _linear([[0.0, 0.0], [0.0, 0.0]])
        for _ in range(2):  # the same data and weights twice: F2 = F1
            ewc.on_train_start(model=model, train_loader=[x1])
            ewc.on_train_end(model=model)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
        penalties[ewc.mode] = float(ewc.penalty(model).detach())
    assert len(separate.fisher_information()) == 2
    assert penalties["separate"] == pytest.approx(2 * (0.25 + 0.25))  # lambda/2 * 2 terms * 0.5
    (online_fisher,) = online.fisher_information()
    torch.testing.assert_close(online_fisher["weight"][:, 0], torch.tensor([0.375, 0.375]))
    assert penalties["online"] == pytest.approx(0.375 + 0.375)


def test_online_needs_a_decay_factor_and_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="decay_factor"):
        ElasticWeightConsolidationComponent(mode="online")
    with pytest.raises(ValueError, match="ewc_lambda"):
        ElasticWeightConsolidationComponent(ewc_lambda=-1.0)
    with pytest.raises(ValueError, match="mode"):
        ElasticWeightConsolidationComponent(mode="joint")
    with pytest.raises(ValueError, match="decay_factor"):
        ElasticWeightConsolidationLearner(
            model=torch.nn.Linear(2, 2), ewc_mode="online", trainer=Trainer(max_epochs=1)
        )


def _data(seed: int, classes: tuple[int, int]) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    targets = torch.tensor(classes).repeat(16)
    inputs = torch.randn(32, 4, generator=generator) + targets[:, None].float()
    return TensorDataset(inputs, targets)


def test_learner_adds_the_penalty_from_the_second_update_and_round_trips(tmp_path) -> None:
    assert LEARNERS["ewc"] is ElasticWeightConsolidationLearner
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    learner = ElasticWeightConsolidationLearner(
        model=model, ewc_lambda=10.0, batch_size=8, trainer=Trainer(max_epochs=1, device="cpu")
    )
    ewc = learner.components["ewc"]
    first = _data(0, (0, 1))
    batch = first.tensors
    plain = learner.training_step(batch)["loss"].detach()
    assert float(plain) == pytest.approx(float(F.cross_entropy(model(batch[0]), batch[1]).detach()))
    learner.fit(first)
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    (fisher,) = ewc.fisher_information()
    with torch.no_grad():
        model.weight.add_(0.1)
    step = learner.training_step(batch)["loss"].detach()
    penalty = 5.0 * sum(
        (fisher[n] * (p.detach() - anchor[n]) ** 2).sum() for n, p in model.named_parameters()
    )
    ce = F.cross_entropy(model(batch[0]), batch[1]).detach()
    assert float(step) == pytest.approx(float(ce + penalty), rel=1e-5)
    assert float(penalty) > 0
    path = tmp_path / "ewc.ckpt"
    learner.save_checkpoint(path)
    clone = ElasticWeightConsolidationLearner(
        model=torch.nn.Linear(4, 4), ewc_lambda=10.0, trainer=Trainer(max_epochs=1, device="cpu")
    )
    clone.load_checkpoint(path)
    (restored,) = clone.components["ewc"].fisher_information()
    torch.testing.assert_close(restored["weight"], fisher["weight"])


def test_checkpoint_with_wrong_shapes_is_refused() -> None:
    ewc = ElasticWeightConsolidationComponent()
    model = torch.nn.Linear(2, 2)
    good = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    bad = {**good, "weight": torch.zeros(3, 2)}
    with pytest.raises(ValueError, match="shape"):
        ewc.on_load_checkpoint(
            checkpoint={"mode": "separate", "fisher": [bad], "anchors": [good]}, model=model
        )
    with pytest.raises(ValueError, match="not a parameter"):
        ewc.on_load_checkpoint(
            checkpoint={"mode": "separate", "fisher": [{"w": torch.zeros(1)}], "anchors": []},
            model=model,
        )
    with pytest.raises(ValueError, match="mode"):
        ewc.on_load_checkpoint(checkpoint={"mode": "online"}, model=model)


def test_a_memory_given_to_the_learner_is_not_replayed_for_nothing() -> None:
    learner = ElasticWeightConsolidationLearner(
        model=torch.nn.Linear(4, 4),
        memory_size=8,
        memory_batch_size=4,
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    learner.fit(_data(0, (0, 1)))
    assert len(learner.buffer) == 8
    state = learner.buffer.sampling_state()
    learner.training_step(_data(1, (2, 3)).tensors)
    assert torch.equal(learner.buffer.sampling_state(), state)  # no memory batch drawn


def test_ewc_fisher_is_that_of_the_transformed_training_data() -> None:
    learner = ElasticWeightConsolidationLearner(
        model=small_mlp(),
        batch_size=16,
        trainer=Trainer(max_epochs=1, device="cpu"),
        **SCALED_TRANSFORMS,
    )
    data = uint8_task(0)
    learner.fit(data)
    (fisher,) = learner.components["ewc"].fisher_information()  # type: ignore[attr-defined]
    model = learner.model
    model.zero_grad()
    inputs, targets = data.tensors
    torch.nn.functional.cross_entropy(model(scaled(inputs)), targets).backward()
    torch.testing.assert_close(fisher["0.weight"], model[0].weight.grad.square())


def test_ewc_refuses_a_decay_factor_it_would_ignore() -> None:
    # decay_factor acts only in online mode; in "separate" mode it was silently ignored
    # (Avalanche's EWCPlugin refuses the combination too).
    with pytest.raises(ValueError, match=r"decay_factor.*ewc_mode='online'"):
        ElasticWeightConsolidationLearner(model=small_mlp(), decay_factor=0.5)
