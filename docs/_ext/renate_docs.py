"""Directives that generate reference tables from the code, so that the pages cannot drift.

* ``.. event-table::`` — every event of :data:`trainer.EVENTS`: hook names, keywords, when it
  fires.
* ``:event-common-keywords:`all``` — the keywords every event offers, inline.
* ``.. cli-reference:: run`` — usage, description and options of a ``renate-events`` subcommand,
  read from the command's own ``argparse`` parser.
* ``.. learner-arguments::`` — the arguments every learner shares, with defaults and meaning.
* ``.. public-names:: trainer.listeners`` — the public names of a module with their summaries.
* ``.. learner-presets::`` — every learner of :data:`renate_events.methods.LEARNERS`: its own
  arguments with their defaults and the components it builds, in order.
"""

from __future__ import annotations

import argparse
from typing import Any

import attrs
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


class _RstDirective(SphinxDirective):
    """A directive that writes reStructuredText and parses it in place."""

    def rst_lines(self) -> list[str]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        container = nodes.container()
        source = self.get_source_info()[0]
        lines = StringList()
        for line in self.rst_lines():
            lines.append(line, source)
        self.state.nested_parse(lines, self.content_offset, container)
        return list(container.children)


def _in_module(module: str, lines: list[str]) -> list[str]:
    """Resolve the short cross-references of docstring text as in ``module``."""
    return [f".. currentmodule:: {module}", "", *lines, "", ".. currentmodule:: None", ""]


def _list_table(header: list[str], rows: list[list[str]], widths: str = "auto") -> list[str]:
    out = [".. list-table::", "   :header-rows: 1", f"   :widths: {widths}", ""]
    for row in [header, *rows]:
        first = True
        for cell in row:
            cell_lines = (cell or " ").splitlines() or [" "]
            prefix = "   * - " if first else "     - "
            out.append(prefix + cell_lines[0])
            out.extend("       " + more for more in cell_lines[1:])
            first = False
    out.append("")
    return out


# -- events ---------------------------------------------------------------------------------------


def _common_keywords() -> list[str]:
    from trainer import EVENTS

    payloads = [spec.payload for spec in EVENTS.values()]
    common = frozenset.intersection(*payloads)
    order = ["sender", "trainer", "model", "optimizer", "state"]
    return sorted(common, key=lambda name: (order.index(name) if name in order else 99, name))


class EventTable(_RstDirective):
    """The table of every event, generated from ``trainer.EVENTS``."""

    def rst_lines(self) -> list[str]:
        from trainer.events import EVENTS, HOOK_ALIASES

        common = set(_common_keywords())
        rows = []
        for name, spec in EVENTS.items():
            hooks = [f"``on_{name}``"] + [
                f"``{alias}`` (alias)" for alias, event in HOOK_ALIASES.items() if event == name
            ]
            own = sorted(spec.payload - common)
            keywords = ", ".join(f"``{k}``" for k in own) if own else "(common only)"
            if spec.scoped:
                keywords += " (per listener: " + ", ".join(f"``{k}``" for k in sorted(spec.scoped))
                keywords += ")"
            rows.append([f"``{name}``", "\n".join(f"| {h}" for h in hooks), keywords, spec.doc])
        return _list_table(
            ["event", "listener method", "keywords besides the common ones", "when it fires"],
            rows,
            widths="14 18 22 46",
        )


def common_keywords_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """``:event-common-keywords:`x``` renders the keywords every event offers, inline."""
    result: list[nodes.Node] = []
    keywords = _common_keywords()
    for i, keyword in enumerate(keywords):
        if i:
            result.append(nodes.Text(" and " if i == len(keywords) - 1 else ", "))
        result.append(nodes.literal(keyword, keyword))
    return result, []


# -- command line ---------------------------------------------------------------------------------


def _cli_parser() -> argparse.ArgumentParser:
    from renate_events.cli._parser import build_parser

    return build_parser()  # the parser `renate-events` itself uses


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"``{action.metavar or action.dest}``"
    value = ""
    if action.nargs != 0:
        metavar = action.metavar or action.dest.upper()
        value = f" {metavar}" if action.nargs in (None, 1) else f" {metavar} [{metavar} ...]"
    return ", ".join(f"``{flag}{value}``" for flag in action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse.BooleanOptionalAction) and action.default is not None:
        return "on" if action.default else "off"
    default = action.default
    if default is None or default == argparse.SUPPRESS:
        return "none"
    if isinstance(default, list):
        return "``" + " ".join(str(item) for item in default) + "``"
    return f"``{default}``"


