"""The buffer kinds: which slot each incoming sample goes to, if any.

* :class:`ReservoirBuffer` keeps a uniform random subset of everything seen so far,
* :class:`SlidingWindowBuffer` keeps the most recent samples,
* :class:`GreedyClassBalancingBuffer` keeps the class counts as even as it can (GDumb),
* :class:`InfiniteBuffer` keeps everything.

Each one is a :class:`~renate_events.memory.DataBuffer` (storage, sampling, metadata and state
dict are there) with its own ``_plan``: the slots of a batch, decided in ``O(batch)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import attrs
import torch

from renate_events.memory import storage
from renate_events.memory.base import BoundedBuffer, DataBuffer
from renate_events.memory.checks import shape
from renate_events.memory.draws import RAND_HIGH, last_occurrences
from trainer import validators

__all__ = [
    "GreedyClassBalancingBuffer",
    "InfiniteBuffer",
    "ReservoirBuffer",
    "SlidingWindowBuffer",
]


@attrs.define(eq=False)
class ReservoirBuffer(BoundedBuffer):
    """Keeps a uniform random subset of the stream: reservoir sampling (Algorithm R).

    Implements the reservoir scheme of J. S. Vitter, "Random sampling with a reservoir", ACM
    Transactions on Mathematical Software 11(1), 1985. The first ``max_size`` samples are kept
    as they come; after that sample number ``n`` (0-based count of samples seen) takes a
    uniformly random slot with probability ``max_size / (n + 1)``, so every sample of the stream
    is in the buffer with the same probability ``max_size / num_seen``.

    An update is vectorised: one raw random integer ``r`` is drawn per sample of the batch, in a
    single ``torch.randint(0, 2**62, (batch,))`` call on the buffer's update generator; sample
    ``n`` (when ``n >= max_size``) goes to slot ``r % (n + 1)`` if that is below ``max_size``.
    Where several samples of one batch pick the same slot the latest wins, exactly as a
    sample-by-sample reservoir would; hence feeding a stream in any batch sizes gives the same
    contents.

    Args:
        max_size: Number of slots, an int >= 1.
        seed: See :class:`DataBuffer`.
        device: See :class:`DataBuffer`.

    Example:
        >>> import torch
        >>> buffer = ReservoirBuffer(100, seed=0)
        >>> for step in range(50):
        ...     buffer.update(torch.randn(32, 8), torch.randint(0, 10, (32,)))
        >>> len(buffer), buffer.num_seen
        (100, 1600)
    """

    def _plan(self, batch_size: int, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raw = torch.randint(0, RAND_HIGH, (batch_size,), generator=self._generator)
        first, size = self._num_seen, self.max_size
        if first + batch_size <= size:  # still filling: the next free slots, in order
            positions = torch.arange(batch_size, dtype=torch.int64)
            return positions + first, positions
        # Sample n replaces slot r % (n + 1) when that is below max_size.
        slots = raw % torch.arange(first + 1, first + batch_size + 1, dtype=torch.int64)
        if first < size:  # the batch fills the last free slots first
            seen = torch.arange(first, first + batch_size, dtype=torch.int64)
            slots = torch.where(seen < size, seen, slots)
        positions = torch.nonzero(slots < size).squeeze(1)
        slots = slots.index_select(0, positions)
        keep = last_occurrences(slots)  # several picks of one slot: the latest wins
        if keep is not None:
            slots, positions = slots.index_select(0, keep), positions.index_select(0, keep)
        return slots, positions


@attrs.define(eq=False)
class SlidingWindowBuffer(BoundedBuffer):
    """Keeps the ``max_size`` most recent samples (a ring buffer).

    Sample number ``n`` (0-based) goes to slot ``n % max_size``, overwriting the oldest one. No
    randomness is used in updates.

    Args:
        max_size: Number of slots, an int >= 1.
        seed: See :class:`DataBuffer` (used for sampling only).
        device: See :class:`DataBuffer`.

    Example:
        >>> import torch
        >>> buffer = SlidingWindowBuffer(3)
        >>> buffer.update(torch.arange(5.0).unsqueeze(1), torch.arange(5))
        >>> sorted(buffer.sample(3)[0][1].tolist())
        [2, 3, 4]
    """

    def _plan(self, batch_size: int, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = max(0, batch_size - self.max_size)  # earlier ones would be overwritten anyway
        positions = torch.arange(start, batch_size, dtype=torch.int64)
        slots = (positions + self._num_seen) % self.max_size
        return slots, positions


@attrs.define(eq=False)
class GreedyClassBalancingBuffer(BoundedBuffer):
    """Keeps the class counts as even as it can: the greedy sampler of GDumb.

    Follows the greedy class-balancing memory of A. Prabhu, P. H. S. Torr and P. K. Dokania,
    "GDumb: A Simple Approach that Questions Our Progress in Continual Learning", ECCV 2020.
    Samples are added while the buffer is not full. Once it is, a sample of class ``c`` is added
    only if ``c`` holds fewer samples than the largest class; it then replaces a random sample of
    a random class among those with the largest count. Once every class present keeps appearing,
    the counts end up within one of each other.

    Targets must be 1-D integer class labels.

    Implementation: each decision depends on the counts left by the previous one, so the
    decisions are taken by a plain loop over the batch on Python ints (``O(1)`` each: per-class
    slot lists and count buckets with swap-removal), with the random numbers for the whole batch
    drawn in one ``torch.randint(0, 2**62, (batch, 2))`` call (column 0 picks the class, column 1
    the slot). The storage is then written in one vectorised copy, the latest sample winning a
    slot that was replaced twice. Cost is ``O(batch)`` per update, independent of ``max_size``.

    Args:
        max_size: Number of slots, an int >= 1.
        seed: See :class:`DataBuffer`.
        device: See :class:`DataBuffer`.

    Example:
        >>> import torch
        >>> buffer = GreedyClassBalancingBuffer(4)
        >>> buffer.update(torch.randn(6, 2), torch.tensor([0, 0, 0, 0, 1, 1]))
        >>> buffer.class_counts()
        {0: 2, 1: 2}
    """

    _class_slots: dict[int, list[int]] = attrs.field(init=False, factory=dict, repr=False)
    _buckets: dict[int, list[int]] = attrs.field(init=False, factory=dict, repr=False)
    _bucket_pos: dict[int, int] = attrs.field(init=False, factory=dict, repr=False)
    _max_count: int = attrs.field(init=False, default=0, repr=False)

    def class_counts(self) -> dict[int, int]:
        """How many samples of each class the buffer holds, by class label (ascending)."""
        return {c: len(self._class_slots[c]) for c in sorted(self._class_slots)}

    def _check_first_targets(self, targets: torch.Tensor, where: str) -> None:
        if targets.dim() != 1 or targets.dtype.is_floating_point or targets.dtype.is_complex:
            raise ValueError(
                f"{where}: {type(self).__name__} needs 1-D integer class labels, got shape "
                f"{shape(targets)} and dtype {targets.dtype}"
            )
        if targets.dtype == torch.bool:
            raise ValueError(f"{where}: class labels must be integers, got a bool tensor")

    def _bucket_add(self, cls: int, count: int) -> None:
        bucket = self._buckets.setdefault(count, [])
        self._bucket_pos[cls] = len(bucket)
        bucket.append(cls)

    def _bucket_remove(self, cls: int, count: int) -> None:
        bucket = self._buckets[count]
        pos = self._bucket_pos.pop(cls)
        last = bucket.pop()
        if last != cls:
            bucket[pos] = last
            self._bucket_pos[last] = pos
        if not bucket:
            del self._buckets[count]

    def _add_slot(self, cls: int, slot: int) -> None:
        slots = self._class_slots.get(cls)
        if slots is None:
            slots = self._class_slots[cls] = []
        else:
            self._bucket_remove(cls, len(slots))
        slots.append(slot)
        self._bucket_add(cls, len(slots))
        self._max_count = max(self._max_count, len(slots))

    def _pop_slot(self, cls: int, raw: int) -> int:
        slots = self._class_slots[cls]
        count = len(slots)
        pos = raw % count
        slot = slots[pos]
        last = slots.pop()
        if pos < len(slots):
            slots[pos] = last
        self._bucket_remove(cls, count)
        if slots:
            self._bucket_add(cls, count - 1)
        else:
            del self._class_slots[cls]
        if count == self._max_count and count not in self._buckets:
            self._max_count = count - 1
        return slot

    def _plan(self, batch_size: int, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        labels = targets.tolist()
        raw = torch.randint(0, RAND_HIGH, (batch_size, 2), generator=self._generator).tolist()
        length = self._length
        assigned: dict[int, int] = {}  # slot -> latest batch position written to it
        for position, (cls, (raw_class, raw_slot)) in enumerate(zip(labels, raw)):
            if length < self.max_size:
                slot = length
                length += 1
            else:
                if len(self._class_slots.get(cls, ())) >= self._max_count:
                    continue
                largest = self._buckets[self._max_count]
                slot = self._pop_slot(largest[raw_class % len(largest)], raw_slot)
            self._add_slot(cls, slot)
            assigned[slot] = position
        pairs = sorted(assigned.items(), key=lambda item: item[1])
        slots = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
        positions = torch.tensor([p for _, p in pairs], dtype=torch.int64)
        return slots, positions

    def _extra_state(self) -> dict[str, Any]:
        order = [c for count in sorted(self._buckets) for c in self._buckets[count]]
        slots = [s for c in order for s in self._class_slots[c]]
        return {
            "class_order": order,
            "class_counts": [len(self._class_slots[c]) for c in order],
            "class_slots": torch.tensor(slots, dtype=torch.int64),
        }

    def _parse_extra_state(
        self, extra: Any, targets: torch.Tensor | None, length: int
    ) -> tuple[list[int], list[int], list[int]]:
        where = "state['extra']"
        if not isinstance(extra, Mapping) or set(extra) != {
            "class_order",
            "class_counts",
            "class_slots",
        }:
            raise ValueError(
                f"{where}: expected a dict with 'class_order', 'class_counts' and 'class_slots', "
                f"got {extra!r}"
            )
        order, counts, slots = extra["class_order"], extra["class_counts"], extra["class_slots"]
        if (
            not isinstance(order, (list, tuple))
            or not all(validators.is_int(c) for c in order)
            or len(set(order)) != len(order)
        ):
            raise ValueError(f"{where}['class_order']: expected distinct int labels, got {order!r}")
        if (
            not isinstance(counts, (list, tuple))
            or len(counts) != len(order)
            or not all(validators.is_int(n) and n >= 1 for n in counts)
            or sum(counts) != length
        ):
            raise ValueError(
                f"{where}['class_counts']: expected {len(order)} ints >= 1 summing to the length "
                f"{length}, got {counts!r}"
            )
        if (
            not isinstance(slots, torch.Tensor)
            or slots.dtype != torch.int64
            or shape(slots) != (length,)
            or not torch.equal(torch.sort(slots.cpu()).values, torch.arange(length))
        ):
            raise ValueError(
                f"{where}['class_slots']: expected an int64 tensor holding a permutation of "
                f"0 .. {length - 1}, got {slots!r}"
            )
        slots = slots.cpu()
        if length > 0:
            targets = cast(torch.Tensor, targets)
            expected = torch.repeat_interleave(
                torch.tensor(list(order), dtype=torch.int64), torch.tensor(list(counts))
            )
            got = targets.detach().cpu().to(torch.int64).index_select(0, slots)
            if not torch.equal(expected, got):
                raise ValueError(
                    f"{where}['class_slots']: the labels stored in those slots (state['targets']) "
                    "disagree with 'class_order' and 'class_counts'"
                )
        return list(order), list(counts), slots.tolist()

    def _load_extra_state(self, parsed: tuple[list[int], list[int], list[int]]) -> None:
        order, counts, slots = parsed
        self._class_slots, self._buckets, self._bucket_pos = {}, {}, {}
        start = 0
        for cls, count in zip(order, counts):
            self._class_slots[cls] = slots[start : start + count]
            start += count
            self._bucket_add(cls, count)
        self._max_count = max(counts, default=0)


# --------------------------------------------------------------------------------------------
# Unbounded buffer
# --------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class InfiniteBuffer(DataBuffer):
    """Keeps every sample it is offered.

    The storage grows geometrically (its capacity at least doubles whenever it runs out), so the
    copying cost per stored sample stays ``O(1)`` amortised.

    Args:
        initial_capacity: Rows allocated at the first update (more if that batch is larger), an
            int >= 1.
        seed: See :class:`DataBuffer` (used for sampling only).
        device: See :class:`DataBuffer`.

    Example:
        >>> import torch
        >>> buffer = InfiniteBuffer(initial_capacity=4)
        >>> for _ in range(3):
        ...     buffer.update(torch.randn(3, 2), torch.zeros(3))
        >>> len(buffer), buffer.capacity
        (9, 16)
    """

    initial_capacity: int = attrs.field(
        default=1024,
        kw_only=True,
        validator=validators.int_at_least(1),
        on_setattr=attrs.setters.frozen,
    )

    def truncate(self, length: int) -> None:
        """Drop the samples after the first ``length``, the ones added last (in place).

        Takes back the latest updates: the joint learner does so when an update fails before
        any of its batches trained. Truncating to 0 also frees the storage, so that the next
        batch fixes its structure, shapes and dtypes afresh.

        Raises:
            ValueError: ``length`` is not an int in ``[0, len(self)]``.

        Example:
            >>> import torch
            >>> buffer = InfiniteBuffer()
            >>> buffer.update(torch.zeros(5, 2), torch.arange(5))
            >>> buffer.truncate(3)
            >>> len(buffer), buffer.num_seen
            (3, 3)
        """
        validators.check_int(f"{type(self).__name__}.truncate: length", length, 0, len(self) + 1)
        self._length = self._num_seen = length
        if length == 0:
            self._release_storage()

    def _bound(self) -> None:
        return None

    def _initial_capacity(self, batch_size: int) -> int:
        return max(self.initial_capacity, batch_size)

    def _ensure_capacity(self, length: int) -> None:
        if length <= self._capacity:
            return
        capacity = max(length, 2 * self._capacity)
        grown = storage.grow(self._storage(), capacity, self._length)
        num_inputs = len(self._inputs)
        self._inputs = grown[:num_inputs]
        self._targets = grown[num_inputs]
        self._metadata = dict(zip(self._metadata, grown[num_inputs + 1 :]))
        self._capacity = capacity

    def _plan(self, batch_size: int, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(batch_size, dtype=torch.int64)
        return positions + self._length, positions
