"""DualPrompt: a shared G-prompt and per-task E-prompts, prefix-tuning a frozen ViT.

Wang, Zhang, Ebrahimi, Sun, Zhang, Lee, Ren, Su, Perot, Dy and Pfister, "DualPrompt:
Complementary Prompting for Rehearsal-free Continual Learning", ECCV 2022. A G(eneral)-prompt
shared by every task is prefixed to the keys and values of the blocks ``g_prompt_layers``; one
E(xpert)-prompt per task, with a key, to those of the blocks ``e_prompt_layers``. In training,
update ``t`` uses and learns E-prompt ``t`` and pulls its key towards the queries; in evaluation
the key most similar (cosine) to the frozen model's class-token feature chooses the E-prompt.
The head reads the class token. Defaults: the reference implementation's CIFAR-100 settings.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import nn

from renate_events.methods._prompting import (
    PromptLearner,
    PromptModule,
    check_layers,
    key_similarity,
    pull_loss,
    top_k_keys,
)
from renate_events.methods.registry import MethodSpec, register
from renate_events.vision_transformer import Prefix, ViTBackbone
from trainer import validators

__all__ = ["SPEC", "DualPromptLearner", "DualPrompts"]


class DualPrompts(PromptModule):
    """The G-prompt ``g_prompts`` ``(len(g_layers), 2, g_length, dim)`` (keys' and values'
    prefixes of each layer), the E-prompts ``e_prompts`` ``(len(e_layers), 2, pool_size,
    e_length, dim)`` and their ``keys`` ``(pool_size, dim)``, all drawn uniformly from [-1, 1].

    Args:
        dim: The backbone's token width.
        g_layers, g_length: The G-prompt's blocks and its prefix length.
        e_layers, e_length: The E-prompts' blocks and their prefix length.
        pool_size: E-prompts (the most updates the learner can take).
        pull_constraint_coeff: Weight of the loss pulling the chosen key to the queries.
    """

    def __init__(
        self,
        dim: int,
        g_layers: Sequence[int],
        g_length: int,
        e_layers: Sequence[int],
        e_length: int,
        pool_size: int,
        pull_constraint_coeff: float,
    ) -> None:
        super().__init__()
        self.g_layers, self.e_layers = tuple(g_layers), tuple(e_layers)
        g_shape = (len(g_layers), 2, g_length, dim)
        self.g_prompts = nn.Parameter(torch.empty(g_shape).uniform_(-1, 1))
        e_shape = (len(e_layers), 2, pool_size, e_length, dim)
        self.e_prompts = nn.Parameter(torch.empty(e_shape).uniform_(-1, 1))
        self.keys = nn.Parameter(torch.empty(pool_size, dim).uniform_(-1, 1))
        self.pull_constraint_coeff = pull_constraint_coeff

    def check_loaded(self) -> None:
        super().check_loaded()
        if int(self.task) >= len(self.keys):
            raise ValueError(
                f"key 'backbone.prompt.task' must be below the pool's {len(self.keys)} "
                f"E-prompts, got {int(self.task)}"
            )

    def check_updates(self, count: int) -> None:
        last = int(self.task) + count  # the E-prompt of the last of these updates
        if last >= len(self.keys):
            raise ValueError(
                f"DualPromptLearner.pool_size must be at least {last + 1} for "
                f"{count} more update{'s' if count > 1 else ''} (one E-prompt each), got "
                f"{len(self.keys)}; build the learner with a larger pool_size"
            )

    def select(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The E-prompt of each image ``(batch, 1)``: the update's own in training, the most
        similar key's in evaluation; and the query-key similarities."""
        similarity = key_similarity(query, self.keys)
        if self.training:
            indices = self.task.clamp(min=0).expand(len(query), 1)
        else:
            indices = top_k_keys(similarity, 1)
        return indices, similarity

    def prefixes(self, indices: torch.Tensor, batch: int) -> dict[int, Prefix]:
        """Every prompted block's prefix keys and values, ``(batch, length, dim)`` each."""
        prefixes: dict[int, Prefix] = {}
        for g, layer in zip(self.g_prompts, self.g_layers):
            prefixes[layer] = (g[0].expand(batch, -1, -1), g[1].expand(batch, -1, -1))
        for e, layer in zip(self.e_prompts, self.e_layers):
            key, value = e[0][indices[:, 0]], e[1][indices[:, 0]]
            if layer in prefixes:  # a block with both: the G-prompt's tokens first
                key = torch.cat([prefixes[layer][0], key], dim=1)
                value = torch.cat([prefixes[layer][1], value], dim=1)
            prefixes[layer] = (key, value)
        return prefixes

    def forward(self, backbone: ViTBackbone, images: torch.Tensor) -> torch.Tensor:
        indices, similarity = self.select(self.query(backbone, images))
        self.record(self.pull_constraint_coeff * pull_loss(similarity, indices))
        tokens = backbone.embed(images)
        prefixes = {
            layer: (key.to(tokens.dtype), value.to(tokens.dtype))
            for layer, (key, value) in self.prefixes(indices, len(images)).items()
        }
        return backbone.encode(tokens, prefixes)[:, 0]


