"""Ends the fit when a validation metric stops improving."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from trainer import validators
from trainer.listeners._common import METRIC_NAME, improved, monitored

__all__ = ["EarlyStopping"]


@attrs.define(eq=False)
class EarlyStopping:
    """Ends the fit when a validation metric has not improved for ``patience`` validations.

    After each validation, a value better than the best so far by more than ``min_delta`` resets
    the count; otherwise the count grows, and at ``patience`` it sets ``state.should_stop`` (the
    fit ends before the next epoch and ``FitResult.stopped_early`` is True). A NaN or infinite
    value stops at once when ``check_finite`` is set. The counters restart with every fit and are
    stored in checkpoints, so a resumed fit stops where the uninterrupted one would have.

    Args:
        monitor: The validation metric to watch, e.g. ``"val_loss"`` or ``"val_accuracy"``.
        mode: ``"min"`` or ``"max"``: whether a lower or a higher value is better.
        patience: Validations without improvement before stopping.
        min_delta: The smallest change that counts as an improvement.
        check_finite: Stop as soon as the metric is NaN or infinite.

    Raises:
        ValueError: When an argument is out of range.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer(max_epochs=100)
        >>> trainer.subscribe(EarlyStopping(monitor="val_loss", patience=5))
        'early_stopping_0'
    """

    monitor: str = attrs.field(
        default="val_loss", validator=validators.non_empty_string(METRIC_NAME)
    )
    mode: str = attrs.field(default="min", validator=validators.one_of("min", "max"))
    patience: int = attrs.field(default=3, validator=validators.int_at_least(1))
    min_delta: float = attrs.field(default=0.0, validator=validators.real_in_range(0.0))
    check_finite: bool = attrs.field(default=True, validator=validators.boolean)
    best_score: float | None = attrs.field(init=False, default=None)
    """The best value seen in this fit, or None."""
    wait_count: int = attrs.field(init=False, default=0)
    """Validations since the last improvement."""
    stopped_epoch: int | None = attrs.field(init=False, default=None)
    """The epoch after which it stopped the fit, or None."""

    def on_train_start(self) -> None:
        self.best_score, self.wait_count, self.stopped_epoch = None, 0, None

    def on_validation_end(self, state: Any, metrics: Mapping[str, float]) -> None:
        value = monitored(self, self.monitor, metrics)
        if self.check_finite and not math.isfinite(value):
            self._stop(state)
        elif improved(value, self.best_score, self.mode, self.min_delta):
            self.best_score, self.wait_count = value, 0
        else:
            self.wait_count += 1
            if self.wait_count >= self.patience:
                self._stop(state)

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        checkpoint["best_score"] = self.best_score
        checkpoint["wait_count"] = self.wait_count
        checkpoint["stopped_epoch"] = self.stopped_epoch

    def on_load_checkpoint(self, checkpoint: Any, state: Any) -> None:
        best = checkpoint["best_score"]
        self.best_score = None if best is None else float(best)
        self.wait_count = int(checkpoint["wait_count"])
        self.stopped_epoch = checkpoint["stopped_epoch"]
        if self.stopped_epoch is not None:
            state.should_stop = True  # the run had stopped: resuming it trains no further

    def _stop(self, state: Any) -> None:
        state.should_stop = True
        self.stopped_epoch = state.epoch
