"""CLS-ER: selection rule, EMA updates, private RNG, checkpoints and device/dtype following."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from renate_events.components import IntermediateRepresentations, WeightedCLSLossComponent


def make_batch(inputs, targets):
    return (inputs, targets), {"idx": torch.arange(len(targets))}


def always_update(**kwargs):
    config = {
        "weight": 1.0,
        "stable_model_update_probability": 1.0,
        "plastic_model_update_probability": 1.0,
    }
    config.update(kwargs)
    return WeightedCLSLossComponent(**config)


def perturb(model, step):
    """A deterministic stand-in for an optimizer step."""
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.add_(0.1 * (step + 1) * (k + 1))


def flat(model):
    return torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])


def to_plain_checkpoint(value):
    """What a serialising loop hands back: tensors cloned on the CPU, tuples as lists."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: to_plain_checkpoint(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain_checkpoint(v) for v in value]
    return value


def assert_checkpoint_is_serialisable(value):
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, dict):
        assert all(isinstance(k, str) for k in value)
        for v in value.values():
            assert_checkpoint_is_serialisable(v)
    elif isinstance(value, list):
        for v in value:
            assert_checkpoint_is_serialisable(v)
    else:
        json.dumps(value)


# --- the loss -------------------------------------------------------------------------------------


def test_loss_selects_per_sample_the_copy_more_confident_on_the_true_class():
    model = nn.Linear(4, 3, bias=False)
    component = always_update(weight=0.5)
    component.on_train_start(model=model)
    # With one-hot inputs, row i of the outputs is column i of the weight.
    plastic_table = [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.5], [1.0, 1.0, 1.0]]
    stable_table = [[1.0, 0.0, 0.0], [0.0, 3.0, 0.0], [1.0, 1.0, 1.5], [0.0, 0.0, 4.0]]
    with torch.no_grad():
        component.plastic_model.weight.copy_(torch.tensor(plastic_table).T)
        component.stable_model.weight.copy_(torch.tensor(stable_table).T)
    inputs = torch.eye(4)
    # Sample 2 is an exact tie (logits shifted by 1): the plastic copy is kept, as in Renate.
    targets = torch.tensor([0, 1, 2, 2])
    current = torch.tensor([[0.5, 0.5, 0.5], [1.0, -1.0, 0.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0]])

    def true_class_probability(row, target):
        return math.exp(row[target]) / sum(math.exp(v) for v in row)

    chosen, expected = [], 0.0
    for i, target in enumerate(targets.tolist()):
        p_plastic = true_class_probability(plastic_table[i], target)
        p_stable = true_class_probability(stable_table[i], target)
        row = stable_table[i] if p_stable > p_plastic else plastic_table[i]
        chosen.append("stable" if p_stable > p_plastic else "plastic")
        expected += sum((c - r) ** 2 for c, r in zip(current[i].tolist(), row))
    expected = 0.5 * expected / current.numel()
    assert chosen == ["plastic", "stable", "plastic", "stable"]
    loss = component.loss(current, make_batch(inputs, targets), None)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_loss_gradient_flows_to_the_model_only():
    model = nn.Linear(3, 2)
    component = always_update()
    component.on_train_start(model=model)
    perturb(model, 0)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    component.loss(model(x), make_batch(x, y), None).backward()
    assert model.weight.grad.abs().sum() > 0
    for copy_model in (component.plastic_model, component.stable_model):
        assert all(p.grad is None and not p.requires_grad for p in copy_model.parameters())
        assert not copy_model.training


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_loss_passes_structured_inputs_to_the_copies(kind):
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 3), nn.Linear(4, 3)

        def forward(self, left, right):
            return self.a(left) + self.b(right)

    model = TwoInputs()
    component = always_update()
    component.on_train_start(model=model)
    left, right = torch.randn(2, 2), torch.randn(2, 4)
    inputs = (left, right) if kind == "tuple" else {"left": left, "right": right}
    loss = component.loss(model(left, right), make_batch(inputs, torch.tensor([0, 2])), None)
    assert loss.item() == pytest.approx(0.0, abs=1e-12)


def test_loss_before_on_train_start_raises():
    component = WeightedCLSLossComponent(weight=1.0)
    with pytest.raises(RuntimeError, match="on_train_start"):
        component.loss(torch.zeros(1, 2), make_batch(torch.zeros(1, 2), torch.tensor([0])), None)


# --- model copies and EMA updates ----------------------------------------------------------------


