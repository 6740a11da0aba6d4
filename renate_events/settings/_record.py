"""The record of one setting (:class:`Setting`), the validators of the settings that are not a
plain number, choice or string, and the defaults of the Python arguments a setting maps onto."""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from trainer import validators as checks

__all__ = [
    "DERIVED",
    "KINDS",
    "Setting",
    "check_device",
    "device",
    "list_of_ints",
    "mapped_default",
    "model_args",
    "switch",
    "text",
]

KINDS = ("str", "int", "float", "flag", "switch", "ints", "table")
"""A setting's kind: a string, an int, a number, an on/off flag, a switch (``--name`` on,
``--no-name`` off, left out: None or the default; ``true``/``false`` in TOML), a list of ints, a
table (a TOML inline table or a JSON object on the command line)."""


class _Derived:
    def __repr__(self) -> str:
        return "DERIVED"


DERIVED: Any = _Derived()
"""What :func:`mapped_default` returns for a default computed from other arguments (an attrs
``Factory`` that takes ``self``): a setting mapping onto it has the default None."""


# -- validators of the settings that are not a plain number, choice or string ---------------------


def text(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A non-empty string (a path, a name). A list (a TOML file's ``class_order = [3, 1]``) is
    told how the command line writes it: one comma-separated string."""
    if not isinstance(value, str) or not value:
        hint = ""
        if isinstance(value, list) and value:
            written = ",".join(str(item) for item in value)
            hint = (
                f'; write a list as one string, comma-separated as on the command line: "{written}"'
            )
        raise checks.WrongTypeError(
            f"{checks.field_name(instance, attribute)} must be a non-empty string, got "
            f"{value!r}{hint}"
        )


def switch(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """``True`` or ``False`` (a TOML boolean; on the command line ``--name`` or ``--no-name``)."""
    if not isinstance(value, bool):
        raise checks.WrongTypeError(
            f"{checks.field_name(instance, attribute)} must be true or false, got {value!r}"
        )


def list_of_ints(low: int, high: int | None, *, empty: bool, distinct: bool) -> Any:
    """An attrs validator: a list of ints in ``[low, high)``, checked with ``check_int``."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        name = checks.field_name(instance, attribute)
        if not isinstance(value, list) or (not value and not empty):
            what = "a list" if empty else "a non-empty list"
            raise checks.WrongTypeError(f"{name} must be {what} of ints, got {value!r}")
        for item in value:
            checks.check_int(name, item, low, high)
        if distinct and len(set(value)) != len(value):
            raise ValueError(f"{name} must not repeat a value, got {value!r}")

    return validate


def device(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """``auto``, ``cpu``, or an accelerator that this machine has."""
    check_device(checks.field_name(instance, attribute), value)


def check_device(name: str, value: Any) -> None:
    """Raise unless ``value`` is ``auto``, ``cpu`` or an accelerator this machine has (``name``
    starts the message)."""
    if not isinstance(value, str):
        raise checks.WrongTypeError(f"{name} must be a device name such as 'cpu', got {value!r}")
    if value == "auto":
        return
    try:
        chosen = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{name} must be auto, cpu, cuda, cuda:<index> or mps, got {value!r}"
        ) from None
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (chosen.index or 0) >= count:
            raise ValueError(
                f"{name} {value}: this machine has {count} CUDA device(s) usable by torch "
                f"{torch.__version__}; use cpu or auto"
            )
    elif chosen.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{name} {value}: MPS is not available here; use cpu or auto")
    elif chosen.type != "cpu":
        raise ValueError(f"{name} must be auto, cpu, cuda, cuda:<index> or mps, got {value!r}")


def model_args(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """None, or a table whose keys are argument names."""
    if value is not None and not (isinstance(value, dict) and all(map(_is_name, value))):
        raise checks.WrongTypeError(
            f"{checks.field_name(instance, attribute)} must be a table of the model's arguments "
            f"such as '{{nf = 20}}' (TOML) or '{{\"nf\": 20}}' (JSON), got {value!r}"
        )


def _is_name(key: Any) -> bool:
    return isinstance(key, str) and key.isidentifier()


# -- the record -----------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


@attrs.frozen
class Setting:
    """One setting of the command line.

    Attributes:
        name: The name in snake case: the flag ``--name-with-dashes``, the TOML key (dashes or
            underscores), the field of the command's option schema.
        help: The help text, or a function making it (for texts built from the method
            registry); ``{default}`` in it stands for the shown default.
        kind: One of :data:`KINDS`.
        default: The value when the setting is left out: argparse's default, or (``deferred``)
            the value the command fills in once it knows the context.
        low: The smallest int or number allowed (None: no bound).
        high: Ints: the first one too large; numbers: the largest allowed (None: no bound).
        low_open: Numbers: ``low`` itself is excluded.
        high_open: Numbers: ``high`` itself is excluded.
        choices: The values allowed.
        parser_choices: Whether argparse checks ``choices`` (False: the option schema does, so
            that the message reads ``unknown --scenario 'x'; choose from [...]``).
        check: An attrs validator for kinds that are not a plain number, choice or string.
        deferred: Left out, the flag is None and the command fills in ``default`` where it
            applies (the buffer size only for a learner with a memory, the learning rate unless
            a config file's ``optimizer_fn`` or the input state sets it).
        later: ``update`` keeps the input state's value when the setting is left out (the flag
            is None there; its help says so).
        required: The command needs the flag.
        shown: How the help shows the default ("" for not at all), or a function making it.
        metavar: argparse's placeholder for the value.
        maps_onto: The Python arguments this setting gives its value to, as
            ``module:Owner.argument`` or ``module:Owner.argument[key]``; their defaults equal
            ``default`` (see :func:`mapped_default`).
        variants: Per command, the attributes that differ there (help, default, required).
    """

    name: str = attrs.field(validator=checks.non_empty_string("a name"))
    help: str | Callable[[], str]
    kind: str = attrs.field(default="str", validator=checks.one_of(*KINDS))
    default: Any = attrs.field(  # a flag is off unless given
        default=attrs.Factory(lambda self: False if self.kind == "flag" else None, takes_self=True)
    )
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[Any, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple)
    )
    parser_choices: bool = True
    check: Callable[..., None] | None = None
    deferred: bool = False
    later: bool = False
    required: bool = False
    shown: str | Callable[[], str] | None = None
    metavar: str | None = None
    maps_onto: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    variants: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)

    @property
    def flag(self) -> str:
        """``--name-with-dashes``."""
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> list[str]:
        """The flags of the setting: :attr:`flag`, and ``--no-name-with-dashes`` for a switch."""
        if self.kind == "switch":
            return [self.flag, "--no-" + self.flag[2:]]
        return [self.flag]

    def for_command(self, command: str) -> Setting:
        """The setting as ``command`` takes it (its ``variants`` applied)."""
        variant = self.variants.get(command)
        return self if not variant else attrs.evolve(self, **variant)

    def flag_default(self, command: str) -> Any:
        """argparse's default in ``command``: None where the value is filled in later."""
        if self.kind == "flag":
            return False
        if self.deferred or (self.later and command == "update"):
            return None
        return self.default

    def shown_default(self) -> str:
        """The default as the help shows it."""
        if callable(self.shown):
            return self.shown()
        return _shown(self.default) if self.shown is None else self.shown

    def help_text(self, command: str) -> str:
        """The help of the flag in ``command``."""
        body = self.help() if callable(self.help) else self.help
        shown = self.shown_default()
        body = body.replace("{default}", shown)
        if not self.later or not shown:
            return body
        if command == "update":
            return f"{body} (default: the input state's, else {shown})"
        return f"{body} (default {shown})"

    def validator(self, command: str) -> Any:
        """The attrs validator of the option schema's field in ``command``."""
        optional = not self.required and self.flag_default(command) is None
        if self.kind == "int":
            low = None if self.low is None else int(self.low)
            high = None if self.high is None else int(self.high)
            return checks.int_at_least(low, high, optional=optional)
        if self.kind == "flag":
            return checks.boolean
        if self.kind == "switch":
            return attrs.validators.optional(switch) if optional else switch
        if self.check is not None:
            validate = self.check
        elif self.choices is not None:
            validate = checks.one_of(*self.choices)
        elif self.kind == "float":
            validate = checks.real_in_range(
                -math.inf if self.low is None else self.low,
                math.inf if self.high is None else self.high,
                low_open=self.low_open,
                high_open=self.high_open,
            )
        else:
            validate = text
        return attrs.validators.optional(validate) if optional else validate


def mapped_default(target: str) -> Any:
    """The default of a Python argument named as in :attr:`Setting.maps_onto`.

    ``module:Owner.argument`` is a field of an attrs class or a parameter of a function or
    method; ``[key]`` picks an entry of a dict default, or of an optimizer factory
    (``functools.partial(torch.optim.Adam, lr=...)`` reads as ``{"name": "adam", "lr": ...}``).
    A default computed from other arguments is :data:`DERIVED`.

    Example:
        >>> from renate_events.settings import mapped_default
        >>> mapped_default("trainer:Trainer.precision")
        '32'
    """
    module, _, path = target.partition(":")
    path, _, key = path.partition("[")
    *owners, argument = path.split(".")
    owner: Any = importlib.import_module(module)
    for part in owners:
        owner = getattr(owner, part)
    if attrs.has(owner):
        value = attrs.fields_dict(owner)[argument].default
        if isinstance(value, attrs.Factory):  # type: ignore[arg-type]
            if value.takes_self:
                return DERIVED
            value = value.factory()
    else:
        value = inspect.signature(owner).parameters[argument].default
    if not key:
        return value
    if isinstance(value, functools.partial):
        from renate_events.choices import OPTIMIZERS

        names = [name for name, cls in OPTIMIZERS.items() if cls is value.func]
        value = {"name": names[0] if names else value.func, **value.keywords}
    return value[key.rstrip("]")]
