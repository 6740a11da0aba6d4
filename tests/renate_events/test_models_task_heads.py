"""MultiHeadClassificationModel: one linear head per task id on a shared backbone."""

from __future__ import annotations

import pytest
import torch

from renate_events.models import ClassificationModel, MultiHeadClassificationModel, mlp, resnet18
from trainer.validators import WrongTypeError


def _model(seed: int = 0) -> MultiHeadClassificationModel:
    torch.manual_seed(seed)
    model = MultiHeadClassificationModel.from_model(mlp(6, num_classes=2, hidden=[8]))
    model.add_task_params(0, 2)
    model.add_task_params(1, 2)
    return model


def test_training_one_head_leaves_the_others_unchanged() -> None:
    model = _model()
    head0 = {k: v.clone() for k, v in model.heads["0"].state_dict().items()}
    head1 = {k: v.clone() for k, v in model.heads["1"].state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    inputs, targets = torch.randn(16, 6), torch.randint(0, 2, (16,))
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs, task_id=1), targets).backward()
        optimizer.step()
    for key, value in model.heads["0"].state_dict().items():
        assert torch.equal(value, head0[key])
    assert any(not torch.equal(v, head1[k]) for k, v in model.heads["1"].state_dict().items())


def test_ways_to_give_the_task_id() -> None:
    model = _model()
    inputs = torch.randn(5, 6)
    features = model.backbone(inputs)
    out0, out1 = model.heads["0"](features), model.heads["1"](features)
    assert torch.allclose(model(inputs, task_id=0), out0)
    ids = torch.tensor([1, 0, 1, 1, 0])
    per_sample = model(inputs, task_id=ids)
    assert torch.allclose(per_sample, torch.where((ids == 1)[:, None], out1, out0))
    model.set_task(1)
    assert torch.allclose(model(inputs), out1)


def test_unknown_task_id_is_a_clear_error() -> None:
    model = _model()
    for task_id in (2, torch.tensor([0, 5]), "1"):
        with pytest.raises(ValueError, match=r"has no head; heads exist for task ids \[0, 1\]"):
            model(torch.randn(2, 6), task_id=task_id)
    with pytest.raises(ValueError, match="has no head"):
        model.set_task(7)
    with pytest.raises(ValueError, match="no task id"):
        model(torch.randn(2, 6))
    model.add_task_params(2, 4)
    with pytest.raises(ValueError, match="different numbers of outputs"):
        model(torch.randn(2, 6), task_id=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="already has a head of 4 outputs"):
        model.add_task_params(2, 3)
    with pytest.raises(ValueError, match="task_id"):
        model.add_task_params(-1, 3)
    with pytest.raises(WrongTypeError, match="linear head"):
        MultiHeadClassificationModel.from_model(torch.nn.Linear(2, 2))


def test_state_dict_round_trip_adds_the_heads() -> None:
    model = _model(seed=1)
    model.add_task_params(3, 5)
    state = model.state_dict()
    assert {k for k in state if k.startswith("heads.")} == {
        f"heads.{t}.{p}" for t in (0, 1, 3) for p in ("weight", "bias")
    }
    assert state["heads.3.weight"].shape == (5, 8)
    fresh = MultiHeadClassificationModel.from_model(mlp(6, num_classes=2, hidden=[8]))
    fresh.load_state_dict(state)
    assert fresh.task_ids == (0, 1, 3)
    inputs = torch.randn(4, 6)
    for task_id in (0, 1, 3):
        assert torch.equal(fresh(inputs, task_id=task_id), model(inputs, task_id=task_id))
    bad = dict(state, **{"heads.9.weight": torch.zeros(2, 7), "heads.9.bias": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"heads\.9\.weight must have shape \(num_outputs, 8\)"):
        MultiHeadClassificationModel.from_model(mlp(6, num_classes=2, hidden=[8])).load_state_dict(
            bad
        )


def test_zoo_backbone_and_single_head_default() -> None:
    model = MultiHeadClassificationModel.from_model(resnet18(10, nf=4))
    model.add_task_params(0, 2)
    assert model(torch.zeros(2, 3, 32, 32), task_id=0).shape == (2, 2)
    assert model.feature_module_names[0] == "backbone.layer1"
    assert isinstance(mlp(6, num_classes=2), ClassificationModel)
