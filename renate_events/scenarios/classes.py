"""Class-incremental scenarios: each task brings its own classes, in a given or seeded class order,
with sharp or blurry task boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch.utils.data import TensorDataset

from renate_events.scenarios.base import (
    Pool,
    Scenario,
    Task,
    stream_generator,
    to_int_tuple,
)
from trainer import validators

__all__ = [
    "BLURRY_STREAM",
    "CLASS_ORDER_STREAM",
    "ClassIncrementalScenario",
    "blurry_assignment",
    "convert_groups",
    "resolve_class_order",
    "shuffled_classes",
]

CLASS_ORDER_STREAM = 3
"""Stream of :func:`~renate_events.scenarios.base.stream_generator` for a seeded class order."""
BLURRY_STREAM = 4
"""Stream of :func:`~renate_events.scenarios.base.stream_generator` for blurry task boundaries."""
_SEED_PREFIX = "seed:"


def shuffled_classes(classes: Sequence[int], seed: int) -> tuple[int, ...]:
    """``classes`` in a random order drawn from ``seed`` (the same order on every machine).

    Example:
        >>> shuffled_classes(range(4), seed=1) == shuffled_classes(range(4), seed=1)
        True
        >>> sorted(shuffled_classes(range(4), seed=1))
        [0, 1, 2, 3]
    """
    validators.check_int("shuffled_classes: seed", seed, 0, 2**63)
    ordered = torch.tensor(sorted(int(c) for c in classes), dtype=torch.int64)
    generator = stream_generator(seed, CLASS_ORDER_STREAM)
    return tuple(ordered[torch.randperm(len(ordered), generator=generator)].tolist())


def resolve_class_order(value: Any, classes: Sequence[int]) -> tuple[int, ...] | None:
    """A class order as given (``None``, a sequence of class ids, or ``"seed:N"``) as a tuple.

    Args:
        value: ``None`` (the sorted classes, no change), ``"seed:N"`` (``classes`` shuffled by
            :func:`shuffled_classes` with seed ``N``) or the class ids in order, each of
            ``classes`` exactly once.
        classes: The classes of the data set.

    Raises:
        ValueError: A malformed ``"seed:N"``, or a list that is not an order of ``classes``.

    Example:
        >>> resolve_class_order([2, 0, 1], range(3))
        (2, 0, 1)
        >>> len(resolve_class_order("seed:7", range(10)))
        10
    """
    if value is None:
        return None
    expected = sorted(int(c) for c in classes)
    if isinstance(value, str):
        number = value[len(_SEED_PREFIX) :] if value.startswith(_SEED_PREFIX) else ""
        if not number.isdigit() or int(number) >= 2**63:
            raise ValueError(
                f"class order {value!r}: give 'seed:N' with an int N >= 0 (a seeded shuffle) or "
                "the class ids in order, such as 3,1,0,2"
            )
        return shuffled_classes(expected, int(number))
    order = to_int_tuple(value) if isinstance(value, (Sequence, torch.Tensor)) else None
    if order is None or sorted(order) != expected or not all(validators.is_int(c) for c in order):
        raise ValueError(
            f"class order {value!r} must list each class of the data ({expected[0]} to "
            f"{expected[-1]}, {len(expected)} classes) exactly once, or be 'seed:N'"
        )
    return tuple(int(c) for c in order)


def blurry_assignment(
    task_of: torch.Tensor, num_tasks: int, fraction: float, generator: torch.Generator
) -> torch.Tensor:
    """The task of each sample once the boundaries are blurred by ``fraction``.

    Of the samples of each task ``t`` (``task_of == t``), ``round(fraction * n_t)`` drawn at
    random move to another task, each drawn uniformly among the other ``num_tasks - 1``; the rest
    stay. Samples with ``task_of == -1`` (classes of no task) stay at -1. With one task, or a
    fraction of 0, nothing moves. Vectorised: one random key per sample, one sort.

    Args:
        task_of: ``int64`` task of each sample, or -1.
        num_tasks: The number of tasks.
        fraction: The share of each task's samples that moves, in [0, 1].
        generator: Where the random draws come from.

    Returns:
        The new task of each sample (``int64``, same shape).
    """
    if num_tasks < 2 or fraction == 0:
        return task_of.clone()
    keys = torch.rand(len(task_of), generator=generator)
    # Within each task, in random order: a sample moves when its rank is below its task's quota.
    order = torch.argsort(task_of.to(torch.float64) * 2 + keys.to(torch.float64))
    grouped = task_of[order]  # the left-out samples (-1) first, then task 0, 1, ...
    counts = torch.bincount(task_of[task_of >= 0], minlength=num_tasks)
    starts = torch.cumsum(counts, 0) - counts + int((task_of < 0).sum())
    index = grouped.clamp(min=0)
    rank = torch.arange(len(order)) - starts[index]
    quota = torch.floor(counts.to(torch.float64) * fraction + 0.5).to(torch.int64)
    moves = (grouped >= 0) & (rank < quota[index])
    offsets = torch.randint(1, num_tasks, (len(order),), generator=generator)
    new = torch.where(moves, (grouped + offsets) % num_tasks, grouped)
    result = torch.empty_like(task_of)
    result[order] = new
    return result


def convert_groups(value: Any) -> Any:
    """attrs converter: groups of classes (or domains) as a tuple of int tuples; else as given."""
    if value is None or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return value
    return tuple(
        to_int_tuple(group) if isinstance(group, (Sequence, torch.Tensor)) else group
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


def _check_class_order(instance: ClassIncrementalScenario, attribute: Any, value: Any) -> None:
    if value is None:
        return
    name = validators.field_name(instance, attribute)
    if instance.class_groups is not None:
        raise ValueError(
            f"{name}: class_groups already orders the classes; give class_order with num_tasks"
        )
    try:
        resolve_class_order(value, instance._present_classes())
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


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
        num_tasks: Instead of ``class_groups``: split the sorted classes of ``dataset`` (or
            ``class_order``) into this many groups of sizes differing by at most one (earlier
            groups get the extra class).
        class_order: With ``num_tasks``: the order in which the classes come, each class of
            ``dataset`` once (Renate's ``class_groupings`` made from an order), or ``"seed:N"``
            for the classes shuffled by :func:`shuffled_classes` with seed ``N``. ``None``
            (default): sorted.
        blurry: The share of each task's training samples that move to other tasks, in [0, 1]
            (default 0: sharp boundaries); see below.
        test_dataset, test_fraction, seed: See :class:`Scenario`.

    Blurry task boundaries ("Blurry-M" of Bang et al., "Rainbow Memory: Continual Learning with
    a Memory of Diverse Samples", CVPR 2021, also the blurry part of Koh et al.'s i-Blurry,
    "Online Continual Learning on Class Incremental Blurry Task Configuration with Anytime
    Inference", ICLR 2022): with ``blurry = M``, ``round(M * n_t)`` of the ``n_t`` training
    samples of each task ``t``'s classes, drawn at random, move to another task drawn uniformly
    among the others (:func:`blurry_assignment`). With tasks of equal size each task's training
    data is then, in expectation, a share ``1 - M`` of its own ("major") classes and ``M`` of the
    other tasks' ("minor") classes. Test sets and ``Task.classes`` stay those of the major classes.
    ``blurry=0`` is the disjoint split; one task has no other to mix with.

    Raises:
        ValueError: Neither or inconsistent ``class_groups`` and ``num_tasks``; repeated classes
            or classes missing from ``dataset``; a task without test samples; a ``class_order``
            that is not an order of the classes; ``blurry`` outside [0, 1].

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.randn(40, 3), torch.arange(40) % 4)
        >>> scenario = ClassIncrementalScenario(data, num_tasks=2, seed=0)
        >>> [task.classes for task in scenario.tasks()]
        [(0, 1), (2, 3)]
    """

    class_groups: tuple[tuple[int, ...], ...] | None = attrs.field(
        default=None, converter=convert_groups, validator=_check_groups
    )
    class_order: tuple[int, ...] | str | None = attrs.field(
        default=None,
        kw_only=True,
        converter=lambda v: to_int_tuple(v) if isinstance(v, (list, torch.Tensor)) else v,
        validator=_check_class_order,
    )
    num_tasks: int = attrs.field(  # type: ignore[assignment]
        default=attrs.Factory(_default_num_tasks, takes_self=True),
        kw_only=True,
        validator=_check_num_tasks_groups,
    )
    blurry: float = attrs.field(default=0.0, kw_only=True, validator=validators.real_in_range(0, 1))

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The classes of each task, in order (``class_groups``, else made from the order).

        Example:
            >>> import torch
            >>> from torch.utils.data import TensorDataset
            >>> data = TensorDataset(torch.randn(40, 3), torch.arange(40) % 4)
            >>> ClassIncrementalScenario(data, num_tasks=2, class_order=[3, 1, 0, 2]).groups()
            ((3, 1), (0, 2))
        """
        if self.class_groups is not None:
            return self.class_groups
        order = resolve_class_order(self.class_order, self._present_classes())
        classes = (
            torch.tensor(order) if order is not None else torch.tensor(self._present_classes())
        )
        return tuple(tuple(g.tolist()) for g in torch.tensor_split(classes, self.num_tasks))

    def _groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups()

    def _present_classes(self) -> tuple[int, ...]:
        train, _ = self._class_counts()
        return tuple(torch.nonzero(train).flatten().tolist())

    def _build(self, train: Pool, test: Pool) -> list[Task]:
        groups = self._groups()
        task_of = torch.full((len(train[1]),), -1, dtype=torch.int64)
        targets = train[1].cpu()
        for task_id, group in enumerate(groups):
            task_of[torch.isin(targets, torch.tensor(group, dtype=torch.int64))] = task_id
        generator = stream_generator(self.seed, BLURRY_STREAM)
        task_of = blurry_assignment(task_of, len(groups), float(self.blurry), generator)
        task_of = task_of.to(train[1].device)
        tasks = []
        for task_id, group in enumerate(groups):
            wanted = torch.tensor(group, dtype=torch.int64)
            train_mask = task_of == task_id
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
