"""The options of every command, made from :mod:`renate_events.settings`: argparse flags, the
learners' hyperparameter flags, the ``--config`` TOML file and the ``--config-file`` Python file
(both read here, and only here), and one typed check of all of them.

Example:
    >>> from renate_events.cli._options import option_schema, parse_value
    >>> schema = option_schema("shift")
    >>> [field.name for field in attrs.fields(schema)][:3]
    ['reference', 'query', 'detector']
    >>> parse_value("[1, 2]"), parse_value("cpu")
    ([1, 2], 'cpu')
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from renate_events.cli._errors import UsageError, one_line
from renate_events.config import ConfigFile, load_config
from renate_events.hyperparameters import HyperparameterError, check_value, hyperparameters
from renate_events.methods import LEARNERS
from renate_events.settings import COMMANDS, SETTINGS, Setting, setting
from trainer import validators as checks
from trainer.checkpoint import json_too_deep

__all__ = [
    "EvaluateOptions",
    "InfoOptions",
    "PredictOptions",
    "RunOptions",
    "ShiftOptions",
    "UpdateOptions",
    "add_hyperparameter_options",
    "add_setting",
    "check_options",
    "given_texts",
    "hyperparameter_epilog",
    "hyperparameter_names",
    "hyperparameter_values",
    "learner_message",
    "load_config_file",
    "option_schema",
    "parse_value",
    "read_config",
    "read_toml",
    "toml_keys",
]

# -- argparse -------------------------------------------------------------------------------------

_TYPES = {"int": int, "float": float, "ints": int}


def add_setting(parser: Any, command: str, name: str) -> None:
    """Add the flag of the setting ``name``, as ``command`` takes it, to ``parser`` (a parser,
    an argument group or a mutually exclusive group)."""
    entry = setting(name, command)
    kwargs: dict[str, Any] = {"help": entry.help_text(command)}
    if entry.kind == "flag":
        kwargs["action"] = "store_true"
    elif entry.kind == "switch":
        kwargs["action"] = argparse.BooleanOptionalAction  # --name, --no-name
        kwargs["default"] = entry.flag_default(command)
    else:
        kwargs["default"] = entry.flag_default(command)
        if entry.kind in _TYPES:
            kwargs["type"] = _TYPES[entry.kind]
        if entry.kind == "ints":
            kwargs["nargs"] = "+"
        if entry.choices is not None and entry.parser_choices:
            kwargs["choices"] = entry.choices
        if entry.metavar is not None:
            kwargs["metavar"] = entry.metavar
    if entry.required:
        kwargs["required"] = True
    action = parser.add_argument(entry.flag, **kwargs)
    action.help = kwargs["help"]  # without the "(default: ...)" a switch's action adds


def hyperparameter_names() -> dict[str, str]:
    """Every learner hyperparameter without a setting of its own (``--memory-size``, ...), with
    its kind."""
    names: dict[str, str] = {}
    for learner in sorted(LEARNERS):
        for name, entry in hyperparameters(learner).items():
            if name not in SETTINGS:
                names.setdefault(name, entry.kind)
    return names


def add_hyperparameter_options(parser: argparse.ArgumentParser) -> None:
    """A flag for every learner hyperparameter, in a group of their own."""
    group = parser.add_argument_group(
        "learner hyperparameters",
        "each learner's own (see the list below); a value is parsed as in TOML: 0.5, true, "
        '["layer1"]; a TOML --config file may set them too',
    )
    for name, kind in hyperparameter_names().items():
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=argparse.SUPPRESS,
            metavar="LIST" if kind.startswith("Sequence") else kind.split(" ")[0].upper(),
        )


def hyperparameter_epilog() -> str:
    """The hyperparameters all learners share, then each learner's own, with their defaults."""
    schemas = {learner: hyperparameters(learner) for learner in sorted(LEARNERS)}
    shared = set.intersection(*(set(schema) for schema in schemas.values()))
    defaults = [[json.dumps(s[name].default) for s in schemas.values()] for name in shared]
    usual = {  # a learner whose default differs from most learners' lists it as its own
        name: max(values, key=values.count) for name, values in zip(shared, defaults)
    }

    def shown(schema: Mapping[str, Any], names: Any) -> str:
        return " ".join(
            f"--{name.replace('_', '-')} "
            + ("(unset)" if schema[name].default is None else json.dumps(schema[name].default))
            for name in schema
            if name in names and name not in SETTINGS
        )

    first = next(iter(schemas.values()))
    lines = ["learner hyperparameters (defaults):", f"  every learner: {shown(first, shared)}"]
    for learner, schema in schemas.items():
        own = set(schema) - shared
        own |= {name for name in shared if json.dumps(schema[name].default) != usual[name]}
        lines.append(f"  {learner}: {shown(schema, own) or '(none of its own)'}")
    return "\n".join(lines)


