"""The undo of a failed :meth:`ModelUpdater.update <renate_events.updater.ModelUpdater.update>`:
the whole update (checks, training, its record and the write of the output folder) runs in the
learner's :meth:`~renate_events.learners.FailedUpdateUndo.all_or_nothing`, and the updater's own
record of the updates is put back with it, so that a failed update leaves no trace."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from renate_events.updater._probes import make_buffer_writable

__all__ = ["all_or_nothing"]

Update = TypeVar("Update", bound=Callable[..., Any])


def all_or_nothing(*kept: str) -> Callable[[Update], Update]:
    """Decorate an updater method so that, if it raises, the learner (its model, buffer,
    components, listeners, optimizer and trainer) and the updater's attributes named in ``kept``
    are as they were before the call. The learner is built (and its input folder read) first,
    outside the undo: a failed build leaves no learner."""

    def decorate(update: Update) -> Update:
        @functools.wraps(update)
        def undone_on_failure(updater: Any, *args: Any, **kwargs: Any) -> Any:
            learner = updater.learner_instance
            # A lazily read mapped buffer gets its working files before the snapshot, which
            # would otherwise copy them first (a full disk is then the update's clear refusal).
            make_buffer_writable(learner)
            before = {name: _copy(getattr(updater, name)) for name in kept}
            with learner.all_or_nothing():
                try:
                    return update(updater, *args, **kwargs)
                except BaseException:
                    for name, value in before.items():
                        setattr(updater, name, value)
                    raise

        return undone_on_failure  # type: ignore[return-value]

    return decorate


def _copy(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value  # dicts are changed in place
