"""The project's Vision Transformer backbone, with what prompting a frozen ViT needs.

Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image Recognition at
Scale", ICLR 2021: a patch embedding, a class token, learned position embeddings, pre-norm
encoder blocks and a final layer norm; the class token's output is the feature of an image.
Beside the plain forward, :class:`ViTBackbone` exposes the pieces the prompt methods of
:mod:`renate_events.methods` build on: :meth:`~ViTBackbone.embed` (the tokens before the first
block), :meth:`~ViTBackbone.encode` (the blocks, with prefix keys and values injected into chosen
layers: prefix-tuning) and :meth:`~ViTBackbone.query` (the class token's feature of the model
without prompts), and a slot for a prompt module (:meth:`~ViTBackbone.attach_prompt`) that the
forward then runs through.

The blocks keep the parameter names of ``torch.nn.TransformerEncoderLayer`` (``self_attn.
in_proj_weight``, ``linear1``, ``norm1``, ...), so state dicts of the zoo's ``vit`` written before
this module existed load unchanged; :mod:`renate_events.pretrained` maps a Hugging Face
``ViTModel``'s weights onto them.

Example:
    >>> import torch
    >>> backbone = ViTBackbone(image_size=8, patch_size=4, in_channels=3, dim=32, depth=2, heads=4)
    >>> backbone(torch.zeros(2, 3, 8, 8)).shape
    torch.Size([2, 32])
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "Block", "Prefix", "ViTBackbone"]

Prefix = tuple[torch.Tensor, torch.Tensor]
"""Prefix keys and values of one layer, each ``(batch, length, dim)``: prepended to the keys and
values of the layer's self-attention (Li and Liang, "Prefix-Tuning", ACL 2021)."""


class Attention(nn.Module):
    """Multi-head self-attention with ``nn.MultiheadAttention``'s parameter names, and optional
    prefix keys and values."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        # The order of nn.MultiheadAttention's initialisation: the same seed gives the same model.
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.out_proj = nn.Linear(dim, dim)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.in_proj_bias)
        nn.init.zeros_(self.out_proj.bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, tokens, dim)`` to ``(batch, heads, tokens, dim / heads)``."""
        batch, tokens, dim = x.shape
        return x.view(batch, tokens, self.heads, dim // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, prefix: Prefix | None = None) -> torch.Tensor:
        query, key, value = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        if prefix is not None:
            key = torch.cat([prefix[0], key], dim=1)
            value = torch.cat([prefix[1], value], dim=1)
        out = F.scaled_dot_product_attention(
            self._heads(query), self._heads(key), self._heads(value)
        )
        return self.out_proj(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """A pre-norm encoder block: ``x + attention(norm1(x))``, then ``x + mlp(norm2(x))`` with a
    GELU between ``linear1`` and ``linear2``."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, eps: float) -> None:
        super().__init__()
        self.self_attn = Attention(dim, heads)
        self.linear1 = nn.Linear(dim, mlp_dim)
        self.linear2 = nn.Linear(mlp_dim, dim)
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.norm2 = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, prefix: Prefix | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x), prefix)
        return x + self.linear2(F.gelu(self.linear1(self.norm2(x))))


class ViTBackbone(nn.Module):
    """Images to the class token's feature, through ``depth`` pre-norm blocks.

    Args:
        image_size: Height and width of the (square) images.
        patch_size: Height and width of a patch (a token).
        in_channels: Channels of the images.
        dim: Width of the tokens.
        depth: Number of blocks.
        heads: Attention heads (a divisor of ``dim``).
        mlp_dim: Hidden width of each block's MLP (default ``4 * dim``).
        eps: The layer norms' epsilon (``1e-5`` as PyTorch's; Hugging Face ViTs use ``1e-12``).
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        in_channels: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_dim: int | None = None,
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        patches = (image_size // patch_size) ** 2
        self.patch = nn.Conv2d(in_channels, dim, patch_size, patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.position = nn.Parameter(torch.randn(1, patches + 1, dim) * 0.02)
        mlp_dim = 4 * dim if mlp_dim is None else mlp_dim
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_dim, eps) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.image_size = image_size
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.dim, self.depth, self.heads, self.mlp_dim = dim, depth, heads, mlp_dim
        self.eps = eps
        self.prompt: nn.Module | None = None

    def attach_prompt(self, prompt: nn.Module) -> None:
        """Run :meth:`forward` through ``prompt`` (``prompt(backbone, images) -> features``);
        its parameters become the backbone's (``prompt.*`` in the state dict)."""
        self.prompt = prompt

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens before the first block: ``(batch, 1 + patches, dim)``, the class token
        first, position embeddings added."""
        if x.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"vit: images must be {self.image_size}x{self.image_size}, got "
                f"{tuple(x.shape[-2:])}; build it with image_size={x.shape[-1]}"
            )
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        return torch.cat([self.cls.expand(len(x), -1, -1), tokens], dim=1) + self.position

    def encode(
        self, tokens: torch.Tensor, prefixes: Mapping[int, Prefix] | None = None
    ) -> torch.Tensor:
        """The blocks and the final norm over ``tokens``; ``prefixes[layer]`` is prepended to
        that layer's keys and values."""
        for layer, block in enumerate(self.blocks):
            tokens = block(tokens, None if prefixes is None else prefixes.get(layer))
        return self.norm(tokens)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """The class token's feature without prompts (the query of key-query matching)."""
        return self.encode(self.embed(x))[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prompt is not None:
            return self.prompt(self, x)
        return self.query(x)
