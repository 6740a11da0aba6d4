"""The undo of a failed fit: what a fit can change, copied once before it and put back if it fails.

A fit changes the attached model's tensors, the optimizer's state (when the same optimizer is
used again), the gradients, the global RNGs, the trainer's attachments and progress, and every
listener's state. :func:`take_fit_snapshot` copies all of it once (one copy of the model and of
the listeners' checkpoint states; never anything per step), and :func:`roll_back_fit` puts it
back, so that a caller can make a failed fit leave no trace. A listener's state is what it
writes in ``on_save_checkpoint``: the snapshot gives it back through ``on_load_checkpoint``, as
a resumed run would.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from trainer import _runtime
from trainer.run import attachments, restore_attachments
from trainer.state import clone_tensors

__all__ = ["FitSnapshot", "roll_back_fit", "take_fit_snapshot"]

_WHERE = "(the state before the fit)"  # the ``path`` of the snapshot's checkpoint events


@attrs.define(eq=False)
class FitSnapshot:
    """What :func:`roll_back_fit` puts back (made by :func:`take_fit_snapshot`)."""

    model: torch.nn.Module
    attached: tuple[Any, ...]
    tensors: dict[str, torch.Tensor]
    training: list[bool]
    grads: list[torch.Tensor | None]
    optimizer: torch.optim.Optimizer | None
    optimizer_state: dict[str, Any] | None
    rng: dict[str, Any]
    listeners: dict[str, Any]


def take_fit_snapshot(
    trainer: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> FitSnapshot:
    """Copy what a fit of ``model`` on ``trainer`` can change.

    Args:
        trainer: The :class:`~trainer.Trainer` that will fit.
        model: The model it will fit (its tensors are copied, and it is attached while the
            listeners give their state, as when a checkpoint is saved).
        optimizer: An optimizer the fit will use again (its state is copied); None when the fit
            makes a new one.
    """
    attached = attachments(trainer)
    trainer.model = model
    try:
        # The trainer's own checkpoint machinery (this package's): every listener's state.
        states = trainer._checkpoints.collect_listener_states(_WHERE).to_tree()
    finally:
        restore_attachments(trainer, attached)
    params = list(model.parameters())
    return FitSnapshot(
        model=model,
        attached=attached,
        tensors={k: v.detach().clone() for k, v in model.state_dict().items()},
        training=[m.training for m in model.modules()],
        grads=[None if p.grad is None else p.grad.detach().clone() for p in params],
        optimizer=optimizer,
        optimizer_state=None if optimizer is None else clone_tensors(optimizer.state_dict()),
        rng=_runtime.get_rng_state(),
        listeners=clone_tensors(states),
    )


def roll_back_fit(trainer: Any, snapshot: FitSnapshot) -> None:
    """Put back what :func:`take_fit_snapshot` copied: the model's tensors, modes and gradients,
    the optimizer's state, every listener's state (while the model is attached, as when a
    checkpoint is loaded), then the trainer's attachments and progress and the global RNGs.

    The model must have the modules it had at the snapshot (a caller removes what it added).
    """
    model = snapshot.model
    model.load_state_dict(snapshot.tensors)
    for module, training in zip(model.modules(), snapshot.training):
        module.training = training
    for param, grad in zip(model.parameters(), snapshot.grads):
        param.grad = grad
    if snapshot.optimizer is not None and snapshot.optimizer_state is not None:
        snapshot.optimizer.load_state_dict(snapshot.optimizer_state)
    trainer.model = model
    try:
        trainer._checkpoints.give_listener_states(snapshot.listeners, _WHERE)
    finally:
        restore_attachments(trainer, snapshot.attached)
    _runtime.set_rng_state(snapshot.rng)
