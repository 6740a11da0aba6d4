"""An update's config file: the updater's arguments read from it, the record a state folder
keeps of it, and the check that a later update uses the same file."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from renate_events.choices import TRANSFORMS
from renate_events.config import ConfigFile, load_config
from renate_events.updater._errors import UpdateInputError

__all__ = [
    "MAX_CONFIG_TEXT",
    "ConfigFunction",
    "check_config_file",
    "config_arguments",
    "config_record",
]

MAX_CONFIG_TEXT = 1 << 20  # a config file's text is kept in the manifest up to this size


def config_arguments(
    config: ConfigFile | str | os.PathLike[str], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The arguments of :meth:`ModelUpdater.from_config
    <renate_events.updater.ModelUpdater.from_config>`: the file's functions under the updater's
    names, overridden by ``kwargs`` (``model``, given there, is not made by ``model_fn``)."""
    if not isinstance(config, ConfigFile):
        config = load_config(config)
    functions: dict[str, Any] = {"config_file": config, "model": kwargs.pop("model", None)}
    if functions["model"] is None:
        functions["model"] = config.model()
    if config.has("loss_fn"):
        functions["loss_fn"] = config.loss()
    if config.has("optimizer_fn"):
        functions["optimizer"] = ConfigFunction(config, "optimizer_fn")
    if config.has("lr_scheduler_fn"):
        functions["learning_rate_scheduler"] = ConfigFunction(config, "lr_scheduler_fn")
        functions["learning_rate_scheduler_interval"] = _scheduler_interval(config)
    functions["listeners"] = config.listeners()
    functions["metrics"] = config.metrics()
    functions["collate_fn"] = config.collate()
    functions["transforms"] = {
        name: function for name in TRANSFORMS if (function := config.transform(name)) is not None
    }
    return {**functions, **kwargs}


@attrs.frozen
class ConfigFunction:
    """A config file's ``optimizer_fn`` or ``lr_scheduler_fn``, called through its checks."""

    config: ConfigFile
    name: str

    def __call__(self, argument: Any) -> Any:
        if self.name == "optimizer_fn":
            return self.config.optimizer(argument)
        scheduler = self.config.scheduler(argument)
        return None if scheduler is None else scheduler[0]


def _scheduler_interval(config: ConfigFile) -> str:
    """The interval ``lr_scheduler_fn`` asks for, from a call on a stand-in optimizer."""
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = config.scheduler(stand_in)
    return "epoch" if scheduler is None else scheduler[1]


def config_record(config: ConfigFile | None) -> dict[str, Any] | None:
    """The manifest's ``config``: the file's name, SHA-256 and text (None beyond
    :data:`MAX_CONFIG_TEXT` bytes)."""
    if config is None:
        return None
    text = None
    if os.path.getsize(config.path) <= MAX_CONFIG_TEXT:
        with open(config.path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    return {"file": os.path.basename(config.path), "sha256": config.sha256, "text": text}


def check_config_file(
    folder: str | os.PathLike[str] | None, saved: Mapping[str, Any] | None, config: ConfigFile
) -> None:
    """Refuse ``config`` when the state folder (its manifest's ``config`` record, ``saved``)
    was written with another config file, saying which line changed.

    Raises:
        UpdateInputError: The files differ.
    """
    if saved is None or saved["sha256"] == config.sha256:
        return
    change = "its text was not kept"
    if saved.get("text") is not None:
        with open(config.path, encoding="utf-8", errors="replace") as handle:
            change = _first_difference(saved["text"], handle.read())
    raise UpdateInputError(
        f"the state folder {folder} was written with another config file ({saved['file']}, "
        f"SHA-256 {saved['sha256'][:12]}...; {config.path} is {config.sha256[:12]}...): "
        f"{change}. Use the same file, or accept the change (accept_config_change=True, "
        "renate-events update --accept-config-change)"
    )


def _first_difference(old: str, new: str) -> str:
    """``line 12: 'a' became 'b'`` for the first lines that differ between two texts."""
    import difflib

    old_lines, new_lines = old.splitlines(), new.splitlines()
    matcher = difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False)
    for tag, i1, _, j1, _ in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag == "delete":
            return f"the line {old_lines[i1].strip()!r} before line {j1 + 1} was removed"
        if tag == "insert":
            return f"line {j1 + 1}, {new_lines[j1].strip()!r}, was added"
        return f"line {j1 + 1}: {old_lines[i1].strip()!r} became {new_lines[j1].strip()!r}"
    return "only whitespace at the ends of lines differs"
