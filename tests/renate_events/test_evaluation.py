"""Tests for renate_events.evaluation: evaluate, AccuracyMatrix and the metrics."""

from __future__ import annotations

import doctest
import inspect
import json
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from renate_events import evaluation
from renate_events.evaluation import (
    AccuracyMatrix,
    average_accuracy,
    backward_transfer,
    evaluate,
    forgetting,
    forward_transfer,
    micro_average_accuracy,
)
from renate_events.scenarios import Task

# A hand-made 3-task matrix and baseline; the expected numbers below are worked out by hand.
R = [
    [0.90, 0.10, 0.20],
    [0.95, 0.80, 0.30],
    [0.60, 0.50, 0.90],
]
B = [0.10, 0.20, 0.10]

# ------------------------------------------------------------------------------------ metrics


def test_average_accuracy_by_hand() -> None:
    assert average_accuracy(R) == pytest.approx((0.6 + 0.5 + 0.9) / 3)  # 0.666...
    assert average_accuracy(R, after=0) == pytest.approx(0.9)
    assert average_accuracy(R, after=1) == pytest.approx((0.95 + 0.8) / 2)  # 0.875
    assert average_accuracy(R[:2], after=1) == pytest.approx(0.875)  # incomplete is fine here


def test_micro_average_accuracy_by_hand() -> None:
    sizes = [10, 30, 60]
    # (10 * 0.6 + 30 * 0.5 + 60 * 0.9) / 100 = (6 + 15 + 54) / 100
    assert micro_average_accuracy(R, sizes) == pytest.approx(0.75)
    # (10 * 0.95 + 30 * 0.8) / 40 = 33.5 / 40
    assert micro_average_accuracy(R, sizes, after=1) == pytest.approx(0.8375)
    equal = micro_average_accuracy(R, [5, 5, 5])
    assert equal == pytest.approx(average_accuracy(R))


def test_forgetting_by_hand() -> None:
    # task 0: max(0.90, 0.95) - 0.60 = 0.35; task 1: max(0.10, 0.80) - 0.50 = 0.30
    assert forgetting(R) == pytest.approx((0.35 + 0.30) / 2)  # 0.325


def test_backward_transfer_by_hand() -> None:
    # task 0: 0.60 - 0.90 = -0.30; task 1: 0.50 - 0.80 = -0.30
    assert backward_transfer(R) == pytest.approx(-0.30)


def test_forward_transfer_by_hand() -> None:
    # task 1: R[0][1] - b[1] = 0.10 - 0.20 = -0.10; task 2: R[1][2] - b[2] = 0.30 - 0.10 = 0.20
    assert forward_transfer(R, B) == pytest.approx(0.05)
    matrix = AccuracyMatrix(rows=R, baseline=B)
    assert forward_transfer(matrix) == pytest.approx(0.05)
    assert forward_transfer(matrix, [0.0, 0.0, 0.0]) == pytest.approx((0.1 + 0.3) / 2)


def test_no_forgetting_and_perfect_learner() -> None:
    perfect = [[1.0, 0.0], [1.0, 1.0]]
    assert forgetting(perfect) == 0.0 and backward_transfer(perfect) == 0.0
    assert average_accuracy(perfect) == 1.0
    improving = [[0.5, 0.0], [0.7, 1.0]]
    assert forgetting(improving) == pytest.approx(-0.2)
    assert backward_transfer(improving) == pytest.approx(0.2)


