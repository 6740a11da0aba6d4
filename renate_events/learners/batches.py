"""What a learner's batches are: ``(inputs, targets)`` or ``(inputs, targets, task_ids)``, and
the loaders that serve them straight from a buffer's storage."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from renate_events.memory import BufferDataset

__all__ = ["buffer_loader", "refuse_task_data", "unpack", "unpack_task"]


def unpack_task(batch: Any) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """``(inputs, targets, task_ids)`` of a batch ``(inputs, targets)`` (task ids None) or
    ``(inputs, targets, task_ids)``."""
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return batch[0], batch[1], (batch[2] if len(batch) == 3 else None)
    shape = f"a {type(batch).__name__}" + (
        f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else ""
    )
    raise TypeError(
        f"learners train on batches of (inputs, targets) or (inputs, targets, task_ids); got "
        f"{shape}. Give fit() a dataset whose items are (inputs, target) pairs (or triples with "
        "an int64 task id), or a loader yielding such batches"
    )


def unpack(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(inputs, targets)`` of a batch that carries no task ids."""
    inputs, targets, task_ids = unpack_task(batch)
    if task_ids is not None:
        raise TypeError(
            "this learner trains on batches of (inputs, targets); got a batch with task ids "
            "(inputs, targets, task_ids). Drop the third tensor, or use a learner that carries "
            "task ids (docs: 'Task-incremental training with heads')"
        )
    return inputs, targets


def refuse_task_data(learner: Any, data: Any) -> None:
    """Data with task ids (three tensors) for a learner that trains on its buffer's
    ``(inputs, targets)`` samples (Joint, GDumb, repeated distillation): refused."""
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 3:
        raise ValueError(
            f"{type(learner).__name__} trains on its buffer's (inputs, targets) samples, which "
            "carry no task ids; give (inputs, targets) data, or use a replay learner (er, "
            "der, ...) for task-incremental data"
        )


def buffer_loader(data: BufferDataset, batch_size: int, shuffle: bool) -> DataLoader[Any]:
    """Stacked batches straight from a buffer's storage, shuffled at iteration time."""
    sampler = _LiveShuffle(data) if shuffle else None
    return DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=data.collate)


class _LiveShuffle(torch.utils.data.Sampler[int]):
    """Shuffles with torch's global RNG over the dataset's length at iteration time, so that a
    buffer filled or restored after the loader was built is sampled in full."""

    def __init__(self, data: BufferDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(len(self.data)).tolist())
