"""The command line's usage error and its one-line messages, in the command line's words."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

__all__ = [
    "ECHO_LIMIT",
    "UsageError",
    "command_line_message",
    "cut_echoes",
    "flag_words",
    "one_line",
]

ECHO_LIMIT = 200
"""The most characters of a given value that an error line repeats (a deeply nested
``--model-args`` or a 10,000-character string would otherwise fill the terminal)."""


class UsageError(Exception):
    """A bad argument or input file: reported in one line with exit code 2."""


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


_PYTHON_ADVICE = (
    ("Trainer(nonfinite_loss='skip')", "--nonfinite-loss skip"),
    ("restart=True", "--restart"),
)
"""Advice in the library's messages that names a Python argument, and the flag that sets it."""


@functools.cache
def _flags() -> dict[str, str]:
    """Each Python argument a setting or a learner hyperparameter sets, and its flag
    (``max_epochs``: ``--epochs``); arguments set under another name (``optimizer[lr]``) are
    left out."""
    from renate_events.hyperparameters import hyperparameters
    from renate_events.methods import LEARNERS
    from renate_events.settings import SETTINGS

    flags = {
        name: "--" + name.replace("_", "-")
        for learner in LEARNERS
        for name in hyperparameters(learner)
    }
    for entry in SETTINGS.values():
        for target in entry.maps_onto:
            argument = target.rpartition(".")[2]
            if "[" not in argument:
                flags[argument] = entry.flag
                if entry.kind == "flag":  # an on/off flag takes no value
                    flags[f"{argument}=True"] = entry.flag
    return flags


def flag_words(message: str) -> str:
    """A message of the library in the command line's words: a Python argument given a value
    (``memory_batch_size=32``, ``accept_config_change=True``) becomes its flag
    (``--memory-batch-size 32``, ``--accept-config-change``). Other mentions stay as they are
    (``LearnerClass.field must be ...`` is learner_message's
    job; a bare name in advice may be a test's words)."""
    flags = _flags()
    named = set(re.findall(r"(?<![\w./-])(\w+)=", message)) & set(flags)
    for name in sorted(named, key=len, reverse=True):
        flag = flags[name]
        if f"{name}=True" in flags:
            message = re.sub(rf"(?<![\w./-]){name}=True\b", flag, message)
        message = re.sub(rf"(?<![\w./-]){name}=", f"{flag} ", message)
    return message


def cut_echoes(message: str, given: Iterable[str]) -> str:
    """``message`` with every text of ``given`` longer than :data:`ECHO_LIMIT` characters that
    it repeats cut to its first ``ECHO_LIMIT`` characters, an ellipsis and its length.

    Example:
        >>> cut_echoes("unknown --scenario " + "x" * 500, ["x" * 500])[-30:]
        'xxxxxxxx... (500 characters)'
    """
    long = sorted({text for text in given if len(text) > ECHO_LIMIT}, key=len, reverse=True)
    for text in long:  # the longest first: a value's repr holds its text
        message = message.replace(text, f"{text[:ECHO_LIMIT]}... ({len(text)} characters)")
    return message


def command_line_message(error: BaseException, given: Iterable[str] = ()) -> str:
    """:func:`one_line`, with the advice naming the flag instead of the Python argument, the
    Python arguments named by their flags (:func:`flag_words`) and over-long given values cut
    (:func:`cut_echoes`; ``given``: the texts the user gave, in every form a message shows)."""
    message = one_line(error)
    for python, flag in _PYTHON_ADVICE:
        message = message.replace(python, flag)
    return cut_echoes(flag_words(message), given)
