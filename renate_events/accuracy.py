"""The forward passes of evaluation: a model's accuracy on each task's test set.

:func:`evaluate` gives one row of the accuracy matrix in one mode; :func:`evaluate_row` gives the
rows of both modes and the class-incremental predictions (for the flip rates between two model
versions) from ONE pass over the test sets, reading the device once: what ``renate-events run``
does after each update. :func:`resident_tests` puts the test sets where they are evaluated once
per run (on the GPU, or in pinned memory) instead of copying them at every evaluation;
:func:`evaluation_batches` is how every pass reads a test set. Both modes are explained in
:mod:`renate_events.evaluation`, which also exports :func:`evaluate`.

Example:
    >>> import torch
    >>> from renate_events.scenarios import IIDScenario
    >>> data = torch.utils.data.TensorDataset(torch.randn(40, 3), torch.arange(40) % 2)
    >>> tasks = IIDScenario(data, num_tasks=2).tasks()
    >>> row = evaluate_row(torch.nn.Linear(3, 2), tasks, predictions=True)
    >>> sorted(row.accuracies), len(row.accuracies["task-incremental"])
    (['class-incremental', 'task-incremental'], 2)
    >>> len(row.predictions) == sum(len(task.test) for task in tasks)  # one per test sample
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

import attrs
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from renate_events.inference import (
    EVAL_BATCH_SIZE,
    forward,
    inference,
    model_device,
    pinned,
    takes_task_id,
)
from trainer import validators
from trainer.data import to_device

__all__ = [
    "MODES",
    "EvaluationRow",
    "evaluate",
    "evaluate_row",
    "evaluation_batches",
    "evaluation_device",
    "resident_tests",
]

Mode = Literal["class-incremental", "task-incremental"]
MODES = ("class-incremental", "task-incremental")
"""The two modes of evaluation: the argmax over all logits, or over the task's classes only."""

RESIDENT_SHARE = 0.25
"""The share of a GPU's free memory that :func:`resident_tests` may fill with test sets."""


def evaluate(
    model: nn.Module,
    tasks: Sequence[Any],
    *,
    mode: Mode = "class-incremental",
    batch_size: int = EVAL_BATCH_SIZE,
    device: str | torch.device | None = None,
) -> list[float]:
    """Accuracy of ``model`` on the test set of each task.

    The model runs in eval mode under ``torch.inference_mode()`` (``torch.no_grad()`` while it
    has lazy parameters to create); afterwards every submodule gets back the train/eval mode it
    had. Test data held on the CPU is pinned once and copied to a GPU without waiting; correct
    predictions are counted on the device, so there is one synchronisation (``.item()``) per
    task, whatever the number of batches (:func:`evaluate_row`: one per row).

    * ``"class-incremental"``: the prediction is the argmax over all logits.
    * ``"task-incremental"``: the task is known at test time; logits of classes outside
      ``task.classes`` are set to ``-inf`` before the argmax. Never lower than class-incremental.
      A model whose forward takes a ``task_id`` (a
      :class:`~renate_events.models.MultiHeadClassificationModel`, Renate's ``RenateModule``) is
      called as ``model(x, task_id=task.task_id)``: each test sample goes through the head of
      its task, whose logits are then masked to ``task.classes`` as above (a head of one output
      per class of the task, with labels ``0..k-1``, has nothing masked).

    Args:
        model: Maps a batch of inputs to logits ``(batch, num_classes)``; called as ``model(x)``,
            ``model(*x)`` for tuple inputs (a ``TensorDataset`` with more than two tensors: all
            but the last) or ``model(**x)`` for dict inputs. Any classifier module returning a
            score per class is evaluated the same way, e.g. iCaRL's nearest-mean-of-exemplars
            classifier, ``evaluate(learner.nme_classifier(), tasks)``
            (:meth:`renate_events.learners.ICaRLLearner.nme_classifier`).
        tasks: :class:`~renate_events.scenarios.Task` objects (anything with ``test``, a dataset
            of ``(inputs, target)``, and ``classes``).
        mode: ``"class-incremental"`` or ``"task-incremental"``.
        batch_size: Test samples per forward pass (large: nothing is kept for a backward pass).
        device: Where to run; by default the device of the model's first parameter (CPU for a
            model without parameters). The model itself is not moved.

    Returns:
        One accuracy in ``[0, 1]`` per task, in order.

    Raises:
        ValueError: Unknown ``mode``, bad ``batch_size``, an empty test set, logits that are not
            ``(batch, num_classes)``, task classes outside the logits (task-incremental), or a
            multi-head model without a head for a task (add one for every task before
            evaluating: ``model.add_task_params(task.task_id)``).

    Example:
        >>> import torch
        >>> from renate_events.scenarios import IIDScenario
        >>> data = torch.utils.data.TensorDataset(torch.randn(40, 3), torch.arange(40) % 2)
        >>> tasks = IIDScenario(data, num_tasks=2).tasks()
        >>> len(evaluate(torch.nn.Linear(3, 2), tasks, mode="task-incremental"))
        2
    """
    tasks, target_device = _checked(model, tasks, (mode,), "evaluate: mode", batch_size, device)
    with inference(model, outputs_leave_autograd=True):
        accuracies = []
        for index, task in enumerate(tasks):
            correct, total = _task_pass(model, task, index, (mode,), batch_size, target_device)
            accuracies.append(correct.item() / total)  # one read per task
        return accuracies


