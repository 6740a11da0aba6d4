"""Tests for renate_events.accuracy: evaluate_row (both modes and the predictions from one pass,
one host read per row), resident_tests and the evaluation batches."""

from __future__ import annotations

import doctest
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events import accuracy
from renate_events.accuracy import evaluate, evaluate_row, resident_tests
from renate_events.models import mlp
from renate_events.scenarios import Task
from trainer.validators import WrongTypeError

# What reads a tensor's values on the host: on a GPU, each of these waits for the device.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def _host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The host reads of tensors (``HOST_READS``) made while the block runs, by name."""
    reads: list[str] = []
    with monkeypatch.context() as patch:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _name=name, _original=original, **kwargs):
                reads.append(_name)
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)
        yield reads


class Counting(torch.nn.Module):
    """An MLP that counts its forward calls; with ``heads``, it takes a ``task_id`` too (a
    second head's logits are the first's shifted by the task id)."""

    def __init__(self, heads: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = mlp(4, num_classes=8, hidden=[8])
        self.calls: list[object] = []
        if heads:
            self.forward = self._with_task_id  # type: ignore[method-assign]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(None)
        return self.body(x)

    def _with_task_id(self, x: torch.Tensor, task_id: int | None = None) -> torch.Tensor:
        self.calls.append(task_id)
        logits = self.body(x)
        return logits if task_id is None else logits.roll(task_id, dims=1)


def _tasks(count: int = 3, per_task: int = 50) -> list[Task]:
    generator = torch.Generator().manual_seed(1)
    tasks = []
    for index in range(count):
        inputs = torch.randn(per_task, 4, generator=generator)
        targets = torch.randint(2 * index, 2 * index + 2, (per_task,), generator=generator)
        data = TensorDataset(inputs, targets)
        tasks.append(Task(task_id=index, train=data, test=data, classes=(2 * index, 2 * index + 1)))
    return tasks


@pytest.mark.parametrize("heads", [False, True])
def test_one_row_gives_what_evaluate_gives_in_both_modes(heads: bool) -> None:
    model, tasks = Counting(heads), _tasks()
    row = evaluate_row(model, tasks, predictions=True, batch_size=16)
    for mode in ("class-incremental", "task-incremental"):
        assert row.accuracies[mode] == evaluate(model, tasks, mode=mode, batch_size=7)
    inputs = torch.cat([task.test.tensors[0] for task in tasks])
    assert torch.equal(row.predictions, model(inputs).argmax(dim=1))
    assert evaluate_row(model, tasks, modes=["task-incremental"]).predictions is None


def test_one_pass_one_forward_per_batch_two_with_task_heads() -> None:
    tasks = _tasks(per_task=40)  # 3 batches of 16 per task
    plain = Counting()
    evaluate_row(plain, tasks, predictions=True, batch_size=16)
    assert len(plain.calls) == 3 * 3  # the task-incremental row masks the same logits
    heads = Counting(heads=True)
    evaluate_row(heads, tasks, batch_size=16)
    assert sorted(heads.calls, key=str) == sorted([None] * 9 + [0, 1, 2] * 3, key=str)
    only_heads = Counting(heads=True)
    evaluate_row(only_heads, tasks, modes=["task-incremental"], batch_size=16)
    assert None not in only_heads.calls and len(only_heads.calls) == 9


def test_a_row_reads_the_device_once_whatever_the_batches(monkeypatch) -> None:
    model, tasks = Counting(), _tasks(count=4, per_task=40)
    with _host_reads(monkeypatch) as reads:
        row = evaluate_row(model, tasks, predictions=True, batch_size=8)  # 20 batches
    assert reads == ["tolist"], reads
    assert len(row.accuracies["class-incremental"]) == 4
    with _host_reads(monkeypatch) as reads:
        evaluate(model, tasks, batch_size=8)
    assert reads == ["item"] * 4, reads  # evaluate: one read per task


def test_the_model_runs_in_eval_mode_under_inference_mode_and_gets_its_mode_back() -> None:
    model, seen = Counting(), []
    model.register_forward_hook(
        lambda module, args, out: seen.append((module.training, torch.is_inference_mode_enabled()))
    )
    model.train()
    evaluate_row(model, _tasks(count=1))
    assert seen == [(False, True)] and model.training


def test_bad_modes_are_refused_before_any_forward() -> None:
    model, tasks = Counting(), _tasks(count=1)
    for modes in ("class-incremental", [], None):
        with pytest.raises(WrongTypeError, match="modes must be a non-empty sequence"):
            evaluate_row(model, tasks, modes=modes)
    with pytest.raises(ValueError, match="evaluate_row: modes"):
        evaluate_row(model, tasks, modes=["class-incremental", "domain"])
    assert model.calls == []
    row = evaluate_row(model, tasks, modes=["task-incremental", "task-incremental"])
    assert list(row.accuracies) == ["task-incremental"]


def test_empty_tasks_give_empty_rows() -> None:
    row = evaluate_row(Counting(), [], predictions=True)
    assert row.accuracies == {"class-incremental": [], "task-incremental": []}
    assert row.predictions is not None and row.predictions.numel() == 0


def test_resident_tests_change_nothing_on_the_cpu() -> None:
    tasks = _tasks()
    assert resident_tests(tasks, "cpu") == tasks
    assert all(a is b for a, b in zip(resident_tests(tasks, torch.device("cpu")), tasks))


def test_docstring_examples_run() -> None:
    result = doctest.testmod(accuracy, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.gpu
def test_resident_tests_keep_the_test_sets_on_the_gpu_and_leave_the_tasks_alone(
    monkeypatch,
) -> None:
    tasks = _tasks()
    moved = resident_tests(tasks, "cuda")
    assert all(t.device.type == "cuda" for task in moved for t in task.test.tensors)
    assert all(t.device.type == "cpu" for task in tasks for t in task.test.tensors)
    assert [task.task_id for task in moved] == [0, 1, 2] and moved[0].train is tasks[0].train
    model = Counting().cuda()
    on_gpu = evaluate_row(model, moved, predictions=True)
    assert on_gpu.predictions.device.type == "cuda"
    assert on_gpu.accuracies == evaluate_row(model.cpu(), tasks).accuracies
    monkeypatch.setattr(accuracy, "RESIDENT_SHARE", 0.0)  # test sets that do not fit: pinned
    pinned = resident_tests(tasks, "cuda")
    assert all(t.is_pinned() for task in pinned for t in task.test.tensors)
