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

:class:`MultiHeadClassificationModel` turns any of them into a task-incremental model: one shared
backbone and one linear head per task id, added with ``add_task_params(task_id, num_outputs)`` as
in Renate's ``RenateModule``. The single-head :class:`ClassificationModel` stays the default.

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
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from renate_events.vision_transformer import ViTBackbone
from trainer.validators import WrongTypeError, check_int
from trainer.validators import is_int as validators_is_int

__all__ = [
    "MODELS",
    "ClassificationModel",
    "MultiHeadClassificationModel",
    "build_model",
    "mlp",
    "resnet18",
    "resnet32",
    "vit",
]


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


_HEAD_KEY = re.compile(r"^heads\.(0|[1-9][0-9]{0,8})\.(weight|bias)$")


class MultiHeadClassificationModel(nn.Module):
    """A shared backbone and one linear head per task: ``heads[str(task_id)](backbone(x))``.

    Heads are added by task id with :meth:`add_task_params` (Renate's ``add_task_params``) and
    live in the ``nn.ModuleDict`` ``heads``, so a state dict names them predictably:
    ``heads.<task_id>.weight`` (``(num_outputs, in_features)``) and ``heads.<task_id>.bias``.
    Training one head leaves the others untouched (they get no gradient).

    How the task id reaches the model:

    * ``model(x, task_id=2)``: every sample through head 2;
    * ``model(x, task_id=ids)`` with an ``int64`` tensor of one id per sample: each sample through
      its own head (the heads must have the same number of outputs; the ids present are read on
      the host, one synchronisation per call);
    * ``model(x)``: the head of :attr:`current_task_id`, set with :meth:`set_task` (for a learner
      or evaluator that calls ``model(inputs)`` without a task id).

    An id without a head raises ``ValueError`` naming the ids that have one.

    Args:
        backbone: Inputs to a feature vector of ``in_features`` per sample.
        in_features: Features per sample, the inputs of every head.
        feature_module_names: Submodules (dotted names) worth distilling or recording.
        architecture: A short description (recorded in state folders' ``model.json``).
        num_outputs: Outputs of a head added without a size (``add_task_params(task_id)``, as a
            learner does for the new task ids of its data); :meth:`from_model` takes the dropped
            head's. None: every head needs its size.

    Example:
        >>> import torch
        >>> model = MultiHeadClassificationModel.from_model(mlp(4, num_classes=2, hidden=[8]))
        >>> model.add_task_params(0, 2); model.add_task_params(1, 3)
        >>> model(torch.zeros(5, 4), task_id=1).shape
        torch.Size([5, 3])
        >>> sorted(k for k in model.state_dict() if k.startswith("heads."))
        ['heads.0.bias', 'heads.0.weight', 'heads.1.bias', 'heads.1.weight']
    """

    def __init__(
        self,
        backbone: nn.Module,
        in_features: int,
        feature_module_names: Sequence[str] = (),
        architecture: str = "multi-head",
        num_outputs: int | None = None,
    ) -> None:
        super().__init__()
        check_int("MultiHeadClassificationModel.in_features", in_features, 1)
        if num_outputs is not None:
            check_int("MultiHeadClassificationModel.num_outputs", num_outputs, 1)
        self.num_outputs = num_outputs
        self.backbone = backbone
        self.heads = nn.ModuleDict()
        self.in_features = in_features
        self.feature_module_names = tuple(feature_module_names)
        self.architecture = architecture
        self.current_task_id: int | None = None

    @classmethod
    def from_model(cls, model: ClassificationModel) -> MultiHeadClassificationModel:
        """The backbone of a zoo model (shared, not copied) with no heads yet; its single
        ``head`` must be an ``nn.Linear`` and is dropped (its number of outputs becomes
        :attr:`num_outputs`, the size of heads added without one)."""
        if not isinstance(model, ClassificationModel) or not isinstance(model.head, nn.Linear):
            raise WrongTypeError(
                "MultiHeadClassificationModel.from_model needs a ClassificationModel with a "
                f"linear head (from the zoo), got {type(model).__name__}"
            )
        return cls(
            model.backbone,
            model.head.in_features,
            model.feature_module_names,
            f"multi-head {model.architecture}",
            model.head.out_features,
        )

    @property
    def task_ids(self) -> tuple[int, ...]:
        """The task ids that have a head, sorted."""
        return tuple(sorted(int(key) for key in self.heads))

    def add_task_params(self, task_id: int, num_outputs: int | None = None) -> None:
        """Add a fresh linear head for ``task_id`` with ``num_outputs`` logits (default
        :attr:`num_outputs`; a no-op if the task already has a head of that size); its device and
        dtype follow the backbone's."""
        check_int("MultiHeadClassificationModel.task_id", task_id, 0, 10**9)
        if num_outputs is None:
            if self.num_outputs is None:
                raise ValueError(
                    f"MultiHeadClassificationModel.add_task_params({task_id}): no num_outputs "
                    "given and the model has no default; pass num_outputs or build the model "
                    "with num_outputs=... (from_model takes the zoo model's classes)"
                )
            num_outputs = self.num_outputs
        check_int("MultiHeadClassificationModel.num_outputs", num_outputs, 1)
        key = str(task_id)
        if key in self.heads:
            existing = self.heads[key].out_features
            if existing != num_outputs:
                raise ValueError(
                    f"MultiHeadClassificationModel: task {task_id} already has a head of "
                    f"{existing} outputs, got num_outputs={num_outputs}"
                )
            return
        head = nn.Linear(self.in_features, num_outputs)
        reference = next(self.backbone.parameters(), None)
        if reference is not None:
            head = head.to(device=reference.device, dtype=reference.dtype)
        self.heads[key] = head

    def set_task(self, task_id: int | None) -> None:
        """The head ``model(x)`` uses without a ``task_id`` (None: refuse such calls)."""
        if task_id is not None:
            self._head(task_id)
        self.current_task_id = task_id

    def _head(self, task_id: Any) -> nn.Module:
        if not validators_is_int(task_id) or str(task_id) not in self.heads:
            raise ValueError(
                f"MultiHeadClassificationModel: task id {task_id!r} has no head; heads exist for "
                f"task ids {list(self.task_ids)} (add one with add_task_params({task_id!r}, "
                "num_outputs))"
            )
        return self.heads[str(task_id)]

    def forward(
        self, inputs: torch.Tensor, task_id: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        if task_id is None:
            if self.current_task_id is None:
                raise ValueError(
                    "MultiHeadClassificationModel: no task id; call model(x, task_id=...) or "
                    "model.set_task(task_id) first"
                )
            task_id = self.current_task_id
        features = self.backbone(inputs)
        if not isinstance(task_id, torch.Tensor):
            return self._head(task_id)(features)
        return self._per_sample(features, task_id)

    def _per_sample(self, features: torch.Tensor, task_ids: torch.Tensor) -> torch.Tensor:
        if task_ids.shape != (len(features),) or task_ids.dtype.is_floating_point:
            raise ValueError(
                "MultiHeadClassificationModel: a task_id tensor must hold one integer id per "
                f"sample, shape ({len(features)},), got shape {tuple(task_ids.shape)} and dtype "
                f"{task_ids.dtype}"
            )
        present = torch.unique(task_ids).tolist()
        heads = {t: self._head(t) for t in present}
        sizes = {head.out_features for head in heads.values()}
        if len(sizes) > 1:
            raise ValueError(
                f"MultiHeadClassificationModel: the heads of tasks {present} have different "
                f"numbers of outputs {sorted(sizes)}; call the model once per task id instead"
            )
        if len(heads) == 1:  # one task in the batch: its head on every sample
            return next(iter(heads.values()))(features)
        if not heads:
            return features.new_empty(0, 0)
        # Every present head on the whole batch, then each sample's row of its own head: no
        # further synchronisation (a boolean selection per head would need one each); a head
        # gets the gradient of its own samples only.
        outputs = torch.stack([head(features) for head in heads.values()])
        position = torch.searchsorted(torch.tensor(present, device=task_ids.device), task_ids)
        index = position.view(1, -1, 1).expand(1, -1, outputs.shape[-1])
        return outputs.gather(0, index).squeeze(0)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load ``state_dict``, first adding the heads it holds (``heads.<id>.weight`` of shape
        ``(num_outputs, in_features)``) that this model lacks: a fresh model loads a saved one."""
        for key, value in state_dict.items():
            match = _HEAD_KEY.match(key)
            if match is None or match.group(2) != "weight" or match.group(1) in self.heads:
                continue
            shape = tuple(getattr(value, "shape", ()))
            if len(shape) != 2 or shape[1] != self.in_features or shape[0] < 1:
                raise ValueError(
                    f"MultiHeadClassificationModel: {key} must have shape (num_outputs, "
                    f"{self.in_features}), got {shape}"
                )
            self.add_task_params(int(match.group(1)), shape[0])
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


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


def vit(
    num_classes: int,
    image_size: int = 32,
    patch_size: int = 4,
    in_channels: int = 3,
    dim: int = 128,
    depth: int = 6,
    heads: int = 4,
    mlp_dim: int = 0,
    layer_norm_eps: float = 1e-5,
) -> ClassificationModel:
    """A small Vision Transformer: patch embedding, ``depth`` pre-norm encoder blocks, the class
    token's features to the head (the backbone is a
    :class:`~renate_events.vision_transformer.ViTBackbone`, which the prompt methods prompt).

    ``mlp_dim`` is the blocks' MLP width (0: ``4 * dim``), ``layer_norm_eps`` the layer norms'
    epsilon (a pretrained Hugging Face ViT's ``1e-12``, :mod:`renate_events.pretrained`)."""
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
    check_int("vit: mlp_dim", mlp_dim, 0)
    if not (isinstance(layer_norm_eps, float) and 0 < layer_norm_eps < 1):
        raise ValueError(f"vit: layer_norm_eps must be a number in (0, 1), got {layer_norm_eps!r}")
    backbone = ViTBackbone(
        image_size, patch_size, in_channels, dim, depth, heads, mlp_dim or None, layer_norm_eps
    )
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
