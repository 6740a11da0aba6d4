"""Evaluation of a continual learner: per-task accuracy, the accuracy matrix and its metrics.

After every model update ``i`` the model is evaluated on the test set of every task ``j`` (also the
tasks it has not trained on yet), which fills row ``i`` of the accuracy matrix ``R``:
``R[i][j]`` is the accuracy on task ``j`` after update ``i``, both counted from 0. ``T`` is the
number of tasks; a complete matrix is ``T x T``. Optionally ``b[j]`` is the accuracy of the model
before any update (needed for forward transfer). :func:`evaluate` gives a row in one mode,
:func:`evaluate_row` the rows of both modes (and the predictions for the flip rates) from one pass
over the test sets; both live in :mod:`renate_events.accuracy`, the forward passes' module.

Metrics (functions of ``R``):

* :func:`average_accuracy`: ``ACC = 1/T sum_j R[T-1][j]``,
* :func:`micro_average_accuracy`: the same, weighted by the number of test samples of each task,
* :func:`forgetting`: ``F = 1/(T-1) sum_{j<T-1} (max_{l<T-1} R[l][j] - R[T-1][j])``,
* :func:`backward_transfer`: ``BWT = 1/(T-1) sum_{j<T-1} (R[T-1][j] - R[j][j])``,
* :func:`forward_transfer`: ``FWT = 1/(T-1) sum_{j>=1} (R[j-1][j] - b[j])``.

Update-regression metrics (Renate's ``performance_regression_metrics``) compare two model
versions sample by sample: :func:`regression_metrics` on their predictions,
:func:`model_regression_metrics` on two models and a dataset.

References:
    David Lopez-Paz and Marc'Aurelio Ranzato, "Gradient Episodic Memory for Continual Learning",
    NeurIPS 2017 (average accuracy, backward and forward transfer).
    Arslan Chaudhry, Puneet K. Dokania, Thalaiyasingam Ajanthan and Philip H. S. Torr, "Riemannian
    Walk for Incremental Learning: Understanding Forgetting and Intransigence", ECCV 2018
    (forgetting).
    Sijie Yan, Yuanjun Xiong, Kaustav Kundu, Shuo Yang, Siqi Deng, Meng Wang, Wei Xia and
    Stefano Soatto, "Positive-Congruent Training: Towards Regression-Free Model Updates", CVPR
    2021 (negative flip rate and impact).

Example:
    >>> from renate_events.evaluation import AccuracyMatrix, average_accuracy, forgetting
    >>> matrix = AccuracyMatrix()
    >>> matrix.append([0.9, 0.1])
    >>> matrix.append([0.7, 0.8])
    >>> round(average_accuracy(matrix), 4), round(forgetting(matrix), 4)
    (0.75, 0.2)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from renate_events.accuracy import evaluate, evaluate_row, evaluation_batches, evaluation_device
from renate_events.inference import EVAL_BATCH_SIZE, forward, inference
from trainer import validators
from trainer.data import to_device

__all__ = [
    "AccuracyMatrix",
    "average_accuracy",
    "backward_transfer",
    "evaluate",
    "evaluate_row",
    "forgetting",
    "forward_transfer",
    "inference",
    "micro_average_accuracy",
    "model_regression_metrics",
    "regression_metrics",
]

MatrixLike = Any  # AccuracyMatrix or a sequence of rows (sequences of floats)


# --------------------------------------------------------------------------------------------
# AccuracyMatrix
# --------------------------------------------------------------------------------------------


def _to_row(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return value
    return [
        float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else v for v in value
    ]


def _to_rows(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return value
    return [_to_row(row) for row in value]


def _to_optional_row(value: Any) -> Any:
    return None if value is None else _to_row(value)


def _row_problem(row: Any) -> str | None:
    """Why ``row`` is not a non-empty list of accuracies in [0, 1], or None if it is."""
    if not isinstance(row, list) or not row:
        return f"must be a non-empty sequence of accuracies, got {row!r}"
    bad = [v for v in row if not isinstance(v, float) or not 0.0 <= v <= 1.0]
    if bad:
        return f"must hold accuracies in [0, 1] (fractions, not percentages), got {bad[:3]!r}"
    return None


def _check_rows(instance: AccuracyMatrix, attribute: Any, value: Any) -> None:
    if not isinstance(value, list):
        raise ValueError(f"AccuracyMatrix.rows must be a list of rows, got {value!r}")
    for i, row in enumerate(value):
        problem = _row_problem(row)
        if problem:
            raise ValueError(f"AccuracyMatrix.rows[{i}] {problem}")
    widths = {len(row) for row in value}
    if len(widths) > 1:
        raise ValueError(
            f"AccuracyMatrix.rows have different lengths {sorted(widths)}; every row holds the "
            "accuracy on every task"
        )
    if value and len(value) > len(value[0]):
        raise ValueError(
            f"AccuracyMatrix.rows: {len(value)} rows for {len(value[0])} tasks; there is one row "
            "per update and at most one update per task"
        )
    baseline = getattr(instance, "baseline", None)
    if value and baseline is not None and len(baseline) != len(value[0]):
        raise ValueError(
            f"AccuracyMatrix.rows have {len(value[0])} tasks but baseline has {len(baseline)}"
        )


def _check_baseline(instance: AccuracyMatrix, attribute: Any, value: Any) -> None:
    if value is None:
        return
    problem = _row_problem(value)
    if problem:
        raise ValueError(f"AccuracyMatrix.baseline {problem}")
    if instance.rows and len(instance.rows[0]) != len(value):
        raise ValueError(
            f"AccuracyMatrix.baseline has {len(value)} tasks but the rows have "
            f"{len(instance.rows[0])}"
        )


@attrs.define
class AccuracyMatrix:
    """The accuracy matrix ``R[i][j]``: accuracy on task ``j`` after update ``i`` (from 0).

    Built row by row: after each update, :meth:`append` the accuracies on *all* tasks (the output
    of :func:`evaluate`). ``baseline`` holds ``b[j]``, the accuracies of the model before the first
    update, which :func:`forward_transfer` needs. Rows and baseline are checked on every change:
    same length ``T`` (the number of tasks), at most ``T`` rows, values in ``[0, 1]``.

    Args:
        rows: The rows so far (default: none).
        baseline: ``b``, or ``None``.

    Example:
        >>> matrix = AccuracyMatrix(baseline=[0.1, 0.1])
        >>> matrix.append([0.9, 0.2])
        >>> matrix.to_dict()
        {'rows': [[0.9, 0.2]], 'baseline': [0.1, 0.1]}
    """

    rows: list[list[float]] = attrs.field(factory=list, converter=_to_rows, validator=_check_rows)
    baseline: list[float] | None = attrs.field(
        default=None, converter=_to_optional_row, validator=_check_baseline
    )

    @property
    def num_tasks(self) -> int | None:
        """``T``, the length of a row (``None`` while there is no row and no baseline)."""
        if self.rows:
            return len(self.rows[0])
        return None if self.baseline is None else len(self.baseline)

    @property
    def is_complete(self) -> bool:
        """Whether there is one row per task (the matrix is square)."""
        return bool(self.rows) and len(self.rows) == len(self.rows[0])

    def append(self, row: Sequence[float]) -> None:
        """Adds the accuracies on every task after the next update.

        Args:
            row: One accuracy per task, e.g. ``evaluate(model, tasks)``.

        Raises:
            ValueError: The row has another length than the others, values outside ``[0, 1]``,
                or the matrix already has a row per task.
        """
        self.rows = [*self.rows, _to_row(row)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[float]:
        return list(self.rows[index])

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able copy: ``{"rows": [[...], ...], "baseline": [...] or None}``."""
        baseline = None if self.baseline is None else list(self.baseline)
        return {"rows": [list(row) for row in self.rows], "baseline": baseline}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AccuracyMatrix:
        """Rebuilds a matrix from :meth:`to_dict`'s output (e.g. after ``json.load``).

        Raises:
            ValueError: ``data`` lacks ``rows``, has unknown keys, or holds an invalid matrix.

        Example:
            >>> AccuracyMatrix.from_dict({"rows": [[0.5]], "baseline": None}).rows
            [[0.5]]
        """
        if not isinstance(data, Mapping):
            raise TypeError(
                f"AccuracyMatrix.from_dict expects a mapping, got {type(data).__name__}"
            )
        unknown = sorted(set(data) - {"rows", "baseline"})
        problems = []
        if "rows" not in data:
            problems.append("missing key 'rows'")
        if unknown:
            problems.append(f"unknown keys {unknown}")
        if problems:
            raise ValueError(
                f"AccuracyMatrix.from_dict: {'; '.join(problems)} (expected the keys 'rows' and "
                "optionally 'baseline', as written by to_dict)"
            )
        return cls(rows=data["rows"], baseline=data.get("baseline"))


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def _rows(matrix: MatrixLike, metric: str) -> list[list[float]]:
    if not isinstance(matrix, AccuracyMatrix):
        try:
            matrix = AccuracyMatrix(rows=matrix)
        except ValueError as exc:
            raise ValueError(f"{metric}: not a valid accuracy matrix: {exc}") from exc
    if not matrix.rows:
        raise ValueError(f"{metric}: the accuracy matrix is empty; append a row after each update")
    return matrix.rows


