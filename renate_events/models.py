"""A small model zoo for continual learning, usable by name from config files and the CLI.

Every model is a ``torch.nn.Module`` with ``backbone`` (inputs to features) and ``head`` (features
to logits), and a ``feature_module_names`` tuple naming the submodules whose outputs PODNet's
distillation and feature recording use (pass them as a learner's ``feature_modules``).

* :func:`mlp`: fully connected layers with ReLU (the default model of ``renate-events run``);
* :func:`resnet18`: ResNet-18 with a CIFAR stem (3x3 convolution, stride 1, no max-pooling) and
  width ``nf``: ``nf=64`` is the ResNet-18 of the DER paper (Buzzega et al., "Dark Experience for
  General Continual Learning: a Strong, Simple Baseline", NeurIPS 2020), ``nf=20`` the reduced
  ResNet-18 of GEM (Lopez-Paz and Ranzato, "Gradient Episodic Memory for Continual Learning",
  NeurIPS 2017);
* :func:`resnet32`: the CIFAR ResNet-32 of He et al. ("Deep Residual Learning for Image
  Recognition", CVPR 2016: three stages of five basic blocks, 16/32/64 channels), used by iCaRL
  and PODNet;
* :func:`vit`: a small Vision Transformer (Dosovitskiy et al., "An Image is Worth 16x16 Words",
  ICLR 2021) for small images.

Example:
    >>> import torch
    >>> model = build_model("resnet18", num_classes=10, nf=20)
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    >>> model.feature_module_names
    ('backbone.layer1', 'backbone.layer2', 'backbone.layer3', 'backbone.layer4')
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from trainer.validators import check_int

__all__ = ["MODELS", "ClassificationModel", "build_model", "mlp", "resnet18", "resnet32", "vit"]


class ClassificationModel(nn.Module):
    """``head(backbone(x))``, with the names of the feature modules.

    Args:
        backbone: Inputs to a feature vector per sample.
        head: Features to logits.
        feature_module_names: Submodules (dotted names) whose outputs are features worth
            distilling or recording.
        architecture: A short description (recorded in state folders' ``model.json``).
    """

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Module,
        feature_module_names: Sequence[str],
        architecture: str,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.feature_module_names = tuple(feature_module_names)
        self.architecture = architecture
        names = dict(self.named_modules())
        missing = [name for name in self.feature_module_names if name not in names]
        if missing:  # pragma: no cover - a bug in a builder below
            raise ValueError(f"feature modules {missing} are not submodules of {architecture}")

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(inputs))


def mlp(inputs: int, num_classes: int, hidden: Sequence[int] = (256,)) -> ClassificationModel:
    """Fully connected layers with ReLU; inputs of any shape are flattened.

    Args:
        inputs: Features per sample (after flattening).
        num_classes: Outputs.
        hidden: Sizes of the hidden layers.
    """
    check_int("mlp: inputs", inputs, 1)
    check_int("mlp: num_classes", num_classes, 1)
    if isinstance(hidden, (str, bytes)) or not isinstance(hidden, Sequence):
        raise TypeError(f"mlp: hidden must be a list of layer sizes, got {hidden!r}")
    for size in hidden:
        check_int("mlp: each hidden size", size, 1, 2**20)
    layers: list[nn.Module] = [nn.Flatten()]
    width = inputs
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    backbone = nn.Sequential(*layers)
    features = [f"backbone.{2 * i + 2}" for i in range(len(hidden))]  # the ReLU outputs
    return ClassificationModel(
        backbone, nn.Linear(width, num_classes), features, f"mlp({inputs}, {list(hidden)})"
    )


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 projection when the shape
    changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def _stage(channels_in: int, channels_out: int, blocks: int, stride: int) -> nn.Sequential:
    layers = [_BasicBlock(channels_in, channels_out, stride)]
    layers += [_BasicBlock(channels_out, channels_out, 1) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


class _ResNetBackbone(nn.Module):
    def __init__(self, in_channels: int, widths: Sequence[int], blocks: Sequence[int]) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        previous = widths[0]
        for index, (width, count) in enumerate(zip(widths, blocks), start=1):
            stride = 1 if index == 1 else 2
            self.add_module(f"layer{index}", _stage(previous, width, count, stride))
            previous = width
        self.stages = len(widths)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.out_features = previous

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for index in range(1, self.stages + 1):
            x = getattr(self, f"layer{index}")(x)
        return self.pool(x)


def _resnet(
    name: str, num_classes: int, in_channels: int, widths: Sequence[int], blocks: Sequence[int]
) -> ClassificationModel:
    check_int(f"{name}: num_classes", num_classes, 1)
    check_int(f"{name}: in_channels", in_channels, 1)
    backbone = _ResNetBackbone(in_channels, widths, blocks)
    features = [f"backbone.layer{i}" for i in range(1, len(widths) + 1)]
    return ClassificationModel(
        backbone, nn.Linear(backbone.out_features, num_classes), features, name
    )


def resnet18(num_classes: int, nf: int = 64, in_channels: int = 3) -> ClassificationModel:
    """ResNet-18 with a CIFAR stem and stage widths ``nf, 2nf, 4nf, 8nf``.

    Args:
        num_classes: Outputs.
        nf: Width of the first stage (64: DER's ResNet-18, 11.2M parameters for 10 classes; 20:
            GEM's reduced ResNet-18, 1.1M).
        in_channels: Channels of the input images.
    """
    check_int("resnet18: nf", nf, 1, 4097)
    widths = (nf, 2 * nf, 4 * nf, 8 * nf)
    return _resnet(f"resnet18(nf={nf})", num_classes, in_channels, widths, (2, 2, 2, 2))


def resnet32(num_classes: int, in_channels: int = 3) -> ClassificationModel:
    """The CIFAR ResNet-32: three stages of five basic blocks, 16, 32 and 64 channels (0.46M
    parameters for 10 classes)."""
    return _resnet("resnet32", num_classes, in_channels, (16, 32, 64), (5, 5, 5))


class _ViTBackbone(nn.Module):
    def __init__(
        self, image_size: int, patch_size: int, in_channels: int, dim: int, depth: int, heads: int
    ) -> None:
        super().__init__()
        patches = (image_size // patch_size) ** 2
        self.patch = nn.Conv2d(in_channels, dim, patch_size, patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.position = nn.Parameter(torch.randn(1, patches + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim,
                heads,
                4 * dim,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.image_size = image_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"vit: images must be {self.image_size}x{self.image_size}, got "
                f"{tuple(x.shape[-2:])}; build it with image_size={x.shape[-1]}"
            )
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(len(x), -1, -1), tokens], dim=1) + self.position
        for block in self.blocks:
            tokens = block(tokens)
        return self.norm(tokens[:, 0])


def vit(
    num_classes: int,
    image_size: int = 32,
    patch_size: int = 4,
    in_channels: int = 3,
    dim: int = 128,
    depth: int = 6,
    heads: int = 4,
) -> ClassificationModel:
    """A small Vision Transformer: patch embedding, ``depth`` pre-norm encoder blocks, the class
    token's features to the head."""
    check_int("vit: num_classes", num_classes, 1)
    check_int("vit: patch_size", patch_size, 1)
    check_int("vit: image_size", image_size, patch_size)
    if image_size % patch_size:
        raise ValueError(
            f"vit: image_size {image_size} is not a multiple of patch_size {patch_size}"
        )
    check_int("vit: heads", heads, 1)
    check_int("vit: dim", dim, heads)
    if dim % heads:
        raise ValueError(f"vit: dim {dim} is not a multiple of heads {heads}")
    check_int("vit: depth", depth, 1)
    backbone = _ViTBackbone(image_size, patch_size, in_channels, dim, depth, heads)
    features = [f"backbone.blocks.{i}" for i in range(depth)]
    name = f"vit(image_size={image_size}, patch_size={patch_size}, dim={dim}, depth={depth})"
    return ClassificationModel(backbone, nn.Linear(dim, num_classes), features, name)


MODELS: dict[str, Callable[..., ClassificationModel]] = {
    "mlp": mlp,
    "resnet18": resnet18,
    "resnet32": resnet32,
    "vit": vit,
}
"""The zoo by name, for config files (``build_model("resnet18", num_classes=10)``) and the CLI."""


def build_model(name: str, **kwargs: Any) -> ClassificationModel:
    """Build a model of :data:`MODELS` by name.

    Raises:
        ValueError: An unknown name, or an argument the model does not take (the message lists
            the ones it takes).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    builder = MODELS[name]
    parameters = inspect.signature(builder).parameters
    unknown = sorted(set(kwargs) - set(parameters))
    missing = [
        p for p, spec in parameters.items() if spec.default is spec.empty and p not in kwargs
    ]
    if unknown or missing:
        takes = ", ".join(
            p if spec.default is spec.empty else f"{p}={spec.default!r}"
            for p, spec in parameters.items()
        )
        problem = f"does not take {unknown}" if unknown else f"needs {missing}"
        raise ValueError(f"model {name!r} {problem}; it takes {takes}")
    return builder(**kwargs)
