"""L2P (Wang et al., CVPR 2022): the prompt pool's forward and surrogate loss against a
hand-written reference on a tiny random ViT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from renate_events.methods.l2p import PromptPool
from renate_events.models import vit


def _reference(backbone, pool, images, batchwise):
    """L2P written out: cosine of the frozen query to every key, the top keys (the batch's most
    frequent ones with ``batchwise``), their prompts after the class token, the mean of the
    prompt tokens' outputs; the surrogate loss."""
    with torch.no_grad():
        query = backbone.encode(backbone.embed(images))[:, 0]
    similarity = torch.stack([F.cosine_similarity(q.unsqueeze(0), pool.keys) for q in query])
    chosen = similarity.topk(pool.pool_selection_size, dim=1).indices
    if batchwise:
        counts = torch.bincount(chosen.flatten(), minlength=len(pool.keys))
        top = counts.topk(pool.pool_selection_size).indices
        chosen = top.expand(len(images), -1)
    tokens = backbone.embed(images)
    prompts = torch.cat([pool.prompts[i].flatten(0, 1).unsqueeze(0) for i in chosen])
    out = backbone.encode(torch.cat([tokens[:, :1], prompts, tokens[:, 1:]], dim=1))
    features = out[:, 1 : 1 + prompts.shape[1]].mean(1)
    pulled = sum(similarity[b, m] for b in range(len(images)) for m in chosen[b])
    return features, -pool.prompt_sim_loss_weight * pulled / len(images)


@pytest.mark.parametrize("training", [False, True])
def test_the_pool_matches_a_hand_written_l2p(training):
    torch.manual_seed(0)
    model = vit(num_classes=3, image_size=8, patch_size=4, dim=32, depth=2)
    pool = PromptPool(32, pool_size=6, pool_selection_size=2, prompt_size=3,
                      prompt_sim_loss_weight=0.1, per_batch_prompt=True)  # fmt: skip
    model.backbone.attach_prompt(pool)
    model.train(training)
    images = torch.randn(5, 3, 8, 8)
    features = model.backbone(images)
    expected, loss = _reference(model.backbone, pool, images, batchwise=training)
    assert torch.allclose(features, expected, atol=1e-5)
    recorded = pool.take_loss()
    if training:
        assert recorded is not None and torch.allclose(recorded, loss, atol=1e-5)
    else:
        assert recorded is None  # evaluation records nothing