@attrs.define(eq=False)
class DualPromptLearner(PromptLearner):
    """DualPrompt on a frozen ViT (Wang et al., "DualPrompt: Complementary Prompting for
    Rehearsal-free Continual Learning", ECCV 2022): see :class:`DualPrompts`. Defaults: the
    reference implementation's CIFAR-100 settings (G-prompt of length 5 at blocks 0 and 1,
    E-prompts of length 5 at blocks 2 to 4, a pool of 10, pull weight 1); the blocks must exist
    in the model (a ViT of at least 5 blocks for the defaults).

    Example:
        >>> import torch
        >>> from renate_events.models import vit
        >>> from trainer import Trainer
        >>> model = vit(num_classes=4, image_size=8, patch_size=4, dim=32, depth=2)
        >>> learner = DualPromptLearner(model=model, g_prompt_layers=[0], e_prompt_layers=[1],
        ...                             trainer=Trainer(max_epochs=1))
        >>> images, labels = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
        >>> data = torch.utils.data.TensorDataset(images, labels)
        >>> learner.fit(data).steps
        1
    """

    g_prompt_length: int = attrs.field(
        default=5, kw_only=True, validator=validators.int_at_least(1)
    )
    g_prompt_layers: Sequence[int] = attrs.field(default=(0, 1), kw_only=True, converter=tuple)
    e_prompt_length: int = attrs.field(
        default=5, kw_only=True, validator=validators.int_at_least(1)
    )
    e_prompt_layers: Sequence[int] = attrs.field(default=(2, 3, 4), kw_only=True, converter=tuple)
    pool_size: int = attrs.field(default=10, kw_only=True, validator=validators.int_at_least(1))
    pull_constraint_coeff: float = attrs.field(
        default=1.0, kw_only=True, validator=validators.real_in_range(0)
    )

    def make_prompt(self, backbone: ViTBackbone) -> PromptModule:
        name = type(self).__name__
        g_layers = check_layers(name, "g_prompt_layers", self.g_prompt_layers, backbone.depth)
        e_layers = check_layers(name, "e_prompt_layers", self.e_prompt_layers, backbone.depth)
        return DualPrompts(
            backbone.dim,
            g_layers,
            self.g_prompt_length,
            e_layers,
            self.e_prompt_length,
            self.pool_size,
            self.pull_constraint_coeff,
        )


SPEC = register(
    MethodSpec(
        name="dualprompt",
        learner=DualPromptLearner,
        summary="DualPrompt: a shared G-prompt and per-task E-prompts chosen by key-query "
        "matching, prefix-tuning a frozen Vision Transformer (Wang et al., 'DualPrompt: "
        "Complementary Prompting for Rehearsal-free Continual Learning', ECCV 2022)",
        uses_memory=False,
        model="vit",
    )
)
