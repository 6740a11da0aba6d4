"""Argument checks shared by ``trainer`` and ``renate_events``: one module, one message shape.

Every check raises with a message of the form ``"Class.field must be <what>, got <value>"``:

- :class:`ValueError` when the value has the right type but is out of range or not allowed;
- :class:`WrongTypeError` when it has the wrong type (a bool where an int is expected, a string
  where a number is expected). It is a :class:`TypeError`; it is also a :class:`ValueError`,
  so that code written against releases that raised ``ValueError`` for every bad argument keeps
  catching it.

The ``check_*`` functions take the name to report; the other functions return attrs validators
that report ``Class.field``.

Example:
    >>> import attrs
    >>> from trainer import validators
    >>> @attrs.define
    ... class Config:
    ...     steps: int = attrs.field(default=1, validator=validators.int_at_least(1))
    >>> Config(steps=0)
    Traceback (most recent call last):
    ...
    ValueError: Config.steps must be an int >= 1, got 0
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Collection
from typing import Any

import attrs

__all__ = [
    "NAME_PATTERN",
    "WrongTypeError",
    "at_least_field",
    "at_most_field",
    "boolean",
    "check_int",
    "check_one_of",
    "field_name",
    "int_at_least",
    "is_callable",
    "is_int",
    "is_real",
    "non_empty_string",
    "one_of",
    "optional_boolean",
    "real_in_range",
    "snake_case",
]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


class WrongTypeError(TypeError, ValueError):
    """Raised when an argument has the wrong type (also a ValueError, see the module docstring)."""


NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
"""A listener's or component's name: letters, digits, ``_`` and ``-``, starting with a letter or
``_``; no dots, since dots separate the parts of a checkpoint key."""


def snake_case(name: str) -> str:
    """``MyLogger`` -> ``my_logger``: the default name of a listener or component of a class."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "listener"
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    return name if name[0].isalpha() or name[0] == "_" else f"_{name}"


def field_name(instance: Any, attribute: attrs.Attribute[Any]) -> str:
    """``Class.field``: how every message names an attrs field."""
    return f"{type(instance).__name__}.{attribute.name}"


def is_int(value: Any) -> bool:
    """True for ints (any ``numbers.Integral``), False for bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """True for finite real numbers (ints and floats), False for bools, NaN and infinities."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _int_text(low: int | None, high: int | None) -> str:
    if low is None:
        return "an int" if high is None else f"an int < {high}"
    return f"an int >= {low}" if high is None else f"an int in [{low}, {high})"


def _in_range(value: int, low: int | None, high: int | None) -> bool:
    return (low is None or value >= low) and (high is None or value < high)


def check_int(name: str, value: Any, low: int | None, high: int | None = None) -> None:
    """Raise unless ``value`` is an int with ``low <= value < high`` (None: no such bound).

    Raises:
        WrongTypeError: ``value`` is not an int (bools are not).
        ValueError: ``value`` is out of range.
    """
    if not is_int(value):
        raise WrongTypeError(
            f"{name} must be {_int_text(low, high)}, got {value!r} of type {type(value).__name__}"
        )
    if not _in_range(value, low, high):
        raise ValueError(f"{name} must be {_int_text(low, high)}, got {value!r}")


