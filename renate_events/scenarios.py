"""Continual-learning scenarios: one data set split into an ordered, reproducible list of tasks.

A scenario takes a data set of ``(inputs, target)`` pairs (a two-tensor ``TensorDataset`` is used
as it is; any other map-style ``Dataset`` is read once and stacked into tensors), splits it into a
training pool and a test pool, and cuts those into :class:`Task` objects, each with its own
``TensorDataset`` for training and for testing. Everything random is drawn from CPU generators
seeded by ``seed`` (independent streams for the train/test split, the assignment to tasks and the
transformations), so the same arguments give identical tensors on every call and every machine.

Train/test split: pass ``test_dataset`` to use a test set of your own, or let the scenario hold out
``test_fraction`` (default 0.25) of ``dataset``, stratified by class: every class with at least two
samples keeps at least one in each pool.

How each scenario builds its tasks (following Renate's benchmark scenarios):

==================================  ==========================================  ===================
Scenario                            Training data of task ``t``                 Test data of task t
==================================  ==========================================  ===================
:class:`ClassIncrementalScenario`   the training samples of ``t``'s classes     same, test pool
:class:`PermutationScenario`        random chunk ``t``, features permuted       whole pool, same
:class:`RotationScenario`           random chunk ``t``, rotated                 whole pool, same
:class:`IIDScenario`                random chunk ``t``                          whole test pool
:class:`DataIncrementalScenario`    the samples of the domains of task ``t``    same, test pool
:class:`FeatureSortingScenario`     chunk ``t`` after sorting by a feature      chunk ``t`` of the
                                                                                sorted test pool
==================================  ==========================================  ===================

"Random chunk" means the training pool is shuffled and cut into ``num_tasks`` disjoint parts whose
sizes differ by at most one, so every model update sees new samples (Renate's ``TransformScenario``
and ``IIDScenario``); test sets are transformed copies of the whole test pool.

Example:
    >>> from renate_events.scenarios import split_digits
    >>> tasks = split_digits(seed=0).tasks()
    >>> [task.classes for task in tasks]
    [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import attrs
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from renate_events.datasets import load_cifar10, load_cifar100, load_digits
from trainer import validators

__all__ = [
    "IMAGE_SCENARIOS",
    "SCENARIOS",
    "ClassIncrementalScenario",
    "DataIncrementalScenario",
    "FeatureSortingScenario",
    "IIDScenario",
    "PermutationScenario",
    "RotationScenario",
    "Scenario",
    "Task",
    "permuted_digits",
    "rotate_images",
    "rotated_digits",
    "seq_cifar10",
    "seq_cifar100",
    "split_digits",
]

DEFAULT_TEST_FRACTION = 0.25
"""Share of each class held out for testing when no ``test_dataset`` is given."""

_SEED_LIMIT = 2**63
_SPLIT_STREAM = 0
_TASK_STREAM = 1
_TRANSFORM_STREAM = 2
_MASK64 = 2**64 - 1

_INTERPOLATIONS = ("bilinear", "nearest")

Pool = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------------------------
# Validators and helpers
# --------------------------------------------------------------------------------------------


def _generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one named use of ``seed`` (splitmix64 of seed and stream)."""
    z = (seed + (stream + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    generator = torch.Generator(device="cpu")
    generator.manual_seed(z ^ (z >> 31))
    return generator


def _materialise(data: Any, name: str) -> TensorDataset:
    """Returns ``data`` as ``TensorDataset(inputs, int64 targets)``, reading it once if needed."""
    if isinstance(data, TensorDataset):
        if len(data.tensors) != 2:
            raise TypeError(
                f"{name}: a TensorDataset must hold exactly two tensors (inputs, targets), got "
                f"{len(data.tensors)}"
            )
        inputs, targets = data.tensors
    elif isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        inputs, targets = _stack_samples(data, name)
    else:
        raise TypeError(
            f"{name} must be a map-style Dataset of (inputs, target) pairs, such as "
            f"TensorDataset(inputs, targets), got {type(data).__name__}"
        )
    if len(targets) == 0:
        raise ValueError(f"{name} is empty; a scenario needs at least one sample")
    if targets.dim() != 1 or targets.dtype.is_floating_point or targets.dtype.is_complex:
        raise TypeError(
            f"{name}: targets must be a 1-D tensor of integer class ids, got shape "
            f"{tuple(targets.shape)} and dtype {targets.dtype}; convert with targets.long()"
        )
    if targets.dtype == torch.bool:
        raise TypeError(f"{name}: targets must be integer class ids, got bool; use targets.long()")
    if bool((targets < 0).any()):
        raise ValueError(
            f"{name}: class ids must be >= 0 (they index the model's logits), found "
            f"{int(targets.min())}"
        )
    if inputs.dim() < 2:
        raise ValueError(
            f"{name}: inputs must have a batch dimension and at least one feature dimension, got "
            f"shape {tuple(inputs.shape)}; use inputs.unsqueeze(1) for scalar features"
        )
    return TensorDataset(inputs, targets.to(torch.int64))


def _stack_samples(data: Any, name: str) -> Pool:
    count = len(data)
    xs, ys = [], []
    for index in range(count):
        sample = data[index]
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise TypeError(
                f"{name}[{index}] must be an (inputs, target) pair, got {type(sample).__name__}"
            )
        x, y = sample
        if isinstance(y, torch.Tensor):
            if y.numel() != 1 or y.dtype.is_floating_point or y.dtype == torch.bool:
                raise TypeError(
                    f"{name}[{index}]: the target must be one integer class id, got a tensor of "
                    f"shape {tuple(y.shape)} and dtype {y.dtype}"
                )
            y = int(y.item())
        elif not validators.is_int(y):
            raise TypeError(
                f"{name}[{index}]: the target must be an integer class id, got {y!r} of type "
                f"{type(y).__name__}"
            )
        xs.append(torch.as_tensor(x))
        ys.append(int(y))
    if not xs:
        return torch.zeros(0, 1), torch.zeros(0, dtype=torch.int64)
    shape = xs[0].shape
    for index, x in enumerate(xs):
        if x.shape != shape:
            raise ValueError(
                f"{name}: every input must have the same shape to be stacked; sample 0 has "
                f"{tuple(shape)}, sample {index} has {tuple(x.shape)}"
            )
    return torch.stack(xs), torch.tensor(ys, dtype=torch.int64)


def _convert_dataset(data: Any) -> TensorDataset:
    return _materialise(data, "dataset")


def _convert_test_dataset(data: Any) -> TensorDataset | None:
    return None if data is None else _materialise(data, "test_dataset")


def _test_counts(counts: torch.Tensor, fraction: float) -> torch.Tensor:
    """Per-class test counts: ``round(fraction * n)``, but 1 to ``n - 1`` when ``n >= 2``."""
    rounded = torch.floor(counts.to(torch.float64) * fraction + 0.5).to(torch.int64)
    bounded = torch.minimum(rounded.clamp(min=1), counts - 1)
    return torch.where(counts >= 2, bounded, torch.zeros_like(counts))


def _stratified_split(
    targets: torch.Tensor, fraction: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted train and test indices; each class's test samples are a uniform random subset."""
    order = torch.randperm(len(targets), generator=generator).to(targets.device)
    by_class, position = torch.sort(targets[order], stable=True)
    grouped = order[position]  # indices grouped by class, in random order within each class
    _, counts = torch.unique_consecutive(by_class, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(targets), device=targets.device) - starts.repeat_interleave(counts)
    is_test = rank < _test_counts(counts, fraction).repeat_interleave(counts)
    return torch.sort(grouped[~is_test]).values, torch.sort(grouped[is_test]).values


def _random_chunks(size: int, num_chunks: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``num_chunks`` disjoint sorted index sets covering ``range(size)``, sizes within one."""
    order = torch.randperm(size, generator=generator)
    return [torch.sort(chunk).values for chunk in torch.tensor_split(order, num_chunks)]


def _classes(*targets: torch.Tensor) -> tuple[int, ...]:
    return tuple(torch.unique(torch.cat([t.flatten() for t in targets])).tolist())


def _take(pool: tuple[torch.Tensor, ...], index: torch.Tensor) -> Any:
    """The rows ``index`` of every tensor of ``pool`` (inputs, targets and, for domains, ids)."""
    index = index.to(pool[1].device)
    return tuple(t[index] for t in pool)


# --------------------------------------------------------------------------------------------
# Task
# --------------------------------------------------------------------------------------------


def _to_int_tuple(values: Any) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    return tuple(values)


def _check_classes(instance: Any, attribute: attrs.Attribute[Any], value: tuple[int, ...]) -> None:
    if (
        not value
        or not all(validators.is_int(c) and c >= 0 for c in value)
        or len(set(value)) != len(value)
    ):
        name = validators.field_name(instance, attribute)
        raise ValueError(f"{name} must be a non-empty tuple of distinct ints >= 0, got {value!r}")


@attrs.frozen(eq=False)
class Task:
    """One step of a scenario: the data of one model update and the test set to evaluate it on.

    Args:
        task_id: Position in the scenario, from 0.
        train: Training data, ``TensorDataset(inputs, targets)``.
        test: Test data, ``TensorDataset(inputs, targets)``.
        classes: Sorted classes of this task (all classes of the data set for the permutation,
            rotation and IID scenarios); task-incremental evaluation predicts among these only.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.zeros(4, 2), torch.tensor([0, 1, 0, 1]))
        >>> Task(task_id=0, train=data, test=data, classes=(0, 1)).classes
        (0, 1)
    """

    task_id: int = attrs.field(validator=validators.int_at_least(0))
    train: TensorDataset = attrs.field(validator=attrs.validators.instance_of(TensorDataset))
    test: TensorDataset = attrs.field(validator=attrs.validators.instance_of(TensorDataset))
    classes: tuple[int, ...] = attrs.field(converter=_to_int_tuple, validator=_check_classes)


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------


_in_open_unit_interval = validators.real_in_range(0, 1, low_open=True, high_open=True)


def _check_test_fraction(instance: Scenario, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if instance.test_dataset is not None:
        name = validators.field_name(instance, attribute)
        raise ValueError(
            f"{name}: give either test_dataset or test_fraction, not both "
            "(the test fraction only applies when the scenario splits dataset itself)"
        )
    _in_open_unit_interval(instance, attribute, value)


def _check_test_dataset(instance: Scenario, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    shape, test_shape = instance.dataset.tensors[0].shape[1:], value.tensors[0].shape[1:]
    if shape != test_shape:
        raise ValueError(
            f"{validators.field_name(instance, attribute)}: test inputs have per-sample shape "
            f"{tuple(test_shape)} but the training inputs {tuple(shape)}; both must match"
        )


@attrs.frozen(eq=False)
class Scenario:
    """Base class of the scenarios: the data, the train/test split and the seed.

    Subclasses add their own arguments and build the tasks. A scenario is cheap to keep: the tasks
    are built on every call of :meth:`tasks` (identically each time), so keep the returned list
    rather than calling it in a loop.

    Args:
        dataset: The data, a map-style ``Dataset`` of ``(inputs, target)`` pairs; stored as a
            ``TensorDataset(inputs, int64 targets)``.
        test_dataset: A separate test set; if ``None``, the scenario holds out ``test_fraction``
            of ``dataset``.
        test_fraction: Share of every class held out for testing, in (0, 1); default 0.25. Only
            without ``test_dataset``.
        seed: Seeds everything random in the scenario.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.randn(40, 3), torch.arange(40) % 4)
        >>> scenario = IIDScenario(data, num_tasks=2, test_fraction=0.5, seed=1)
        >>> [(task.task_id, len(task.train), len(task.test)) for task in scenario]
        [(0, 10, 20), (1, 10, 20)]
    """

    dataset: TensorDataset = attrs.field(converter=_convert_dataset)
    test_dataset: TensorDataset | None = attrs.field(
        default=None, kw_only=True, converter=_convert_test_dataset, validator=_check_test_dataset
    )
    test_fraction: float | None = attrs.field(
        default=None, kw_only=True, validator=_check_test_fraction
    )
    seed: int = attrs.field(
        default=0, kw_only=True, validator=validators.int_at_least(0, _SEED_LIMIT)
    )

    @property
    def num_tasks(self) -> int:
        """The number of tasks."""
        raise NotImplementedError(f"{type(self).__name__} does not define num_tasks")

    def tasks(self) -> list[Task]:
        """Builds the tasks, in order; the same list (equal tensors) on every call.

        Returns:
            ``num_tasks`` tasks with ``task_id`` 0, 1, ...
        """
        train, test = self._pools()
        return self._build(train, test)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks())

    def __len__(self) -> int:
        return self.num_tasks

    def _build(self, train: Pool, test: Pool) -> list[Task]:
        raise NotImplementedError(
            f"{type(self).__name__} does not build tasks; Scenario is a base class, use one of "
            "its subclasses such as ClassIncrementalScenario"
        )

    def _pools(self) -> tuple[Pool, Pool]:
        inputs, targets = self.dataset.tensors
        if self.test_dataset is not None:
            test_inputs, test_targets = self.test_dataset.tensors
            return (inputs, targets), (test_inputs, test_targets)
        generator = _generator(self.seed, _SPLIT_STREAM)
        train_idx, test_idx = _stratified_split(targets, self._fraction(), generator)
        return _take((inputs, targets), train_idx), _take((inputs, targets), test_idx)

    def _fraction(self) -> float:
        return DEFAULT_TEST_FRACTION if self.test_fraction is None else float(self.test_fraction)

    def _class_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples per class id (index) in the training and test pools, without splitting."""
        targets = self.dataset.tensors[1].cpu()
        if self.test_dataset is None:
            counts = torch.bincount(targets)
            test = _test_counts(counts, self._fraction())
            return counts - test, test
        test_targets = self.test_dataset.tensors[1].cpu()
        size = max(int(targets.max()), int(test_targets.max())) + 1
        return torch.bincount(targets, minlength=size), torch.bincount(test_targets, minlength=size)

    def _check_chunks(self, num_tasks: int, *, test_too: bool) -> None:
        train, test = self._class_counts()
        sizes = {"training": int(train.sum())}
        if test_too:
            sizes["test"] = int(test.sum())
        for pool, size in sizes.items():
            if num_tasks > size:
                raise ValueError(
                    f"{type(self).__name__}: {num_tasks} tasks need at least {num_tasks} samples "
                    f"in the {pool} pool, which has {size}; use fewer tasks or more data"
                )

    def _all_classes(self, train: Pool, test: Pool) -> tuple[int, ...]:
        return _classes(train[1], test[1])


def _convert_groups(value: Any) -> Any:
    if value is None or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return value
    return tuple(
        _to_int_tuple(group) if isinstance(group, (Sequence, torch.Tensor)) else group
        for group in value
    )


def _default_num_tasks(instance: Any) -> int | None:
    groups = instance.class_groups
    return len(groups) if isinstance(groups, tuple) else None


def _check_groups(instance: ClassIncrementalScenario, attribute: Any, value: Any) -> None:
    if value is None:
        return
    name = validators.field_name(instance, attribute)
    valid = (
        isinstance(value, tuple)
        and len(value) > 0
        and all(
            isinstance(g, tuple) and g and all(validators.is_int(c) and c >= 0 for c in g)
            for g in value
        )
    )
    if not valid:
        raise ValueError(
            f"{name} must be a non-empty sequence of non-empty sequences of int class ids, such "
            f"as [[0, 1], [2, 3]], got {value!r}"
        )
    flat = [c for group in value for c in group]
    repeated = sorted({c for c in flat if flat.count(c) > 1})
    if repeated:
        raise ValueError(
            f"{name}: classes {repeated} appear more than once; every class belongs to one task"
        )
    train, _ = instance._class_counts()
    present = set(torch.nonzero(train).flatten().tolist())
    missing = sorted(c for c in flat if c not in present)
    if missing:
        raise ValueError(
            f"{name}: classes {missing} have no training samples in dataset (its classes are "
            f"{sorted(present)}); remove them from class_groups"
        )


def _check_num_tasks_groups(instance: ClassIncrementalScenario, attribute: Any, value: Any) -> None:
    name = validators.field_name(instance, attribute)
    if instance.class_groups is None:
        if value is None:
            raise ValueError(
                f"{type(instance).__name__}: give class_groups (e.g. [[0, 1], [2, 3]]) or "
                "num_tasks (to split the sorted classes evenly)"
            )
        train, _ = instance._class_counts()
        num_classes = int(torch.count_nonzero(train))
        if not validators.is_int(value) or not 1 <= value <= num_classes:
            raise ValueError(
                f"{name} must be an int in [1, {num_classes}] (the number of classes in "
                f"dataset), got {value!r}"
            )
    elif value != len(instance.class_groups):
        raise ValueError(
            f"{name} is {value!r} but class_groups has {len(instance.class_groups)} groups; "
            "give only one of them"
        )
    _, test = instance._class_counts()
    for task_id, group in enumerate(instance._groups()):
        if sum(int(test[c]) if c < len(test) else 0 for c in group) == 0:
            raise ValueError(
                f"{type(instance).__name__}: task {task_id} (classes {list(group)}) has no test "
                "samples; give a test_dataset with these classes or more samples per class"
            )


@attrs.frozen(eq=False)
class ClassIncrementalScenario(Scenario):
    """Each task brings new classes: task ``t`` holds the samples of ``class_groups[t]``.

    Args:
        dataset: The data (see :class:`Scenario`).
        class_groups: The classes of each task, in order, e.g. ``[[0, 1], [2, 3]]``; disjoint,
            every class present in ``dataset``. Classes not listed are left out.
        num_tasks: Instead of ``class_groups``: split the sorted classes of ``dataset`` into this
            many groups of sizes differing by at most one (earlier groups get the extra class).
        test_dataset, test_fraction, seed: See :class:`Scenario`.

    Raises:
        ValueError: Neither or inconsistent ``class_groups`` and ``num_tasks``; repeated classes
            or classes missing from ``dataset``; a task without test samples.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.randn(40, 3), torch.arange(40) % 4)
        >>> scenario = ClassIncrementalScenario(data, num_tasks=2, seed=0)
        >>> [task.classes for task in scenario.tasks()]
        [(0, 1), (2, 3)]
    """

    class_groups: tuple[tuple[int, ...], ...] | None = attrs.field(
        default=None, converter=_convert_groups, validator=_check_groups
    )
    num_tasks: int = attrs.field(  # type: ignore[assignment]
        default=attrs.Factory(_default_num_tasks, takes_self=True),
        kw_only=True,
        validator=_check_num_tasks_groups,
    )

    def _groups(self) -> tuple[tuple[int, ...], ...]:
        if self.class_groups is not None:
            return self.class_groups
        train, _ = self._class_counts()
        classes = torch.nonzero(train).flatten()
        return tuple(tuple(g.tolist()) for g in torch.tensor_split(classes, self.num_tasks))

    def _build(self, train: Pool, test: Pool) -> list[Task]:
        tasks = []
        for task_id, group in enumerate(self._groups()):
            wanted = torch.tensor(group, dtype=torch.int64)
            train_mask = torch.isin(train[1], wanted.to(train[1].device))
            test_mask = torch.isin(test[1], wanted.to(test[1].device))
            tasks.append(
                Task(
                    task_id=task_id,
                    train=TensorDataset(train[0][train_mask], train[1][train_mask]),
                    test=TensorDataset(test[0][test_mask], test[1][test_mask]),
                    classes=tuple(sorted(group)),
                )
            )
        return tasks


def _check_num_tasks_train(instance: Scenario, attribute: Any, value: Any) -> None:
    validators.int_at_least(1)(instance, attribute, value)
    instance._check_chunks(value, test_too=False)


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

    num_tasks: int = attrs.field(validator=_check_num_tasks_train)  # type: ignore[assignment]

    def permutations(self) -> list[torch.Tensor]:
        """The feature permutation of each task (task 0: the identity).

        Returns:
            One ``int64`` tensor per task, a permutation of ``range(num_features)``; task ``t``
            maps ``inputs.flatten(1)`` to ``inputs.flatten(1)[:, permutations[t]]``.
        """
        features = math.prod(self.dataset.tensors[0].shape[1:])
        generator = _generator(self.seed, _TRANSFORM_STREAM)
        identity = torch.arange(features)
        return [identity] + [
            torch.randperm(features, generator=generator) for _ in range(self.num_tasks - 1)
        ]

    def _build(self, train: Pool, test: Pool) -> list[Task]:
        chunks = _random_chunks(len(train[1]), self.num_tasks, _generator(self.seed, _TASK_STREAM))
        classes = self._all_classes(train, test)
        tasks = []
        for task_id, (chunk, permutation) in enumerate(zip(chunks, self.permutations())):
            x, y = _take(train, chunk)
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
    if not inputs.dtype.is_floating_point:
        raise TypeError(
            f"{type(instance).__name__}: rotation interpolates, so inputs must be floating point, "
            f"got {inputs.dtype}; convert them with inputs.float()"
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
        dataset: The data (see :class:`Scenario`), floating-point inputs.
        degrees: One angle per task, in degrees; positive is counter-clockwise.
        image_shape: How to view one input as an image, ``(C, H, W)`` or ``(H, W)``; ``None`` if
            the inputs already are images of that shape. Outputs keep the inputs' shape.
        interpolation: ``"bilinear"`` (default) or ``"nearest"`` (torchvision's default for
            ``RandomRotation``, used by Renate).
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
        chunks = _random_chunks(len(train[1]), self.num_tasks, _generator(self.seed, _TASK_STREAM))
        classes = self._all_classes(train, test)
        tasks = []
        for task_id, (chunk, angle) in enumerate(zip(chunks, self.degrees)):
            x, y = _take(train, chunk)
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


@attrs.frozen(eq=False)
class IIDScenario(Scenario):
    """Data-incremental: the training pool in random, equally sized chunks, one per task.

    All tasks share the same distribution; every task is tested on the whole test pool (as in
    Renate's ``IIDScenario``). For data that arrives from named sources, one per update, see
    :class:`DataIncrementalScenario`.

    Args:
        dataset: The data (see :class:`Scenario`).
        num_tasks: Number of chunks, at least 1 and at most the size of the training pool.
        test_dataset, test_fraction, seed: See :class:`Scenario`.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.randn(40, 3), torch.arange(40) % 4)
        >>> [len(task.train) for task in IIDScenario(data, num_tasks=2)]  # 28 of 40 train
        [14, 14]
    """

    num_tasks: int = attrs.field(validator=_check_num_tasks_train)  # type: ignore[assignment]

    def _build(self, train: Pool, test: Pool) -> list[Task]:
        chunks = _random_chunks(len(train[1]), self.num_tasks, _generator(self.seed, _TASK_STREAM))
        classes = self._all_classes(train, test)
        test_data = TensorDataset(*test)
        return [
            Task(
                task_id=i,
                train=TensorDataset(*_take(train, chunk)),
                test=test_data,
                classes=classes,
            )
            for i, chunk in enumerate(chunks)
        ]


def _to_domains(value: Any) -> Any:
    if value is None or isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return value  # the validator names what is wrong


def _check_domains(instance: DataIncrementalScenario, attribute: Any, value: Any) -> None:
    data = instance.dataset if attribute.name == "domains" else instance.test_dataset
    name = validators.field_name(instance, attribute)
    if data is None:  # test_domains without test_dataset
        if value is not None:
            raise ValueError(f"{name} labels the samples of test_dataset; give test_dataset too")
        return
    count = len(data)
    valid = (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and len(value) == count
        and not (value.dtype.is_floating_point or value.dtype.is_complex)
        and value.dtype != torch.bool
    )
    if not valid:
        raise ValueError(
            f"{name} must hold one integer domain id per sample ({count}), such as "
            f"torch.tensor([0, 0, 1, ...]), got {_describe_tensor(value)}"
        )
    if bool((value < 0).any()):
        raise ValueError(f"{name}: domain ids must be >= 0, found {int(value.min())}")


def _describe_tensor(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value)


def _to_ids(value: Any) -> Any:
    if value is None or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return value
    return tuple(value)


def _check_groupings(instance: DataIncrementalScenario, attribute: Any, value: Any) -> None:
    if (instance.data_ids is None) == (value is None):
        raise ValueError(
            f"{type(instance).__name__}: give either data_ids (one domain per task) or "
            "groupings (the domains of each task), not both and not neither"
        )
    name = "groupings" if value is not None else "data_ids"
    groups = instance._groups()
    valid = len(groups) > 0 and all(
        isinstance(g, tuple) and g and all(validators.is_int(d) and d >= 0 for d in g)
        for g in groups
    )
    if not valid:
        raise ValueError(
            f"{type(instance).__name__}.{name} must hold int domain ids >= 0, such as "
            f"data_ids=[0, 1, 2] or groupings=[[0, 1], [2]], got {getattr(instance, name)!r}"
        )
    repeated = [g for g in groups if len(set(g)) != len(g)]
    if repeated:
        raise ValueError(
            f"{type(instance).__name__}.{name}: the group {list(repeated[0])} repeats a domain"
        )
    instance._check_domain_samples(groups)


@attrs.frozen(eq=False)
class DataIncrementalScenario(Scenario):
    """Predefined data domains: task ``t`` trains on the domains of ``groupings[t]``.

    As Renate's ``DataIncrementalScenario``: the data of each update comes from named sources
    (domains) rather than from a random cut. ``domains`` gives every sample of ``dataset`` its
    domain id; ``data_ids=(a, b, ...)`` makes one task per domain, in that order, and
    ``groupings=((a, b), (c,), ...)`` merges several domains into one task. Task ``t`` trains on
    the training samples of its domains and is tested on the test samples of the same domains;
    its ``classes`` are those present in either. A domain may come back in a later task.

    Without ``test_dataset`` the test pool holds out ``test_fraction`` of every (domain, class)
    pair, so each domain keeps test samples of each of its classes; with ``test_dataset``,
    ``test_domains`` labels its samples. :meth:`from_datasets` builds the scenario from one data
    set per domain.

    Args:
        dataset: The data (see :class:`Scenario`).
        domains: One domain id per sample of ``dataset``, an integer tensor or sequence ``>= 0``.
        data_ids: The domain of each task, in order (Renate's ``data_ids``).
        groupings: Instead of ``data_ids``: the domains of each task (Renate's ``groupings``).
        test_domains: One domain id per sample of ``test_dataset`` (only with it).
        test_dataset, test_fraction, seed: See :class:`Scenario`.

    Raises:
        ValueError: Neither or both of ``data_ids`` and ``groupings``; domain ids that are not
            ints ``>= 0``, have no training samples, or leave a task without test samples;
            ``domains`` (``test_domains``) not one id per sample.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.randn(60, 3), torch.arange(60) % 2)
        >>> domains = torch.arange(60) // 20  # three domains of 20 samples
        >>> scenario = DataIncrementalScenario(data, domains, groupings=[[2], [0, 1]])
        >>> [(len(task.train), len(task.test)) for task in scenario]
        [(14, 6), (28, 12)]
    """

    domains: torch.Tensor = attrs.field(converter=_to_domains, validator=_check_domains)
    test_domains: torch.Tensor | None = attrs.field(
        default=None, kw_only=True, converter=_to_domains, validator=_check_domains
    )
    data_ids: tuple[int, ...] | None = attrs.field(default=None, kw_only=True, converter=_to_ids)
    groupings: tuple[tuple[int, ...], ...] | None = attrs.field(
        default=None, kw_only=True, converter=_convert_groups, validator=_check_groupings
    )

    @classmethod
    def from_datasets(
        cls,
        datasets: Sequence[Any],
        *,
        test_datasets: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> DataIncrementalScenario:
        """Build the scenario from one data set per domain: domain ``i`` is ``datasets[i]``.

        Args:
            datasets: The data of each domain (map-style datasets of ``(inputs, target)``, all
                with inputs of one per-sample shape).
            test_datasets: Optionally a test set per domain, in the same order.
            **kwargs: ``data_ids`` or ``groupings`` (indices into ``datasets``), and
                ``test_fraction`` or ``seed`` (see the class).

        Example:
            >>> import torch
            >>> from torch.utils.data import TensorDataset
            >>> days = [TensorDataset(torch.randn(8, 2), torch.arange(8) % 2) for _ in range(3)]
            >>> scenario = DataIncrementalScenario.from_datasets(days, data_ids=[0, 1, 2])
            >>> scenario.num_tasks, len(scenario.tasks()[0].train)
            (3, 6)
        """
        dataset, domains = _concatenate_domains(datasets, "datasets")
        if test_datasets is None:
            return cls(dataset, domains, **kwargs)
        test_dataset, test_domains = _concatenate_domains(test_datasets, "test_datasets")
        if len(test_datasets) != len(datasets):
            raise ValueError(
                f"test_datasets has {len(test_datasets)} data sets for {len(datasets)} domains; "
                "give one test set per domain"
            )
        return cls(dataset, domains, test_dataset=test_dataset, test_domains=test_domains, **kwargs)

    @property
    def num_tasks(self) -> int:
        """The number of tasks, one per entry of ``data_ids`` or ``groupings``."""
        return len(self._groups())

    def tasks(self) -> list[Task]:
        """Builds the tasks, in order; the same list (equal tensors) on every call.

        Returns:
            One task per group of domains, with ``task_id`` 0, 1, ...
        """
        train, test = self._domain_pools()
        tasks = []
        for task_id, group in enumerate(self._groups()):
            x, y = _in_domains(train, group)
            test_x, test_y = _in_domains(test, group)
            classes = _classes(y, test_y)
            tasks.append(Task(task_id, TensorDataset(x, y), TensorDataset(test_x, test_y), classes))
        return tasks

    def _groups(self) -> tuple[Any, ...]:
        if self.groupings is not None:
            return self.groupings
        return tuple((d,) for d in self.data_ids or ())

    def _strata(self) -> torch.Tensor:
        """One id per (domain, class) pair, so that the test split keeps both apart."""
        targets = self.dataset.tensors[1]
        return self.domains.to(targets.device) * (int(targets.max()) + 1) + targets

    def _domain_pools(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        inputs, targets = self.dataset.tensors
        every = (inputs, targets, self.domains.to(targets.device))
        if self.test_dataset is not None:
            test_inputs, test_targets = self.test_dataset.tensors
            test_domains = cast(torch.Tensor, self.test_domains).to(test_targets.device)
            return every, (test_inputs, test_targets, test_domains)
        generator = _generator(self.seed, _SPLIT_STREAM)
        train_idx, test_idx = _stratified_split(self._strata(), self._fraction(), generator)
        return _take(every, train_idx), _take(every, test_idx)

    def _domain_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples per domain id (index) in the training and test pools, without splitting."""
        domains = self.domains.cpu()
        if self.test_dataset is not None:
            test_domains = cast(torch.Tensor, self.test_domains).cpu()
            size = max(int(domains.max()), int(test_domains.max())) + 1
            return torch.bincount(domains, minlength=size), torch.bincount(
                test_domains, minlength=size
            )
        classes = int(self.dataset.tensors[1].max()) + 1
        counts = torch.bincount(self._strata().cpu(), minlength=(int(domains.max()) + 1) * classes)
        test = _test_counts(counts, self._fraction())
        return (counts - test).reshape(-1, classes).sum(1), test.reshape(-1, classes).sum(1)

    def _check_domain_samples(self, groups: tuple[tuple[int, ...], ...]) -> None:
        train, test = self._domain_counts()

        def count(counts: torch.Tensor, group: tuple[int, ...]) -> int:
            return sum(int(counts[d]) if d < len(counts) else 0 for d in group)

        missing = sorted({d for g in groups for d in g if count(train, (d,)) == 0})
        if missing:
            present = torch.nonzero(train).flatten().tolist()
            raise ValueError(
                f"{type(self).__name__}: domains {missing} have no training samples (the domain "
                f"ids in domains are {present})"
            )
        for task_id, group in enumerate(groups):
            if count(test, group) == 0:
                raise ValueError(
                    f"{type(self).__name__}: task {task_id} (domains {list(group)}) has no test "
                    "samples; give a test_dataset with these domains or more samples"
                )


def _in_domains(pool: tuple[torch.Tensor, ...], group: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Inputs and targets of the samples of ``pool`` whose domain is in ``group``."""
    inputs, targets, domains = pool
    mask = torch.isin(domains, torch.tensor(group, dtype=domains.dtype, device=domains.device))
    return inputs[mask], targets[mask]


def _concatenate_domains(datasets: Any, name: str) -> tuple[TensorDataset, torch.Tensor]:
    """One ``TensorDataset`` of the samples of all ``datasets`` and the index of each's source."""
    if isinstance(datasets, (str, bytes)) or not isinstance(datasets, Sequence) or not datasets:
        raise TypeError(f"{name} must be a non-empty sequence of data sets, one per domain")
    parts = [_materialise(data, f"{name}[{i}]") for i, data in enumerate(datasets)]
    shapes = {tuple(part.tensors[0].shape[1:]) for part in parts}
    if len(shapes) > 1:
        raise ValueError(
            f"{name}: every domain needs inputs of one per-sample shape, got {sorted(shapes)}"
        )
    inputs = torch.cat([part.tensors[0] for part in parts])
    targets = torch.cat([part.tensors[1] for part in parts])
    domains = torch.cat([torch.full((len(p),), i, dtype=torch.int64) for i, p in enumerate(parts)])
    return TensorDataset(inputs, targets), domains


def _check_num_tasks_both(instance: Scenario, attribute: Any, value: Any) -> None:
    validators.int_at_least(1)(instance, attribute, value)
    instance._check_chunks(value, test_too=True)


def _check_feature_idx(instance: FeatureSortingScenario, attribute: Any, value: Any) -> None:
    inputs = instance.dataset.tensors[0]
    validators.int_at_least(0, inputs.shape[1])(instance, attribute, value)


@attrs.frozen(eq=False)
class FeatureSortingScenario(Scenario):
    """Sorted by one input feature: task ``t`` holds the ``t``-th chunk in ascending order.

    The training pool and the test pool are each sorted (stably) by the value of feature
    ``feature_idx`` and cut into ``num_tasks`` chunks whose sizes differ by at most one, so the
    feature drifts upwards from task to task, as in Renate's ``FeatureSortingScenario``. For inputs
    with more than one dimension per sample, ``feature_idx`` indexes the first dimension and the
    rest is averaged (for images: the mean of a colour channel). ``randomness`` softens the order:
    ``int(randomness * n / 2)`` random pairs of positions are swapped before cutting.

    Args:
        dataset: The data (see :class:`Scenario`).
        num_tasks: Number of tasks, at most the size of the training and of the test pool.
        feature_idx: The feature to sort by, in ``[0, inputs.shape[1])``.
        randomness: In [0, 1]; 0 (default) keeps the exact order.
        test_dataset, test_fraction, seed: See :class:`Scenario`.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8) % 2)
        >>> tasks = FeatureSortingScenario(data, num_tasks=2, feature_idx=0).tasks()
        >>> tasks[0].train.tensors[0][:, 0].max() < tasks[1].train.tensors[0][:, 0].min()
        tensor(True)
    """

    num_tasks: int = attrs.field(validator=_check_num_tasks_both)  # type: ignore[assignment]
    feature_idx: int = attrs.field(validator=_check_feature_idx)
    randomness: float = attrs.field(
        default=0.0, kw_only=True, validator=validators.real_in_range(0, 1)
    )

    def _order(self, inputs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        feature = inputs[:, self.feature_idx]
        scores = feature.reshape(feature.shape[0], -1).to(torch.float64).mean(dim=1)
        order = torch.sort(scores.cpu(), stable=True).indices
        swaps = int(self.randomness * len(order) / 2)
        if swaps:
            positions = order.tolist()
            for i, j in torch.randint(len(order), (swaps, 2), generator=generator).tolist():
                positions[i], positions[j] = positions[j], positions[i]
            order = torch.tensor(positions, dtype=torch.int64)
        return order

    def _build(self, train: Pool, test: Pool) -> list[Task]:
        generator = _generator(self.seed, _TASK_STREAM)
        train_chunks = torch.tensor_split(self._order(train[0], generator), self.num_tasks)
        test_chunks = torch.tensor_split(self._order(test[0], generator), self.num_tasks)
        tasks = []
        for task_id, (train_idx, test_idx) in enumerate(zip(train_chunks, test_chunks)):
            x, y = _take(train, train_idx)
            test_x, test_y = _take(test, test_idx)
            tasks.append(
                Task(
                    task_id=task_id,
                    train=TensorDataset(x, y),
                    test=TensorDataset(test_x, test_y),
                    classes=_classes(y, test_y),
                )
            )
        return tasks


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
