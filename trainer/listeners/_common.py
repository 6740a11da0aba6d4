"""Helpers that several listeners share: the metric to monitor, its comparison, deferred actions,
optional packages."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from trainer import validators
from trainer.exceptions import MissingPackageError

METRIC_NAME = "a metric name such as 'val_loss'"
"""How argument messages describe a ``monitor`` field."""

INT_AT_LEAST_1_OR_NONE: Callable[[Any, attrs.Attribute[Any], Any], None] = (
    attrs.validators.optional(validators.int_at_least(1))
)
"""A validator for an int >= 1 or None whose message says "an int >= 1" (the shared
``int_at_least(1, optional=True)`` says "a positive int or None")."""


def improved(value: float, best: float | None, mode: str, min_delta: float) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` (NaN never does)."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


def monitored(owner: Any, monitor: str, metrics: Mapping[str, float]) -> float:
    """The value of ``monitor`` among ``metrics``; when it is missing, an error listing them."""
    if monitor not in metrics:
        raise ValueError(
            f"{type(owner).__name__} monitors {monitor!r}, which is not among the validation "
            f"metrics {sorted(metrics)}; set monitor= to one of them (val_step's keys get a "
            "'val_' prefix)"
        )
    return float(metrics[monitor])


def after_pending_saves(trainer: Any, action: Callable[[], Any]) -> None:
    """Run ``action`` after the checkpoints a listener asked for during this event are written.

    ``trainer.save_checkpoint`` called from a listener waits until every listener has handled
    the event; actions deferred after it run after it, and are dropped if the write fails.
    """
    if trainer.events.dispatching:
        trainer.events.defer(action)
    else:
        action()


def import_optional(module: str, *, owner: str, package: str, extra: str, install: str) -> Any:
    """The module ``module`` of an optional package; a :class:`MissingPackageError` naming the
    extra to install when it is missing.

    Args:
        module: The module to import (``"mlflow"``, ``"torch.utils.tensorboard"``).
        owner: Who needs it, the start of the message (``"MLflowLogger"``).
        package: The package's name in the message.
        extra: The ``renate-events`` extra that installs it.
        install: What ``pip install`` takes to install it alone.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingPackageError(
            f"{owner} needs the {package} package: pip install 'renate-events[{extra}]' "
            f"(or pip install {install})",
            package=package,
            extra=extra,
        ) from exc