def test_copies_are_hook_free_frozen_eval_and_persist_across_train_starts():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    recorder = IntermediateRepresentations(model, ["0"])
    component = always_update()
    component.on_train_start(model=model)
    plastic, stable = component.plastic_model, component.stable_model
    assert plastic is not stable and plastic is not model
    for copy_model in (plastic, stable):
        assert (
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in copy_model.modules())
            == 0
        )
    x = torch.randn(2, 3)
    model(x)
    recorded = recorder.representations[0]
    component.loss(model(x), make_batch(x, torch.tensor([0, 1])), None)
    # Running the copies does not touch the recorder (the model's second forward did).
    assert recorder.representations[0] is not recorded
    recorded = recorder.representations[0]
    component.loss(torch.zeros(2, 2), make_batch(x, torch.tensor([0, 1])), None)
    assert recorder.representations[0] is recorded
    component.on_train_start(model=model)
    assert component.plastic_model is plastic and component.stable_model is stable


def test_ema_updates_match_hand_computation():
    model = nn.Linear(2, 1)
    component = always_update(plastic_model_update_weight=0.6, stable_model_update_weight=0.8)
    component.on_train_start(model=model)
    plastic = [p.detach().clone() for p in model.parameters()]
    stable = [p.detach().clone() for p in model.parameters()]
    for step in range(1, 5):
        perturb(model, step)
        component.on_train_batch_end(model=model)
        current = [p.detach() for p in model.parameters()]
        decay_plastic = min(1 - 1 / (step + 1), 0.6)
        decay_stable = min(1 - 1 / (step + 1), 0.8)
        plastic = [decay_plastic * e + (1 - decay_plastic) * c for e, c in zip(plastic, current)]
        stable = [decay_stable * e + (1 - decay_stable) * c for e, c in zip(stable, current)]
        for got, want in zip(component.plastic_model.parameters(), plastic):
            torch.testing.assert_close(got, want)
        for got, want in zip(component.stable_model.parameters(), stable):
            torch.testing.assert_close(got, want)
    assert component.iteration == 4


def test_updates_happen_with_the_configured_probabilities_from_the_private_generator():
    model = nn.Linear(2, 2)
    component = WeightedCLSLossComponent(
        stable_model_update_probability=0.3, plastic_model_update_probability=0.6, seed=11
    )
    component.on_train_start(model=model)
    reference = torch.Generator().manual_seed(11)
    updated = {"plastic": 0, "stable": 0}
    for step in range(40):
        before = {"plastic": flat(component.plastic_model), "stable": flat(component.stable_model)}
        perturb(model, step)
        draw_plastic, draw_stable = torch.rand(2, generator=reference).tolist()
        component.on_train_batch_end(model=model)
        for name, draw, probability in (
            ("plastic", draw_plastic, 0.6),
            ("stable", draw_stable, 0.3),
        ):
            changed = not torch.equal(before[name], flat(getattr(component, f"{name}_model")))
            assert changed == (draw < probability)
            updated[name] += changed
    assert 0 < updated["stable"] < updated["plastic"] < 40


def test_generator_is_independent_of_the_global_rng():
    def run(global_seeds):
        model = nn.Linear(3, 3)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.5)
        component = WeightedCLSLossComponent(
            stable_model_update_probability=0.4, plastic_model_update_probability=0.5, seed=5
        )
        component.on_train_start(model=model)
        for step, seed in enumerate(global_seeds):
            torch.manual_seed(seed)
            perturb(model, step)
            component.on_train_batch_end(model=model)
        return flat(component.plastic_model), flat(component.stable_model)

    first = run([0, 1, 2, 3, 4, 5, 6, 7])
    second = run([99, 12, 7, 1234, 5, 42, 0, 3])
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])

    component = WeightedCLSLossComponent()
    model = nn.Linear(2, 2)
    component.on_train_start(model=model)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    component.on_train_batch_end(model=model)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is not consumed


def test_batchnorm_buffers_are_averaged_and_counters_copied():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    component = always_update(plastic_model_update_weight=0.5, stable_model_update_weight=0.5)
    component.on_train_start(model=model)
    model.train()
    model(torch.randn(8, 2) + 3.0)  # moves running statistics
    component.on_train_batch_end(model=model)  # step 1: decay min(0.5, 0.5)
    expected_mean = 0.5 * torch.zeros(3) + 0.5 * model[1].running_mean
    torch.testing.assert_close(component.plastic_model[1].running_mean, expected_mean)
    assert component.plastic_model[1].num_batches_tracked.item() == 1


def test_structure_change_raises_clear_error():
    model = nn.Linear(2, 2)
    component = always_update()
    component.on_train_start(model=model)
    with pytest.raises(ValueError, match="no longer match"):
        component.on_train_batch_end(model=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"no longer match.*\(3, 2\).*\(2, 2\)"):
        component.on_train_batch_end(model=nn.Linear(2, 3))  # a grown classification head


# --- checkpoints ----------------------------------------------------------------------------------