def _square(matrix: MatrixLike, metric: str, *, min_tasks: int = 1) -> list[list[float]]:
    rows = _rows(matrix, metric)
    tasks = len(rows[0])
    if len(rows) != tasks:
        raise ValueError(
            f"{metric} needs the complete T x T matrix (one row per update, T = {tasks} tasks), "
            f"got {len(rows)} rows; finish all updates first"
        )
    if tasks < min_tasks:
        raise ValueError(
            f"{metric} is undefined for {tasks} task(s); it needs at least {min_tasks} tasks"
        )
    return rows


def _update_index(rows: list[list[float]], after: Any, metric: str) -> int:
    if after is None:
        if len(rows) != len(rows[0]):
            raise ValueError(
                f"{metric}: the matrix has {len(rows)} of {len(rows[0])} rows; finish all updates "
                "or pass after=<update index>"
            )
        return len(rows) - 1
    validators.check_int(f"{metric}: after (the index of an update)", after, 0, len(rows))
    return after


def average_accuracy(matrix: MatrixLike, after: int | None = None) -> float:
    """Average accuracy over the tasks seen so far (Lopez-Paz & Ranzato, NeurIPS 2017).

    ``ACC(t) = 1/(t+1) sum_{j<=t} R[t][j]``; by default ``t = T-1``, the mean of the last row of
    the complete matrix over all ``T`` tasks.

    Args:
        matrix: An :class:`AccuracyMatrix` or a sequence of rows.
        after: The update ``t``; ``None`` for the last one (needs the complete matrix).

    Returns:
        The average accuracy in ``[0, 1]``.

    Raises:
        ValueError: An empty or incomplete matrix (with ``after=None``), or a bad ``after``.

    Example:
        >>> average_accuracy([[0.9, 0.1], [0.7, 0.8]]), average_accuracy([[0.9, 0.1]], after=0)
        (0.75, 0.9)
    """
    rows = _rows(matrix, "average_accuracy")
    t = _update_index(rows, after, "average_accuracy")
    return math.fsum(rows[t][: t + 1]) / (t + 1)