# -- the files: --config (TOML) and --config-file (Python) ----------------------------------------


def _toml() -> Any:
    """The TOML reader: ``tomllib``, or ``tomli`` on Python 3.10."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError as exc:
            raise UsageError(
                "reading --config on Python 3.10 needs tomli: pip install tomli"
            ) from exc
    return tomllib


# Deeper than any option needs. The TOML reader has no limit of its own (the interpreter's
# recursion limit stops it, at a depth that differs between Python versions) and dotted keys
# (``a.b.c = 1``) nest without brackets, so the depth of what was read is counted here.
_MAX_DEPTH = 64


def _too_deep(value: Any, limit: int = _MAX_DEPTH) -> bool:
    """Whether tables and arrays in ``value`` nest more than ``limit`` levels, counted without
    recursion."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)
    return False


def _loads_toml(text: str) -> dict[str, Any] | None:
    """The table of TOML ``text``; None when it nests deeper than ``_MAX_DEPTH`` levels."""
    tomllib = _toml()
    try:
        table = tomllib.loads(text)
    except RecursionError:  # arrays or inline tables far deeper than _MAX_DEPTH
        return None
    return None if _too_deep(table) else table


def _is_python(path: str, text: str) -> bool:
    """Whether a file given to ``--config`` (TOML) is a Python config file: named ``*.py``, or
    Python that defines a function or imports (as ``model_fn``'s file does; a line such as
    ``epochs = x`` parses as Python too, and is a TOML mistake)."""
    if path.endswith(".py"):
        return True
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a null byte
        return False
    kinds = (ast.FunctionDef, ast.Import, ast.ImportFrom)
    return any(isinstance(node, kinds) for node in tree.body)


def read_toml(path: str) -> dict[str, Any]:
    """The table of a TOML file; an unreadable, invalid or too deep file is a
    :class:`UsageError`."""
    text = ""
    try:
        with open(path, "rb") as handle:
            text = handle.read().decode("utf-8")
        table = _loads_toml(text)
    except OSError as exc:
        raise UsageError(f"cannot read --config {path}: {exc.strerror}") from exc
    except ValueError as exc:  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        hint = "; a Python config file goes to --config-file" if _is_python(path, text) else ""
        raise UsageError(f"{path} is not valid TOML: {exc}{hint}") from exc
    if table is None:
        raise UsageError(
            f"{path}: its tables or arrays nest deeper than {_MAX_DEPTH} levels, deeper than "
            "any option needs"
        )
    return table


def toml_keys(command: str) -> set[str]:
    """The keys a ``--config`` file of ``command`` may hold (snake case): its settings but
    ``config``, and every learner hyperparameter."""
    return (set(COMMANDS[command]) - {"config"}) | set(hyperparameter_names())


def read_config(path: str, command: str) -> dict[str, Any]:
    """The options of a ``--config`` TOML file, under their setting names (not yet checked)."""
    allowed = toml_keys(command)
    values: dict[str, Any] = {}
    for key, value in read_toml(path).items():
        name = key.replace("-", "_")
        if name not in allowed:
            raise UsageError(
                f"{path}: unknown options [{key!r}]; see renate-events {command} -h for the "
                "options and the learners' hyperparameters"
            )
        if name in values:
            raise UsageError(f"{path}: the option {name.replace('_', '-')} is given twice")
        values[name] = value
    return values


def parse_value(text: Any) -> Any:
    """A flag's text as a TOML value (``0.5``, ``true``, ``["a"]``); other text, and text nested
    deeper than any option needs, stays a string (for the option's check to refuse)."""
    if not isinstance(text, str):
        return text  # from a TOML file: typed already
    try:
        table = _loads_toml(f"value = {text}")
    except ValueError:  # TOMLDecodeError is one
        return text
    return text if table is None else table["value"]


def load_config_file(path: str) -> ConfigFile:
    """The ``--config-file`` Python file (a :class:`~renate_events.config.ConfigError`, one line
    and exit status 2, when it does not hold the functions it must)."""
    return load_config(path)


# -- one typed check of everything ----------------------------------------------------------------


def _table_value(value: Any) -> Any:
    """``--model-args`` text as a TOML inline table (``{nf = 20}``) or a JSON object; a table
    from a TOML file stays as it is; anything else is left for the check to refuse."""
    value = parse_value(value)
    if isinstance(value, str) and not json_too_deep(value, _MAX_DEPTH):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def given_texts(argv: Sequence[str], values: Mapping[str, Any]) -> set[str]:
    """Every value given on the command line (``argv``) or in a ``--config`` file (``values``),
    in each form an error message may show it: as given, quoted, and read as a value (a
    ``--model-args`` table shown as a dict); for cutting over-long echoes."""
    items = list(values.values())
    for token in argv:
        items.append(token)
        if token.startswith("--") and "=" in token:  # --flag=value
            items.append(token.partition("=")[2])
    texts: set[str] = set()
    for item in items:
        forms = [item, parse_value(item), _table_value(item)] if isinstance(item, str) else [item]
        texts.update(text for form in forms for text in (str(form), repr(form)))
    return texts


