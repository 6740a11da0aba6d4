"""Calling a model: the one home for how every learner, component, probe and command runs one.

``call_model`` unpacks the inputs (a tensor, a tuple/list or a dict), ``forward`` adds the task id
Renate's ``RenateModule.forward(x, task_id)`` takes, ``model_device`` finds where a model lives,
``inference`` runs it without gradients in eval mode, and ``outputs_in_batches`` runs it over a
large tensor in chunks, on the model's device.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 3)
    >>> with inference(model):
    ...     logits = torch.cat([out for out in outputs_in_batches(model, torch.zeros(10, 4), 4)])
    >>> tuple(logits.shape), model_device(model).type, model.training
    ((10, 3), 'cpu', True)
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "call_model",
    "forward",
    "inference",
    "model_device",
    "outputs_in_batches",
    "takes_task_id",
]


def call_model(model: nn.Module, inputs: Any, **keywords: Any) -> Any:
    """``model(x)``, ``model(*x)`` for a tuple or list, ``model(**x)`` for a dict: how every
    learner and component calls a model (or a copy of it); ``keywords`` (the learners'
    ``task_id``) are passed along."""
    if isinstance(inputs, Mapping):
        return model(**inputs, **keywords)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs, **keywords)
    return model(inputs, **keywords)


def forward(model: nn.Module, inputs: Any, task_id: Any = None) -> torch.Tensor:
    """Call ``model`` on inputs as :func:`call_model` does.

    A ``task_id`` that is not None (an int, or an ``int64`` tensor of one id per sample) is passed
    as the keyword ``task_id``, Renate's ``RenateModule.forward(x, task_id)``:
    ``model(x, task_id=ids)``.
    """
    if task_id is None:
        return cast(torch.Tensor, call_model(model, inputs))
    return cast(torch.Tensor, call_model(model, inputs, task_id=task_id))


def takes_task_id(model: nn.Module) -> bool:
    """Whether ``model.forward`` declares a ``task_id`` parameter (as Renate's
    ``RenateModule.forward(x, task_id)`` and :class:`MultiHeadClassificationModel` do)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False
    return "task_id" in parameters


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (or buffer); the CPU for a model with neither."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


@contextlib.contextmanager
def inference(model: nn.Module) -> Iterator[None]:
    """Run ``model`` in eval mode without gradients, then give every submodule back the
    train/eval mode it had (also when the block raises)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def outputs_in_batches(
    model: nn.Module, inputs: torch.Tensor, batch_size: int = 256
) -> Iterator[torch.Tensor]:
    """``model``'s outputs on ``inputs``, ``batch_size`` rows at a time, each chunk moved to the
    model's device first. Call it inside :func:`inference` for evaluation."""
    device = model_device(model)
    for start in range(0, len(inputs), batch_size):
        yield forward(model, inputs[start : start + batch_size].to(device))
