"""Re-initialisation components: cold start and shrink-and-perturb."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from renate_events.components import (
    ReinitializationComponent,
    ShrinkAndPerturbReinitializationComponent,
)


def small_model():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def fill_constant(model, value):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
        for b in model.buffers():
            b.fill_(int(value) if not b.is_floating_point() else value)


def test_reinitialization_calls_every_reset_parameters_in_module_order():
    model = small_model()
    fill_constant(model, 3.0)
    expected = copy.deepcopy(model)
    torch.manual_seed(4)
    ReinitializationComponent().on_train_start(model=model)
    torch.manual_seed(4)
    for module in (expected[0], expected[1], expected[3]):
        module.reset_parameters()
    for got, want in zip(model.state_dict().values(), expected.state_dict().values()):
        assert torch.equal(got, want)
    assert torch.equal(model[1].weight, torch.ones(4))
    assert torch.equal(model[1].running_mean, torch.zeros(4))
    assert model[1].num_batches_tracked.item() == 0
    assert not torch.equal(model[0].weight, torch.full((4, 3), 3.0))


def reference_shrink_and_perturb(params, shrink, sigma, generator):
    total = sum(p.numel() for p in params)
    noise = torch.randn(total, generator=generator, dtype=torch.float32).tolist()
    results, offset = [], 0
    for p in params:
        values = p.detach().reshape(-1).tolist()
        new = [shrink * value + sigma * noise[offset + i] for i, value in enumerate(values)]
        offset += len(values)
        results.append(torch.tensor(new, dtype=p.dtype).reshape(p.shape))
    return results


def test_shrink_and_perturb_matches_hand_computation():
    torch.manual_seed(0)
    model = small_model()
    model[3].to(torch.float64)  # mixed dtypes exercise the grouping
    before = [p.detach().clone() for p in model.parameters()]
    component = ShrinkAndPerturbReinitializationComponent(shrink_factor=0.4, sigma=0.01, seed=7)
    component.on_train_start(model=model)
    reference = torch.Generator().manual_seed(7)
    expected = reference_shrink_and_perturb(before, 0.4, 0.01, reference)
    for got, want in zip(model.parameters(), expected):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-7)
    # A second call continues the generator's sequence.
    before = [p.detach().clone() for p in model.parameters()]
    component.on_train_start(model=model)
    expected = reference_shrink_and_perturb(before, 0.4, 0.01, reference)
    for got, want in zip(model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("shrink", "sigma"), [(1.0, 0.0), (0.5, 0.0)])
def test_shrink_only_and_identity(shrink, sigma):
    model = small_model()
    before = [p.detach().clone() for p in model.parameters()]
    ShrinkAndPerturbReinitializationComponent(shrink, sigma).on_train_start(model=model)
    for got, want in zip(model.parameters(), before):
        assert torch.equal(got.detach(), shrink * want)
    assert all(p.requires_grad for p in model.parameters())


def test_shrink_and_perturb_ignores_the_global_rng_and_restores_from_checkpoint():
    def perturbed(component, global_seed):
        model = nn.Linear(3, 3)
        with torch.no_grad():
            model.weight.zero_()
            model.bias.zero_()
        torch.manual_seed(global_seed)
        component.on_train_start(model=model)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    component = ShrinkAndPerturbReinitializationComponent(0.9, 1.0, seed=1)
    first = perturbed(component, 0)
    checkpoint = {}
    component.on_save_checkpoint(checkpoint=checkpoint)
    assert set(checkpoint) == {"generator_state"}
    assert checkpoint["generator_state"].dtype == torch.uint8
    second = perturbed(component, 123)

    same_seed = ShrinkAndPerturbReinitializationComponent(0.9, 1.0, seed=1)
    assert torch.equal(perturbed(same_seed, 55), first)

    resumed = ShrinkAndPerturbReinitializationComponent(0.9, 1.0, seed=2)
    resumed.on_load_checkpoint(
        checkpoint={"generator_state": checkpoint["generator_state"].clone()}
    )
    assert torch.equal(perturbed(resumed, 9), second)
    assert not torch.equal(first, second)
    with pytest.raises(ValueError, match="generator_state"):
        resumed.on_load_checkpoint(checkpoint={})


def test_reinitialization_components_add_no_loss():
    outputs = torch.randn(2, 3)
    for component in (
        ReinitializationComponent(),
        ShrinkAndPerturbReinitializationComponent(0.5, 0.1),
    ):
        assert component.loss(outputs, ((None, None), {}), None).item() == 0.0


def test_model_without_parameters_is_a_no_op():
    ShrinkAndPerturbReinitializationComponent(0.5, 0.1).on_train_start(model=nn.ReLU())
    ReinitializationComponent().on_train_start(model=nn.ReLU())
