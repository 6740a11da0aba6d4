"""Replay memories for experience replay, on preallocated tensor storage.

Public names follow Renate's buffers:

* :class:`DataBuffer`: the abstract base (update / sample / metadata / state dict),
* :class:`BoundedBuffer`: the base of the buffers that hold at most ``max_size`` samples,
* :class:`ReservoirBuffer`: uniform random subset of the stream (Vitter 1985),
* :class:`SlidingWindowBuffer`: the most recent samples,
* :class:`GreedyClassBalancingBuffer`: class-balanced memory of GDumb (Prabhu et al., 2020),
* :class:`InfiniteBuffer`: everything,
* :class:`HerdingBuffer`: iCaRL's exemplars, chosen by herding (Rebuffi et al., 2017).

Example:
    >>> import torch
    >>> from renate_events.memory import ReservoirBuffer
    >>> memory = ReservoirBuffer(max_size=500, seed=0)
    >>> memory.update(torch.randn(32, 784), torch.randint(0, 10, (32,)),
    ...               metadata={"logits": torch.randn(32, 10)})
    >>> (inputs, targets), metadata = memory.sample(16)
    >>> inputs.shape, metadata["idx"].dtype
    (torch.Size([16, 784]), torch.int64)
"""

from __future__ import annotations

from renate_events.memory.base import BatchMemory, BoundedBuffer, BufferDataset, DataBuffer
from renate_events.memory.buffers import (
    GreedyClassBalancingBuffer,
    InfiniteBuffer,
    ReservoirBuffer,
    SlidingWindowBuffer,
)
from renate_events.memory.herding import HerdingBuffer, herding_selection
from renate_events.memory.state import STATE_FORMAT_VERSION

__all__ = [
    "STATE_FORMAT_VERSION",
    "BatchMemory",
    "BoundedBuffer",
    "BufferDataset",
    "DataBuffer",
    "GreedyClassBalancingBuffer",
    "HerdingBuffer",
    "InfiniteBuffer",
    "ReservoirBuffer",
    "SlidingWindowBuffer",
    "herding_selection",
]
