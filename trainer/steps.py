"""What the caller's step functions return, read by the loop: the training step's loss and
outputs (and the error of a non-finite loss), and validation metrics as batch-size weighted means
over every rank's samples."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from trainer import _runtime
from trainer.distributed import DistributedContext
from trainer.exceptions import NonFiniteLossError
from trainer.state import TrainState

__all__ = [
    "StepOutput",
    "nonfinite_loss_error",
    "split_step_output",
    "validation_metrics",
    "validation_values",
]

StepOutput = torch.Tensor | Mapping[str, Any]
"""What a training step returns: the loss tensor, or a mapping with ``"loss"`` and anything else."""


def split_step_output(outputs: Any) -> tuple[torch.Tensor, Mapping[str, Any]]:
    """The loss and the outputs listeners see (``{"loss": loss}`` for a bare tensor).

    Raises:
        TypeError: When ``outputs`` is neither a tensor nor a mapping with a ``"loss"`` tensor.
    """
    if isinstance(outputs, torch.Tensor):
        return outputs, {"loss": outputs}
    if isinstance(outputs, Mapping) and isinstance(outputs.get("loss"), torch.Tensor):
        return outputs["loss"], outputs
    raise TypeError(
        "step(batch) must return the loss tensor or a mapping with a 'loss' tensor; got "
        f"{type(outputs).__name__}"
        + (f" with keys {sorted(outputs)}" if isinstance(outputs, Mapping) else "")
    )


def nonfinite_loss_error(loss: torch.Tensor, state: TrainState) -> NonFiniteLossError:
    """The error of a NaN or infinite ``loss`` at the current step of ``state``."""
    return NonFiniteLossError(
        f"the loss is {loss.detach().float().tolist()} at step {state.global_step} "
        f"(epoch {state.epoch}, batch {state.batch_idx}); no optimizer step was taken for "
        "it. Check the data and the learning rate, or pass "
        "Trainer(nonfinite_loss='skip') to skip such batches",
        step=state.global_step,
        epoch=state.epoch,
        batch_idx=state.batch_idx,
    )


def validation_values(outputs: Any) -> dict[str, torch.Tensor]:
    """What ``val_step`` returned as ``{"val_<name>": scalar tensor}``.

    Raises:
        TypeError: When ``outputs`` is neither a tensor nor a mapping.
        ValueError: When a value is not a scalar.
    """
    if isinstance(outputs, torch.Tensor):
        outputs = {"loss": outputs}
    if not isinstance(outputs, Mapping):
        raise TypeError(
            f"val_step(batch) must return a scalar tensor or a mapping of scalars, got "
            f"{type(outputs).__name__}"
        )
    values = {}
    for name, value in outputs.items():
        tensor = torch.as_tensor(value)
        if tensor.numel() != 1:
            raise ValueError(
                f"val_step returned {name!r} with shape {tuple(tensor.shape)}; validation metrics "
                "must be scalars (reduce them in val_step, e.g. .mean())"
            )
        key = name if str(name).startswith("val_") else f"val_{name}"
        values[key] = tensor.reshape(())
    return values


def validation_metrics(
    loader: Iterable[Any] | None,
    val_step: Callable[[Any], StepOutput],
    move: Callable[[Any], Any],
    autocast: Callable[[], Any],
    dist: DistributedContext,
) -> dict[str, float]:
    """Batch-size weighted means of what ``val_step`` returns, over every rank's samples.

    Args:
        loader: The validation batches (None: no metrics).
        val_step: Returns a scalar tensor or a mapping of scalars per batch.
        move: Moves a batch to the device.
        autocast: The precision context of the fit.
        dist: Sums the totals over the ranks.
    """
    totals: dict[str, torch.Tensor] = {}
    count = 0
    for batch in loader or ():
        batch = move(batch)
        with autocast():
            values = validation_values(val_step(batch))
        size = _runtime.batch_size_of(batch)
        for name, value in values.items():
            weighted = value.detach().float() * size
            totals[name] = totals[name] + weighted if name in totals else weighted
        count += size
    names = list(totals)
    if not names:
        return {}
    counted = totals[names[0]].new_tensor(float(count))
    sums = dist.sum(torch.stack([*(totals[n] for n in names), counted]))
    return dict(zip(names, (sums[:-1] / max(float(sums[-1]), 1.0)).tolist()))