def run_steps(component, model, steps, start):
    for step in range(start, start + steps):
        perturb(model, step)
        component.on_train_batch_end(model=model)


@pytest.mark.parametrize("load_before_train_start", [True, False])
def test_checkpoint_round_trip_gives_identical_subsequent_updates(load_before_train_start):
    config = {
        "stable_model_update_probability": 0.4,
        "plastic_model_update_probability": 0.7,
        "plastic_model_update_weight": 0.9,
        "stable_model_update_weight": 0.95,
        "seed": 3,
    }
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    original = WeightedCLSLossComponent(**config)
    original.on_train_start(model=model)
    run_steps(original, model, 6, 0)

    saved = {}
    original.on_save_checkpoint(checkpoint=saved)
    model_at_save = copy.deepcopy(model)
    assert set(saved) == {"iteration", "generator_state", "plastic_model", "stable_model"}
    assert saved["generator_state"].dtype == torch.uint8
    assert_checkpoint_is_serialisable(saved)

    # Training goes on before the checkpoint is serialised: the saved values are snapshots.
    run_steps(original, model, 10, 6)
    checkpoint = to_plain_checkpoint(saved)

    resumed = WeightedCLSLossComponent(**config)
    if load_before_train_start:
        resumed.on_load_checkpoint(checkpoint=checkpoint)
        resumed.on_train_start(model=model_at_save)
    else:
        resumed.on_train_start(model=model_at_save)
        resumed.on_load_checkpoint(checkpoint=checkpoint)
    assert resumed.iteration == 6
    run_steps(resumed, model_at_save, 10, 6)

    assert resumed.iteration == original.iteration == 16
    for name in ("plastic_model", "stable_model"):
        assert torch.equal(flat(getattr(original, name)), flat(getattr(resumed, name)))
    assert torch.equal(original._generator.get_state(), resumed._generator.get_state())


def test_checkpoint_before_train_start_has_no_models_and_loads():
    component = WeightedCLSLossComponent(seed=9)
    saved = {}
    component.on_save_checkpoint(checkpoint=saved)
    assert set(saved) == {"iteration", "generator_state"}
    other = WeightedCLSLossComponent(seed=1)
    other.on_load_checkpoint(checkpoint=to_plain_checkpoint(saved))
    assert torch.equal(other._generator.get_state(), component._generator.get_state())
    with pytest.raises(ValueError, match="generator_state"):
        other.on_load_checkpoint(checkpoint={"iteration": 0})


def test_pending_copies_survive_a_save_before_train_start():
    model = nn.Linear(2, 2)
    component = always_update()
    component.on_train_start(model=model)
    run_steps(component, model, 2, 0)
    saved = {}
    component.on_save_checkpoint(checkpoint=saved)
    pending = always_update()
    pending.on_load_checkpoint(checkpoint=to_plain_checkpoint(saved))
    again = {}
    pending.on_save_checkpoint(checkpoint=again)  # not yet started: the loaded copies are kept
    for name in ("plastic_model", "stable_model"):
        for key, value in saved[name].items():
            assert torch.equal(again[name][key], value)


# --- device and dtype ----------------------------------------------------------------------------


def test_copies_follow_the_model_dtype():
    model = nn.Linear(3, 2)
    component = always_update()
    component.on_train_start(model=model)
    model.to(torch.float64)
    perturb(model, 0)
    component.on_train_batch_end(model=model)
    for copy_model in (component.plastic_model, component.stable_model):
        assert all(p.dtype == torch.float64 for p in copy_model.parameters())
    x = torch.randn(4, 3, dtype=torch.float64)
    loss = component.loss(model(x), make_batch(x, torch.tensor([0, 1, 0, 1])), None)
    assert loss.dtype == torch.float64
    # Also at on_train_start, e.g. when a new task starts after a conversion.
    model.to(torch.float32)
    component.on_train_start(model=model)
    assert component.stable_model.weight.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copies_follow_the_model_device():
    model = nn.Linear(3, 2)
    component = always_update()
    component.on_train_start(model=model)
    model.cuda()
    x = torch.randn(4, 3, device="cuda")
    loss = component.loss(model(x), make_batch(x, torch.tensor([0, 1, 0, 1], device="cuda")), None)
    assert loss.device.type == "cuda"
    component.on_train_batch_end(model=model)
    assert component.plastic_model.weight.device.type == "cuda"
    saved = {}
    component.on_save_checkpoint(checkpoint=saved)
    resumed = always_update()
    resumed.on_load_checkpoint(checkpoint=to_plain_checkpoint(saved))
    resumed.on_train_start(model=model)
    assert torch.equal(flat(resumed.stable_model), flat(component.stable_model))
