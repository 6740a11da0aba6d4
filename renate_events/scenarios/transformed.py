"""Domain-incremental scenarios by transformation: the same classes, permuted or rotated inputs."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from renate_events.scenarios.base import (
    TASK_STREAM,
    TRANSFORM_STREAM,
    Pool,
    Scenario,
    Task,
    check_num_tasks_train,
    random_chunks,
    stream_generator,
    take,
)
from trainer import validators

__all__ = ["PermutationScenario", "RotationScenario", "rotate_images"]

_INTERPOLATIONS = ("bilinear", "nearest")


@attrs.frozen(eq=False)
class PermutationScenario(Scenario):
    """Permuted inputs: task ``t`` applies its own fixed permutation to the features of every input.

    The inputs of a sample are flattened, permuted and reshaped back, so images get their pixels
    shuffled. Task 0 keeps the original order (the identity permutation), as Renate and the
    permuted-MNIST literature do; tasks 1, 2, ... draw uniform random permutations. Each task
    trains on its own random chunk of the training pool and is tested on the whole test pool
    under its permutation.

    Args:
        dataset: The data (see :class:`Scenario`).
        num_tasks: Number of tasks, at least 1 and at most the size of the training pool.
        test_dataset, test_fraction, seed: See :class:`Scenario`.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.arange(24.0).reshape(8, 3), torch.arange(8) % 2)
        >>> tasks = PermutationScenario(data, num_tasks=2, seed=0).tasks()
        >>> len(tasks[0].train) + len(tasks[1].train), len(tasks[1].test)
        (6, 2)
    """

    num_tasks: int = attrs.field(validator=check_num_tasks_train)  # type: ignore[assignment]

    def permutations(self) -> list[torch.Tensor]:
        """The feature permutation of each task (task 0: the identity).

        Returns:
            One ``int64`` tensor per task, a permutation of ``range(num_features)``; task ``t``
            maps ``inputs.flatten(1)`` to ``inputs.flatten(1)[:, permutations[t]]``.
        """
        features = math.prod(self.dataset.tensors[0].shape[1:])
        generator = stream_generator(self.seed, TRANSFORM_STREAM)
        identity = torch.arange(features)
        return [identity] + [
            torch.randperm(features, generator=generator) for _ in range(self.num_tasks - 1)
        ]

    def _build(self, train: Pool, test: Pool) -> list[Task]:
        chunks = random_chunks(
            len(train[1]), self.num_tasks, stream_generator(self.seed, TASK_STREAM)
        )
        classes = self._all_classes(train, test)
        tasks = []
        for task_id, (chunk, permutation) in enumerate(zip(chunks, self.permutations())):
            x, y = take(train, chunk)
            tasks.append(
                Task(
                    task_id=task_id,
                    train=TensorDataset(_permute(x, permutation), y),
                    test=TensorDataset(_permute(test[0], permutation), test[1]),
                    classes=classes,
                )
            )
        return tasks


def _permute(inputs: torch.Tensor, permutation: torch.Tensor) -> torch.Tensor:
    flat = inputs.reshape(inputs.shape[0], -1)
    return flat[:, permutation.to(inputs.device)].reshape(inputs.shape)


def _to_degrees(value: Any) -> Any:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return value
    return tuple(
        float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else v for v in value
    )


def _check_degrees(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    ok = (
        isinstance(value, tuple)
        and len(value) > 0
        and all(isinstance(v, float) and math.isfinite(v) for v in value)
    )
    if not ok:
        name = validators.field_name(instance, attribute)
        raise ValueError(
            f"{name} must be a non-empty sequence of finite angles in degrees, one per task, such "
            f"as (0, 45, 90), got {value!r}"
        )
    instance._check_chunks(len(value), test_too=False)


def _to_shape(value: Any) -> Any:
    if value is None or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return value
    return tuple(value)


def _check_image_shape(instance: RotationScenario, attribute: Any, value: Any) -> None:
    name = validators.field_name(instance, attribute)
    inputs = instance.dataset.tensors[0]
    per_sample = tuple(inputs.shape[1:])
    if value is None:
        if len(per_sample) not in (2, 3):
            raise ValueError(
                f"{name}: inputs of per-sample shape {per_sample} are not images; pass "
                "image_shape=(C, H, W) or (H, W) to say how to reshape them, e.g. (1, 8, 8) for "
                "flat digits"
            )
    elif (
        not isinstance(value, tuple)
        or len(value) not in (2, 3)
        or not all(validators.is_int(s) and s > 0 for s in value)
        or math.prod(value) != math.prod(per_sample)
    ):
        raise ValueError(
            f"{name} must be (C, H, W) or (H, W) of positive ints holding the "
            f"{math.prod(per_sample)} values of one input (shape {per_sample}), got {value!r}"
        )
    if instance.byte_images and inputs.dtype != torch.uint8:
        raise TypeError(
            f"{type(instance).__name__}: byte_images=True takes uint8 inputs, got {inputs.dtype}"
        )
    if not inputs.dtype.is_floating_point and not instance.byte_images:
        raise TypeError(
            f"{type(instance).__name__}: rotation interpolates, so inputs must be floating point, "
            f"got {inputs.dtype}; convert them with inputs.float() (or pass byte_images=True for "
            "uint8 images)"
        )


@attrs.frozen(eq=False)
class RotationScenario(Scenario):
    """Rotated inputs: task ``t`` rotates every image by ``degrees[t]`` (counter-clockwise).

    Rotation is about the image centre, by ``torch.nn.functional.affine_grid`` and ``grid_sample``
    over the whole batch at once, with zeros where the rotated image leaves the frame (torchvision's
    default fill). Pixel aspect ratios are respected on non-square images. An angle that is a
    multiple of 360 returns the inputs unchanged (exactly). Each task trains on its own random chunk
    of the training pool and is tested on the whole test pool rotated by its angle.

    Args:
        dataset: The data (see :class:`Scenario`), floating-point inputs (``uint8`` ones with
            ``byte_images``).
        degrees: One angle per task, in degrees; positive is counter-clockwise.
        image_shape: How to view one input as an image, ``(C, H, W)`` or ``(H, W)``; ``None`` if
            the inputs already are images of that shape. Outputs keep the inputs' shape.
        interpolation: ``"bilinear"`` (default) or ``"nearest"`` (torchvision's default for
            ``RandomRotation``, used by Renate).
        byte_images: The inputs are ``uint8`` image bytes: each task's images are rotated as
            floats and rounded back to ``uint8`` (a quarter of the memory of float images).
        test_dataset, test_fraction, seed: See :class:`Scenario`.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.rand(8, 16), torch.arange(8) % 2)
        >>> scenario = RotationScenario(data, degrees=(0, 90), image_shape=(1, 4, 4))
        >>> scenario.tasks()[1].test.tensors[0].shape
        torch.Size([2, 16])
    """

    degrees: tuple[float, ...] = attrs.field(converter=_to_degrees, validator=_check_degrees)
    byte_images: bool = attrs.field(default=False, kw_only=True, validator=validators.boolean)
    image_shape: tuple[int, ...] | None = attrs.field(
        default=None, converter=_to_shape, validator=_check_image_shape
    )
    interpolation: str = attrs.field(
        default="bilinear", kw_only=True, validator=validators.one_of(*_INTERPOLATIONS)
    )

    @property
    def num_tasks(self) -> int:
        """The number of tasks, ``len(degrees)``."""
        return len(self.degrees)

    def _build(self, train: Pool, test: Pool) -> list[Task]:
        chunks = random_chunks(
            len(train[1]), self.num_tasks, stream_generator(self.seed, TASK_STREAM)
        )
        classes = self._all_classes(train, test)
        tasks = []
        for task_id, (chunk, angle) in enumerate(zip(chunks, self.degrees)):
            x, y = take(train, chunk)
            tasks.append(
                Task(
                    task_id=task_id,
                    train=TensorDataset(self._rotate(x, angle), y),
                    test=TensorDataset(self._rotate(test[0], angle), test[1]),
                    classes=classes,
                )
            )
        return tasks

    def _rotate(self, inputs: torch.Tensor, angle: float) -> torch.Tensor:
        shape = self.image_shape if self.image_shape is not None else tuple(inputs.shape[1:])
        if len(shape) == 2:
            shape = (1, *shape)
        images = inputs.reshape(inputs.shape[0], *shape)
        if images.dtype == torch.uint8:  # image bytes: rotated as floats, rounded back
            rotated = rotate_images(images.float(), angle, interpolation=self.interpolation)
            return rotated.round_().clamp_(0, 255).to(torch.uint8).reshape(inputs.shape)
        return rotate_images(images, angle, interpolation=self.interpolation).reshape(inputs.shape)


def rotate_images(
    images: torch.Tensor, degrees: float, *, interpolation: str = "bilinear"
) -> torch.Tensor:
    """Rotates a batch of images ``(N, C, H, W)`` counter-clockwise by ``degrees`` about the centre.

    One ``grid_sample`` call covers the whole batch (the batch is folded into the channels, so the
    sampling grid is built once). Pixels that come from outside the frame are 0.

    Args:
        images: Floating-point tensor ``(N, C, H, W)``.
        degrees: The angle; multiples of 360 return a copy of ``images``.
        interpolation: ``"bilinear"`` or ``"nearest"``.

    Returns:
        The rotated images, same shape, dtype and device.

    Example:
        >>> import torch
        >>> image = torch.arange(4.0).reshape(1, 1, 2, 2)
        >>> rotate_images(image, 90).round().flatten().tolist()
        [1.0, 3.0, 0.0, 2.0]
    """
    if images.dim() != 4 or not images.dtype.is_floating_point:
        raise ValueError(
            f"rotate_images expects floating-point images (N, C, H, W), got shape "
            f"{tuple(images.shape)} and dtype {images.dtype}"
        )
    validators.check_one_of("rotate_images: interpolation", interpolation, _INTERPOLATIONS)
    if float(degrees) % 360 == 0 or images.numel() == 0:
        return images.clone()
    n, c, h, w = images.shape
    radians = math.radians(float(degrees))
    cos, sin = math.cos(radians), math.sin(radians)
    # Output pixel p samples the input at R^-1 p (x right, y down, in pixels from the centre).
    # grid_sample's coordinates are normalised to [-1, 1] per axis, so scale the off-diagonal
    # terms by the aspect ratio to keep the rotation rigid on non-square images.
    theta = torch.tensor(
        [[[cos, -sin * h / w, 0.0], [sin * w / h, cos, 0.0]]], dtype=images.dtype
    ).to(images.device)
    grid = F.affine_grid(theta, [1, n * c, h, w], align_corners=False)
    rotated = F.grid_sample(
        images.reshape(1, n * c, h, w),
        grid,
        mode=interpolation,
        padding_mode="zeros",
        align_corners=False,
    )
    return rotated.reshape(n, c, h, w)