def int_at_least(low: int | None, high: int | None = None, *, optional: bool = False) -> Validator:
    """A validator for ints in ``[low, high)`` (None: no such bound), or None if ``optional``.
    The message of an optional field with ``low == 1`` says "a positive int"."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if optional:
            what = "a positive int" if (low, high) == (1, None) else _int_text(low, high)
            if not is_int(value) or not _in_range(value, low, high):
                error = ValueError if is_int(value) else WrongTypeError
                raise error(
                    f"{field_name(instance, attribute)} must be {what} or None, got {value!r}"
                )
            return
        check_int(field_name(instance, attribute), value, low, high)

    return validate


def _fmt(bound: float) -> str:
    if math.isinf(bound):
        return "-inf" if bound < 0 else "inf"
    return f"{bound:g}"


def _range_text(low: float, high: float, low_open: bool, high_open: bool) -> str:
    """``a number > 0``, ``a number <= 1``, ``a number in (0, 1]`` or ``a finite number``."""
    if math.isinf(low) and math.isinf(high):
        return "a finite number"
    if math.isinf(high):
        return f"a number {'>' if low_open else '>='} {_fmt(low)}"
    if math.isinf(low):
        return f"a number {'<' if high_open else '<='} {_fmt(high)}"
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    return f"a number in {left}{_fmt(low)}, {_fmt(high)}{right}"


def real_in_range(
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
) -> Validator:
    """A validator for finite real numbers (not bools) between ``low`` and ``high``.

    Args:
        low: Lower bound (``-inf`` for none).
        high: Upper bound (``inf`` for none).
        low_open: Whether ``low`` itself is excluded.
        high_open: Whether ``high`` itself is excluded.
        optional: Whether None is accepted.
    """
    what = _range_text(low, high, low_open, high_open) + (" or None" if optional else "")

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise WrongTypeError(f"{field_name(instance, attribute)} must be {what}, got {value!r}")
        inside = (
            math.isfinite(value)
            and (float(value) > low if low_open else float(value) >= low)
            and (float(value) < high if high_open else float(value) <= high)
        )
        if not inside:
            raise ValueError(f"{field_name(instance, attribute)} must be {what}, got {value!r}")

    return validate


def boolean(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A validator accepting only ``True`` and ``False``."""
    if not isinstance(value, bool):
        raise WrongTypeError(
            f"{field_name(instance, attribute)} must be a bool (True or False), got {value!r}"
        )


def optional_boolean(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A validator accepting ``True``, ``False`` and ``None`` (a switch left as it is)."""
    if value is not None and not isinstance(value, bool):
        raise WrongTypeError(
            f"{field_name(instance, attribute)} must be True, False or None, got {value!r}"
        )


def check_one_of(name: str, value: Any, choices: Collection[Any]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices`` (listed in the message)."""
    if not _member(value, choices):
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _member(value: Any, choices: Collection[Any]) -> bool:
    try:
        return value in choices
    except TypeError:  # an unhashable value tested against a set
        return False


def one_of(*choices: Any) -> Validator:
    """A validator accepting only the given values."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        check_one_of(field_name(instance, attribute), value, choices)

    return validate


def non_empty_string(what: str, *, optional: bool = False) -> Validator:
    """A validator for a non-empty string; ``what`` describes it in the message."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if (optional and value is None) or (isinstance(value, str) and value):
            return
        allowed = what + (" or None" if optional else "")
        error = ValueError if isinstance(value, str) else WrongTypeError
        raise error(f"{field_name(instance, attribute)} must be {allowed}, got {value!r}")

    return validate


def is_callable(signature: str) -> Validator:
    """A validator accepting any callable; ``signature`` says how it is called."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not callable(value):
            raise WrongTypeError(
                f"{field_name(instance, attribute)} must be a callable {signature}, got {value!r}"
            )

    return validate


def at_most_field(other: str, reason: str) -> Validator:
    """A validator requiring ``value <= getattr(instance, other)``.

    attrs runs validators after all fields are assigned in ``__init__`` and before assignment on
    ``setattr``, so the comparison always sees the other field's current value.
    """

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        bound = getattr(instance, other)
        if _both_real(value, bound) and not value <= bound:
            raise ValueError(
                f"{field_name(instance, attribute)} must be <= {other} ({reason}), "
                f"got {attribute.name}={value!r} and {other}={bound!r}"
            )

    return validate


def at_least_field(other: str, reason: str) -> Validator:
    """A validator requiring ``value >= getattr(instance, other)``."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        bound = getattr(instance, other)
        if _both_real(value, bound) and not value >= bound:
            raise ValueError(
                f"{field_name(instance, attribute)} must be >= {other} ({reason}), "
                f"got {attribute.name}={value!r} and {other}={bound!r}"
            )

    return validate


def _both_real(a: Any, b: Any) -> bool:
    # Type and range errors are reported by each field's own validator.
    return all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in (a, b))