def _values(action: argparse.Action) -> str:
    if action.choices:
        return " | ".join(f"``{choice}``" for choice in action.choices)
    if isinstance(action, argparse._StoreTrueAction):
        return "flag"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "switch"
    if action.type is not None:
        return getattr(action.type, "__name__", str(action.type))
    return "str"


class CliReference(_RstDirective):
    """Usage, description and option table of one ``renate-events`` subcommand."""

    required_arguments = 0
    optional_arguments = 1

    def rst_lines(self) -> list[str]:
        parser = _cli_parser()
        if self.arguments:
            parser = _subparsers(parser)[self.arguments[0]]
        usage = parser.format_usage().strip()
        out = ["::", ""] + ["   " + line for line in usage.splitlines()] + [""]
        if parser.description:
            out += [parser.description, ""]
        rows = []
        groups = {id(a): g for g in parser._mutually_exclusive_groups for a in g._group_actions}
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            help_text = (action.help or "").replace("*", r"\*")
            group = groups.get(id(action))
            default = _default(action)
            if group is not None:
                names = ", ".join(f"``{a.option_strings[0]}``" for a in group._group_actions)
                if group.required:
                    help_text += f" (give exactly one of {names})"
                    default = "see meaning"
                else:
                    help_text += f" (at most one of {names})"
            rows.append([_flags(action), _values(action), default, help_text])
        out += _list_table(["option", "values", "default", "meaning"], rows, widths="26 22 14 38")
        return out


def _python_argument(target: str) -> str:
    """``module:Owner.argument[key]`` as the docs name it: ``Owner.argument[key]``."""
    return "``" + target.split(":", 1)[1] + "``"


class SettingsReference(_RstDirective):
    """Every setting of renate_events.settings: its commands, default and Python arguments."""

    def rst_lines(self) -> list[str]:
        from renate_events.settings import SETTINGS, commands_of

        rows = []
        for entry in SETTINGS.values():
            commands = ", ".join(commands_of(entry.name))
            default = _settings_default(entry)
            targets = " | ".join(map(_python_argument, entry.maps_onto)) or "—"
            rows.append([f"``{entry.flag}``", commands, default, targets])
        return _list_table(
            ["setting", "commands", "default", "Python argument with the same default"],
            rows,
            widths="26 22 16 36",
        )


def _settings_default(entry: Any) -> str:
    """The default as the table shows it (a deferred one applies where the command needs it)."""
    from renate_events.settings import commands_of

    commands = commands_of(entry.name)
    required = [command for command in commands if entry.for_command(command).required]
    if required:
        return "required" + ("" if required == list(commands) else f" ({', '.join(required)})")
    if entry.kind == "flag":
        return "off"
    if entry.default is None and entry.shown is None:
        return "none"
    text = f"``{entry.shown_default() or entry.default}``"
    return f"{text} (where it applies)" if entry.deferred else text


# -- learners -------------------------------------------------------------------------------------


def _preset_rows() -> list[list[str]]:
    import torch

    from renate_events import components as shared_components
    from renate_events.learners import BaseExperienceReplayLearner
    from renate_events.methods import LEARNERS, METHODS
    from renate_events.models import vit
    from trainer import Trainer

    base_fields = {f.name: f for f in attrs.fields(BaseExperienceReplayLearner)}
    shared = set(shared_components.__all__)
    rows = []
    for name, cls in LEARNERS.items():
        own = []
        for field in attrs.fields(cls):
            if field.name.startswith("_") or not field.init:
                continue
            inherited = base_fields.get(field.name)
            if inherited is not None and inherited.default == field.default:
                continue
            own.append(f"``{field.name}={field.default!r}``")
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        if METHODS[name].model == "vit":  # a prompt method: a tiny ViT deep enough for its layers
            model = vit(num_classes=2, image_size=4, patch_size=4, dim=8, depth=5, heads=1)
        try:
            learner = cls(model=model, trainer=Trainer(device="cpu"))
        except ValueError:  # POD components need recorded features
            learner = cls(model=model, feature_modules=["0"], trainer=Trainer(device="cpu"))
        components = []
        for key, component in learner.components.items():
            detail = [f"weight {component.weight:g}"] if component.weight else ["no loss"]
            if component.sample_new_memory_batch:
                detail.append("fresh memory batch")
            kind = type(component)  # a shared component, or one of its method's module
            home = "renate_events.components" if kind.__name__ in shared else kind.__module__
            components.append(
                f"| ``{key}``: :class:`~{home}.{kind.__name__}` ({', '.join(detail)})"
            )
        rows.append(
            [
                f"``{name}``",
                f":class:`~renate_events.methods.{cls.__name__}`",
                "\n".join(f"| {item}" for item in own) or "—",
                "\n".join(components) or "none",
            ]
        )
    return rows