def micro_average_accuracy(
    matrix: MatrixLike, test_sizes: Sequence[int], after: int | None = None
) -> float:
    """Sample-weighted average accuracy over the tasks seen so far.

    ``sum_{j<=t} n_j R[t][j] / sum_{j<=t} n_j`` with ``n_j`` the number of test samples of task
    ``j``: the accuracy on the union of the test sets seen so far. By default ``t = T-1``.

    Args:
        matrix: An :class:`AccuracyMatrix` or a sequence of rows.
        test_sizes: ``n_j`` for every task, e.g. ``[len(task.test) for task in tasks]``.
        after: The update ``t``; ``None`` for the last one (needs the complete matrix).

    Returns:
        The micro-averaged accuracy in ``[0, 1]``.

    Raises:
        ValueError: As :func:`average_accuracy`; ``test_sizes`` not ``T`` ints ``>= 0`` with a
            positive sum over the tasks seen.

    Example:
        >>> micro_average_accuracy([[0.9, 0.1], [0.7, 0.8]], test_sizes=[10, 30])
        0.775
    """
    rows = _rows(matrix, "micro_average_accuracy")
    t = _update_index(rows, after, "micro_average_accuracy")
    sizes = list(test_sizes) if isinstance(test_sizes, Sequence) else test_sizes
    valid = (
        isinstance(sizes, list)
        and len(sizes) == len(rows[0])
        and all(validators.is_int(n) and n >= 0 for n in sizes)
    )
    if not valid:
        raise ValueError(
            f"micro_average_accuracy: test_sizes must hold one int >= 0 per task ({len(rows[0])}), "
            f"got {test_sizes!r}"
        )
    total = sum(sizes[: t + 1])
    if total == 0:
        raise ValueError("micro_average_accuracy: the tasks seen so far have no test samples")
    return math.fsum(n * a for n, a in zip(sizes[: t + 1], rows[t][: t + 1])) / total


