"""Stateful (Hypothesis) tests of the replay buffers against plain-Python models.

Every sample of the stream carries a unique id, in its inputs (nested: a float tensor and a dict
holding an int64 tensor), so the machines can tell which samples a buffer holds in which slot. The
buffer's contents are read through its public ``state_dict()`` after every step.

* Reservoir: the model replays Algorithm R sample by sample with the random numbers the buffer
  documents it draws (one ``randint(0, 2**62)`` per offered sample, from a CPU generator seeded
  with ``seed``), so it predicts the exact slot of every sample. That the buffer decides a whole
  batch at once with tensor ops while the model goes one by one checks the "latest wins" rule.
* Sliding window: sample ``n`` lives in slot ``n % max_size``.
* Greedy class balancing: exact single-sample semantics, and for batches the invariants the greedy
  rule guarantees (bounded size, fill order, the largest class never grows once full, the spread of
  class counts never grows on batches of known classes).
* Infinite: everything, in order; storage grows geometrically.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from renate_events.memory import (
    DataBuffer,
    GreedyClassBalancingBuffer,
    InfiniteBuffer,
    ReservoirBuffer,
    SlidingWindowBuffer,
)

NUM_CLASSES = 4
SETTINGS = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def make_batch(ids: list[int], labels: list[int]) -> tuple[Any, torch.Tensor, dict]:
    """A batch whose every tensor is derived from the sample ids."""
    ident = torch.tensor(ids, dtype=torch.int64)
    x = ident.to(torch.float32).unsqueeze(1) + torch.tensor([0.0, 0.5, 0.25])
    inputs = (x, {"id": ident})
    targets = torch.tensor(labels, dtype=torch.int64)
    logits = ident.to(torch.float32).unsqueeze(1) + torch.arange(4, dtype=torch.float32) / 8
    return inputs, targets, {"logits": logits}


def initial_logits(sample_id: int) -> torch.Tensor:
    return float(sample_id) + torch.arange(4, dtype=torch.float32) / 8


def json_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """Pass a state dict through JSON the way a checkpoint would: tensors aside, the rest JSON."""
    tensors: list[torch.Tensor] = []

    def encode(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return {"$tensor": len(tensors) - 1}
        if isinstance(value, dict):
            return {k: encode(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [encode(v) for v in value]
        assert value is None or isinstance(value, (bool, int, float, str)), type(value)
        return value

    def decode(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"$tensor"}:
                return tensors[value["$tensor"]].clone()
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    return decode(json.loads(json.dumps(encode(state))))


class BufferMachine(RuleBasedStateMachine):
    """Shared rules; subclasses build the buffer and check their own model."""

    buffer: DataBuffer

    def make_buffer(self, max_size: int, seed: int) -> DataBuffer:
        raise NotImplementedError

    def model_update(self, ids: list[int], labels: list[int]) -> None:
        raise NotImplementedError

    def check_model(self, slot_ids: list[int]) -> None:
        raise NotImplementedError

    def init_model(self) -> None:
        """Set up the model's own state (after ``max_size`` and ``seed`` are known)."""

    @initialize(max_size=st.integers(1, 7), seed=st.integers(0, 2**64 - 1))
    def setup(self, max_size: int, seed: int) -> None:
        self.max_size = max_size
        self.seed = seed
        self.buffer = self.make_buffer(max_size, seed)
        self.labels: list[int] = []  # label of every id seen
        self.logits: dict[int, torch.Tensor] = {}  # logits rewritten by set_metadata, by id
        self.init_model()

    # ------------------------------------------------------------------ rules

    @rule(labels=st.lists(st.integers(0, NUM_CLASSES - 1), min_size=0, max_size=12))
    def update(self, labels: list[int]) -> None:
        ids = list(range(len(self.labels), len(self.labels) + len(labels)))
        self.buffer.update(*make_batch(ids, labels))
        self.labels.extend(labels)
        self.model_update(ids, labels)

    @precondition(lambda self: len(self.buffer) > 0)
    @rule(k=st.integers(1, 10))
    def sample(self, k: int) -> None:
        slot_ids = self.slot_ids()
        (inputs, targets), meta = self.buffer.sample(k)
        idx = meta["idx"]
        assert idx.dtype == torch.int64
        assert idx.numel() == min(k, len(self.buffer))
        assert len(set(idx.tolist())) == idx.numel(), "sampled with replacement"
        x, nested = inputs
        for row, slot in enumerate(idx.tolist()):
            sample_id = slot_ids[slot]
            assert int(nested["id"][row]) == sample_id
            assert x[row].tolist() == [sample_id, sample_id + 0.5, sample_id + 0.25]
            assert int(targets[row]) == self.labels[sample_id]
            assert torch.equal(meta["logits"][row], self.expected_logits(sample_id))
        assert set(meta) == {"idx", "logits"}

    @precondition(lambda self: len(self.buffer) > 0)
    @rule(k=st.integers(1, 10), gamma=st.sampled_from([0.0, 0.5, 0.9]))
    def ema_update_logits(self, k: int, gamma: float) -> None:
        (_, _), meta = self.buffer.sample(k)
        new = gamma * meta["logits"] + (1 - gamma) * torch.full_like(meta["logits"], -1.0)
        self.buffer.set_metadata("logits", meta["idx"], new)
        assert torch.equal(self.buffer.get_metadata("logits", meta["idx"]), new)
        slot_ids = self.slot_ids()
        for row, slot in enumerate(meta["idx"].tolist()):
            self.logits[slot_ids[slot]] = new[row].clone()

    @rule(new_seed=st.integers(0, 2**64 - 1), via_json=st.booleans())
    def round_trip(self, new_seed: int, via_json: bool) -> None:
        state = self.buffer.state_dict()
        if via_json:
            state = json_round_trip(state)
        restored = self.make_buffer(self.max_size, new_seed)
        restored.load_state_dict(state)
        assert_states_equal(self.buffer.state_dict(), restored.state_dict())
        self.buffer = restored

    # ------------------------------------------------------------------ invariants

    def slot_ids(self) -> list[int]:
        state = self.buffer.state_dict()
        if state["inputs_structure"] is None:
            return []
        return state["inputs"][1].tolist()

    def expected_logits(self, sample_id: int) -> torch.Tensor:
        return self.logits.get(sample_id, initial_logits(sample_id))

    @invariant()
    def contents_are_consistent(self) -> None:
        if not hasattr(self, "buffer"):
            return
        state = self.buffer.state_dict()
        n = len(self.buffer)
        assert state["length"] == n
        assert self.buffer.num_seen == len(self.labels)
        bound = self.buffer.max_size
        assert bound is None or n <= bound
        if state["inputs_structure"] is None:
            assert n == 0
            self.check_model([])
            return
        x, ids = state["inputs"]
        slot_ids = ids.tolist()
        assert len(slot_ids) == n
        assert len(set(slot_ids)) == n, "a sample is stored twice"
        assert all(0 <= i < len(self.labels) for i in slot_ids), "stored a sample never seen"
        for slot, sample_id in enumerate(slot_ids):
            assert x[slot].tolist() == [sample_id, sample_id + 0.5, sample_id + 0.25]
            assert int(state["targets"][slot]) == self.labels[sample_id]
            assert torch.equal(state["metadata"]["logits"][slot], self.expected_logits(sample_id))
        self.check_model(slot_ids)


