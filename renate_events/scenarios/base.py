"""The base of the scenarios: data pools, the stratified split, :class:`Task` and :class:`Scenario`.

The helpers here (seeded generator streams, the split, random chunks, row selection) are shared by
the scenario kinds in :mod:`~renate_events.scenarios.classes`,
:mod:`~renate_events.scenarios.transformed` and :mod:`~renate_events.scenarios.streams`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import torch
from torch.utils.data import Dataset, TensorDataset

from trainer import validators

__all__ = [
    "DEFAULT_TEST_FRACTION",
    "SPLIT_STREAM",
    "TASK_STREAM",
    "TRANSFORM_STREAM",
    "Pool",
    "Scenario",
    "Task",
    "check_num_tasks_train",
    "classes_of",
    "materialise",
    "random_chunks",
    "stratified_split",
    "stream_generator",
    "take",
    "test_counts",
    "to_int_tuple",
]


DEFAULT_TEST_FRACTION = 0.25
"""Share of each class held out for testing when no ``test_dataset`` is given."""

_SEED_LIMIT = 2**63
SPLIT_STREAM = 0
"""Stream of :func:`stream_generator` for the train/test split."""
TASK_STREAM = 1
"""Stream of :func:`stream_generator` for the assignment of samples to tasks."""
TRANSFORM_STREAM = 2
"""Stream of :func:`stream_generator` for the transformations (permutations)."""
_MASK64 = 2**64 - 1

Pool = tuple[torch.Tensor, torch.Tensor]
"""A pool of samples: ``(inputs, int64 targets)``."""


# --------------------------------------------------------------------------------------------
# Data pools and the helpers the scenario kinds share
# --------------------------------------------------------------------------------------------


def stream_generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one named use of ``seed`` (splitmix64 of seed and stream)."""
    z = (seed + (stream + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    generator = torch.Generator(device="cpu")
    generator.manual_seed(z ^ (z >> 31))
    return generator


def materialise(data: Any, name: str) -> TensorDataset:
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
    return materialise(data, "dataset")


def _convert_test_dataset(data: Any) -> TensorDataset | None:
    return None if data is None else materialise(data, "test_dataset")


def test_counts(counts: torch.Tensor, fraction: float) -> torch.Tensor:
    """Per-class test counts: ``round(fraction * n)``, but 1 to ``n - 1`` when ``n >= 2``."""
    rounded = torch.floor(counts.to(torch.float64) * fraction + 0.5).to(torch.int64)
    bounded = torch.minimum(rounded.clamp(min=1), counts - 1)
    return torch.where(counts >= 2, bounded, torch.zeros_like(counts))


def stratified_split(
    targets: torch.Tensor, fraction: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted train and test indices; each class's test samples are a uniform random subset."""
    order = torch.randperm(len(targets), generator=generator).to(targets.device)
    by_class, position = torch.sort(targets[order], stable=True)
    grouped = order[position]  # indices grouped by class, in random order within each class
    _, counts = torch.unique_consecutive(by_class, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(targets), device=targets.device) - starts.repeat_interleave(counts)
    is_test = rank < test_counts(counts, fraction).repeat_interleave(counts)
    return torch.sort(grouped[~is_test]).values, torch.sort(grouped[is_test]).values


def random_chunks(size: int, num_chunks: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``num_chunks`` disjoint sorted index sets covering ``range(size)``, sizes within one."""
    order = torch.randperm(size, generator=generator)
    return [torch.sort(chunk).values for chunk in torch.tensor_split(order, num_chunks)]


def classes_of(*targets: torch.Tensor) -> tuple[int, ...]:
    """The sorted distinct class ids of all of ``targets``."""
    return tuple(torch.unique(torch.cat([t.flatten() for t in targets])).tolist())


def take(pool: tuple[torch.Tensor, ...], index: torch.Tensor) -> Any:
    """The rows ``index`` of every tensor of ``pool`` (inputs, targets and, for domains, ids)."""
    index = index.to(pool[1].device)
    return tuple(t[index] for t in pool)


# --------------------------------------------------------------------------------------------
# Task
# --------------------------------------------------------------------------------------------


def to_int_tuple(values: Any) -> tuple[int, ...]:
    """attrs converter: a tensor or sequence of class ids as a tuple."""
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
    classes: tuple[int, ...] = attrs.field(converter=to_int_tuple, validator=_check_classes)


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
        >>> from renate_events.scenarios import IIDScenario
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
        generator = stream_generator(self.seed, SPLIT_STREAM)
        train_idx, test_idx = stratified_split(targets, self._fraction(), generator)
        return take((inputs, targets), train_idx), take((inputs, targets), test_idx)

    def _fraction(self) -> float:
        return DEFAULT_TEST_FRACTION if self.test_fraction is None else float(self.test_fraction)

    def _class_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples per class id (index) in the training and test pools, without splitting."""
        targets = self.dataset.tensors[1].cpu()
        if self.test_dataset is None:
            counts = torch.bincount(targets)
            test = test_counts(counts, self._fraction())
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
        return classes_of(train[1], test[1])


def check_num_tasks_train(instance: Scenario, attribute: Any, value: Any) -> None:
    """attrs validator: ``num_tasks >= 1`` and no more tasks than training samples."""
    validators.int_at_least(1)(instance, attribute, value)
    instance._check_chunks(value, test_too=False)
