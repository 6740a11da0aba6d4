"""Anytime accuracy of an online stream: the :class:`AnytimeAccuracy` listener that evaluates the
model every few training steps, the curve it records, and its plot.

Online continual learning (Koh et al., "Online Continual Learning on Class Incremental Blurry
Task Configuration with Anytime Inference", ICLR 2022; Avalanche's and Mammoth's online settings)
trains in one pass over a stream, each sample seen once in small batches, and asks for a model
that is good at any time, not only at the end of each task. :class:`AnytimeAccuracy` measures it:
every ``every`` optimizer steps it evaluates the model (class-incremental, the argmax over all
logits) on the test sets of the tasks the stream has reached so far, pooled; the curve of these
accuracies against the number of training samples seen is the anytime accuracy, and its mean over
the equally spaced evaluations is the area under it normalised by the stream's length (Koh et al.'s
:math:`A_{AUC}` divided by the number of samples).

Python::

    anytime = AnytimeAccuracy(tasks, every=50)
    updater = ModelUpdater(model, learner=..., listeners=[anytime],
                           max_epochs=1)  # one pass
    for task in tasks:
        anytime.reach(task.task_id)
        updater.update(task.train, task_id=task.task_id)
    anytime.finish(model)
    anytime.curve, anytime.area()

``renate-events run --online --eval-every 50`` does the same and writes the curve to
``results.json`` and ``anytime_accuracy.png``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from torch import nn

from renate_events import evaluation
from trainer import validators

__all__ = ["DEFAULT_EVERY", "AnytimeAccuracy", "plot_curves"]

DEFAULT_EVERY = 50
"""Training steps between two evaluations of :class:`AnytimeAccuracy` (and of ``--eval-every``)."""


def _check_tasks(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not value or not all(hasattr(task, "test") and hasattr(task, "classes") for task in value):
        raise validators.WrongTypeError(
            f"{validators.field_name(instance, attribute)} must be a non-empty sequence of tasks "
            f"(objects with test and classes, such as scenario.tasks()), got {value!r}"
        )


@attrs.define(eq=False)
class AnytimeAccuracy:
    """Listener: the accuracy on the test sets of the tasks seen so far, every ``every`` steps.

    Subscribe it to the learner's trainer (``ModelUpdater(listeners=[...])``) and call
    :meth:`reach` before each task's update; its step count runs on across updates. Evaluation
    runs in eval mode without gradients and puts the train mode back (see
    :func:`renate_events.evaluation.evaluate`); it draws no random numbers, so training is the
    same with or without it. Between evaluations it only counts (no host synchronisation).

    Args:
        tasks: The scenario's tasks (each with ``test`` and ``classes``), in stream order.
        every: Optimizer steps between evaluations, >= 1.
        model: What to evaluate, e.g. the model with its test transform; ``None`` (default): the
            trainer's model as the ``batch_end`` event gives it.

    Attributes:
        curve: One point per evaluation: ``step`` (steps so far, all updates), ``samples``
            (training samples so far), ``tasks_seen`` and ``accuracy``.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> from renate_events.scenarios import Task
        >>> data = TensorDataset(torch.randn(8, 2), torch.tensor([0, 1] * 4))
        >>> anytime = AnytimeAccuracy([Task(0, data, data, (0, 1))], every=2)
        >>> model = torch.nn.Linear(2, 2)
        >>> for _ in range(4):
        ...     anytime.on_batch_end(model, (data.tensors[0][:2], data.tensors[1][:2]))
        >>> [point["samples"] for point in anytime.curve]
        [4, 8]
    """

    tasks: Sequence[Any] = attrs.field(converter=tuple, validator=_check_tasks)
    every: int = attrs.field(default=DEFAULT_EVERY, validator=validators.int_at_least(1))
    model: nn.Module | None = attrs.field(default=None, kw_only=True)
    curve: list[dict[str, Any]] = attrs.field(init=False, factory=list)
    _seen: int = attrs.field(init=False, default=1)
    _steps: int = attrs.field(init=False, default=0)
    _samples: int = attrs.field(init=False, default=0)

    def reach(self, task_index: int) -> None:
        """The stream has reached task ``task_index`` (its position in ``tasks``): from now on
        its test set counts too."""
        validators.check_int("AnytimeAccuracy.reach: task_index", task_index, 0, len(self.tasks))
        self._seen = max(self._seen, task_index + 1)

    def on_batch_end(self, model: nn.Module, batch: Any) -> None:
        """Count the step and its samples; evaluate every ``every`` steps."""
        self._steps += 1
        self._samples += _batch_size(batch)
        if self._steps % self.every == 0:
            self._evaluate(model)

    def finish(self, model: nn.Module | None = None) -> None:
        """Evaluate once more at the end of the stream, unless the last step just did."""
        if self._steps and (not self.curve or self.curve[-1]["step"] != self._steps):
            target = model if model is not None else self.model
            if target is None:
                raise ValueError("AnytimeAccuracy.finish needs the model (none was given)")
            self._evaluate(target)

    def area(self) -> float:
        """The mean accuracy over the evaluations: the area under the curve divided by the
        stream's length (equal spacing); ``nan`` before any evaluation."""
        if not self.curve:
            return float("nan")
        return sum(point["accuracy"] for point in self.curve) / len(self.curve)

    def to_dict(self) -> dict[str, Any]:
        """The curve as lists, for a JSON file: ``every``, ``step``, ``samples``, ``tasks_seen``,
        ``accuracy`` and ``area``."""
        keys = ("step", "samples", "tasks_seen", "accuracy")
        return {
            "every": self.every,
            **{key: [point[key] for point in self.curve] for key in keys},
            "area": self.area(),
        }

    def _evaluate(self, model: nn.Module) -> None:
        seen = self.tasks[: self._seen]
        target = self.model if self.model is not None else model
        # one pass, one read of the device for all the tasks seen (evaluate reads once per task)
        row = evaluation.evaluate_row(target, seen, modes=["class-incremental"])
        accuracies = row.accuracies["class-incremental"]
        sizes = [len(task.test) for task in seen]
        accuracy = sum(a * n for a, n in zip(accuracies, sizes)) / sum(sizes)
        self.curve.append(
            {
                "step": self._steps,
                "samples": self._samples,
                "tasks_seen": self._seen,
                "accuracy": accuracy,
            }
        )


def _batch_size(batch: Any) -> int:
    """The number of samples of a batch (its targets' length; shapes need no synchronisation)."""
    if isinstance(batch, Mapping):
        batch = next(iter(batch.values()))
    if isinstance(batch, (tuple, list)):
        batch = batch[-1]
    return int(batch.shape[0]) if hasattr(batch, "shape") and batch.dim() else 1


def plot_curves(curves: Sequence[Mapping[str, Any]], title: str) -> bytes | None:
    """The anytime-accuracy curves (:meth:`AnytimeAccuracy.to_dict`, one per seed) as a PNG
    against the training samples seen; ``None`` without matplotlib (imported only here)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None  # the plot is optional (pip install 'renate-events[plot]')
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for index, curve in enumerate(curves):
        axes.plot(curve["samples"], curve["accuracy"], marker=".", label=f"run {index}")
    axes.set_xlabel("training samples seen")
    axes.set_ylabel("accuracy on the tasks seen")
    axes.set_ylim(0.0, 1.0)
    axes.set_title(title)
    if len(curves) > 1:
        axes.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    plt.close(figure)
    return buffer.getvalue()