def assert_states_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_states_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_states_equal(x, y)
    else:
        assert a == b, (a, b)


class ReservoirMachine(BufferMachine):
    def make_buffer(self, max_size: int, seed: int) -> DataBuffer:
        return ReservoirBuffer(max_size, seed=seed)

    def init_model(self) -> None:
        self.model_generator = torch.Generator().manual_seed(self.seed)
        self.model_slots: list[int] = []

    def model_update(self, ids: list[int], labels: list[int]) -> None:
        if not ids:
            return
        raw = torch.randint(0, 2**62, (len(ids),), generator=self.model_generator).tolist()
        for sample_id, r in zip(ids, raw):
            n = sample_id  # ids count the samples seen, from 0
            if n < self.max_size:
                self.model_slots.append(sample_id)
            else:
                j = r % (n + 1)  # uniform in [0, n]: replace with probability max_size / (n + 1)
                if j < self.max_size:
                    self.model_slots[j] = sample_id

    def check_model(self, slot_ids: list[int]) -> None:
        assert slot_ids == self.model_slots
        if len(self.labels) <= self.max_size:  # not full yet: the first samples, verbatim
            assert slot_ids == list(range(len(self.labels)))


class SlidingWindowMachine(BufferMachine):
    def make_buffer(self, max_size: int, seed: int) -> DataBuffer:
        return SlidingWindowBuffer(max_size, seed=seed)

    def model_update(self, ids: list[int], labels: list[int]) -> None:
        pass

    def check_model(self, slot_ids: list[int]) -> None:
        seen = len(self.labels)
        last = list(range(max(0, seen - self.max_size), seen))
        assert sorted(slot_ids) == last
        assert all(slot == i % self.max_size for slot, i in enumerate(slot_ids))


