"""Tests of the component base classes, field validation and the simple losses."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import renate_events.components as comps
import renate_events.memory as memory
from renate_events.components import (
    Component,
    ReinitializationComponent,
    ShrinkAndPerturbReinitializationComponent,
    WeightedCLSLossComponent,
    WeightedCustomLossComponent,
    WeightedLossComponent,
    WeightedMeanSquaredErrorLossComponent,
    WeightedPooledOutputDistillationLossComponent,
)

HOOKS = {
    "on_train_start": ["self", "model"],
    "on_train_batch_end": ["self", "model"],
    "on_load_checkpoint": ["self", "checkpoint"],
    "on_save_checkpoint": ["self", "checkpoint"],
}
LOSS_PARAMS = ["self", "outputs_memory", "batch_memory", "intermediate_representation_memory"]

COMPONENT_CLASSES = [
    Component,
    WeightedLossComponent,
    WeightedCustomLossComponent,
    WeightedMeanSquaredErrorLossComponent,
    WeightedPooledOutputDistillationLossComponent,
    WeightedCLSLossComponent,
    ReinitializationComponent,
    ShrinkAndPerturbReinitializationComponent,
]


def make_batch(inputs, targets, **metadata):
    metadata.setdefault("idx", torch.arange(len(targets), dtype=torch.int64))
    return (inputs, targets), metadata


def test_all_exports_resolve():
    for name in comps.__all__:
        assert getattr(comps, name) is not None


def test_one_batch_memory_type_for_buffers_and_components():
    assert comps.BatchMemory is memory.BatchMemory


@pytest.mark.parametrize("cls", COMPONENT_CLASSES, ids=lambda c: c.__name__)
def test_event_hooks_are_exactly_the_contract(cls):
    on_names = {name for name in dir(cls) if name.startswith("on_")}
    assert on_names == set(HOOKS)
    for name, params in HOOKS.items():
        assert list(inspect.signature(getattr(cls, name)).parameters) == params
    assert list(inspect.signature(cls.loss).parameters) == LOSS_PARAMS


def test_component_defaults_and_zero_loss():
    component = Component()
    assert component.weight == 0
    assert component.sample_new_memory_batch is False
    outputs = torch.randn(3, 4, dtype=torch.float64)
    loss = component.loss(outputs, make_batch(torch.zeros(3, 2), torch.zeros(3)), None)
    assert loss.shape == ()
    assert loss.dtype == torch.float64
    assert loss.device == outputs.device
    assert loss.item() == 0.0
    # Default hooks accept keyword arguments and do nothing.
    component.on_train_start(model=torch.nn.Linear(2, 2))
    component.on_train_batch_end(model=torch.nn.Linear(2, 2))
    checkpoint = {}
    component.on_save_checkpoint(checkpoint=checkpoint)
    component.on_load_checkpoint(checkpoint=checkpoint)
    assert checkpoint == {}


def test_weighted_loss_component_is_abstract():
    with pytest.raises(TypeError):
        WeightedLossComponent()


def test_component_positional_signatures_follow_renate():
    assert list(inspect.signature(Component).parameters) == ["weight", "sample_new_memory_batch"]
    assert list(inspect.signature(WeightedCustomLossComponent).parameters) == [
        "loss_fn",
        "weight",
        "sample_new_memory_batch",
    ]
    assert list(inspect.signature(WeightedPooledOutputDistillationLossComponent).parameters) == [
        "weight",
        "sample_new_memory_batch",
        "distillation_type",
        "normalize",
    ]
    sp = ShrinkAndPerturbReinitializationComponent(0.4, 0.01)
    assert (sp.shrink_factor, sp.sigma, sp.weight) == (0.4, 0.01, 0.0)
    cls = WeightedCLSLossComponent()
    assert (
        cls.weight,
        cls.stable_model_update_weight,
        cls.plastic_model_update_weight,
        cls.stable_model_update_probability,
        cls.plastic_model_update_probability,
    ) == (0.1, 0.999, 0.999, 0.7, 0.9)


# --- validation ----------------------------------------------------------------------------------

INVALID = [
    (Component, {"weight": -1}, "weight", "-1", "[0, inf)"),
    (Component, {"weight": float("nan")}, "weight", "nan", "[0, inf)"),
    (Component, {"weight": True}, "weight", "True", "[0, inf)"),
    (Component, {"weight": "1"}, "weight", "'1'", "[0, inf)"),
    (Component, {"sample_new_memory_batch": 1}, "sample_new_memory_batch", "1", "bool"),
    (WeightedMeanSquaredErrorLossComponent, {"weight": -0.5}, "weight", "-0.5", "[0, inf)"),
    (WeightedCustomLossComponent, {"loss_fn": 3}, "loss_fn", "3", "callable"),
    (
        WeightedPooledOutputDistillationLossComponent,
        {"distillation_type": "channels"},
        "distillation_type",
        "'channels'",
        "'pixel', 'channel', 'width', 'height', 'gap', 'spatial'",
    ),
    (WeightedPooledOutputDistillationLossComponent, {"normalize": 1}, "normalize", "1", "bool"),
    (
        WeightedCLSLossComponent,
        {"stable_model_update_weight": 1.0},
        "stable_model_update_weight",
        "1.0",
        "(0, 1)",
    ),
    (
        WeightedCLSLossComponent,
        {"plastic_model_update_weight": 0.0},
        "plastic_model_update_weight",
        "0.0",
        "(0, 1)",
    ),
    (
        WeightedCLSLossComponent,
        {"stable_model_update_probability": 0.0},
        "stable_model_update_probability",
        "0.0",
        "(0, 1]",
    ),
    (
        WeightedCLSLossComponent,
        {"plastic_model_update_probability": 1.5},
        "plastic_model_update_probability",
        "1.5",
        "(0, 1]",
    ),
    (
        WeightedCLSLossComponent,
        {"stable_model_update_weight": 0.5, "plastic_model_update_weight": 0.9},
        "stable_model_update_weight",
        "0.5",
        ">= plastic_model_update_weight",
    ),
    (
        WeightedCLSLossComponent,
        {"stable_model_update_probability": 0.95},
        "stable_model_update_probability",
        "0.95",
        "<= plastic_model_update_probability",
    ),
    (WeightedCLSLossComponent, {"seed": -1}, "seed", "-1", "[0, 18446744073709551616)"),
    (WeightedCLSLossComponent, {"seed": 1.5}, "seed", "1.5", "integer"),
    (
        ShrinkAndPerturbReinitializationComponent,
        {"shrink_factor": 0.0, "sigma": 0.1},
        "shrink_factor",
        "0.0",
        "(0, inf)",
    ),
    (
        ShrinkAndPerturbReinitializationComponent,
        {"shrink_factor": 1.0, "sigma": -0.1},
        "sigma",
        "-0.1",
        "[0, inf)",
    ),
]


@pytest.mark.parametrize(
    ("cls", "kwargs", "field", "given", "allowed"),
    INVALID,
    ids=[f"{case[0].__name__}-{case[2]}-{case[3]}" for case in INVALID],
)
def test_invalid_field_values_raise_value_error(cls, kwargs, field, given, allowed):
    if cls is WeightedCustomLossComponent:
        kwargs = {"loss_fn": lambda o, t: o.sum(), **kwargs}
    if cls is Component:
        cls = ReinitializationComponent  # a concrete subclass without extra fields
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    message = str(info.value)
    assert field in message
    assert given in message
    assert allowed in message


def test_validation_also_runs_on_assignment():
    der = WeightedMeanSquaredErrorLossComponent(weight=1.0)
    with pytest.raises(ValueError, match=r"weight.*\[0, inf\).*-2"):
        der.weight = -2
    assert der.weight == 1.0
    cls = WeightedCLSLossComponent(plastic_model_update_weight=0.9, stable_model_update_weight=0.99)
    with pytest.raises(ValueError, match="plastic_model_update_weight"):
        cls.plastic_model_update_weight = 0.995  # would exceed the stable decay
    cls.stable_model_update_weight = 0.9  # equal is allowed
    with pytest.raises(ValueError, match="plastic_model_update_probability"):
        cls.plastic_model_update_probability = 0.5  # below the stable probability 0.7


def test_seeds_are_fixed_after_construction():
    import attrs

    for component in (WeightedCLSLossComponent(), ShrinkAndPerturbReinitializationComponent(1, 0)):
        with pytest.raises(attrs.exceptions.FrozenAttributeError):
            component.seed = 3


def test_boundary_values_are_accepted():
    WeightedCLSLossComponent(
        weight=0,
        stable_model_update_weight=0.5,
        plastic_model_update_weight=0.5,
        stable_model_update_probability=1.0,
        plastic_model_update_probability=1.0,
        seed=2**64 - 1,
    )
    ShrinkAndPerturbReinitializationComponent(shrink_factor=1e-9, sigma=0)
    WeightedMeanSquaredErrorLossComponent(weight=0)


# --- custom loss -------------------------------------------------------------------------------


def reference_cross_entropy(logits, targets):
    total = 0.0
    for row, target in zip(logits.tolist(), targets.tolist()):
        log_norm = math.log(sum(math.exp(value) for value in row))
        total += log_norm - row[target]
    return total / len(targets)


def test_custom_loss_matches_hand_computed_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(4, 3, dtype=torch.float64)
    targets = torch.tensor([2, 0, 1, 1])
    seen = []

    def loss_fn(outputs, targets_memory):
        seen.append((outputs, targets_memory))
        return torch.nn.functional.cross_entropy(outputs, targets_memory)

    component = WeightedCustomLossComponent(loss_fn, 0.7, True)
    loss = component.loss(logits, make_batch(torch.zeros(4, 5), targets), None)
    assert seen[0][0] is logits and seen[0][1] is targets
    assert component.sample_new_memory_batch is True
    assert loss.item() == pytest.approx(0.7 * reference_cross_entropy(logits, targets), rel=1e-12)


@pytest.mark.parametrize(
    "component",
    [
        WeightedCustomLossComponent(lambda o, t: 1 / 0, weight=0),
        WeightedMeanSquaredErrorLossComponent(weight=0),
        WeightedPooledOutputDistillationLossComponent(weight=0),
        WeightedCLSLossComponent(weight=0),
    ],
    ids=lambda c: type(c).__name__,
)
def test_zero_weight_skips_computation(component):
    outputs = torch.randn(2, 3, dtype=torch.float64)
    # No logits, no features, no model copies: computing anything would raise.
    loss = component.loss(outputs, ((object(), object()), {}), None)
    assert loss.item() == 0.0
    assert loss.dtype == torch.float64 and loss.shape == ()


# --- DER (mean squared error) --------------------------------------------------------------------


def test_mean_squared_error_matches_hand_computation():
    torch.manual_seed(1)
    outputs = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    stored = torch.randn(3, 4, dtype=torch.float64)
    component = WeightedMeanSquaredErrorLossComponent(weight=0.3)
    loss = component.loss(outputs, make_batch(torch.zeros(3, 2), torch.zeros(3), logits=stored), [])
    expected = 0.0
    for out_row, stored_row in zip(outputs.tolist(), stored.tolist()):
        for a, b in zip(out_row, stored_row):
            expected += (a - b) ** 2
    expected = 0.3 * expected / 12
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(outputs.grad, 0.3 * 2 * (outputs.detach() - stored) / 12)


def test_mean_squared_error_casts_stored_logits_to_the_outputs_dtype():
    outputs = torch.zeros(2, 2, dtype=torch.float64)
    stored = torch.ones(2, 2, dtype=torch.float16)
    loss = WeightedMeanSquaredErrorLossComponent().loss(
        outputs, make_batch(None, torch.zeros(2), logits=stored), None
    )
    assert loss.dtype == torch.float64 and loss.item() == 1.0


def test_mean_squared_error_reports_missing_or_mismatched_logits():
    der = WeightedMeanSquaredErrorLossComponent()
    with pytest.raises(ValueError, match=r"'logits'.*idx"):
        der.loss(torch.zeros(2, 3), make_batch(None, torch.zeros(2)), None)
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 3\)"):
        der.loss(
            torch.zeros(2, 3), make_batch(None, torch.zeros(2), logits=torch.zeros(2, 4)), None
        )
