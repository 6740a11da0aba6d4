"""Helpers that several listeners share: argument checks, metric comparison, deferred actions."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs


def _int_at_least(minimum: int, *, optional: bool = False) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
            return
        allowed = f"an int >= {minimum}" + (" or None" if optional else "")
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be {allowed}, got {value!r}"
        )

    return check


def _number_at_least(minimum: float) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= minimum
        ):
            return
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a finite number >= {minimum}, "
            f"got {value!r}"
        )

    return check


def _one_of(*allowed: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in allowed:
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name} must be one of {list(allowed)}, "
                f"got {value!r}"
            )

    return check


def _metric_name(*, optional: bool = False) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, str) and value:
            return
        allowed = "a metric name such as 'val_loss'" + (" or None" if optional else "")
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be {allowed}, got {value!r}"
        )

    return check


def _improved(value: float, best: float | None, mode: str, min_delta: float) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` (NaN never does)."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


def _monitored(owner: Any, monitor: str, metrics: Mapping[str, float]) -> float:
    if monitor not in metrics:
        raise ValueError(
            f"{type(owner).__name__} monitors {monitor!r}, which is not among the validation "
            f"metrics {sorted(metrics)}; set monitor= to one of them (val_step's keys get a "
            "'val_' prefix)"
        )
    return float(metrics[monitor])


def _after_pending_saves(trainer: Any, action: Callable[[], Any]) -> None:
    """Run ``action`` after the checkpoints a listener asked for during this event are written.

    ``trainer.save_checkpoint`` called from a listener waits until every listener has handled
    the event; actions deferred after it run after it, and are dropped if the write fails.
    """
    if trainer.events.dispatching:
        trainer.events.defer(action)
    else:
        action()