class GreedyClassBalancingMachine(BufferMachine):
    def make_buffer(self, max_size: int, seed: int) -> DataBuffer:
        return GreedyClassBalancingBuffer(max_size, seed=seed)

    def init_model(self) -> None:
        self.previous: list[int] = []

    def counts(self, slot_ids: list[int]) -> dict[int, int]:
        counts: dict[int, int] = {}
        for sample_id in slot_ids:
            counts[self.labels[sample_id]] = counts.get(self.labels[sample_id], 0) + 1
        return counts

    def model_update(self, ids: list[int], labels: list[int]) -> None:
        before, after = self.previous, self.slot_ids()
        self.previous = after
        before_counts, after_counts = self.counts(before), self.counts(after)
        assert isinstance(self.buffer, GreedyClassBalancingBuffer)
        assert self.buffer.class_counts() == dict(sorted(after_counts.items()))
        was_full = len(before) == self.max_size
        if not was_full:
            # Filling: samples go to the next free slots; once full, the rule below applies to
            # the rest of the batch, which the single-sample checks cover.
            if len(ids) <= self.max_size - len(before):
                assert after == before + ids
            return
        assert len(after) == self.max_size
        new = set(after) - set(before)
        assert new <= set(ids), "a slot changed to a sample not in this batch"
        top_before = max(before_counts.values())
        assert max(after_counts.values()) <= top_before, "the largest class grew while full"
        if set(labels) <= set(before_counts):  # no new class: the spread cannot widen
            spread_before = top_before - min(before_counts.values())
            assert max(after_counts.values()) - min(after_counts.values()) <= spread_before
            assert set(after_counts) == set(before_counts), "a class vanished"
        if len(ids) == 1:
            (label,) = labels
            if before_counts.get(label, 0) < top_before:  # accepted
                assert len(new) == 1
                evicted = set(before) - set(after)
                assert len(evicted) == 1
                (gone,) = evicted
                assert before_counts[self.labels[gone]] == top_before, "evicted from a small class"
                slot = before.index(gone)
                assert after[slot] == ids[0] and after[:slot] + after[slot + 1 :] == (
                    before[:slot] + before[slot + 1 :]
                )
            else:  # rejected: nothing changes
                assert after == before

    def check_model(self, slot_ids: list[int]) -> None:
        assert len(slot_ids) == min(self.max_size, len(self.labels))
        if len(self.labels) <= self.max_size:
            assert slot_ids == list(range(len(self.labels)))

    @rule(label=st.integers(0, NUM_CLASSES - 1))
    def update_one(self, label: int) -> None:
        self.update([label])

    @rule(new_seed=st.integers(0, 2**64 - 1), via_json=st.booleans())
    def round_trip(self, new_seed: int, via_json: bool) -> None:
        super().round_trip(new_seed, via_json)
        self.previous = self.slot_ids()


class InfiniteMachine(BufferMachine):
    def make_buffer(self, max_size: int, seed: int) -> DataBuffer:
        return InfiniteBuffer(seed=seed, initial_capacity=max_size)

    def model_update(self, ids: list[int], labels: list[int]) -> None:
        pass

    def check_model(self, slot_ids: list[int]) -> None:
        assert slot_ids == list(range(len(self.labels)))
        assert self.buffer.max_size is None
        if slot_ids:
            # geometric growth: never more than twice what is needed, beyond the first allocation
            assert len(self.buffer) <= self.buffer.capacity
            assert self.buffer.capacity <= max(self.max_size, 12, 2 * len(self.buffer))


TestReservoirMachine = ReservoirMachine.TestCase
TestReservoirMachine.settings = SETTINGS
TestSlidingWindowMachine = SlidingWindowMachine.TestCase
TestSlidingWindowMachine.settings = SETTINGS
TestGreedyClassBalancingMachine = GreedyClassBalancingMachine.TestCase
TestGreedyClassBalancingMachine.settings = SETTINGS
TestInfiniteMachine = InfiniteMachine.TestCase
TestInfiniteMachine.settings = SETTINGS
