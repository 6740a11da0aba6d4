"""Tests for the update-regression metrics: regression_metrics and model_regression_metrics."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.evaluation import model_regression_metrics, regression_metrics
from trainer import validators


def test_flip_rates_and_impacts_by_hand() -> None:
    # sample: 0     1     2     3     4     5
    # old ok: yes   yes   no    no    yes   no
    # new ok: yes   no    yes   no    no    yes
    targets = torch.tensor([0, 1, 2, 3, 4, 5])
    old = torch.tensor([0, 1, 9, 9, 4, 9])
    new = torch.tensor([0, 9, 2, 9, 9, 5])
    # negative flips: samples 1 and 4 (2 of 6); new errors: 1, 3, 4 (3)
    # positive flips: samples 2 and 5 (2 of 6); new correct: 0, 2, 5 (3)
    assert regression_metrics(old, new, targets) == pytest.approx(
        {"nfr": 2 / 6, "nfi": 2 / 3, "pfr": 2 / 6, "pfi": 2 / 3}
    )


def test_asymmetric_case_tells_rates_from_impacts() -> None:
    targets = torch.zeros(5, dtype=torch.long)
    old = torch.tensor([0, 0, 0, 1, 1])  # right on 0, 1, 2
    new = torch.tensor([0, 1, 1, 1, 0])  # right on 0, 4; negative flips 1, 2; positive flip 4
    result = regression_metrics(old, new, targets)
    assert result == pytest.approx({"nfr": 2 / 5, "nfi": 2 / 3, "pfr": 1 / 5, "pfi": 1 / 2})


def test_logits_are_reduced_by_argmax() -> None:
    targets = torch.tensor([1, 0, 1])
    old_logits = torch.tensor([[0.0, 2.0], [1.0, 0.0], [3.0, 1.0]])  # predicts 1, 0, 0
    new_logits = torch.tensor([[5.0, 1.0], [1.0, 0.0], [0.0, 1.0]])  # predicts 0, 0, 1
    from_logits = regression_metrics(old_logits, new_logits, targets)
    from_labels = regression_metrics(torch.tensor([1, 0, 0]), torch.tensor([0, 0, 1]), targets)
    assert (
        from_logits
        == from_labels
        == pytest.approx({"nfr": 1 / 3, "nfi": 1.0, "pfr": 1 / 3, "pfi": 1 / 2})
    )


def test_identical_models_have_no_flips_and_zero_denominators_give_zero() -> None:
    targets = torch.tensor([0, 1, 1])
    perfect = regression_metrics(targets, targets, targets)
    assert perfect == {"nfr": 0.0, "nfi": 0.0, "pfr": 0.0, "pfi": 0.0}
    wrong = 1 - targets
    assert regression_metrics(targets, wrong, targets) == {
        "nfr": 1.0,
        "nfi": 1.0,
        "pfr": 0.0,
        "pfi": 0.0,
    }


def test_matches_per_sample_loop_on_random_predictions() -> None:
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 4, (500,), generator=generator)
    old = torch.randint(0, 4, (500,), generator=generator)
    new = torch.randint(0, 4, (500,), generator=generator)
    pairs = list(zip(old.tolist(), new.tolist(), targets.tolist()))
    negative = sum(o == t and n != t for o, n, t in pairs)
    positive = sum(o != t and n == t for o, n, t in pairs)
    errors = sum(n != t for _, n, t in pairs)
    assert regression_metrics(old, new, targets) == pytest.approx(
        {
            "nfr": negative / 500,
            "nfi": negative / errors,
            "pfr": positive / 500,
            "pfi": positive / (500 - errors),
        }
    )


@pytest.mark.parametrize(
    ("old", "new", "targets", "error", "match"),
    [
        ([0, 1], torch.tensor([0, 1]), torch.tensor([0, 1]), validators.WrongTypeError, "old"),
        (torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([0, 1]), ValueError, "same"),
        (torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), torch.tensor([0, 1]), ValueError, "old"),
        (
            torch.tensor([0, 1]),
            torch.tensor([0, 1]),
            torch.zeros(2, 2),
            ValueError,
            "targets must be labels",
        ),
        (
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            ValueError,
            "no samples",
        ),
    ],
)
def test_bad_input_is_refused(old, new, targets, error, match) -> None:
    with pytest.raises(error, match=match):
        regression_metrics(old, new, targets)


def test_two_models_on_a_dataset_by_hand() -> None:
    inputs = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    targets = torch.tensor([0, 1, 1, 0])
    old = torch.nn.Linear(2, 2, bias=False)
    new = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        old.weight.copy_(torch.eye(2))  # predicts the input's hot index: right on 0, 1
        new.weight.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))  # the other: right on 2, 3
    old.train()
    result = model_regression_metrics(old, new, TensorDataset(inputs, targets), batch_size=3)
    assert result == pytest.approx({"nfr": 0.5, "nfi": 1.0, "pfr": 0.5, "pfi": 1.0})
    assert old.training and new.training  # modes given back


def test_model_helper_refuses_non_models_and_empty_data() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="old_model"):
        model_regression_metrics("model", model, TensorDataset(torch.zeros(1, 2), torch.zeros(1)))
    empty = TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        model_regression_metrics(model, model, empty)
