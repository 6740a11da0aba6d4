"""CODA-Prompt: prompts assembled from components by attention-weighted key matching.

Smith, Karlinsky, Gutta, Cascante-Bonilla, Kim, Arbelle, Panda, Feris and Kira, "CODA-Prompt:
COntinual Decomposed Attention-based Prompting for Rehearsal-Free Continual Learning", CVPR
2023. Each prompted block has ``pool_size`` prompt components ``P_m``, keys ``K_m`` and attention
vectors ``A_m``; an image's prompt is ``sum_m alpha_m P_m`` with ``alpha_m = cos(q * A_m, K_m)``
(``q`` the frozen model's class-token feature), split in halves into prefix keys and values
(prefix-tuning). The components are divided among ``num_tasks`` updates: update ``t`` adds its
share (initialised orthogonal to the earlier ones, Gram-Schmidt) and trains only it, the
earlier components frozen; the orthogonality penalty on keys, attention vectors and
components is weighted by ``ortho_mu``. End to end: no surrogate key loss. The head reads the
class token. Defaults: the reference implementation's (100 components of length 8 at blocks 0
to 4, 10 tasks, ``ortho_mu`` 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from renate_events.methods._prompting import (
    PromptLearner,
    PromptModule,
    check_layers,
    orthogonal_rows_,
    orthogonality_penalty,
)
from renate_events.methods.registry import MethodSpec, register
from renate_events.vision_transformer import Prefix, ViTBackbone
from trainer import validators

__all__ = ["SPEC", "CodaPromptLearner", "PromptComponents"]


class PromptComponents(PromptModule):
    """CODA-Prompt's ``components`` ``(len(layers), pool_size, length, dim)``, ``keys`` and
    ``attention`` ``(len(layers), pool_size, dim)``; each update's share is made orthonormal to
    the earlier ones when its update starts.

    Args:
        dim: The backbone's token width.
        layers: The prompted blocks.
        pool_size: Components per block (a multiple of ``num_tasks``).
        length: Prefix length of a prompt (even: half keys, half values).
        num_tasks: Updates the components are divided among; later updates keep using the
            last share.
        ortho_mu: Weight of the orthogonality penalty.
    """

    def __init__(
        self,
        dim: int,
        layers: Sequence[int],
        pool_size: int,
        length: int,
        num_tasks: int,
        ortho_mu: float,
    ) -> None:
        super().__init__()
        self.layers = tuple(layers)
        count = len(self.layers)
        self.components = nn.Parameter(torch.empty(count, pool_size, length, dim).uniform_())
        self.keys = nn.Parameter(torch.empty(count, pool_size, dim).uniform_())
        self.attention = nn.Parameter(torch.empty(count, pool_size, dim).uniform_())
        self.per_task = pool_size // num_tasks
        self.num_tasks = num_tasks
        self.ortho_mu = ortho_mu

    def new_task(self, task: int) -> None:
        task = min(task, self.num_tasks - 1)
        start, stop = task * self.per_task, (task + 1) * self.per_task
        for weights in (self.components, self.keys, self.attention):
            for layer in weights:
                orthogonal_rows_(layer, start, stop)

    def _shares(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean ``(pool,)`` masks, on the device: the components in use (this update's share
        and the earlier ones) and the earlier ones (frozen in training)."""
        index = torch.arange(self.keys.shape[1], device=self.keys.device)
        task = self.task.clamp(0, self.num_tasks - 1)
        return index < (task + 1) * self.per_task, index < task * self.per_task

    def _trained(self, weights: torch.Tensor) -> torch.Tensor:
        """One block's ``(pool, ...)`` weights, the earlier updates' rows without gradients in
        training (as the reference implementation detaches them)."""
        if not self.training:
            return weights
        earlier = self._shares()[1].view(-1, *([1] * (weights.dim() - 1)))
        return torch.where(earlier, weights.detach(), weights)

    def weights(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """``alpha`` ``(batch, pool)`` of prompted block number ``layer`` (of ``layers``): the
        cosine of the attended query to each key, 0 for components not in use; the earlier
        updates' keys and attention vectors without gradients in training."""
        active = self._shares()[0]
        keys, attention = self._trained(self.keys[layer]), self._trained(self.attention[layer])
        attended = F.normalize(query.unsqueeze(1) * attention, dim=2)  # (batch, pool, dim)
        alpha = torch.einsum("bkd,kd->bk", attended, F.normalize(keys, dim=1))
        return alpha * active

    def prefix(self, alpha: torch.Tensor, layer: int) -> Prefix:
        """The prefix keys and values of prompted block number ``layer``."""
        components = self._trained(self.components[layer])
        prompt = torch.einsum("bk,kld->bld", alpha, components)
        half = prompt.shape[1] // 2
        return prompt[:, :half], prompt[:, half:]

    def penalty(self) -> torch.Tensor:
        """The orthogonality penalty summed over the blocks, on the components in use (the
        earlier updates' without gradients in training)."""
        active = self._shares()[0]
        total = self.keys.new_zeros(())
        for layer in range(len(self.layers)):
            for weights in (self.keys, self.attention, self.components):
                total = total + orthogonality_penalty(self._trained(weights[layer]), active)
        return self.ortho_mu * total

    def forward(self, backbone: ViTBackbone, images: torch.Tensor) -> torch.Tensor:
        query = self.query(backbone, images)
        tokens = backbone.embed(images)
        prefixes = {}
        for number, layer in enumerate(self.layers):
            key, value = self.prefix(self.weights(query, number), number)
            prefixes[layer] = (key.to(tokens.dtype), value.to(tokens.dtype))
        if self.ortho_mu > 0:
            self.record(self.penalty())
        return backbone.encode(tokens, prefixes)[:, 0]


@attrs.define(eq=False)
class CodaPromptLearner(PromptLearner):
    """CODA-Prompt on a frozen ViT (Smith et al., "CODA-Prompt: COntinual Decomposed
    Attention-based Prompting for Rehearsal-Free Continual Learning", CVPR 2023): see
    :class:`PromptComponents`.

    Example:
        >>> import torch
        >>> from renate_events.models import vit
        >>> from trainer import Trainer
        >>> model = vit(num_classes=4, image_size=8, patch_size=4, dim=32, depth=2)
        >>> learner = CodaPromptLearner(model=model, pool_size=10, num_tasks=5,
        ...                             prompt_layers=[0, 1], trainer=Trainer(max_epochs=1))
        >>> images, labels = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
        >>> data = torch.utils.data.TensorDataset(images, labels)
        >>> learner.fit(data).steps
        1
    """

    pool_size: int = attrs.field(default=100, kw_only=True, validator=validators.int_at_least(1))
    prompt_length: int = attrs.field(default=8, kw_only=True, validator=validators.int_at_least(2))
    prompt_layers: Sequence[int] = attrs.field(
        default=(0, 1, 2, 3, 4), kw_only=True, converter=tuple
    )
    num_tasks: int = attrs.field(default=10, kw_only=True, validator=validators.int_at_least(1))
    ortho_mu: float = attrs.field(default=0.0, kw_only=True, validator=validators.real_in_range(0))

    def make_prompt(self, backbone: ViTBackbone) -> PromptModule:
        name = type(self).__name__
        layers = check_layers(name, "prompt_layers", self.prompt_layers, backbone.depth)
        if self.prompt_length % 2:
            raise ValueError(
                f"{name}.prompt_length must be even (half prefix keys, half values), got "
                f"{self.prompt_length}"
            )
        if self.pool_size % self.num_tasks:
            raise ValueError(
                f"{name}.pool_size {self.pool_size} must be a multiple of num_tasks "
                f"{self.num_tasks} (each update adds pool_size / num_tasks components)"
            )
        return PromptComponents(
            backbone.dim, layers, self.pool_size, self.prompt_length, self.num_tasks, self.ortho_mu
        )


SPEC = register(
    MethodSpec(
        name="coda-prompt",
        learner=CodaPromptLearner,
        summary="CODA-Prompt: prompts assembled from per-task components by attention-weighted "
        "key matching, prefix-tuning a frozen Vision Transformer (Smith et al., 'CODA-Prompt: "
        "COntinual Decomposed Attention-based Prompting for Rehearsal-Free Continual Learning', "
        "CVPR 2023)",
        uses_memory=False,
        model="vit",
    )
)
