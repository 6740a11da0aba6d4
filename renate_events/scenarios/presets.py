"""Named scenarios: the embedded digits (:data:`SCENARIOS`) and Seq-CIFAR from local files
(:data:`IMAGE_SCENARIOS`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from renate_events.datasets import load_cifar10, load_cifar100, load_digits
from renate_events.scenarios.base import (
    DEFAULT_TEST_FRACTION,
    Scenario,
)
from renate_events.scenarios.classes import ClassIncrementalScenario
from renate_events.scenarios.transformed import PermutationScenario, RotationScenario

__all__ = [
    "IMAGE_SCENARIOS",
    "SCENARIOS",
    "permuted_digits",
    "rotated_digits",
    "seq_cifar10",
    "seq_cifar100",
    "split_digits",
]


# --------------------------------------------------------------------------------------------
# The embedded default: scikit-learn's digits
# --------------------------------------------------------------------------------------------


def split_digits(seed: int = 0, test_fraction: float = DEFAULT_TEST_FRACTION) -> Scenario:
    """Split digits: five class-incremental tasks {0, 1}, {2, 3}, ..., {8, 9} on the 8x8 digits.

    Args:
        seed: Seeds the stratified train/test split.
        test_fraction: Share of each class held out for testing.

    Returns:
        A :class:`ClassIncrementalScenario` (needs scikit-learn, see
        :func:`renate_events.datasets.load_digits`).

    Example:
        >>> tasks = split_digits().tasks()
        >>> len(tasks), len(tasks[0].train) + len(tasks[0].test)
        (5, 360)
    """
    groups = tuple((c, c + 1) for c in range(0, 10, 2))
    return ClassIncrementalScenario(
        load_digits(), class_groups=groups, test_fraction=test_fraction, seed=seed
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
    return tuple(tuple(range(c, c + per_task)) for c in range(0, num_classes, per_task))


def seq_cifar10(path: str | os.PathLike[str], seed: int = 0) -> Scenario:
    """Seq-CIFAR-10: five class-incremental tasks {0, 1}, {2, 3}, ..., {8, 9} on CIFAR-10.

    The setting of the DER paper (Buzzega et al., "Dark Experience for General Continual
    Learning: a Strong, Simple Baseline", NeurIPS 2020): the labels in their natural order, two
    per task; each task trains on the 10 000 training images of its classes and is tested on the
    2 000 test images of the same classes (the official test batch, no split of the training set).

    Args:
        path: The folder of the CIFAR-10 binary version (``cifar-10-batches-bin`` or the folder
            above it), read by :func:`renate_events.datasets.load_cifar10`; nothing is downloaded.
        seed: The scenario's seed (the split is fixed by the files, so it changes nothing here; it
            is kept for the same call as the other scenarios).

    Returns:
        A :class:`ClassIncrementalScenario` of ``uint8`` images ``(N, 3, 32, 32)`` (convert them to
        float per batch, in a transform or in the config file's ``data_fn``).

    Example:
        >>> tasks = seq_cifar10("data/cifar10").tasks()  # doctest: +SKIP
        >>> [task.classes for task in tasks]  # doctest: +SKIP
        [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]
    """
    train = load_cifar10(path, dtype=torch.uint8)
    test = load_cifar10(path, train=False, dtype=torch.uint8)
    return ClassIncrementalScenario(
        train, class_groups=_consecutive_groups(10, 2), test_dataset=test, seed=seed
    )


def seq_cifar100(path: str | os.PathLike[str], seed: int = 0) -> Scenario:
    """Seq-CIFAR-100: ten class-incremental tasks of ten fine classes, {0..9}, {10..19}, ...

    The common Seq-CIFAR-100 setting (the 10-task split of the DER authors' follow-up, X-DER,
    Boschini et al., "Class-Incremental Continual Learning into the eXtended DER-verse", TPAMI
    2022): the 100 fine labels in their natural order, ten per task, each tested on the official
    test images of its classes.

    Args:
        path: The folder of the CIFAR-100 binary version (``cifar-100-binary`` or the folder above
            it), read by :func:`renate_events.datasets.load_cifar100`; nothing is downloaded.
        seed: The scenario's seed (see :func:`seq_cifar10`).

    Returns:
        A :class:`ClassIncrementalScenario` of ``uint8`` images ``(N, 3, 32, 32)``.
    """
    train = load_cifar100(path, dtype=torch.uint8)
    test = load_cifar100(path, train=False, dtype=torch.uint8)
    return ClassIncrementalScenario(
        train, class_groups=_consecutive_groups(100, 10), test_dataset=test, seed=seed
    )


IMAGE_SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "seq-cifar10": seq_cifar10,
    "seq-cifar100": seq_cifar100,
}
"""Named scenarios on image data sets in local files; build one with
``IMAGE_SCENARIOS[name](path, seed=0)`` (not in :data:`SCENARIOS`, whose entries take no path)."""
