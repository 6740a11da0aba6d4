"""The listeners an update subscribes to its learner's trainer: the best weights of one update,
and the validation memory kept across updates."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils.data import TensorDataset

from renate_events.memory import DataBuffer, InfiniteBuffer, ReservoirBuffer
from renate_events.updater._probes import dataset_tensors
from trainer import Trainer
from trainer.listeners import EarlyStopping

__all__ = [
    "VALIDATION_MEMORY",
    "BestWeights",
    "ValidationMemory",
    "update_listeners",
    "validation_data",
]

VALIDATION_MEMORY = "validation_memory"  # the listener's name in the learner's checkpoint


@attrs.define(eq=False)
class BestWeights:
    """Keeps a CPU copy of the model's weights at its best validation of one update (in the
    trainer's checkpoints too, so that a resumed update keeps the best of its whole run)."""

    model: nn.Module
    metric: str
    mode: str
    best: float | None = None
    epoch: int | None = None
    weights: dict[str, torch.Tensor] | None = None

    def on_validation_end(self, state: Any, metrics: Mapping[str, float]) -> None:
        value = float(metrics[self.metric])
        if value != value:  # NaN is never the best
            return
        if self.best is None or (value < self.best if self.mode == "min" else value > self.best):
            self.best, self.epoch = value, int(state.epoch)
            self.weights = {
                key: tensor.detach().to("cpu", copy=True)
                for key, tensor in self.model.state_dict().items()
            }

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        if self.best is not None:
            checkpoint.update(best=self.best, epoch=self.epoch, weights=dict(self.weights or {}))

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        if "best" not in checkpoint:
            self.best = self.epoch = self.weights = None
            return
        current = self.model.state_dict()
        weights = checkpoint["weights"]
        if not isinstance(weights, Mapping) or sorted(weights) != sorted(current):
            raise ValueError("the best weights' state must hold every tensor of the model")
        for key, tensor in current.items():
            if weights[key].shape != tensor.shape or weights[key].dtype != tensor.dtype:
                raise ValueError(f"the best weights' {key!r} is not the model's shape or dtype")
        self.best, self.epoch = float(checkpoint["best"]), int(checkpoint["epoch"])
        self.weights = {key: weights[key].clone() for key in current}


@attrs.define(eq=False)
class ValidationMemory:
    """Validation data of earlier updates, kept in the learner's checkpoint (Renate keeps all of
    it; ``max_size`` bounds it with reservoir sampling)."""

    buffer: DataBuffer

    @classmethod
    def of_size(cls, max_size: int | None, seed: int) -> ValidationMemory:
        """All validation data (``max_size=None``) or a reservoir sample of ``max_size``."""
        if max_size is None:
            return cls(InfiniteBuffer(seed=seed))
        return cls(ReservoirBuffer(max_size=max_size, seed=seed))

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        checkpoint["buffer"] = self.buffer.state_dict()

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        if "buffer" not in checkpoint:
            raise ValueError("the validation memory's state has no 'buffer'")
        self.buffer.load_state_dict(checkpoint["buffer"])

    def data(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if len(self.buffer) == 0:
            return None
        inputs, targets = self.buffer.dataset().__getitems__(list(range(len(self.buffer))))
        return inputs, targets


def validation_data(
    memory: ValidationMemory | None, val_dataset: Any, collate_fn: Any
) -> tuple[tuple[torch.Tensor, ...] | None, Any]:
    """This update's validation tensors (to keep afterwards) and what it validates on: its own
    validation data and the ``memory`` of earlier updates'."""
    if memory is None:
        return None, val_dataset
    current = None
    if val_dataset is not None:
        current = dataset_tensors(val_dataset, collate_fn, "the validation data")
        memory.buffer.check_batch(*current)
    kept = memory.data()
    if kept is None:
        return current, None if current is None else TensorDataset(*current)
    if current is None:
        return None, TensorDataset(*kept)
    return current, TensorDataset(*(torch.cat(pair) for pair in zip(kept, current)))


@contextmanager
def update_listeners(
    trainer: Trainer,
    best: BestWeights | None,
    metric: str | None,
    mode: str | None,
    patience: int | None,
) -> Iterator[None]:
    """``best`` (if any) and early stopping on ``metric`` (if ``patience`` is given) subscribed
    to ``trainer`` for the duration of one update."""
    with ExitStack() as stack:
        if best is not None:
            stack.enter_context(trainer.subscribed(best, name="_best_weights"))
        if patience is not None:
            stopper = EarlyStopping(monitor=metric, mode=mode, patience=patience)
            stack.enter_context(trainer.subscribed(stopper, name="_early_stopping"))
        yield
