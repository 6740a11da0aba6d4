"""One schema of settings: every option of the ``renate-events`` command, defined once.

Each :class:`Setting` holds a setting's name (the flag ``--name-with-dashes`` and the key of a
``--config`` TOML file), its kind, its range or choices, its default and its help, and names the
Python arguments it sets (``maps_onto``: a :class:`~renate_events.updater.ModelUpdater` argument,
a learner field, a :class:`~trainer.Trainer` argument), whose defaults must be its own (a test
compares them). :data:`COMMANDS` says which commands take each setting, in the order of their
help. The command line builds its flags, its TOML keys and its option schemas from here. The
learners' own hyperparameters (``alpha``, ``feature_modules``, ...) are not repeated here: their
one home is the learners' attrs fields (:mod:`renate_events.hyperparameters`).

A new setting is one :class:`Setting` in ``_table.py`` and its name in the :data:`COMMANDS` that
take it; the command reads it from its options.

Example:
    >>> from renate_events.settings import COMMANDS, setting
    >>> lr = setting("lr")
    >>> lr.default, lr.kind, lr.maps_onto[0]
    (0.001, 'float', 'renate_events.updater:ModelUpdater.optimizer[lr]')
    >>> setting("epochs").flag_default("run"), setting("epochs").flag_default("update")
    (10, None)
    >>> setting("epochs").help_text("update")
    "epochs per update (default: the input state's, else 10)"
    >>> sorted(name for name in COMMANDS["shift"] if setting(name, "shift").required)
    ['query', 'reference']
"""

from __future__ import annotations

from renate_events.settings._record import (
    DERIVED,
    KINDS,
    Setting,
    check_device,
    device,
    list_of_ints,
    mapped_default,
    model_args,
    switch,
    text,
)
from renate_events.settings._table import (
    COMMANDS,
    MAX_SEED,
    PRECISIONS,
    SETTINGS,
    commands_of,
    setting,
)

__all__ = [
    "COMMANDS",
    "DERIVED",
    "KINDS",
    "MAX_SEED",
    "PRECISIONS",
    "SETTINGS",
    "Setting",
    "check_device",
    "commands_of",
    "device",
    "list_of_ints",
    "mapped_default",
    "model_args",
    "setting",
    "switch",
    "text",
]
