"""The typed schema of every learner's hyperparameters, for the command line, TOML files and
searches.

A hyperparameter is a JSON-able argument of a learner in :data:`~renate_events.methods.LEARNERS`
that :class:`~renate_events.updater.ModelUpdater` passes through ``learner_kwargs`` (``alpha``,
``memory_size``, ``feature_modules``, ...). Its kind comes from the learner's attrs field
annotation; its range is checked by the learner itself when it is built.

Example:
    >>> schema = hyperparameters("der")
    >>> schema["alpha"].kind, schema["alpha"].default
    ('float', 1.0)
    >>> check_value("der", "alpha", 2)
    2.0
    >>> try:
    ...     check_value("er", "beta", 0.5)
    ... except HyperparameterError as error:
    ...     print(str(error)[:50])
    the learner 'er' has no hyperparameter 'beta'; its
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

from trainer import validators

__all__ = ["KINDS", "Hyperparameter", "HyperparameterError", "check_value", "hyperparameters"]

KINDS = {
    "int": "an int",
    "float": "a number",
    "float | None": "a number",
    "int | None": "an int",
    "bool": "true or false",
    "str": "a string",
    "Sequence[str]": 'a list of strings such as ["layer1", "layer2"]',
    "Sequence[int]": "a list of ints such as [0, 1]",
}
"""The annotations a hyperparameter may have, and how a message names each."""


class HyperparameterError(ValueError):
    """Raised for a hyperparameter the learner does not have, or a value of the wrong kind."""


@attrs.frozen
class Hyperparameter:
    """One hyperparameter of a learner.

    Attributes:
        name: The argument's name (``alpha``).
        kind: Its annotation, a key of :data:`KINDS`.
        default: The learner's default.
    """

    name: str
    kind: str
    default: Any


@functools.cache
def hyperparameters(learner: str) -> dict[str, Hyperparameter]:
    """The hyperparameters of the learner named ``learner`` in ``LEARNERS``, by name."""
    from renate_events.methods import method  # the methods' modules build on this one

    spec = method(learner)
    learner_class = spec.learner
    names = spec.arguments()
    schema = {}
    for field in attrs.fields(learner_class):
        if field.alias in names and field.type in KINDS:
            default = field.default
            if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
                default = default.factory()
            if isinstance(default, tuple):
                default = list(default)
            schema[field.alias] = Hyperparameter(field.alias, str(field.type), default)
    return schema


def check_value(learner: str, name: str, value: Any) -> Any:
    """``value`` as the learner's hyperparameter ``name`` takes it (an int given for a number
    becomes a float); its range is the learner's to check.

    Raises:
        HyperparameterError: The learner has no such hyperparameter, or ``value`` is of another
            kind (a string for a number, a scalar for a list).
    """
    schema = hyperparameters(learner)
    if name not in schema:
        raise HyperparameterError(
            f"the learner {learner!r} has no hyperparameter {name!r}; its hyperparameters are "
            f"{sorted(schema)}"
        )
    kind = schema[name].kind
    checked = _of_kind(kind, value)
    if checked is _WRONG:
        raise HyperparameterError(f"{name} must be {KINDS[kind]}, got {value!r}")
    return checked


_WRONG = object()


def _of_kind(kind: str, value: Any) -> Any:
    if value is None and kind.endswith("| None"):
        return None
    if kind.startswith("int"):
        return value if validators.is_int(value) else _WRONG
    if kind.startswith("float"):
        return float(value) if validators.is_real(value) else _WRONG
    if kind == "bool":
        return value if isinstance(value, bool) else _WRONG
    if kind == "str":
        return value if isinstance(value, str) else _WRONG
    if not isinstance(value, (list, tuple)):
        return _WRONG
    item_kind = validators.is_int if kind == "Sequence[int]" else (lambda i: isinstance(i, str))
    return list(value) if all(item_kind(item) for item in value) else _WRONG
