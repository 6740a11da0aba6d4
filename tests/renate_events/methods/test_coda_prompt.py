"""CODA-Prompt (Smith et al., CVPR 2023): the attention-weighted component sum against a
hand-written one, each update's share of components made orthonormal to the earlier ones and
the earlier ones frozen, the orthogonality penalty."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from renate_events.methods.coda_prompt import PromptComponents
from renate_events.models import vit


def _prompted(ortho_mu: float = 0.0):
    torch.manual_seed(0)
    model = vit(num_classes=3, image_size=8, patch_size=4, dim=32, depth=2)
    components = PromptComponents(32, layers=[0, 1], pool_size=6, length=4, num_tasks=3,
                                  ortho_mu=ortho_mu)  # fmt: skip
    model.backbone.attach_prompt(components)
    return model, components


def test_the_prompt_is_the_hand_written_weighted_sum_of_the_components_in_use():
    model, components = _prompted()
    components.start_task()
    components.start_task()  # the second update: components 0..3 in use
    model.eval()
    images = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        query = model.backbone.query(images)
        prefixes = {}
        for number, layer in enumerate((0, 1)):
            keys, attention = components.keys[number], components.attention[number]
            alpha = torch.zeros(3, 6)
            for b in range(3):
                for m in range(4):
                    alpha[b, m] = F.cosine_similarity(query[b] * attention[m], keys[m], dim=0)
            prompt = torch.einsum("bk,kld->bld", alpha, components.components[number])
            prefixes[layer] = (prompt[:, :2], prompt[:, 2:])
        expected = model.backbone.encode(model.backbone.embed(images), prefixes)[:, 0]
        assert torch.allclose(model.backbone(images), expected, atol=1e-5)


def test_a_new_share_is_orthonormal_to_the_earlier_ones_which_get_no_gradient():
    model, components = _prompted(ortho_mu=0.1)
    components.start_task()
    earlier = components.keys.detach()[:, :2].clone()
    components.start_task()  # the second update: its share is rows 2 and 3
    keys = components.keys.detach()
    assert torch.equal(keys[:, :2], earlier)
    for layer in range(2):
        rows = F.normalize(keys[layer, :4], dim=1)
        new = keys[layer, 2:4]
        assert torch.allclose(new @ new.t(), torch.eye(2), atol=1e-5)
        assert torch.allclose(new @ keys[layer, :2].t(), torch.zeros(2, 2), atol=1e-5)
        assert rows.shape == (4, 32)
    model.train()
    logits = model(torch.randn(4, 3, 8, 8))
    (logits.sum() + components.take_loss()).backward()
    for weights in (components.keys, components.attention, components.components):
        grad = weights.grad
        assert torch.count_nonzero(grad[:, :2]) == 0  # earlier shares frozen
        assert torch.count_nonzero(grad[:, 2:4]) > 0  # this update's share learns
        assert torch.count_nonzero(grad[:, 4:]) == 0  # later shares not in use


def test_the_penalty_is_recorded_with_its_weight():
    model, components = _prompted(ortho_mu=0.5)
    components.start_task()
    model.train()
    model(torch.randn(2, 3, 8, 8))
    loss = components.take_loss()
    assert loss is not None and torch.allclose(loss, components.penalty())
    assert components.take_loss() is None
