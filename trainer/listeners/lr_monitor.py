"""The learning rate of every parameter group, step by step."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from trainer import validators
from trainer.listeners._common import INT_AT_LEAST_1_OR_NONE

__all__ = ["LearningRateMonitor"]


@attrs.define(eq=False)
class LearningRateMonitor:
    """Records the learning rate of every parameter group every ``log_every_n_steps`` batches.

    ``history`` holds ``(step, [lr of group 0, lr of group 1, ...])`` with the rates that batch
    number ``step`` (the global step it completes) trained with, read before its optimizer step
    (so a scheduler stepped per batch shows each rate at the step that used it). Rates are host
    numbers, so reading them costs no synchronisation. The history covers the fits of this
    process; it is not stored in checkpoints. It keeps the latest ``max_history`` records (1000
    by default) and drops older ones, so that a long run or a process that fits many times does
    not grow it without end; for the whole run, log the rates to a file with
    :class:`MetricsLogger` (its ``lr`` column).

    Args:
        log_every_n_steps: Batches between records.
        max_history: How many records ``history`` keeps, the latest (None: all of them).

    Raises:
        ValueError: When ``log_every_n_steps`` is not an int >= 1, or ``max_history`` not an int
            >= 1 or None.

    Example:
        >>> from trainer import Trainer
        >>> monitor = LearningRateMonitor(log_every_n_steps=10)
        >>> Trainer().subscribe(monitor)
        'learning_rate_monitor_0'
    """

    log_every_n_steps: int = attrs.field(default=1, validator=validators.int_at_least(1))
    max_history: int | None = attrs.field(default=1000, validator=INT_AT_LEAST_1_OR_NONE)
    history: list[tuple[int, list[float]]] = attrs.field(init=False, factory=list)
    """``(step, learning rates)`` records, oldest first: the latest ``max_history``."""

    @property
    def last(self) -> list[float] | None:
        """The most recent learning rates, or None before the first record."""
        return self.history[-1][1] if self.history else None

    def on_batch_start(self, state: Any, optimizer: torch.optim.Optimizer) -> None:
        step = state.global_step + 1  # the step this batch completes
        if step % self.log_every_n_steps == 0:
            self.history.append((step, [float(group["lr"]) for group in optimizer.param_groups]))
            if self.max_history is not None and len(self.history) > self.max_history:
                del self.history[: len(self.history) - self.max_history]