@attrs.frozen(eq=False)
class EvaluationRow:
    """What :func:`evaluate_row` gives.

    Attributes:
        accuracies: For each mode asked for, one accuracy per task, in order.
        predictions: The class-incremental predictions (argmax over all logits) on every task's
            test set, one after another, on the device the model ran on; ``None`` unless asked
            for.
    """

    accuracies: dict[str, list[float]]
    predictions: torch.Tensor | None = None


def evaluate_row(
    model: nn.Module,
    tasks: Sequence[Any],
    *,
    modes: Sequence[str] = MODES,
    predictions: bool = False,
    batch_size: int = EVAL_BATCH_SIZE,
    device: str | torch.device | None = None,
) -> EvaluationRow:
    """The accuracy of ``model`` on each task in every mode of ``modes``, and with
    ``predictions=True`` its class-incremental predictions, from one pass over the test sets.

    Each batch goes through the model once (twice for task-incremental accuracy of a model that
    takes a ``task_id``: once without, once through the task's head); the task-incremental
    prediction masks the same logits as the class-incremental one. The correct predictions are
    counted on the device and read once for the whole row. Arguments, modes and errors as
    :func:`evaluate` (which gives the same accuracies).

    Example:
        >>> import torch
        >>> from renate_events.scenarios import IIDScenario
        >>> data = torch.utils.data.TensorDataset(torch.randn(40, 3), torch.arange(40) % 2)
        >>> tasks = IIDScenario(data, num_tasks=2).tasks()
        >>> model = torch.nn.Linear(3, 2)
        >>> row = evaluate_row(model, tasks, modes=["class-incremental"])
        >>> row.accuracies["class-incremental"] == evaluate(model, tasks)
        True
    """
    if isinstance(modes, str) or not isinstance(modes, Sequence) or not modes:
        raise validators.WrongTypeError(
            f"evaluate_row: modes must be a non-empty sequence of modes out of {list(MODES)}, "
            f"got {modes!r}"
        )
    modes = tuple(dict.fromkeys(modes))
    name = "evaluate_row: modes[...]"
    tasks, target_device = _checked(model, tasks, modes, name, batch_size, device)
    predicted: list[torch.Tensor] | None = [] if predictions else None
    counts, totals = [], []
    with inference(model, outputs_leave_autograd=True):
        for index, task in enumerate(tasks):
            correct, total = _task_pass(
                model, task, index, modes, batch_size, target_device, predicted
            )
            counts.append(correct)
            totals.append(total)
    rows = torch.stack(counts).tolist() if counts else []  # the row's one read
    accuracies = {
        mode: [row[m] / total for row, total in zip(rows, totals)] for m, mode in enumerate(modes)
    }
    joined = None
    if predicted is not None:
        joined = torch.cat(predicted) if predicted else torch.zeros(0, dtype=torch.int64)
    return EvaluationRow(accuracies, joined)


