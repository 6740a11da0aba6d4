"""attrs validators shared by the components.

Every validator raises :class:`ValueError` whose message names the field, repeats the value that
was given and states the allowed range, e.g.
``WeightedCLSLossComponent.weight must be a real number in [0, inf), got -1``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection
from typing import Any

import attrs

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _field_name(instance: Any, attribute: attrs.Attribute[Any]) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def real_in_range(
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> Validator:
    """Returns a validator accepting finite real numbers (not bools) between ``low`` and ``high``.

    Args:
        low: Lower bound (``-inf`` for none).
        high: Upper bound (``inf`` for none).
        low_open: Whether ``low`` itself is excluded.
        high_open: Whether ``high`` itself is excluded.
    """
    left = "(" if low_open or math.isinf(low) else "["
    right = ")" if high_open or math.isinf(high) else "]"
    interval = f"{left}{_fmt(low)}, {_fmt(high)}{right}"

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        ok = (
            isinstance(value, numbers.Real)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (float(value) > low if low_open else float(value) >= low)
            and (float(value) < high if high_open else float(value) <= high)
        )
        if not ok:
            raise ValueError(
                f"{_field_name(instance, attribute)} must be a real number in {interval}, "
                f"got {value!r}"
            )

    return validate


def _fmt(bound: float) -> str:
    if math.isinf(bound):
        return "-inf" if bound < 0 else "inf"
    return f"{bound:g}"


def integer_in_range(low: int, high_exclusive: int) -> Validator:
    """Returns a validator accepting ints (not bools) with ``low <= value < high_exclusive``."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        ok = (
            isinstance(value, numbers.Integral)
            and not isinstance(value, bool)
            and low <= int(value) < high_exclusive
        )
        if not ok:
            raise ValueError(
                f"{_field_name(instance, attribute)} must be an integer in "
                f"[{low}, {high_exclusive}), got {value!r}"
            )

    return validate


def boolean(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Validator accepting only ``True`` and ``False``."""
    if not isinstance(value, bool):
        raise ValueError(
            f"{_field_name(instance, attribute)} must be a bool (True or False), got {value!r}"
        )


def one_of(choices: Collection[str]) -> Validator:
    """Returns a validator accepting only the given strings."""
    allowed = ", ".join(repr(c) for c in choices)

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(
                f"{_field_name(instance, attribute)} must be one of {allowed}, got {value!r}"
            )

    return validate


def is_callable(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Validator accepting any callable."""
    if not callable(value):
        raise ValueError(
            f"{_field_name(instance, attribute)} must be a callable "
            f"(outputs, targets) -> loss tensor, got {value!r}"
        )


def at_most_field(other: str, reason: str) -> Validator:
    """Returns a validator requiring ``value <= getattr(instance, other)``.

    attrs runs validators after all fields are assigned in ``__init__`` and before assignment on
    ``setattr``, so the comparison always sees the other field's current value.
    """

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        bound = getattr(instance, other)
        if _both_real(value, bound) and not value <= bound:
            raise ValueError(
                f"{_field_name(instance, attribute)} must be <= {other} ({reason}), "
                f"got {attribute.name}={value!r} and {other}={bound!r}"
            )

    return validate


def at_least_field(other: str, reason: str) -> Validator:
    """Returns a validator requiring ``value >= getattr(instance, other)``."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        bound = getattr(instance, other)
        if _both_real(value, bound) and not value >= bound:
            raise ValueError(
                f"{_field_name(instance, attribute)} must be >= {other} ({reason}), "
                f"got {attribute.name}={value!r} and {other}={bound!r}"
            )

    return validate


def _both_real(a: Any, b: Any) -> bool:
    # Type and range errors are reported by each field's own validator.
    return all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in (a, b))