def test_metrics_accept_an_accuracy_matrix_or_rows() -> None:
    matrix = AccuracyMatrix()
    for row in R:
        matrix.append(row)
    for metric in (average_accuracy, forgetting, backward_transfer):
        assert metric(matrix) == metric(R)
        assert metric(torch.tensor(R, dtype=torch.float64)) == pytest.approx(metric(R))


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: average_accuracy([]), ["empty"]),
        (lambda: average_accuracy(AccuracyMatrix()), ["empty"]),
        (lambda: average_accuracy(R[:2]), ["2 of 3 rows", "after="]),
        (lambda: forgetting(R[:2]), ["complete", "2 rows"]),
        (lambda: backward_transfer([[0.5, 0.5]]), ["complete"]),
        (lambda: forgetting([[0.5]]), ["at least 2 tasks"]),
        (lambda: backward_transfer([[0.5]]), ["at least 2 tasks"]),
        (lambda: forward_transfer([[0.5]], [0.1]), ["at least 2 tasks"]),
        (lambda: average_accuracy([[0.5, 0.5], [0.5]]), ["different lengths"]),
        (lambda: average_accuracy([[0.5], [0.5]]), ["2 rows for 1 tasks"]),
        (lambda: average_accuracy([[50.0, 10.0]], after=0), ["[0, 1]", "percentages"]),
        (lambda: average_accuracy(R, after=3), ["after", "[0, 3)"]),
        (lambda: forward_transfer(R), ["baseline=evaluate"]),
        (lambda: forward_transfer(AccuracyMatrix(rows=R)), ["baseline=evaluate"]),
        (lambda: forward_transfer(R, [0.1, 0.1]), ["one accuracy in [0, 1] per task (3)"]),
        (lambda: micro_average_accuracy(R, [1, 2]), ["one int >= 0 per task (3)"]),
        (lambda: micro_average_accuracy(R, [0, 0, 1], after=1), ["no test samples"]),
    ],
)
def test_metric_errors(call, words) -> None:
    with pytest.raises(ValueError) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ------------------------------------------------------------------------------ AccuracyMatrix


def test_accuracy_matrix_is_built_row_by_row_and_checked() -> None:
    matrix = AccuracyMatrix()
    assert matrix.num_tasks is None and not matrix.is_complete and len(matrix) == 0
    matrix.append([0.5, 0.25])
    assert matrix.num_tasks == 2 and matrix[0] == [0.5, 0.25]
    with pytest.raises(ValueError, match="different lengths"):
        matrix.append([0.5])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        matrix.append([0.5, 1.5])
    assert matrix.rows == [[0.5, 0.25]]  # failed appends change nothing
    matrix.append(torch.tensor([0.75, 1.0]))
    assert matrix.is_complete
    with pytest.raises(ValueError, match="one row per update"):
        matrix.append([0.5, 0.5])
    with pytest.raises(ValueError, match="baseline has 3 tasks"):
        matrix.baseline = [0.1, 0.1, 0.1]
    matrix.baseline = [0.1, 0.2]
    assert matrix.baseline == [0.1, 0.2]


def test_accuracy_matrix_json_round_trip() -> None:
    matrix = AccuracyMatrix(rows=R, baseline=B)
    text = json.dumps(matrix.to_dict())
    again = AccuracyMatrix.from_dict(json.loads(text))
    assert again == matrix
    assert AccuracyMatrix.from_dict({"rows": []}) == AccuracyMatrix()


def test_accuracy_matrix_from_dict_reports_every_problem() -> None:
    with pytest.raises(ValueError) as info:
        AccuracyMatrix.from_dict({"R": [[0.5]], "b": None})
    message = str(info.value)
    assert "missing key 'rows'" in message and "unknown keys ['R', 'b']" in message
    with pytest.raises(TypeError, match="mapping"):
        AccuracyMatrix.from_dict([[0.5]])
    with pytest.raises(ValueError, match=r"rows\[1\]"):
        AccuracyMatrix.from_dict({"rows": [[0.5, 0.5], [0.5, "x"]]})


# ----------------------------------------------------------------------------------- evaluate