def evaluation_device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    """``device`` (checked), or where ``model`` lives: where an evaluation of it runs."""
    if device is not None:
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"evaluate: device must be a str or torch.device, got {device!r}")
        return torch.device(device)
    return model_device(model)


def resident_tests(tasks: Sequence[Any], device: str | torch.device) -> list[Any]:
    """``tasks`` with their test tensors where a model on ``device`` evaluates them again and
    again without copying them each time: on a GPU when all of them fit in a quarter of its free
    memory (then no copy at all), else in pinned memory (each batch's copy then does not wait).
    Nothing changes on the CPU or for a test set that is not a ``TensorDataset``; the tasks
    themselves are not changed (a task with a moved test set is a copy, ``attrs.evolve``).

    Example:
        >>> import torch
        >>> from renate_events.scenarios import IIDScenario
        >>> data = torch.utils.data.TensorDataset(torch.randn(40, 3), torch.arange(40) % 2)
        >>> tasks = IIDScenario(data, num_tasks=2).tasks()
        >>> resident_tests(tasks, "cpu") == list(tasks)
        True
    """
    device = torch.device(device)
    tasks = list(tasks)
    movable = [isinstance(task.test, TensorDataset) and attrs.has(type(task)) for task in tasks]
    if device.type != "cuda" or not any(movable):
        return tasks
    size = sum(
        tensor.nbytes for task, move in zip(tasks, movable) if move for tensor in task.test.tensors
    )
    free, _ = torch.cuda.mem_get_info(device)
    on_device = size <= RESIDENT_SHARE * free

    def place(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device) if on_device else pinned(tensor, device)

    return [
        attrs.evolve(task, test=TensorDataset(*map(place, task.test.tensors))) if move else task
        for task, move in zip(tasks, movable)
    ]