def _field(entry: Setting, command: str) -> Any:
    converter = _table_value if entry.kind == "table" else None
    default = attrs.NOTHING if entry.required else entry.flag_default(command)
    return attrs.field(
        default=default, kw_only=True, converter=converter, validator=entry.validator(command)
    )


def option_schema(command: str) -> type:
    """The attrs class of ``command``'s options: a frozen field per setting, with the setting's
    default and validator (``update`` adds ``search_space``, the tables of its ``--config``
    file)."""
    fields = {name: _field(setting(name, command), command) for name in COMMANDS[command]}
    if command == "update":
        fields["search_space"] = attrs.field(
            factory=dict, kw_only=True, validator=attrs.validators.instance_of(dict)
        )
    schema = attrs.make_class(f"{command.title()}Options", fields, frozen=True)
    schema.__doc__ = f"The options of ``renate-events {command}``, as the settings name them."
    schema.__module__ = __name__
    return schema


RunOptions: Any = option_schema("run")
UpdateOptions: Any = option_schema("update")
EvaluateOptions: Any = option_schema("evaluate")
ShiftOptions: Any = option_schema("shift")
PredictOptions: Any = option_schema("predict")
InfoOptions: Any = option_schema("info")


def check_options(
    schema: type, values: Mapping[str, Any], from_file: frozenset[str] = frozenset()
) -> Any:
    """Check ``values`` against ``schema``; a failure names the option as the user wrote it."""
    names = {field.name for field in attrs.fields(schema)}
    try:
        return schema(**{name: value for name, value in values.items() if name in names})
    except ValueError as exc:  # the shared checks' contract (WrongTypeError is one too)
        message = str(exc)
        for field in attrs.fields(schema):
            prefix = f"{schema.__name__}.{field.name} "
            if message.startswith(prefix):
                flag = "--" + field.name.replace("_", "-")
                message = _flag_message(flag, message.removeprefix(prefix), exc)
                value = values.get(field.name)
                if message.startswith("unknown ") and not isinstance(value, str):
                    # a file's true, 3 or [..] where a name is expected: say the type too
                    message = message.replace(
                        f"unknown {flag} {value!r}",
                        f"{flag} must be a name, got {type(value).__name__} {value!r}",
                        1,
                    )
                if field.name in from_file:
                    message += f" (in {values['config']})"
        raise UsageError(message) from None


def _flag_message(flag: str, rest: str, exc: ValueError) -> str:
    """The check's message in the command line's words: ``unknown --scenario 'x'; choose from
    [...]`` for a value outside a choice, ``--epochs must be >= 1, got 0`` for an int out of range
    (the type is right, so only the range is said)."""
    choice = re.fullmatch(r"must be one of (\[.*\]), got (.*)", rest)
    if choice:
        return f"unknown {flag} {choice.group(2)}; choose from {choice.group(1)}"
    if not isinstance(exc, checks.WrongTypeError):
        rest = rest.replace("must be an int >= ", "must be >= ", 1)
        # an optional int (None: filled in later, as update's --epochs) words low 1 "a positive
        # int": one wording for a setting in every command
        rest = rest.replace("must be a positive int", "must be >= 1", 1)
    # None is what leaving the option out gives: it cannot be typed, so it is not offered
    rest = re.sub(r"^(must be .*?) or None, got ", r"\1, got ", rest)
    return f"{flag} {rest}"


# -- learner hyperparameters ----------------------------------------------------------------------


def hyperparameter_values(
    values: dict[str, Any], learner: str, from_file: frozenset[str], config: str | None
) -> dict[str, Any]:
    """Take the learner hyperparameters out of ``values``, each checked against ``learner``."""
    chosen: dict[str, Any] = {}
    for name in hyperparameter_names():
        if name not in values:
            continue
        raw = values.pop(name)
        where = f" (in {config})" if name in from_file else ""
        value = raw if name in from_file else parse_value(raw)
        try:
            chosen[name] = check_value(learner, name, value)
        except HyperparameterError as exc:
            flag = "--" + name.replace("_", "-")
            message = str(exc).replace(f"{name} must be", f"{flag} must be", 1)
            if message.startswith("the learner"):
                message = f"{flag}: {message}"
            raise UsageError(message + where) from None
    return chosen


def learner_message(exc: ValueError) -> str:
    """A learner's check (``DarkExperienceReplayLearner.alpha must be ...``) in flag words."""
    message = one_line(exc)
    match = re.match(r"\w+Learner\.(\w+) (.*)", message)
    if match:
        return f"--{match.group(1).replace('_', '-')} {match.group(2)}"
    return message