def forgetting(matrix: MatrixLike) -> float:
    """Average forgetting (Chaudhry et al., "Riemannian Walk for Incremental Learning", ECCV 2018).

    ``F = 1/(T-1) sum_{j<T-1} f_j`` with ``f_j = max_{l<T-1} R[l][j] - R[T-1][j]``: how far the
    final accuracy on each earlier task lies below the best accuracy it had before the last
    update. Lower is better; it is negative only if every earlier task improved at the end.

    Args:
        matrix: The complete ``T x T`` matrix, ``T >= 2``.

    Returns:
        The average forgetting.

    Raises:
        ValueError: An empty, incomplete or ``1 x 1`` matrix.

    Example:
        >>> round(forgetting([[0.9, 0.1], [0.7, 0.8]]), 4)
        0.2
    """
    rows = _square(matrix, "forgetting", min_tasks=2)
    last = len(rows) - 1
    drops = [max(rows[i][j] for i in range(last)) - rows[last][j] for j in range(last)]
    return math.fsum(drops) / last


def backward_transfer(matrix: MatrixLike) -> float:
    """Backward transfer, BWT (Lopez-Paz & Ranzato, "Gradient Episodic Memory", NeurIPS 2017).

    ``BWT = 1/(T-1) sum_{j<T-1} (R[T-1][j] - R[j][j])``: the effect of the later updates on the
    earlier tasks; negative values mean forgetting.

    Args:
        matrix: The complete ``T x T`` matrix, ``T >= 2``.

    Returns:
        The backward transfer.

    Raises:
        ValueError: An empty, incomplete or ``1 x 1`` matrix.

    Example:
        >>> round(backward_transfer([[0.9, 0.1], [0.7, 0.8]]), 4)
        -0.2
    """
    rows = _square(matrix, "backward_transfer", min_tasks=2)
    last = len(rows) - 1
    return math.fsum(rows[last][j] - rows[j][j] for j in range(last)) / last