def evaluation_batches(
    data: Any, batch_size: int, name: str, device: torch.device
) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(inputs, targets)`` chunks of ``data`` (a ``TensorDataset``: slices, the last tensor the
    targets; any other dataset: a ``DataLoader``'s batches); for a GPU, from pinned memory
    (tensors pinned once per call unless they are pinned or on the device already, a
    DataLoader's batches by the loader). ``name`` (``"task 3"``) goes into the errors."""
    if isinstance(data, TensorDataset):
        *inputs, targets = (pinned(tensor, device) for tensor in data.tensors)
        if not inputs:
            raise ValueError(f"evaluate ({name}): the test TensorDataset has no input tensor")
        for start in range(0, len(targets), batch_size):
            stop = start + batch_size
            batch = [t[start:stop] for t in inputs]
            yield (batch[0] if len(batch) == 1 else tuple(batch)), targets[start:stop]
        return
    loader = DataLoader(data, batch_size=batch_size, pin_memory=device.type == "cuda")
    for batch in loader:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(
                f"evaluate ({name}): test batches must be (inputs, targets) pairs, got "
                f"{type(batch).__name__}"
            )
        yield batch[0], batch[1]


# -- one task's pass --------------------------------------------------------------------------


def _checked(
    model: nn.Module,
    tasks: Sequence[Any],
    modes: Sequence[str],
    modes_name: str,
    batch_size: int,
    device: str | torch.device | None,
) -> tuple[list[Any], torch.device]:
    """The arguments every pass checks first: the model, the modes (called ``modes_name`` in
    the error), the batch size, the tasks (and their heads for task-incremental accuracy); the
    tasks as a list and the device to run on."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"evaluate: model must be a torch.nn.Module, got {type(model).__name__}")
    for mode in modes:
        validators.check_one_of(modes_name, mode, MODES)
    validators.check_int("evaluate: batch_size", batch_size, 1)
    tasks = list(tasks)
    for index, task in enumerate(tasks):
        if not hasattr(task, "test") or not hasattr(task, "classes"):
            raise TypeError(
                f"evaluate: tasks[{index}] is a {type(task).__name__}; expected a Task (with "
                "test and classes), such as the items of scenario.tasks()"
            )
    target_device = evaluation_device(model, device)
    if "task-incremental" in modes:
        _check_heads(model, tasks)
    return tasks, target_device


def _task_pass(
    model: nn.Module,
    task: Any,
    index: int,
    modes: Sequence[str],
    batch_size: int,
    device: torch.device,
    predicted: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, int]:
    """The correct predictions on ``task``'s test set in each mode of ``modes`` (an ``int64``
    tensor on ``device``, never read here) and the number of test samples; the class-incremental
    predictions of each batch appended to ``predicted`` if given."""
    task_id = getattr(task, "task_id", index)
    name = f"task {task_id}"
    correct = torch.zeros(len(modes), dtype=torch.int64, device=device)
    total = 0
    allowed: torch.Tensor | None = None
    # Task-incremental: through the task's own head, when the model takes a task id.
    head = task_id if takes_task_id(model) else None
    plain = "class-incremental" in modes or predicted is not None or head is None
    for inputs, targets in evaluation_batches(task.test, batch_size, name, device):
        targets, inputs = to_device(targets, device), to_device(inputs, device)
        logits = _logits(model, inputs, None, targets, name) if plain else None
        guess = None if logits is None else logits.argmax(dim=1)  # class-incremental
        hits = []
        for mode in modes:
            if mode == "class-incremental":
                hits.append(guess == targets)
                continue
            masked = logits if head is None else _logits(model, inputs, head, targets, name)
            if allowed is None:
                allowed = _class_mask(task.classes, masked.shape[1], masked.device, name)
            hits.append(masked.masked_fill(~allowed, float("-inf")).argmax(dim=1) == targets)
        correct += torch.stack(hits).sum(dim=1)
        if predicted is not None and guess is not None:
            predicted.append(guess)
        total += targets.shape[0]
    if total == 0:
        raise ValueError(f"evaluate ({name}): the test set is empty; accuracy is undefined")
    return correct, total


def _logits(
    model: nn.Module, inputs: Any, head: Any, targets: torch.Tensor, name: str
) -> torch.Tensor:
    """``model``'s logits on a batch (through task ``head`` if not None), their shape checked."""
    logits = forward(model, inputs, head)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"evaluate ({name}): the model must return logits of shape (batch, num_classes), "
            f"got {got}"
        )
    if logits.shape[0] != targets.shape[0]:
        raise ValueError(
            f"evaluate ({name}): the model returned {logits.shape[0]} rows of logits for a "
            f"batch of {targets.shape[0]} samples"
        )
    return logits


def _check_heads(model: nn.Module, tasks: Sequence[Any]) -> None:
    """A multi-head model needs a head for every task it is evaluated on (task-incremental)."""
    heads = getattr(model, "task_ids", None)
    if not (takes_task_id(model) and isinstance(heads, tuple)):
        return
    ids = [getattr(task, "task_id", index) for index, task in enumerate(tasks)]
    missing = [task_id for task_id in ids if task_id not in heads]
    if missing:
        raise ValueError(
            f"evaluate: task-incremental evaluation runs each task's test set through its own "
            f"head, but tasks {missing} have none (heads exist for {list(heads)}); add a head "
            "for every task before evaluating, e.g. model.add_task_params(task.task_id) for "
            "each task right after building the model"
        )


def _class_mask(
    classes: Sequence[int], num_logits: int, device: torch.device, name: str
) -> torch.Tensor:
    classes = list(classes)
    outside = [c for c in classes if not 0 <= c < num_logits]
    if not classes or outside:
        raise ValueError(
            f"evaluate ({name}): task-incremental evaluation needs the task's classes among the "
            f"model's {num_logits} logits; classes {classes} (outside: {outside}). Give the model "
            "one output per class id"
        )
    mask = torch.zeros(num_logits, dtype=torch.bool)
    mask[classes] = True
    return to_device(mask, device, pin=True)  # through pinned memory: the host does not wait