class LearnerPresets(_RstDirective):
    """Each learner's own arguments (defaults) and the components it builds, from the code."""

    def rst_lines(self) -> list[str]:
        return _list_table(
            ["name", "class", "own arguments (defaults)", "components, in order"],
            _preset_rows(),
            widths="10 26 28 36",
        )


def _documented_args(cls: type) -> dict[str, str]:
    """The ``Args:`` entries of a Google-style class docstring, as ``{name: text}``."""
    import inspect

    lines = (inspect.getdoc(cls) or "").splitlines()
    args: dict[str, str] = {}
    inside, current = False, None
    for line in lines:
        if line.strip() == "Args:":
            inside = True
            continue
        if not inside:
            continue
        if line and not line.startswith(" "):
            break  # the next section
        if line.startswith("    ") and not line.startswith("        ") and ":" in line:
            current, text = line.strip().split(":", 1)
            args[current] = text.strip()
        elif current is not None and line.strip():
            args[current] += " " + line.strip()
    return args


def _name_of(value: Any) -> str:
    module = getattr(value, "__module__", "") or ""
    return f"{module}.{value.__qualname__}" if module else value.__qualname__


def _show_default(default: Any) -> str:
    """A default as a reader would write it (no ``<function ... at 0x...>``)."""
    import functools

    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return f"``{getattr(default.factory, '__name__', 'factory')}()``"
    if isinstance(default, functools.partial):
        arguments = [_name_of(default.func)] + [f"{k}={v!r}" for k, v in default.keywords.items()]
        return f"``functools.partial({', '.join(arguments)})``"
    if callable(default) and hasattr(default, "__qualname__"):
        return f"``{_name_of(default)}``"
    return f"``{default!r}``"


class LearnerArguments(_RstDirective):
    """The arguments every learner shares: name, default and meaning, from the base class."""

    def rst_lines(self) -> list[str]:
        from renate_events.learners import BaseExperienceReplayLearner

        docs = _documented_args(BaseExperienceReplayLearner)
        rows = []
        for field in attrs.fields(BaseExperienceReplayLearner):
            if field.name.startswith("_") or not field.init:
                continue
            shown = _show_default(field.default)
            rows.append([f"``{field.name}``", shown, docs.get(field.name, "")])
        table = _list_table(["argument", "default", "meaning"], rows, widths="22 22 56")
        return _in_module("renate_events.learners", table)


class PublicNames(_RstDirective):
    """``.. public-names:: module``: each name in ``module.__all__`` with its summary line."""

    required_arguments = 1

    def rst_lines(self) -> list[str]:
        import importlib
        import inspect

        module = importlib.import_module(self.arguments[0])
        out = []
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            role = "class" if inspect.isclass(obj) else "func" if callable(obj) else "data"
            summary = (inspect.getdoc(obj) or "").strip().split("\n\n")[0].replace("\n", " ")
            out.append(f"* :{role}:`~{module.__name__}.{name}`: {summary}")
        return _in_module(module.__name__, [*out, ""])


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("event-table", EventTable)
    app.add_role("event-common-keywords", common_keywords_role)
    app.add_directive("cli-reference", CliReference)
    app.add_directive("settings-reference", SettingsReference)
    app.add_directive("learner-presets", LearnerPresets)
    app.add_directive("learner-arguments", LearnerArguments)
    app.add_directive("public-names", PublicNames)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


__all__ = ["setup"]
