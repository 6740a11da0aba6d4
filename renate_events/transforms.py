"""Batch transforms for image workloads: whole-batch tensor operations on the training device.

The learners' ``train_transform``, ``buffer_transform`` and ``test_transform`` (Renate's names)
take any callable ``f(batch) -> batch`` on a batch tensor. This module ships vectorised ones,
with no Python loop over the samples, and the standard CIFAR presets
(:func:`cifar_train_transform`, :func:`cifar_test_transform`): random crop of 32x32 from the image
zero-padded by 4 pixels, horizontal flip with probability 0.5, then normalisation with the
per-channel means and standard deviations of the CIFAR-10 or CIFAR-100 training set (and the same
for Tiny-ImageNet's 64x64 images, ``"tinyimagenet"``: crop 64, its own statistics), as in
He et al., "Deep Residual Learning for Image Recognition", CVPR 2016, and Buzzega et al., "Dark
Experience for General Continual Learning: a Strong, Simple Baseline", NeurIPS 2020.

Randomness: a transform built with ``generator=None`` (the default) draws from torch's global RNG
on the batch's device, which the trainer seeds and checkpoints (CPU and every CUDA device), so a
resumed run draws the same augmentations as an uninterrupted one. With a ``torch.Generator`` it
draws from that generator instead (on the generator's device; the few random numbers are then
copied to the batch's device, through pinned memory from a CPU generator to a GPU, without
waiting) and its state is the caller's to keep.

``benchmarks/transforms.py`` measures these against kornia's (see ``docs/images.rst``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from trainer import validators
from trainer.data import to_device

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "TINYIMAGENET_MEAN",
    "TINYIMAGENET_STD",
    "Compose",
    "Normalize",
    "RandomCrop",
    "RandomHorizontalFlip",
    "ToFloat",
    "cifar_test_transform",
    "cifar_train_transform",
]

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
"""Per-channel mean of the CIFAR-10 training images (RGB, values in [0, 1])."""
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
"""Per-channel standard deviation of the CIFAR-10 training images."""
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
"""Per-channel mean of the CIFAR-100 training images (RGB, values in [0, 1])."""
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
"""Per-channel standard deviation of the CIFAR-100 training images."""

TINYIMAGENET_MEAN = (0.4802, 0.4480, 0.3975)
"""Per-channel mean of the Tiny-ImageNet training images (RGB, values in [0, 1]; Mammoth's)."""
TINYIMAGENET_STD = (0.2770, 0.2691, 0.2821)
"""Per-channel standard deviation of the Tiny-ImageNet training images."""

_STATS = {
    "cifar10": (CIFAR10_MEAN, CIFAR10_STD),
    "cifar100": (CIFAR100_MEAN, CIFAR100_STD),
    "tinyimagenet": (TINYIMAGENET_MEAN, TINYIMAGENET_STD),
}
_CROP = {"cifar10": 32, "cifar100": 32, "tinyimagenet": 64}  # the images' own size


def _check_images(name: str, images: Any) -> torch.Tensor:
    """A batch of images ``(N, C, H, W)``."""
    if not isinstance(images, torch.Tensor):
        raise validators.WrongTypeError(
            f"{name} must be given a batch tensor (N, C, H, W), got {type(images).__name__}"
        )
    if images.dim() != 4:
        raise ValueError(
            f"{name} must be given a batch of images (N, C, H, W), got shape {tuple(images.shape)}"
        )
    return images


def _uniform(n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` floats uniform in ``[0, 1)`` on ``device`` (from ``generator`` where given)."""
    if generator is None:
        return torch.rand(n, device=device)
    return to_device(torch.rand(n, generator=generator, device=generator.device), device, pin=True)


def _integers(
    high: int, shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    if generator is None:
        return torch.randint(0, high, shape, device=device)
    drawn = torch.randint(0, high, shape, generator=generator, device=generator.device)
    # Through pinned memory: a copy from pageable memory waits for the GPU, non_blocking or not.
    return to_device(drawn, device, pin=True)


def _optional_generator(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, torch.Generator):
        raise validators.WrongTypeError(
            f"{validators.field_name(instance, attribute)} must be a torch.Generator or None, "
            f"got {value!r}"
        )


@attrs.define(eq=False)
class ToFloat:
    """``uint8`` images (0..255) to ``float32`` in ``[0, 1]``; float images pass as they are
    only with ``accept_float=True`` (the default refuses them, so that a preset meant for raw
    ``uint8`` images is not silently applied to images normalised already).

    Example:
        >>> import torch
        >>> ToFloat()(torch.tensor([[[[0, 255]]]], dtype=torch.uint8))
        tensor([[[[0., 1.]]]])
    """

    accept_float: bool = attrs.field(default=False, kw_only=True, validator=validators.boolean)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = _check_images("ToFloat", images)
        if images.dtype == torch.uint8:
            return images.to(torch.float32).div_(255.0)
        if images.dtype.is_floating_point and self.accept_float:
            return images
        raise ValueError(
            f"ToFloat expects uint8 images (0..255), got dtype {images.dtype}; store the raw "
            "uint8 images, or build the transform with ToFloat(accept_float=True) for images "
            "scaled to [0, 1] already"
        )


@attrs.define(eq=False)
class Normalize:
    """``(x - mean) / std`` per channel of float images ``(N, C, H, W)``.

    Example:
        >>> import torch
        >>> Normalize((0.5,), (0.25,))(torch.ones(1, 1, 1, 2))
        tensor([[[[2., 2.]]]])
    """

    mean: tuple[float, ...] = attrs.field(converter=tuple)
    std: tuple[float, ...] = attrs.field(converter=tuple)
    _cache: dict[Any, tuple[torch.Tensor, torch.Tensor]] = attrs.field(
        init=False, factory=dict, repr=False
    )

    def __attrs_post_init__(self) -> None:
        if not self.mean or len(self.mean) != len(self.std):
            raise ValueError(
                f"Normalize.mean and Normalize.std must have one value per channel, got "
                f"{len(self.mean)} and {len(self.std)}"
            )
        if not all(validators.is_real(s) and s > 0 for s in self.std):
            raise ValueError(f"Normalize.std must be positive numbers, got {self.std}")
        if not all(validators.is_real(m) for m in self.mean):
            raise ValueError(f"Normalize.mean must be finite numbers, got {self.mean}")

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = _check_images("Normalize", images)
        if not images.dtype.is_floating_point:
            raise ValueError(
                f"Normalize expects float images, got dtype {images.dtype}; put ToFloat() first"
            )
        if images.shape[1] != len(self.mean):
            raise ValueError(
                f"Normalize has {len(self.mean)} channels, got images of shape "
                f"{tuple(images.shape)}"
            )
        key = (images.device, images.dtype)
        if key not in self._cache:
            shape = (1, len(self.mean), 1, 1)
            self._cache[key] = (
                torch.tensor(self.mean, dtype=images.dtype, device=images.device).view(shape),
                torch.tensor(self.std, dtype=images.dtype, device=images.device).view(shape),
            )
        mean, std = self._cache[key]
        return (images - mean) / std


@attrs.define(eq=False)
class RandomHorizontalFlip:
    """Mirror each image left-right with probability ``p`` (one draw per image).

    Example:
        >>> import torch
        >>> RandomHorizontalFlip(p=1.0)(torch.arange(3.0).view(1, 1, 1, 3))
        tensor([[[[2., 1., 0.]]]])
    """

    p: float = attrs.field(default=0.5, validator=validators.real_in_range(0, 1))
    generator: torch.Generator | None = attrs.field(
        default=None, kw_only=True, validator=_optional_generator
    )

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = _check_images("RandomHorizontalFlip", images)
        flip = _uniform(images.shape[0], images.device, self.generator) < self.p
        return torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)


@attrs.define(eq=False)
class RandomCrop:
    """A random ``size`` crop of each image zero-padded by ``padding`` pixels on every side.

    Every image gets its own offset (two integers per image); the crops are taken with one
    ``torch.gather`` over the flattened padded batch (about 8 times faster on a CPU than
    advanced indexing with four index tensors), so the cost does not depend on how many
    distinct offsets there are.

    Example:
        >>> import torch
        >>> out = RandomCrop(4, padding=2)(torch.ones(8, 3, 4, 4, dtype=torch.uint8))
        >>> out.shape, out.dtype
        (torch.Size([8, 3, 4, 4]), torch.uint8)
    """

    size: int = attrs.field(validator=validators.int_at_least(1))
    padding: int = attrs.field(default=4, kw_only=True, validator=validators.int_at_least(0))
    generator: torch.Generator | None = attrs.field(
        default=None, kw_only=True, validator=_optional_generator
    )
    _grid: dict[Any, torch.Tensor] = attrs.field(init=False, factory=dict, repr=False)
    _limits: dict[Any, torch.Tensor] = attrs.field(init=False, factory=dict, repr=False)

    def _constants(self, device: torch.device, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The largest offsets ``(2,)`` for images ``h x w`` and the ``arange(size)`` grid, on
        ``device``, made once per device and image size: a tensor built from a Python list on a
        GPU is a synchronising host-to-device copy, which would run twice per replay step."""
        grid = self._grid.get(device)
        if grid is None:
            grid = self._grid[device] = torch.arange(self.size, device=device)
        key = (device, h, w)
        limits = self._limits.get(key)
        if limits is None:
            p, size = self.padding, self.size
            limits = torch.tensor([h + 2 * p - size, w + 2 * p - size], device=device)
            self._limits[key] = limits
        return limits, grid

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = _check_images("RandomCrop", images)
        n, _, h, w = images.shape
        p, size = self.padding, self.size
        if h + 2 * p < size or w + 2 * p < size:
            raise ValueError(
                f"RandomCrop({size}, padding={p}) cannot crop images of shape "
                f"{tuple(images.shape)}: the padded image is smaller than the crop"
            )
        padded = F.pad(images, (p, p, p, p)) if p else images
        offsets = _integers(
            max(h + 2 * p, w + 2 * p) - size + 1, (n, 2), images.device, self.generator
        )
        limits, grid = self._constants(images.device, h, w)
        offsets = torch.minimum(offsets, limits)
        c, wp = images.shape[1], w + 2 * p
        rows = (offsets[:, 0:1] + grid).view(n, size, 1)
        cols = (offsets[:, 1:2] + grid).view(n, 1, size)
        flat = (rows * wp + cols).view(n, 1, size * size).expand(n, c, size * size)
        return padded.reshape(n, c, -1).gather(2, flat).view(n, c, size, size)


@attrs.define(eq=False)
class Compose:
    """Apply ``transforms`` in order.

    Example:
        >>> import torch
        >>> Compose([ToFloat(), Normalize((0.0,), (0.5,))])(torch.full((1, 1, 1, 1), 255,
        ...                                                          dtype=torch.uint8))
        tensor([[[[2.]]]])
    """

    transforms: Sequence[Callable[[torch.Tensor], torch.Tensor]] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        for i, transform in enumerate(self.transforms):
            if not callable(transform):
                raise validators.WrongTypeError(
                    f"Compose.transforms[{i}] must be a callable batch -> batch, got {transform!r}"
                )

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        for transform in self.transforms:
            images = transform(images)
        return images


def _stats(dataset: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    validators.check_one_of("dataset", dataset, tuple(_STATS))
    return _STATS[dataset]


def cifar_train_transform(
    dataset: str = "cifar10",
    *,
    generator: torch.Generator | None = None,
    size: int | None = None,
) -> Compose:
    """The standard CIFAR training augmentation for raw ``uint8`` batches ``(N, 3, 32, 32)``:
    random crop 32 with padding 4, horizontal flip, to float, normalisation.

    ``"tinyimagenet"`` gives the same for Tiny-ImageNet's ``(N, 3, 64, 64)`` (crop 64, padding 4,
    as Mammoth's Seq-TinyImageNet).

    Args:
        dataset: ``"cifar10"``, ``"cifar100"`` or ``"tinyimagenet"`` (which means and stds
            normalise).
        generator: Where the random draws come from; ``None``: torch's global RNG (checkpointed
            by the trainer).
        size: The crop's side, for images of another size than the data set's own (a folder
            of 32x32 Tiny-ImageNet images); ``None``: 32 for CIFAR, 64 for Tiny-ImageNet.

    Example:
        >>> import torch
        >>> images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
        >>> cifar_train_transform("cifar100")(images).dtype
        torch.float32
    """
    mean, std = _stats(dataset)
    return Compose(
        [
            RandomCrop(size or _CROP[dataset], padding=4, generator=generator),
            RandomHorizontalFlip(0.5, generator=generator),
            ToFloat(),
            Normalize(mean, std),
        ]
    )


def cifar_test_transform(dataset: str = "cifar10") -> Compose:
    """The CIFAR evaluation transform for raw ``uint8`` batches: to float, normalisation.

    Example:
        >>> import torch
        >>> cifar_test_transform()(torch.zeros(2, 3, 32, 32, dtype=torch.uint8)).shape
        torch.Size([2, 3, 32, 32])
    """
    mean, std = _stats(dataset)
    return Compose([ToFloat(), Normalize(mean, std)])