class OneHot(torch.nn.Module):
    """Logits = the first ``classes`` input features: predicts argmax of the inputs."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.classes = classes
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        self.calls.append((self.training, torch.is_grad_enabled()))
        logits = x[:, : self.classes] * self.scale
        return logits if extra is None else logits + extra


def _task(logits: list[list[float]], targets: list[int], classes, task_id: int = 0) -> Task:
    data = TensorDataset(torch.tensor(logits), torch.tensor(targets))
    return Task(task_id=task_id, train=data, test=data, classes=classes)


def test_evaluate_counts_correct_predictions_in_both_modes() -> None:
    # the model predicts class 2 for the first two samples, which task-incremental masks away
    task = _task(
        [[0.0, 1.0, 9.0], [1.0, 0.0, 9.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]],
        [1, 0, 0, 1],
        classes=(0, 1),
    )
    other = _task([[0.0, 0.0, 1.0]] * 3, [2, 2, 1], classes=(2,), task_id=1)
    model = OneHot(3)
    assert evaluate(model, [task, other]) == [0.0, pytest.approx(2 / 3)]
    assert evaluate(model, [task, other], mode="task-incremental") == [0.5, pytest.approx(2 / 3)]
    assert evaluate(model, [task], batch_size=1) == evaluate(model, [task], batch_size=3)
    assert evaluate(model, [], mode="task-incremental") == []


def test_evaluate_uses_eval_mode_no_grad_and_restores_modes() -> None:
    inner = OneHot(2)
    model = torch.nn.Sequential(torch.nn.Dropout(0.9), inner)
    model.train()
    model[0].eval()  # mixed modes must come back exactly as they were
    task = _task([[1.0, 0.0]] * 5, [0] * 5, classes=(0, 1))
    assert evaluate(model, [task], batch_size=2) == [1.0]
    assert inner.calls == [(False, False)] * 3
    assert model.training and inner.training and not model[0].training
    assert torch.is_grad_enabled()


def test_evaluate_runs_in_inference_mode_except_for_lazy_parameters() -> None:
    seen = []
    model = torch.nn.Sequential(torch.nn.Identity())
    model.register_forward_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
    task = _task([[1.0, 0.0]] * 3, [0] * 3, classes=(0, 1))
    assert evaluate(model, [task]) == [1.0] and seen == [True]
    assert not torch.is_inference_mode_enabled()
    # a lazy layer created during evaluation must still be trainable afterwards
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(2))
    evaluate(lazy, [task])
    weight = lazy[0].weight
    assert not weight.is_inference() and weight.requires_grad
    lazy(torch.ones(1, 2)).sum().backward()
    assert weight.grad is not None


def test_evaluation_runs_large_batches_by_default() -> None:
    model = OneHot(2)
    evaluate(model, [_task([[1.0, 0.0]] * 1500, [0] * 1500, classes=(0, 1))])
    assert len(model.calls) == 2  # EVAL_BATCH_SIZE = 1024 rows per forward


def test_evaluate_restores_modes_after_an_error() -> None:
    model = OneHot(2).train()
    task = _task([[1.0, 0.0]], [0], classes=(0, 5))
    with pytest.raises(ValueError, match="outside: \\[5\\]"):
        evaluate(model, [task], mode="task-incremental")
    assert model.training


def test_evaluate_calls_model_with_tuples_and_dicts() -> None:
    model = OneHot(2)
    x, extra = torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([[0.0, 5.0], [0.0, 0.0]])
    data = TensorDataset(x, extra, torch.tensor([0, 0]))
    task = Task(task_id=0, train=data, test=data, classes=(0, 1))
    assert evaluate(model, [task]) == [0.5]  # model(x, extra)

    class DictData(Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int):
            return {"x": x[index], "extra": extra[index]}, 0

    duck = SimpleNamespace(test=DictData(), classes=(0, 1), task_id=7)
    assert evaluate(model, [duck], batch_size=1) == [0.5]  # model(**inputs)


def test_evaluate_synchronises_once_per_task(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = torch.Tensor.item

    def counting_item(self):
        calls.append(1)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    tasks = [_task([[1.0, 0.0]] * 10, [0] * 10, classes=(0, 1), task_id=i) for i in range(3)]
    evaluate(OneHot(2), tasks, batch_size=3)
    assert len(calls) == 3


def test_evaluate_on_an_explicit_device() -> None:
    task = _task([[1.0, 0.0]], [0], classes=(0,))
    assert evaluate(OneHot(2), [task], device="cpu") == [1.0]
    assert evaluate(torch.nn.Identity(), [task]) == [1.0]  # no parameters: CPU


@pytest.mark.parametrize(
    ("kwargs", "model", "tasks", "error", "words"),
    [
        ({"mode": "domain"}, OneHot(2), [], ValueError, ["mode", "domain"]),
        ({"batch_size": 0}, OneHot(2), [], ValueError, ["batch_size", ">= 1"]),
        ({}, lambda x: x, [], TypeError, ["torch.nn.Module"]),
        ({}, OneHot(2), [TensorDataset(torch.zeros(1, 2))], TypeError, ["tasks[0]", "Task"]),
        ({"device": 0}, OneHot(2), [], TypeError, ["device"]),
        (
            {},
            torch.nn.Flatten(0),
            [_task([[1.0, 0.0]], [0], classes=(0,))],
            ValueError,
            ["(batch, num_classes)", "(2,)"],
        ),
        (
            {},
            OneHot(2),
            [
                Task(
                    task_id=3,
                    train=_task([[1.0]], [0], (0,)).train,
                    test=TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)),
                    classes=(0,),
                )
            ],
            ValueError,
            ["task 3", "empty"],
        ),
    ],
)
def test_evaluate_errors(kwargs, model, tasks, error, words) -> None:
    with pytest.raises(error) as info:
        evaluate(model, tasks, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.gpu
def test_evaluate_moves_batches_to_the_model_device() -> None:
    model = OneHot(3).cuda()
    task = _task([[0.0, 1.0, 9.0], [1.0, 0.0, 0.0]], [1, 0], classes=(0, 1))
    assert evaluate(model, [task]) == [0.5]
    assert evaluate(model, [task], mode="task-incremental") == [1.0]
    assert evaluate(model.cpu(), [task], device="cuda") == [0.5]  # explicit device, model stays


def test_end_to_end_on_split_digits() -> None:
    pytest.importorskip("sklearn")
    from renate_events.scenarios import split_digits

    tasks = split_digits(seed=0).tasks()
    x = torch.cat([task.train.tensors[0] for task in tasks])
    y = torch.cat([task.train.tensors[1] for task in tasks])
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    before = evaluate(model, tasks)
    for _ in range(60):  # full-batch joint training: a few hundred milliseconds
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    class_incremental = evaluate(model, tasks, mode="class-incremental")
    task_incremental = evaluate(model, tasks, mode="task-incremental", batch_size=64)
    assert all(t >= c for t, c in zip(task_incremental, class_incremental))
    assert min(class_incremental) > 0.8 and min(task_incremental) > 0.9
    matrix = AccuracyMatrix(baseline=before)
    for _ in tasks:
        matrix.append(class_incremental)
    assert average_accuracy(matrix) == pytest.approx(sum(class_incremental) / 5)
    assert forgetting(matrix) == 0.0 and backward_transfer(matrix) == 0.0


def test_no_object_serialization_in_the_module() -> None:
    source = inspect.getsource(evaluation)
    for word in ("pickle", "torch.save", "torch.load"):
        assert word not in source, word


def test_docstring_examples_run() -> None:
    result = doctest.testmod(evaluation, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_test_data_is_pinned_only_for_a_gpu() -> None:
    from renate_events.inference import pinned

    data = torch.zeros(4, 2)
    assert pinned(data, torch.device("cpu")) is data


@pytest.mark.gpu
def test_test_data_for_a_gpu_is_pinned_once_and_copied_without_waiting() -> None:
    from renate_events.inference import inference, outputs_in_batches, pinned

    data = torch.zeros(4, 2)
    staged = pinned(data, torch.device("cuda"))
    assert staged.is_pinned() and not data.is_pinned()
    assert pinned(staged, torch.device("cuda")) is staged
    model = torch.nn.Linear(2, 3).cuda()
    with inference(model, outputs_leave_autograd=True):
        outputs = torch.cat(list(outputs_in_batches(model, data, 3)))
    assert outputs.device.type == "cuda"
    torch.testing.assert_close(outputs.cpu(), model.cpu()(data).detach())
