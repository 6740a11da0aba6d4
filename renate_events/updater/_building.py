"""Building an update's learner: the method's learner class with the update's buffer (in memory
or mapped), its trainer with the update's listeners, and the update's functions."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from renate_events.choices import BUFFERS, MAPPED_BUFFERS, optimizer_factory
from renate_events.learners import BaseExperienceReplayLearner
from renate_events.memory import DataBuffer
from renate_events.methods import method
from renate_events.state_folder import folder_key
from trainer import Trainer
from trainer import validators as checks

__all__ = ["make_buffer", "make_learner", "updater_learner"]


def make_learner(
    name: str,
    model: nn.Module,
    learner_kwargs: Mapping[str, Any],
    *,
    optimizer: Callable[..., torch.optim.Optimizer],
    trainer_kwargs: Mapping[str, Any],
    listeners: Sequence[Any],
    functions: Mapping[str, Any],
    scheduler_interval: str,
    buffer: Callable[[int, int], DataBuffer],
) -> BaseExperienceReplayLearner:
    """The learner of the method ``name``.

    Args:
        name: The method's name.
        model: The model to train.
        learner_kwargs: The learner's JSON-able keyword arguments.
        optimizer: ``f(params)``, the optimizer factory.
        trainer_kwargs: The keyword arguments of :class:`trainer.Trainer`.
        listeners: Subscribed to the trainer.
        functions: The learner's arguments that are functions, by name (None: not given).
        scheduler_interval: The learning-rate scheduler's interval, if one is given.
        buffer: ``f(memory_size, seed)``, called when the learner keeps a memory of its own
            buffer kind.
    """
    kwargs = dict(learner_kwargs)
    spec = method(name)
    fields = attrs.fields_dict(spec.learner)
    memory_size = kwargs.get("memory_size", fields["memory_size"].default)
    checks.check_int("ModelUpdater.learner_kwargs['memory_size']", memory_size, 0)
    if memory_size > 0 and not spec.own_buffer:
        kwargs["buffer"] = buffer(memory_size, kwargs.get("seed", 0))
    objects = _learner_objects(name, fields, functions, scheduler_interval)
    trainer = Trainer(**trainer_kwargs)
    for listener in listeners:
        trainer.subscribe(listener)
    return spec.learner(model=model, optimizer=optimizer, trainer=trainer, **objects, **kwargs)


def _learner_objects(
    learner: str,
    fields: Mapping[str, Any],
    given: Mapping[str, Any],
    scheduler_interval: str,
) -> dict[str, Any]:
    """The learner's arguments of the given functions, refusing those that the learner (its
    attrs ``fields``) does not take."""
    objects = {name: value for name, value in given.items() if value is not None}
    unsupported = sorted(name for name in objects if name not in fields)
    if unsupported:
        raise ValueError(
            f"ModelUpdater: the learner {learner!r} takes no {unsupported}; leave them "
            "out for this learner"
        )
    if given.get("learning_rate_scheduler") is not None:
        objects["learning_rate_scheduler_interval"] = scheduler_interval
    return objects


def make_buffer(
    name: str,
    storage: str,
    folder: str | os.PathLike[str] | None,
    near: Sequence[str | os.PathLike[str] | None],
    memory_size: int,
    seed: int,
) -> DataBuffer:
    """The buffer ``name`` in ``storage`` (a name of :data:`~renate_events.choices.
    BUFFER_STORAGES`).

    A mapped buffer makes its working files in ``folder``, by default beside the first of the
    state folders ``near`` (the output, then the input: its nearest existing ancestor) that may
    be written there, else in the system's temporary folder. Without an output folder (the
    first of ``near``: an evaluation, or an update that writes nowhere) it loads a state lazily:
    it reads the input's files in place and makes working files only before it trains, so that
    a state on read-only or full storage can be read.
    """
    if storage == "memory":
        return BUFFERS[name](max_size=memory_size, seed=seed)
    if folder is None:
        parents = [_existing_folder(os.path.dirname(folder_key(f))) for f in near if f is not None]
        writable = [p for p in parents if os.access(p, os.W_OK | os.X_OK)]
        folder = writable[0] if writable else tempfile.gettempdir()
    lazy = not near or near[0] is None
    try:
        return MAPPED_BUFFERS[name](
            max_size=memory_size, seed=seed, folder=folder, unlinked=True, lazy=lazy
        )
    except ValueError as exc:
        raise ValueError(
            f"ModelUpdater.buffer_folder: {exc} (the mapped buffer's working files go there)"
        ) from None


def _existing_folder(path: str) -> str:
    """``path``, or its nearest existing ancestor (on the disk where a folder made there goes)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def updater_learner(updater: Any) -> BaseExperienceReplayLearner:
    """The learner of a :class:`~renate_events.updater.ModelUpdater`, made from its arguments
    (a mapped buffer's working files near its output or input folder)."""
    near = (updater.output_state_folder, updater.input_state_folder)
    functions = {
        "loss_fn": updater.loss_fn,
        "learning_rate_scheduler": updater.learning_rate_scheduler,
        "collate_fn": updater.collate_fn,
        "metrics": updater.metrics or None,
        **updater.transforms,
    }
    return make_learner(
        updater.learner,
        updater.model,
        updater.learner_kwargs,
        optimizer=optimizer_factory(updater.optimizer),
        trainer_kwargs=updater.trainer_arguments,
        listeners=updater.listeners,
        functions=functions,
        scheduler_interval=updater.learning_rate_scheduler_interval,
        buffer=functools.partial(
            make_buffer, updater.buffer, updater.buffer_storage, updater.buffer_folder, near
        ),
    )
