"""A replay buffer's storage tensors: their allocation, the rows an update writes, their growth.

A buffer keeps one preallocated tensor per input leaf, one for the targets and one per metadata
key, always in this order; row ``i`` of each is slot ``i``. These functions work on that list and
know nothing about which slot a sample goes to. All of them are vectorised: one operation per
stored tensor, whatever the number of rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from renate_events.memory.draws import indices_to

__all__ = ["allocate", "grow", "write_rows"]


def allocate(
    new_storage: Callable[[list[tuple[int, ...]], list[torch.dtype]], list[torch.Tensor]],
    prototypes: list[torch.Tensor],
    capacity: int,
) -> list[torch.Tensor]:
    """``capacity`` uninitialised rows for each of ``prototypes``' per-sample shape and dtype.

    Args:
        new_storage: Makes the tensors from their full shapes and dtypes (in memory or on files).
        prototypes: A tensor per storage tensor, batch first (a batch or a saved state).
        capacity: Rows to allocate.
    """
    # Storage must be a normal tensor even when the first batch arrives in inference mode,
    # or later in-place writes outside inference mode would fail.
    with torch.inference_mode(False):
        return new_storage(
            [(capacity, *t.shape[1:]) for t in prototypes], [t.dtype for t in prototypes]
        )


def write_rows(
    storage: list[torch.Tensor],
    sources: list[torch.Tensor],
    slots: torch.Tensor,
    positions: torch.Tensor,
    batch_size: int,
) -> None:
    """Write row ``positions[i]`` of every source tensor to row ``slots[i]`` of its storage.

    Args:
        storage: The storage tensors, all on one device.
        sources: The batch's tensors in the order of ``storage`` (on any device).
        slots: CPU int64 slots, distinct.
        positions: CPU int64 rows of the batch, strictly increasing.
        batch_size: Rows of the batch (all of them are written when ``positions`` has as many).
    """
    device_slots = indices_to(slots, storage[0].device)
    whole_batch = positions.numel() == batch_size  # positions are then 0 .. batch_size - 1
    moved_positions: dict[torch.device, torch.Tensor] = {}
    for stored, source in zip(storage, sources):
        # detach() and to() are dispatcher calls even when they return the tensor as it is;
        # this runs for every stored tensor on every update.
        if source.requires_grad:
            source = source.detach()
        if not whole_batch:
            pos = moved_positions.get(source.device)
            if pos is None:
                pos = moved_positions[source.device] = indices_to(positions, source.device)
            source = source.index_select(0, pos)
        if source.device != stored.device:
            source = source.to(stored.device)
        stored.index_copy_(0, device_slots, source)


def grow(storage: list[torch.Tensor], capacity: int, length: int) -> list[torch.Tensor]:
    """New in-memory storage of ``capacity`` rows, holding the first ``length`` rows of ``storage``.

    Only unbounded buffers grow (geometrically, so the copying stays ``O(1)`` per stored row).
    """
    grown = []
    with torch.inference_mode(False):
        for stored in storage:
            new = torch.empty(
                (capacity, *stored.shape[1:]), dtype=stored.dtype, device=stored.device
            )
            new[:length].copy_(stored[:length])
            grown.append(new)
    return grown
