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
:class:`HueShiftScenario`           chunk ``t`` after sorting by dominant hue   chunk ``t`` of the
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

from renate_events.scenarios.base import DEFAULT_TEST_FRACTION, Scenario, Task
from renate_events.scenarios.classes import (
    ClassIncrementalScenario,
    blurry_assignment,
    resolve_class_order,
    shuffled_classes,
)
from renate_events.scenarios.presets import (
    DOMAIN_TASKS,
    IMAGE_SCENARIOS,
    IMAGE_SOURCES,
    SCENARIOS,
    domain_images,
    permuted_digits,
    rotated_digits,
    seq_cifar10,
    seq_cifar100,
    seq_tinyimagenet,
    split_digits,
)
from renate_events.scenarios.streams import (
    DataIncrementalScenario,
    FeatureSortingScenario,
    HueShiftScenario,
    IIDScenario,
    dominant_hues,
)
from renate_events.scenarios.transformed import (
    PermutationScenario,
    RotationScenario,
    rotate_images,
)

__all__ = [
    "DEFAULT_TEST_FRACTION",
    "DOMAIN_TASKS",
    "IMAGE_SCENARIOS",
    "IMAGE_SOURCES",
    "SCENARIOS",
    "ClassIncrementalScenario",
    "DataIncrementalScenario",
    "FeatureSortingScenario",
    "HueShiftScenario",
    "IIDScenario",
    "PermutationScenario",
    "RotationScenario",
    "Scenario",
    "Task",
    "blurry_assignment",
    "domain_images",
    "dominant_hues",
    "permuted_digits",
    "resolve_class_order",
    "rotate_images",
    "rotated_digits",
    "seq_cifar10",
    "seq_cifar100",
    "seq_tinyimagenet",
    "shuffled_classes",
    "split_digits",
]