def forward_transfer(matrix: MatrixLike, baseline: Sequence[float] | None = None) -> float:
    """Forward transfer, FWT (Lopez-Paz & Ranzato, "Gradient Episodic Memory", NeurIPS 2017).

    ``FWT = 1/(T-1) sum_{j>=1} (R[j-1][j] - b[j])``: how much training on the earlier tasks helps
    a task before it is trained on, compared with ``b[j]``, the accuracy of the model before any
    update (GEM uses a randomly initialised model).

    Args:
        matrix: The complete ``T x T`` matrix, ``T >= 2``.
        baseline: ``b``, one accuracy per task; defaults to ``matrix.baseline`` for an
            :class:`AccuracyMatrix`.

    Returns:
        The forward transfer.

    Raises:
        ValueError: An empty, incomplete or ``1 x 1`` matrix, or no (or a wrong-length) baseline.

    Example:
        >>> round(forward_transfer([[0.9, 0.3], [0.7, 0.8]], baseline=[0.1, 0.1]), 4)
        0.2
    """
    rows = _square(matrix, "forward_transfer", min_tasks=2)
    if baseline is None and isinstance(matrix, AccuracyMatrix):
        baseline = matrix.baseline
    if baseline is None:
        raise ValueError(
            "forward_transfer needs b, the accuracy on every task before the first update: pass "
            "baseline=evaluate(untrained_model, tasks) or set AccuracyMatrix.baseline"
        )
    b = _to_row(baseline)
    problem = _row_problem(b)
    if problem or len(b) != len(rows):
        raise ValueError(
            f"forward_transfer: baseline must hold one accuracy in [0, 1] per task "
            f"({len(rows)}), got {baseline!r}"
        )
    return math.fsum(rows[j - 1][j] - b[j] for j in range(1, len(rows))) / (len(rows) - 1)


# --------------------------------------------------------------------------------------------
# Update-regression metrics
# --------------------------------------------------------------------------------------------


def _predictions(values: Any, name: str) -> torch.Tensor:
    """Class predictions from ``(N,)`` integer labels or ``(N, K)`` logits (their argmax)."""
    if not isinstance(values, torch.Tensor):
        raise validators.WrongTypeError(
            f"regression_metrics: {name} must be a torch.Tensor of labels (N,) or logits (N, K), "
            f"got {type(values).__name__}"
        )
    if values.dim() == 2:
        return values.argmax(dim=1)
    if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
        raise ValueError(
            f"regression_metrics: {name} must be integer labels of shape (N,) or logits of shape "
            f"(N, K), got {values.dtype} of shape {tuple(values.shape)}"
        )
    return values


