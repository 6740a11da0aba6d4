"""PODNet distillation against a reference written with explicit loops."""

from __future__ import annotations

import math

import pytest
import torch

from renate_events.components import (
    DISTILLATION_TYPES,
    WeightedPooledOutputDistillationLossComponent,
)


def pooled(sample, kind):
    """PODNet pooling of one squared (C, H, W) feature map, written out with loops."""
    channels, height, width = len(sample), len(sample[0]), len(sample[0][0])
    sq = [
        [[sample[c][h][w] ** 2 for w in range(width)] for h in range(height)]
        for c in range(channels)
    ]
    if kind == "pixel":
        return [sq[c][h][w] for c in range(channels) for h in range(height) for w in range(width)]
    if kind == "channel":
        return [
            sum(sq[c][h][w] for c in range(channels)) for h in range(height) for w in range(width)
        ]
    if kind == "width":  # pooled over the height: one value per (channel, column)
        return [
            sum(sq[c][h][w] for h in range(height)) for c in range(channels) for w in range(width)
        ]
    if kind == "height":  # pooled over the width: one value per (channel, row)
        return [
            sum(sq[c][h][w] for w in range(width)) for c in range(channels) for h in range(height)
        ]
    if kind == "gap":
        return [
            sum(sq[c][h][w] for h in range(height) for w in range(width)) / (height * width)
            for c in range(channels)
        ]
    assert kind == "spatial"
    return pooled(sample, "height") + pooled(sample, "width")


def normalized(vector):
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / max(norm, 1e-12) for x in vector]


def reference_pod(current_layers, stored_layers, kind, normalize, weight):
    layer_losses = []
    for current, stored in zip(current_layers, stored_layers):
        distances = []
        for a_map, b_map in zip(current.tolist(), stored.tolist()):
            a, b = pooled(a_map, kind), pooled(b_map, kind)
            if normalize:
                a, b = normalized(a), normalized(b)
            distances.append(math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))))
        layer_losses.append(sum(distances) / len(distances))
    return weight * sum(layer_losses) / len(layer_losses)


def as_maps(features):
    """Views an (N, D) tensor as (N, D, 1, 1) feature maps."""
    return features[:, :, None, None]


def batch_with(stored_layers):
    metadata = {f"intermediate_representation_{i}": s for i, s in enumerate(stored_layers)}
    metadata["idx"] = torch.arange(stored_layers[0].shape[0])
    return (torch.zeros(1), torch.zeros(1)), metadata


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("kind", DISTILLATION_TYPES)
def test_pod_matches_reference_on_feature_maps(kind, normalize):
    generator = torch.Generator().manual_seed(7)
    shapes = [(3, 2, 4, 5), (3, 3, 2, 2)]  # two layers, H != W to tell width and height apart
    current = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    stored = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    component = WeightedPooledOutputDistillationLossComponent(
        weight=0.4, distillation_type=kind, normalize=normalize
    )
    loss = component.loss(torch.zeros(3, 5, dtype=torch.float64), batch_with(stored), current)
    expected = reference_pod(current, stored, kind, normalize, 0.4)
    assert loss.item() == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("kind", DISTILLATION_TYPES)
def test_pod_on_2d_features_treats_them_as_1x1_maps(kind, normalize):
    generator = torch.Generator().manual_seed(3)
    current = [torch.randn(4, 6, generator=generator, dtype=torch.float64)]
    stored = [torch.randn(4, 6, generator=generator, dtype=torch.float64)]
    component = WeightedPooledOutputDistillationLossComponent(
        weight=1.5, distillation_type=kind, normalize=normalize
    )
    outputs = torch.zeros(4, 2, dtype=torch.float64)
    if kind == "channel" and normalize:
        with pytest.raises(ValueError, match=r"identically zero.*'pixel' or 'gap'"):
            component.loss(outputs, batch_with(stored), current)
        return
    loss = component.loss(outputs, batch_with(stored), current)
    expected = reference_pod([as_maps(current[0])], [as_maps(stored[0])], kind, normalize, 1.5)
    assert loss.item() == pytest.approx(expected, rel=1e-10)

    # The documented consequences, against a direct formula on the squared features.
    distances = []
    for a_row, b_row in zip(current[0].tolist(), stored[0].tolist()):
        a, b = [x * x for x in a_row], [x * x for x in b_row]
        if normalize:
            a, b = normalized(a), normalized(b)
        distances.append(math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))))
    pixel = 1.5 * sum(distances) / len(distances)
    if kind in ("pixel", "width", "height"):
        assert loss.item() == pytest.approx(pixel, rel=1e-10)
    if kind == "gap":  # mean over a 1x1 map is the value itself
        assert loss.item() == pytest.approx(pixel, rel=1e-10)
    if kind == "spatial":
        factor = 1.0 if normalize else math.sqrt(2)
        assert loss.item() == pytest.approx(factor * pixel, rel=1e-10)


def test_pod_is_zero_and_has_finite_gradients_when_features_match():
    stored = torch.randn(2, 3, 4, 4)
    current = stored.clone().requires_grad_(True)
    component = WeightedPooledOutputDistillationLossComponent()
    loss = component.loss(torch.zeros(2, 2), batch_with([stored]), [current])
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(current.grad).all()


def test_pod_gradient_reaches_the_current_features():
    stored = torch.randn(2, 3, 4, 4)
    current = torch.randn(2, 3, 4, 4, requires_grad=True)
    WeightedPooledOutputDistillationLossComponent(weight=2.0).loss(
        torch.zeros(2, 2), batch_with([stored]), [current]
    ).backward()
    assert current.grad.abs().sum() > 0


@pytest.mark.parametrize("features", [None, []])
def test_pod_without_intermediate_representations_names_what_to_configure(features):
    component = WeightedPooledOutputDistillationLossComponent()
    with pytest.raises(ValueError) as info:
        component.loss(torch.zeros(2, 2), batch_with([torch.zeros(2, 3)]), features)
    message = str(info.value)
    assert "IntermediateRepresentations" in message
    assert "intermediate_representation_{i}" in message


def test_pod_reports_missing_stored_features_bad_shapes_and_ranks():
    component = WeightedPooledOutputDistillationLossComponent()
    current = [torch.zeros(2, 3), torch.zeros(2, 3)]
    with pytest.raises(ValueError, match="'intermediate_representation_1'"):
        component.loss(torch.zeros(2, 2), batch_with([torch.zeros(2, 3)]), current)
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 3\)"):
        component.loss(torch.zeros(2, 2), batch_with([torch.zeros(2, 4)]), current[:1])
    with pytest.raises(ValueError, match=r"\(N, C, H, W\) or \(N, D\)"):
        component.loss(
            torch.zeros(2, 2), batch_with([torch.zeros(2, 3, 4)]), [torch.zeros(2, 3, 4)]
        )
    with pytest.raises(ValueError, match="did the recorded module run"):
        component.loss(torch.zeros(2, 2), batch_with([torch.zeros(2, 3)]), [None])
