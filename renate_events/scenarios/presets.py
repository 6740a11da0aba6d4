"""Named scenarios: the embedded digits (:data:`SCENARIOS`), and from local image files
(:data:`IMAGE_SCENARIOS`) Seq-CIFAR, Seq-TinyImageNet and the domain-incremental hue-shift,
rotated and permuted images of each."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import TensorDataset

from renate_events.datasets import load_cifar10, load_cifar100, load_digits, load_tiny_imagenet
from renate_events.scenarios.base import (
    DEFAULT_TEST_FRACTION,
    Scenario,
)
from renate_events.scenarios.classes import ClassIncrementalScenario
from renate_events.scenarios.streams import HueShiftScenario
from renate_events.scenarios.transformed import PermutationScenario, RotationScenario

__all__ = [
    "DOMAIN_TASKS",
    "IMAGE_SCENARIOS",
    "IMAGE_SOURCES",
    "SCENARIOS",
    "domain_images",
    "permuted_digits",
    "rotated_digits",
    "seq_cifar10",
    "seq_cifar100",
    "seq_tinyimagenet",
    "split_digits",
]

ClassOrder = Sequence[int] | str | None
"""A class order: the class ids in order, ``"seed:N"``, or ``None`` for sorted (see
:class:`ClassIncrementalScenario`)."""


def _class_incremental(
    data: TensorDataset,
    per_task: int,
    class_order: ClassOrder,
    blurry: float,
    **kwargs: Any,
) -> ClassIncrementalScenario:
    """``per_task`` classes per task, in sorted order or ``class_order``; ``blurry`` boundaries."""
    num_classes = int(data.tensors[1].max()) + 1
    if class_order is None:
        groups = _consecutive_groups(num_classes, per_task)
        return ClassIncrementalScenario(data, class_groups=groups, blurry=blurry, **kwargs)
    scenario = ClassIncrementalScenario(
        data,
        num_tasks=-(-num_classes // per_task),
        class_order=class_order,
        blurry=blurry,
        **kwargs,
    )
    if num_classes % per_task == 0:
        return scenario
    # num_tasks splits into sizes differing by one; the preset's tasks are per_task classes in
    # this order, the last one the rest (as without a class order)
    order = [c for group in scenario.groups() for c in group]
    groups = tuple(tuple(order[i : i + per_task]) for i in range(0, len(order), per_task))
    return ClassIncrementalScenario(data, class_groups=groups, blurry=blurry, **kwargs)


# --------------------------------------------------------------------------------------------
# The embedded default: scikit-learn's digits
# --------------------------------------------------------------------------------------------


def split_digits(
    seed: int = 0,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    *,
    class_order: ClassOrder = None,
    blurry: float = 0.0,
) -> Scenario:
    """Split digits: five class-incremental tasks {0, 1}, {2, 3}, ..., {8, 9} on the 8x8 digits.

    Args:
        seed: Seeds the stratified train/test split (and the blurry boundaries).
        test_fraction: Share of each class held out for testing.
        class_order: Two classes per task in this order (a list of the ten ids, or
            ``"seed:N"``); ``None``: 0, 1, ..., 9.
        blurry: The share of each task's training samples mixed into other tasks, in [0, 1].

    Returns:
        A :class:`ClassIncrementalScenario` (needs scikit-learn, see
        :func:`renate_events.datasets.load_digits`).

    Example:
        >>> tasks = split_digits().tasks()
        >>> len(tasks), len(tasks[0].train) + len(tasks[0].test)
        (5, 360)
    """
    return _class_incremental(
        load_digits(), 2, class_order, blurry, test_fraction=test_fraction, seed=seed
    )


def permuted_digits(num_tasks: int = 5, seed: int = 0) -> Scenario:
    """Permuted digits: task 0 the plain 8x8 digits, each later task its own pixel permutation.

    Args:
        num_tasks: Number of tasks.
        seed: Seeds the split, the chunks and the permutations.

    Returns:
        A :class:`PermutationScenario` with 25% of each class held out for testing.

    Example:
        >>> len(permuted_digits(num_tasks=3).tasks())
        3
    """
    return PermutationScenario(load_digits(), num_tasks, seed=seed)


def rotated_digits(degrees: Sequence[float] = (0, 45, 90, 135, 180), seed: int = 0) -> Scenario:
    """Rotated digits: task ``t`` shows the 8x8 digits rotated by ``degrees[t]``.

    Args:
        degrees: One angle per task (counter-clockwise, in degrees).
        seed: Seeds the split and the chunks.

    Returns:
        A :class:`RotationScenario` on flat ``(N, 64)`` inputs viewed as ``(1, 8, 8)`` images.

    Example:
        >>> rotated_digits(degrees=(0, 90)).num_tasks
        2
    """
    return RotationScenario(load_digits(), degrees, image_shape=(1, 8, 8), seed=seed)


SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "split-digits": split_digits,
    "permuted-digits": permuted_digits,
    "rotated-digits": rotated_digits,
}
"""Named scenarios on the bundled digits, for the command line; build one with
``SCENARIOS[name](seed=0)``."""


# --------------------------------------------------------------------------------------------
# Seq-CIFAR: class-incremental CIFAR from local binary files
# --------------------------------------------------------------------------------------------


def _consecutive_groups(num_classes: int, per_task: int) -> tuple[tuple[int, ...], ...]:
    """``per_task`` classes per task; the last task has the rest (data with a part of a data
    set's classes, such as 50 wnids of Tiny-ImageNet, ends with a smaller task)."""
    return tuple(
        tuple(range(c, min(c + per_task, num_classes))) for c in range(0, num_classes, per_task)
    )


def seq_cifar10(
    path: str | os.PathLike[str],
    seed: int = 0,
    *,
    class_order: ClassOrder = None,
    blurry: float = 0.0,
) -> Scenario:
    """Seq-CIFAR-10: five class-incremental tasks {0, 1}, {2, 3}, ..., {8, 9} on CIFAR-10.

    The setting of the DER paper (Buzzega et al., "Dark Experience for General Continual
    Learning: a Strong, Simple Baseline", NeurIPS 2020): the labels in their natural order, two
    per task; each task trains on the 10 000 training images of its classes and is tested on the
    2 000 test images of the same classes (the official test batch, no split of the training set).

    Args:
        path: The folder of the CIFAR-10 binary version (``cifar-10-batches-bin`` or the folder
            above it), read by :func:`renate_events.datasets.load_cifar10`; nothing is downloaded.
        seed: The scenario's seed (the split is fixed by the files; it seeds the blurry
            boundaries).
        class_order: Two classes per task in this order (the ten ids, or ``"seed:N"``).
        blurry: The share of each task's training samples mixed into other tasks, in [0, 1].

    Returns:
        A :class:`ClassIncrementalScenario` of ``uint8`` images ``(N, 3, 32, 32)`` (convert them to
        float per batch, in a transform or in the config file's ``data_fn``).

    Example:
        >>> tasks = seq_cifar10("data/cifar10").tasks()  # doctest: +SKIP
        >>> [task.classes for task in tasks]  # doctest: +SKIP
        [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]
    """
    train, test = _cifar10(path)
    return _class_incremental(train, 2, class_order, blurry, test_dataset=test, seed=seed)


def seq_cifar100(
    path: str | os.PathLike[str],
    seed: int = 0,
    *,
    class_order: ClassOrder = None,
    blurry: float = 0.0,
) -> Scenario:
    """Seq-CIFAR-100: ten class-incremental tasks of ten fine classes, {0..9}, {10..19}, ...

    The common Seq-CIFAR-100 setting (the 10-task split of the DER authors' follow-up, X-DER,
    Boschini et al., "Class-Incremental Continual Learning into the eXtended DER-verse", TPAMI
    2022): the 100 fine labels in their natural order, ten per task, each tested on the official
    test images of its classes.

    Args:
        path: The folder of the CIFAR-100 binary version (``cifar-100-binary`` or the folder above
            it), read by :func:`renate_events.datasets.load_cifar100`; nothing is downloaded.
        seed: The scenario's seed (see :func:`seq_cifar10`).
        class_order: Ten classes per task in this order (the 100 ids, or ``"seed:N"``).
        blurry: The share of each task's training samples mixed into other tasks, in [0, 1].

    Returns:
        A :class:`ClassIncrementalScenario` of ``uint8`` images ``(N, 3, 32, 32)``.
    """
    train, test = _cifar100(path)
    return _class_incremental(train, 10, class_order, blurry, test_dataset=test, seed=seed)


def seq_tinyimagenet(
    path: str | os.PathLike[str],
    seed: int = 0,
    *,
    class_order: ClassOrder = None,
    blurry: float = 0.0,
) -> Scenario:
    """Seq-TinyImageNet: ten class-incremental tasks of twenty classes on Tiny-ImageNet (64x64).

    The setting of Mammoth's ``seq-tinyimg`` (Buzzega et al., NeurIPS 2020): the 200 classes
    (wnids in sorted order, :func:`~renate_events.datasets.load_tiny_imagenet`) twenty per task,
    each task tested on the labelled validation images of its classes.

    Args:
        path: ``tiny-imagenet-200`` or the folder above it; nothing is downloaded.
        seed: The scenario's seed (seeds the blurry boundaries).
        class_order: Twenty classes per task in this order (the 200 ids, or ``"seed:N"``).
        blurry: The share of each task's training samples mixed into other tasks, in [0, 1].

    Returns:
        A :class:`ClassIncrementalScenario` of ``uint8`` images ``(N, 3, 64, 64)``.
    """
    train, test = _tinyimagenet(path)
    return _class_incremental(train, 20, class_order, blurry, test_dataset=test, seed=seed)


# --------------------------------------------------------------------------------------------
# Domain-incremental scenarios on any of the image data sets
# --------------------------------------------------------------------------------------------


def _cifar10(path: str | os.PathLike[str]) -> tuple[TensorDataset, TensorDataset]:
    return load_cifar10(path, dtype=torch.uint8), load_cifar10(path, train=False, dtype=torch.uint8)


def _cifar100(path: str | os.PathLike[str]) -> tuple[TensorDataset, TensorDataset]:
    train = load_cifar100(path, dtype=torch.uint8)
    return train, load_cifar100(path, train=False, dtype=torch.uint8)


def _tinyimagenet(path: str | os.PathLike[str]) -> tuple[TensorDataset, TensorDataset]:
    return load_tiny_imagenet(path), load_tiny_imagenet(path, train=False)


IMAGE_SOURCES: dict[str, Callable[[str | os.PathLike[str]], tuple[TensorDataset, TensorDataset]]]
IMAGE_SOURCES = {"cifar10": _cifar10, "cifar100": _cifar100, "tinyimagenet": _tinyimagenet}
"""The image data sets read from local files, by name: ``(train, test)`` of ``uint8`` images."""

DOMAIN_TASKS = 5
"""The number of tasks of the named domain-incremental image scenarios."""
_DOMAIN_DEGREES = (0.0, 45.0, 90.0, 135.0, 180.0)  # as rotated_digits


def domain_images(kind: str, source: str, path: str | os.PathLike[str], seed: int = 0) -> Scenario:
    """A domain-incremental scenario of :data:`DOMAIN_TASKS` tasks on an image data set.

    Every task has all classes; what changes is the input distribution, as in Renate's
    scenarios of the same names:

    * ``"hue-shift"``: :class:`HueShiftScenario`, the images sorted by dominant hue;
    * ``"rotated"``: :class:`RotationScenario`, task ``t`` rotated by 0, 45, 90, 135, 180 degrees;
    * ``"permuted"``: :class:`PermutationScenario`, task 0 plain, each later task its own pixel
      permutation drawn from ``seed``.

    Args:
        kind: ``"hue-shift"``, ``"rotated"`` or ``"permuted"``.
        source: A name of :data:`IMAGE_SOURCES`.
        path: The data's folder; nothing is downloaded.
        seed: Seeds the chunks and the permutations.

    Returns:
        The scenario, on the data set's ``uint8`` images and its official test split.
    """
    train, test = IMAGE_SOURCES[source](path)
    if kind == "hue-shift":
        return HueShiftScenario(train, DOMAIN_TASKS, test_dataset=test, seed=seed)
    if kind == "rotated":
        return RotationScenario(
            train, _DOMAIN_DEGREES, test_dataset=test, seed=seed, byte_images=True
        )
    if kind == "permuted":
        return PermutationScenario(train, DOMAIN_TASKS, test_dataset=test, seed=seed)
    raise ValueError(f"domain_images: kind must be hue-shift, rotated or permuted, got {kind!r}")


IMAGE_SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "seq-cifar10": seq_cifar10,
    "seq-cifar100": seq_cifar100,
    "seq-tinyimagenet": seq_tinyimagenet,
    **{
        f"{kind}-{source}": functools.partial(domain_images, kind, source)
        for kind in ("hue-shift", "rotated", "permuted")
        for source in IMAGE_SOURCES
    },
}
"""Named scenarios on image data sets in local files; build one with
``IMAGE_SCENARIOS[name](path, seed=0)`` (not in :data:`SCENARIOS`, whose entries take no path).
The ``seq-`` ones are class-incremental (and take ``class_order`` and ``blurry``); the others are
:func:`domain_images`."""