def regression_metrics(
    old_outputs: torch.Tensor, new_outputs: torch.Tensor, targets: torch.Tensor
) -> dict[str, float]:
    """Negative and positive flip rates and impacts between an old and a new model version.

    With ``old_ok = old == y`` and ``new_ok = new == y`` per sample (``N`` samples), as Renate's
    ``performance_regression_metrics`` defines them:

    * ``"nfr"``, negative flip rate: ``#(old_ok & ~new_ok) / N``;
    * ``"nfi"``, negative flip impact: ``#(old_ok & ~new_ok) / #(~new_ok)``, the share of the
      new model's errors that the old model got right;
    * ``"pfr"``, positive flip rate: ``#(~old_ok & new_ok) / N``;
    * ``"pfi"``, positive flip impact: ``#(~old_ok & new_ok) / #(new_ok)``, the share of the new
      model's correct predictions that the old model got wrong.

    An impact whose denominator is zero (the new model makes no error, or gets nothing right)
    has a zero numerator too and is reported as ``0.0`` (Renate would give NaN). The counts are
    taken on the tensors' device with one synchronisation.

    Args:
        old_outputs: The old model's predicted labels ``(N,)`` or logits ``(N, K)``.
        new_outputs: The new model's predicted labels ``(N,)`` or logits ``(N, K)``.
        targets: The true labels ``(N,)``.

    Returns:
        ``{"nfr": ..., "nfi": ..., "pfr": ..., "pfi": ...}``, each in ``[0, 1]``.

    Raises:
        ValueError: Empty inputs, shapes that differ, or tensors that are neither labels nor
            logits.

    Example:
        >>> import torch
        >>> old, new = torch.tensor([2, 1, 0, 2]), torch.tensor([1, 3, 0, 3])
        >>> regression_metrics(old, new, torch.tensor([3, 3, 0, 2]))
        {'nfr': 0.25, 'nfi': 0.5, 'pfr': 0.25, 'pfi': 0.5}
    """
    old = _predictions(old_outputs, "old_outputs")
    new = _predictions(new_outputs, "new_outputs")
    labels = _predictions(targets, "targets")
    if targets.dim() != 1:
        raise ValueError(
            f"regression_metrics: targets must be labels of shape (N,), got {tuple(targets.shape)}"
        )
    if not old.shape == new.shape == labels.shape:
        raise ValueError(
            "regression_metrics: old_outputs, new_outputs and targets must describe the same "
            f"samples, got {tuple(old.shape)}, {tuple(new.shape)} and {tuple(labels.shape)} "
            "predictions"
        )
    if labels.numel() == 0:
        raise ValueError("regression_metrics: no samples; the flip rates are undefined")
    new = new.to(labels.device)
    old_ok, new_ok = old.to(labels.device) == labels, new == labels
    counts = torch.stack(
        [(old_ok & ~new_ok).sum(), (~new_ok).sum(), (~old_ok & new_ok).sum(), new_ok.sum()]
    ).tolist()
    negative, errors, positive, correct = counts
    total = labels.numel()
    return {
        "nfr": negative / total,
        "nfi": negative / errors if errors else 0.0,
        "pfr": positive / total,
        "pfi": positive / correct if correct else 0.0,
    }


def _all_logits(model: nn.Module, data: Any, batch_size: int, device: torch.device) -> Any:
    """Logits of ``model`` on every sample of ``data`` and the targets, on ``device``."""
    outputs, labels = [], []
    for inputs, targets in evaluation_batches(data, batch_size, "regression metrics", device):
        logits = forward(model, to_device(inputs, device))
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(
                "model_regression_metrics: the models must return logits of shape "
                f"(batch, num_classes), got {got}"
            )
        outputs.append(logits.argmax(dim=1))
        labels.append(to_device(targets, device))
    if not labels:
        raise ValueError("model_regression_metrics: the dataset is empty")
    return torch.cat(outputs), torch.cat(labels)


def model_regression_metrics(
    old_model: nn.Module,
    new_model: nn.Module,
    data: Any,
    *,
    batch_size: int = EVAL_BATCH_SIZE,
    device: str | torch.device | None = None,
) -> dict[str, float]:
    """:func:`regression_metrics` of two models on a dataset of ``(inputs, target)``.

    Both models run in eval mode under ``torch.inference_mode()`` and get back their train/eval
    modes afterwards; each runs on ``device``, by default the device of its own first parameter
    (neither model is moved).

    Example:
        >>> import torch
        >>> data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.arange(8) % 2)
        >>> model = torch.nn.Linear(3, 2)
        >>> model_regression_metrics(model, model, data)["nfr"]
        0.0
    """
    for name, model in (("old_model", old_model), ("new_model", new_model)):
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model_regression_metrics: {name} must be a torch.nn.Module, got "
                f"{type(model).__name__}"
            )
    validators.check_int("model_regression_metrics: batch_size", batch_size, 1)
    with (
        inference(old_model, outputs_leave_autograd=True),
        inference(new_model, outputs_leave_autograd=True),
    ):
        old_device, new_device = (evaluation_device(m, device) for m in (old_model, new_model))
        old, _ = _all_logits(old_model, data, batch_size, old_device)
        new, targets = _all_logits(new_model, data, batch_size, new_device)
    return regression_metrics(old, new, targets)
