"""Class-incremental scenarios: each task brings its own classes."""

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
    to_int_tuple,
)
from trainer import validators

__all__ = ["ClassIncrementalScenario", "convert_groups"]


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
        default=None, converter=convert_groups, validator=_check_groups
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
