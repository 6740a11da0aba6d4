"""The named choices of an update and their checks: buffers, where a buffer is stored, optimizers,
transforms, experiment trackers, and the keyword arguments of the trainer.

One home for :class:`~renate_events.updater.ModelUpdater`, the command line and the state folder's
manifest schema (:mod:`renate_events.state_folder`), which all check a name against the same
registry and build the same object from it.

Example:
    >>> from renate_events.choices import BUFFERS, default_buffer
    >>> sorted(BUFFERS)[:2], default_buffer("er")
    (['greedy-class-balancing', 'herding'], 'reservoir')
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from renate_events.memory import (
    DataBuffer,
    GreedyClassBalancingBuffer,
    HerdingBuffer,
    ReservoirBuffer,
    SlidingWindowBuffer,
)
from renate_events.memory.mapped import (
    MappedGreedyClassBalancingBuffer,
    MappedReservoirBuffer,
    MappedSlidingWindowBuffer,
)
from renate_events.methods import METHODS
from trainer import Trainer
from trainer.listeners import ExperimentTracker, MLflowLogger, TensorBoardLogger, WandbLogger

__all__ = [
    "BUFFERS",
    "BUFFER_STORAGES",
    "MAPPED_BUFFERS",
    "MAPPED_TYPES",
    "OPTIMIZERS",
    "TRACKERS",
    "TRANSFORMS",
    "check_known_keys",
    "check_optimizer",
    "default_buffer",
    "optimizer_factory",
    "trainer_arguments",
]

BUFFERS: dict[str, type[DataBuffer]] = {
    "reservoir": ReservoirBuffer,
    "sliding-window": SlidingWindowBuffer,
    "greedy-class-balancing": GreedyClassBalancingBuffer,
    "herding": HerdingBuffer,
}
"""Buffer names for :class:`~renate_events.updater.ModelUpdater` and the command line (built with
the learner's ``memory_size`` and ``seed``)."""

BUFFER_STORAGES = ("memory", "mapped")
"""Where :class:`~renate_events.updater.ModelUpdater` keeps the buffer: ``"memory"`` (tensors,
saved inside ``learner.safetensors``) or ``"mapped"`` (memory-mapped files, saved as files of the
state folder: see :mod:`renate_events.memory.mapped` and the docs' "Buffers beyond RAM")."""

MAPPED_BUFFERS: dict[str, type[DataBuffer]] = {
    "reservoir": MappedReservoirBuffer,
    "sliding-window": MappedSlidingWindowBuffer,
    "greedy-class-balancing": MappedGreedyClassBalancingBuffer,
}
"""The buffers that ``buffer_storage="mapped"`` offers, by the same names as :data:`BUFFERS`."""

MAPPED_TYPES = tuple(MAPPED_BUFFERS.values())
"""The classes of :data:`MAPPED_BUFFERS`, for ``isinstance``."""

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}
"""Optimizer names of ``ModelUpdater(optimizer={"name": ..., **kwargs})``."""

TRANSFORMS = (
    "train_transform",
    "train_target_transform",
    "buffer_transform",
    "buffer_target_transform",
    "test_transform",
)
"""The transform arguments of :class:`~renate_events.updater.ModelUpdater` (Renate's names),
passed to the learner."""

TRACKERS: dict[str, type[ExperimentTracker]] = {
    "mlflow": MLflowLogger,
    "wandb": WandbLogger,
    "tensorboard": TensorBoardLogger,
}
"""The experiment trackers of ``--tracker`` (``run``, ``update``), by name."""


def default_buffer(learner: str) -> str:
    """The buffer ``learner`` gets when none is named: its method spec's ``default_buffer``.

    Example:
        >>> default_buffer("icarl"), default_buffer("der")
        ('herding', 'reservoir')
    """
    spec = METHODS.get(learner)  # an unknown name is the learner field's error, not this one's
    return "reservoir" if spec is None else spec.default_buffer


def check_optimizer(name: str, value: Any) -> None:
    """``{"name": ..., **kwargs}`` that the named torch optimizer accepts (``name`` says whose
    value it is in the error)."""
    choice = value.get("name", "adam") if isinstance(value, Mapping) else None
    if choice not in OPTIMIZERS:
        raise ValueError(
            f"{name} must be a dict with 'name' in {sorted(OPTIMIZERS)} and its keyword "
            f"arguments (e.g. {{'name': 'adam', 'lr': 0.001}}), got {value!r}"
        )
    options = {key: item for key, item in value.items() if key != "name"}
    try:  # the optimizer's own checks, on a stand-in parameter
        OPTIMIZERS[choice]([torch.zeros(1, requires_grad=True)], **options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: torch.optim refuses {options!r} for {choice!r}: {exc}") from None


def optimizer_factory(
    optimizer: Mapping[str, Any] | Callable[..., torch.optim.Optimizer],
) -> Callable[..., torch.optim.Optimizer]:
    """``f(params)`` for a checked ``{"name": ..., **kwargs}``; a factory as it is."""
    if not isinstance(optimizer, Mapping):
        return optimizer
    options = dict(optimizer)
    return functools.partial(OPTIMIZERS[options.pop("name", "adam")], **options)


def trainer_arguments() -> frozenset[str]:
    """The keyword arguments of :class:`trainer.Trainer`."""
    return frozenset(inspect.signature(Trainer).parameters)


def check_known_keys(name: str, given: Mapping[str, Any], known: frozenset[str]) -> None:
    """Refuse keys of ``given`` outside ``known`` (``name`` says whose keys they are)."""
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{name} has unknown arguments {unknown}; known are {sorted(known)}")
