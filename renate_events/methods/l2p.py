"""L2P: Learning to Prompt, a pool of prompts chosen by key-query matching on a frozen ViT.

Wang, Zhang, Lee, Zhang, Sun, Ren, Su, Perot, Dy and Pfister, "Learning to Prompt for Continual
Learning", CVPR 2022. A pool of ``pool_size`` prompts of ``prompt_size`` tokens, each with a key;
the frozen model's class-token feature of an image is its query, the ``pool_selection_size``
keys of highest cosine similarity choose the prompts, which are inserted after the class token
(prompt-tuning); the head reads the mean of the prompt tokens' outputs. The surrogate loss pulls
the chosen keys towards their queries. Hyperparameter names are Renate's (``pool_size``,
``pool_selection_size``, ``prompt_size``, ``prompt_sim_loss_weight``, ``per_batch_prompt``).
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from renate_events.methods._prompting import (
    PromptLearner,
    PromptModule,
    batchwise_keys,
    key_similarity,
    pull_loss,
    top_k_keys,
)
from renate_events.methods.registry import MethodSpec, register
from renate_events.vision_transformer import ViTBackbone
from trainer import validators

__all__ = ["SPEC", "LearningToPromptLearner", "PromptPool"]


class PromptPool(PromptModule):
    """L2P's prompt pool: ``prompts`` ``(pool_size, prompt_size, dim)`` and ``keys``
    ``(pool_size, dim)``, both drawn uniformly from [-1, 1] as in the reference implementation.

    Args:
        dim: The backbone's token width.
        pool_size: Prompts in the pool (M in the paper).
        pool_selection_size: Prompts chosen per image (N).
        prompt_size: Tokens per prompt (L_p).
        prompt_sim_loss_weight: Weight of the surrogate loss (minus the summed cosine similarity
            of each query to its chosen keys, averaged over the batch).
        per_batch_prompt: In training, every image of a batch gets the prompts chosen most often
            in the batch (the reference implementation's ``batchwise_prompt``); evaluation
            always chooses per image.
    """

    def __init__(
        self,
        dim: int,
        pool_size: int,
        pool_selection_size: int,
        prompt_size: int,
        prompt_sim_loss_weight: float,
        per_batch_prompt: bool,
    ) -> None:
        super().__init__()
        self.prompts = nn.Parameter(torch.empty(pool_size, prompt_size, dim).uniform_(-1, 1))
        self.keys = nn.Parameter(torch.empty(pool_size, dim).uniform_(-1, 1))
        self.pool_selection_size = pool_selection_size
        self.prompt_sim_loss_weight = prompt_sim_loss_weight
        self.per_batch_prompt = per_batch_prompt

    def select(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen prompts' indices ``(batch, N)`` and the query-key similarities."""
        similarity = key_similarity(query, self.keys)
        indices = top_k_keys(similarity, self.pool_selection_size)
        if self.per_batch_prompt and self.training:
            indices = batchwise_keys(indices, len(self.keys))
        return indices, similarity

    def forward(self, backbone: ViTBackbone, images: torch.Tensor) -> torch.Tensor:
        indices, similarity = self.select(self.query(backbone, images))
        self.record(self.prompt_sim_loss_weight * pull_loss(similarity, indices))
        prompts = self.prompts[indices].flatten(1, 2)  # (batch, N * prompt_size, dim)
        tokens = backbone.embed(images)
        tokens = torch.cat([tokens[:, :1], prompts.to(tokens.dtype), tokens[:, 1:]], dim=1)
        return backbone.encode(tokens)[:, 1 : 1 + prompts.shape[1]].mean(dim=1)


@attrs.define(eq=False)
class LearningToPromptLearner(PromptLearner):
    """L2P on a frozen ViT (Wang et al., "Learning to Prompt for Continual Learning", CVPR
    2022): see :class:`PromptPool`. Defaults: the paper's pool of 10 prompts of 5 tokens, 5
    chosen per image; the reference implementation's surrogate-loss weight 0.1 and batch-wise
    choice in training.

    Example:
        >>> import torch
        >>> from renate_events.models import vit
        >>> from trainer import Trainer
        >>> model = vit(num_classes=4, image_size=8, patch_size=4, dim=32, depth=2)
        >>> learner = LearningToPromptLearner(model=model, trainer=Trainer(max_epochs=1))
        >>> images, labels = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
        >>> data = torch.utils.data.TensorDataset(images, labels)
        >>> learner.fit(data).steps
        1
        >>> model.backbone.patch.weight.requires_grad, model.backbone.prompt.keys.requires_grad
        (False, True)
    """

    pool_size: int = attrs.field(default=10, kw_only=True, validator=validators.int_at_least(1))
    pool_selection_size: int = attrs.field(
        default=5, kw_only=True, validator=validators.int_at_least(1)
    )
    prompt_size: int = attrs.field(default=5, kw_only=True, validator=validators.int_at_least(1))
    prompt_sim_loss_weight: float = attrs.field(
        default=0.1, kw_only=True, validator=validators.real_in_range(0)
    )
    per_batch_prompt: bool = attrs.field(default=True, kw_only=True, validator=validators.boolean)

    def make_prompt(self, backbone: ViTBackbone) -> PromptModule:
        if self.pool_selection_size > self.pool_size:
            raise ValueError(
                f"{type(self).__name__}.pool_selection_size must be at most pool_size "
                f"{self.pool_size}, got {self.pool_selection_size}"
            )
        return PromptPool(
            backbone.dim,
            self.pool_size,
            self.pool_selection_size,
            self.prompt_size,
            self.prompt_sim_loss_weight,
            self.per_batch_prompt,
        )


SPEC = register(
    MethodSpec(
        name="l2p",
        learner=LearningToPromptLearner,
        summary="L2P: a pool of prompts chosen by key-query matching, on a frozen Vision "
        "Transformer (Wang et al., 'Learning to Prompt for Continual Learning', CVPR 2022)",
        uses_memory=False,
        model="vit",
    )
)
