"""Calling a model: the one home for how every learner, component, probe and command runs one.

``call_model`` unpacks the inputs (a tensor, a tuple/list or a dict), ``forward`` adds the task id
Renate's ``RenateModule.forward(x, task_id)`` takes, ``model_device`` finds where a model lives,
``inference`` runs it without gradients in eval mode (``torch.inference_mode`` where its outputs
never meet autograd: evaluation), and ``outputs_in_batches`` runs it over a large tensor in
chunks of ``EVAL_BATCH_SIZE`` rows, on the model's device (from pinned memory, without waiting
for each copy, when that device is a GPU).

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
    "EVAL_BATCH_SIZE",
    "call_model",
    "forward",
    "inference",
    "model_device",
    "outputs_in_batches",
    "pinned",
    "takes_task_id",
]

EVAL_BATCH_SIZE = 1024
"""Samples per forward pass when a model is only evaluated: without gradients nothing is kept
for a backward pass, so a large batch costs little memory and saves per-call overhead (the
launches and Python work that bound a small model's forward on a GPU)."""


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
def inference(model: nn.Module, *, outputs_leave_autograd: bool = False) -> Iterator[None]:
    """Run ``model`` in eval mode without gradients, then give every submodule back the
    train/eval mode it had (also when the block raises).

    Args:
        model: The model.
        outputs_leave_autograd: The tensors made in the block never enter autograd later (they
            are reduced to counts or metrics, as in evaluation): run under the faster
            ``torch.inference_mode``. Not for tensors kept for training (a replay buffer's
            inputs or logits), nor for a model with lazy parameters still to be created (they
            would be inference tensors): those run under ``torch.no_grad``.
    """
    modes = [(module, module.training) for module in model.modules()]
    lazy = any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters())
    model.eval()
    try:
        with torch.inference_mode() if outputs_leave_autograd and not lazy else torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def pinned(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` in page-locked memory when it is copied from the CPU to a GPU in chunks (pinned
    once, so that each chunk's ``.to(device, non_blocking=True)`` does not wait for the copy)."""
    if device.type != "cuda" or tensor.device.type != "cpu" or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def outputs_in_batches(
    model: nn.Module, inputs: torch.Tensor, batch_size: int = EVAL_BATCH_SIZE
) -> Iterator[torch.Tensor]:
    """``model``'s outputs on ``inputs``, ``batch_size`` rows at a time, each chunk moved to the
    model's device first (from pinned memory, without a wait, on a GPU). Call it inside
    :func:`inference` for evaluation."""
    device = model_device(model)
    inputs = pinned(inputs, device)
    for start in range(0, len(inputs), batch_size):
        yield forward(model, inputs[start : start + batch_size].to(device, non_blocking=True))
