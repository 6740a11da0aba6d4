"""Evaluation on a CUDA device at training speed: no synchronisation per batch.

``evaluate`` copies test data from pinned memory without waiting and counts correct predictions
on the device, so the host waits once per task (the accuracy's ``.item()``), whatever the number
of batches; the class mask of task-incremental evaluation goes to the device through pinned
memory too. ``evaluate_row`` (both modes and the predictions, as ``run`` evaluates an update)
waits once for the whole row, with test sets pinned on the CPU or resident on the GPU. The syncs
are counted under ``torch.cuda.set_sync_debug_mode("warn")``. Skipped without CUDA (see
``tests/conftest.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.accuracy import resident_tests
from renate_events.evaluation import evaluate, evaluate_row
from renate_events.models import resnet18
from renate_events.scenarios import Task

pytestmark = pytest.mark.gpu

SYNC_MESSAGE = "synchronizing CUDA operation"
TASKS, PER_TASK, BATCH = 3, 40, 8  # five batches per task


@contextmanager
def _counted_syncs() -> Iterator[list[str]]:
    """The synchronising operations (their warnings) while the block runs."""
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode(0)
    seen += [str(w.message) for w in caught if SYNC_MESSAGE in str(w.message)]


def _tasks() -> list[Task]:
    generator = torch.Generator().manual_seed(0)
    tasks = []
    for index in range(TASKS):
        images = torch.rand(PER_TASK, 3, 32, 32, generator=generator)
        labels = torch.randint(2 * index, 2 * index + 2, (PER_TASK,), generator=generator)
        data = TensorDataset(images, labels)
        tasks.append(Task(task_id=index, train=data, test=data, classes=(2 * index, 2 * index + 1)))
    return tasks


@pytest.mark.parametrize("mode", ["class-incremental", "task-incremental"])
def test_evaluation_synchronises_once_per_task_not_per_batch(mode):
    torch.manual_seed(0)
    model = resnet18(num_classes=2 * TASKS, nf=8).cuda()
    tasks = _tasks()
    evaluate(model, tasks, mode=mode, batch_size=BATCH)  # warm-up: cuDNN's first calls
    with _counted_syncs() as syncs:
        accuracies = evaluate(model, tasks, mode=mode, batch_size=BATCH)
    assert len(accuracies) == TASKS
    assert len(syncs) == TASKS, syncs


@pytest.mark.parametrize("place", ["pinned from the CPU", "resident on the GPU"])
def test_a_row_of_both_modes_and_the_predictions_synchronises_once(place):
    torch.manual_seed(0)
    model = resnet18(num_classes=2 * TASKS, nf=8).cuda()
    tasks = _tasks() if place.startswith("pinned") else resident_tests(_tasks(), "cuda")
    evaluate_row(model, tasks, predictions=True, batch_size=BATCH)  # warm-up
    with _counted_syncs() as syncs:
        row = evaluate_row(model, tasks, predictions=True, batch_size=BATCH)
    assert len(row.accuracies["task-incremental"]) == TASKS
    assert row.predictions.device.type == "cuda" and len(row.predictions) == TASKS * PER_TASK
    assert len(syncs) == 1, syncs  # the row's one read, whatever the tasks and batches
