"""Tests of the replay buffers: API, validation, state dicts, statistics.

The stateful (model-based) tests are in ``test_memory_stateful.py``.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import renate_events.memory as memory
from renate_events.memory import (
    DataBuffer,
    GreedyClassBalancingBuffer,
    InfiniteBuffer,
    ReservoirBuffer,
    SlidingWindowBuffer,
)
from renate_events.memory.draws import draw_distinct as _draw_distinct

BOUNDED = [ReservoirBuffer, SlidingWindowBuffer, GreedyClassBalancingBuffer]


def make(kind: Any, size: int = 8, seed: int = 0) -> DataBuffer:
    if kind is InfiniteBuffer:
        return InfiniteBuffer(seed=seed, initial_capacity=size)
    return kind(size, seed=seed)


ALL_KINDS = [*BOUNDED, InfiniteBuffer]


def batch(start: int, n: int, num_classes: int = 3) -> tuple[Any, torch.Tensor, dict]:
    ids = torch.arange(start, start + n)
    inputs = torch.stack([ids.float(), -ids.float()], dim=1)
    targets = ids % num_classes
    return inputs, targets, {"logits": ids.float().unsqueeze(1).repeat(1, 5)}


def stream(buffer: DataBuffer, sizes: list[int], start: int = 0) -> int:
    for n in sizes:
        buffer.update(*batch(start, n))
        start += n
    return start


def chi2_critical(df: int, alpha: float) -> float:
    """Upper ``alpha`` quantile of chi-square with ``df`` degrees of freedom (Wilson-Hilferty).

    Accurate to well under 1% for the ``df >= 10`` used here.
    """
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def assert_tree_equal(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_tree_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


# ------------------------------------------------------------------------------------ basics


def test_public_names() -> None:
    assert set(memory.__all__) >= {
        "DataBuffer",
        "ReservoirBuffer",
        "SlidingWindowBuffer",
        "GreedyClassBalancingBuffer",
        "InfiniteBuffer",
    }
    for name in memory.__all__:
        assert hasattr(memory, name)
    with pytest.raises(TypeError):
        DataBuffer()  # type: ignore[abstract]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_update_sample_layout(kind: type[DataBuffer]) -> None:
    buffer = make(kind, size=8)
    assert len(buffer) == 0 and buffer.num_seen == 0 and buffer.metadata_keys == ()
    stream(buffer, [5])
    assert len(buffer) == 5 and buffer.num_seen == 5
    assert buffer.metadata_keys == ("logits",)
    (inputs, targets), meta = buffer.sample(3)
    assert inputs.shape == (3, 2) and targets.shape == (3,)
    assert list(meta) == ["idx", "logits"]
    assert meta["idx"].dtype == torch.int64 and meta["idx"].device == buffer.device
    ids = inputs[:, 0].long()
    assert torch.equal(targets, ids % 3)
    assert torch.equal(meta["logits"][:, 0].long(), ids)
    assert len(set(meta["idx"].tolist())) == 3
    # fewer stored than asked: everything, once
    (inputs, _), meta = buffer.sample(50)
    assert sorted(meta["idx"].tolist()) == list(range(5))
    assert sorted(inputs[:, 0].long().tolist()) == list(range(5))


def test_reservoir_keeps_first_then_counts() -> None:
    buffer = ReservoirBuffer(10, seed=3)
    stream(buffer, [4, 6])
    assert buffer.state_dict()["inputs"][0][:, 0].long().tolist() == list(range(10))
    stream(buffer, [7] * 20, start=10)
    assert len(buffer) == 10 and buffer.num_seen == 150
    ids = buffer.state_dict()["inputs"][0][:, 0].long().tolist()
    assert len(set(ids)) == 10 and all(0 <= i < 150 for i in ids)


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    max_size=st.integers(1, 12),
    seed=st.integers(0, 2**32),
)
@settings(max_examples=40, deadline=None)
def test_reservoir_batching_does_not_matter(sizes: list[int], max_size: int, seed: int) -> None:
    """Deciding a batch at once equals deciding it sample by sample ("latest wins" on ties)."""
    total = sum(sizes)
    batched, single = ReservoirBuffer(max_size, seed=seed), ReservoirBuffer(max_size, seed=seed)
    stream(batched, sizes)
    stream(single, [1] * total)
    assert_tree_equal(batched.state_dict(), single.state_dict())


def test_sliding_window_large_batch_keeps_last() -> None:
    buffer = SlidingWindowBuffer(4)
    stream(buffer, [3, 10])
    ids = buffer.state_dict()["inputs"][0][:, 0].long().tolist()
    assert sorted(ids) == [9, 10, 11, 12]
    assert all(slot == i % 4 for slot, i in enumerate(ids))


def test_greedy_class_balancing_converges() -> None:
    buffer = GreedyClassBalancingBuffer(30, seed=1)
    # fill with a heavily imbalanced stream: 27 of class 0, 3 of class 1
    labels = torch.tensor([0] * 27 + [1] * 3)
    buffer.update(torch.randn(30, 2), labels)
    assert buffer.class_counts() == {0: 27, 1: 3}
    # a stream with classes 0..3 in turn evens the counts out
    for _ in range(40):
        buffer.update(torch.randn(8, 2), torch.arange(8) % 4)
    counts = buffer.class_counts()
    assert sum(counts.values()) == 30 and set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    stored = buffer.state_dict()["targets"].tolist()
    assert {c: stored.count(c) for c in counts} == counts


def test_greedy_rejects_when_its_class_is_largest() -> None:
    buffer = GreedyClassBalancingBuffer(4)
    buffer.update(torch.arange(4.0).unsqueeze(1), torch.tensor([0, 0, 1, 1]))
    before = buffer.state_dict()
    buffer.update(torch.tensor([[9.0]]), torch.tensor([0]))
    after = buffer.state_dict()
    assert torch.equal(before["inputs"][0], after["inputs"][0]) and after["num_seen"] == 5


def test_infinite_buffer_grows_geometrically() -> None:
    buffer = InfiniteBuffer(initial_capacity=4)
    capacities = []
    for step in range(40):
        buffer.update(*batch(3 * step, 3))
        capacities.append(buffer.capacity)
    assert len(buffer) == 120 and buffer.max_size is None
    assert sorted(set(capacities)) == [4, 8, 16, 32, 64, 128]
    ids = buffer.state_dict()["inputs"][0][:, 0].long().tolist()
    assert ids == list(range(120))
    big = InfiniteBuffer(initial_capacity=2)
    big.update(*batch(0, 5))
    assert big.capacity == 5 and len(big) == 5


def test_nested_inputs_tuple_and_dict() -> None:
    buffer = ReservoirBuffer(6, seed=2)
    for step in range(4):
        ids = torch.arange(3 * step, 3 * step + 3)
        inputs = {
            "image": ids.float().view(3, 1, 1).expand(3, 2, 2).contiguous(),
            "extra": (ids.clone(), [ids.double() * 2]),
        }
        buffer.update(inputs, ids % 2, {"feat": ids.float().unsqueeze(1)})
    (inputs, targets), meta = buffer.sample(4)
    assert set(inputs) == {"image", "extra"}
    assert isinstance(inputs["extra"], tuple) and isinstance(inputs["extra"][1], list)
    ids = inputs["extra"][0]
    assert torch.equal(inputs["image"][:, 0, 0].long(), ids)
    assert torch.equal(inputs["extra"][1][0], ids.double() * 2)
    assert torch.equal(targets, ids % 2) and torch.equal(meta["feat"][:, 0].long(), ids)
    # dict keys may come in another order
    ids = torch.tensor([100])
    buffer.update(
        {"extra": (ids, [ids.double()]), "image": torch.zeros(1, 2, 2)},
        ids % 2,
        {"feat": torch.zeros(1, 1)},
    )
    assert buffer.num_seen == 13


def test_metadata_set_get_and_duplicates() -> None:
    buffer = SlidingWindowBuffer(10)
    stream(buffer, [10])
    (_, _), meta = buffer.sample(4)
    idx = meta["idx"]
    gamma = 0.9
    ema = gamma * meta["logits"] + (1 - gamma) * torch.ones_like(meta["logits"])
    buffer.set_metadata("logits", idx, ema)
    assert torch.equal(buffer.get_metadata("logits", idx), ema)
    untouched = sorted(set(range(10)) - set(idx.tolist()))
    rows = buffer.get_metadata("logits", torch.tensor(untouched))
    assert torch.equal(rows[:, 0], torch.tensor(untouched, dtype=torch.float32))
    # a repeated slot: the last value wins
    buffer.set_metadata("logits", torch.tensor([2, 2, 2]), torch.arange(15.0).view(3, 5))
    assert torch.equal(
        buffer.get_metadata("logits", torch.tensor([2])), torch.arange(10.0, 15.0)[None]
    )


def test_inputs_are_copied_and_detached() -> None:
    buffer = ReservoirBuffer(4)
    x = torch.ones(2, 3, requires_grad=True)
    buffer.update(x * 2, torch.zeros(2, dtype=torch.long))
    source = torch.ones(2, 3)
    buffer.update(source, torch.zeros(2, dtype=torch.long))
    source.fill_(7)
    (inputs, _), _ = buffer.sample(4)
    assert not inputs.requires_grad
    assert set(inputs.flatten().tolist()) == {1.0, 2.0}


def test_update_in_inference_mode_then_outside() -> None:
    buffer = ReservoirBuffer(4)
    with torch.inference_mode():
        buffer.update(*batch(0, 2))
    buffer.update(*batch(2, 2))
    assert len(buffer) == 4


def test_to_device_keeps_contents() -> None:
    buffer = ReservoirBuffer(4)
    stream(buffer, [3])
    before = buffer.state_dict()
    assert buffer.to("cpu") is buffer
    assert buffer.device == torch.device("cpu")
    assert_tree_equal(before, buffer.state_dict())


def test_sampling_state_takes_back_draws_and_nothing_else() -> None:
    buffer = ReservoirBuffer(16, seed=3)
    stream(buffer, [20])
    state = buffer.sampling_state()
    first = buffer.sample(4)
    kept = buffer.state_dict()
    buffer.set_sampling_state(state)
    assert_tree_equal(buffer.sample(4), first)
    after = buffer.state_dict()
    assert torch.equal(after["generator_state"], kept["generator_state"])  # updates untouched
    assert_tree_equal(after["inputs"], kept["inputs"])
    assert not torch.equal(state, kept["sample_generator_state"])  # the draw did advance it
    with pytest.raises(ValueError, match="set_sampling_state"):
        buffer.set_sampling_state(torch.zeros(3, dtype=torch.uint8))


def test_samples_on_storage_device_is_true_for_the_stock_sample_only() -> None:
    @attrs.define(eq=False)
    class OwnSample(ReservoirBuffer):
        def sample(self, batch_size: int) -> Any:
            return super().sample(batch_size)

    assert ReservoirBuffer(4).samples_on_storage_device
    assert InfiniteBuffer().samples_on_storage_device
    assert not OwnSample(4).samples_on_storage_device


def test_infinite_buffer_truncate_takes_back_the_latest_samples() -> None:
    buffer = InfiniteBuffer(initial_capacity=4, seed=1)
    stream(buffer, [3])
    before = buffer.state_dict()
    stream(buffer, [5], start=3)
    buffer.truncate(3)
    assert_tree_equal(buffer.state_dict(), before)
    stream(buffer, [2], start=50)
    assert buffer.dataset()[4][1].item() == 51 % 3
    buffer.truncate(0)  # nothing left: the next batch may have another layout
    assert len(buffer) == 0 and buffer.capacity == 0
    buffer.update(torch.zeros(2, 7), torch.zeros(2))
    for bad, error in ((6, ValueError), (-1, ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="truncate"):
            buffer.truncate(bad)


# ------------------------------------------------------------------------------------ statistics


def test_reservoir_inclusion_is_uniform_over_the_stream() -> None:
    """Chi-square test: every stream position ends up in the reservoir equally often.

    ``runs`` reservoirs of ``max_size`` slots each see a stream of ``n`` samples; position ``i``
    is kept ``O_i`` times, expected ``E = runs * max_size / n``. Within one run exactly
    ``max_size`` positions are kept, so the counts follow a (sum of) multivariate hypergeometric,
    whose Pearson statistic is ``(n - max_size) / (n - 1)`` times a chi-square with ``n - 1``
    degrees of freedom: comparing it with the chi-square quantile is slightly conservative. At
    ``alpha = 1e-4`` a correct buffer fails once in 10 000 seeds; a biased one (e.g. favouring the
    end or the beginning of the stream by a few percent) exceeds it by far.
    """
    runs, max_size, n, batch_size = 100, 100, 2000, 250
    kept = torch.zeros(n, dtype=torch.float64)
    data = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    targets = torch.zeros(n, dtype=torch.long)
    for seed in range(runs):
        buffer = ReservoirBuffer(max_size, seed=seed)
        for start in range(0, n, batch_size):
            end = start + batch_size
            buffer.update(data[start:end], targets[start:end])
        ids = buffer.state_dict()["inputs"][0][:, 0].long()
        assert ids.unique().numel() == max_size
        kept[ids] += 1
    expected = runs * max_size / n
    chi2 = float(((kept - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(n - 1, 1e-4), chi2
    # and no drift between the beginning and the end of the stream (first vs second half)
    half = n // 2
    first, second = float(kept[:half].sum()), float(kept[half:].sum())
    total = first + second  # = runs * max_size; first ~ hypergeometric(total, half / n)
    sd = math.sqrt(total * 0.25 * (n - max_size) / (n - 1))
    z = statistics.NormalDist().inv_cdf(1 - 1e-4 / 2)
    assert abs(first - total / 2) < z * sd, (first, second)


def test_sample_is_uniform_over_slots() -> None:
    """Chi-square over slots of ``sample``: uniform, without replacement inside a draw."""
    length, k, draws = 50, 10, 2000
    buffer = SlidingWindowBuffer(length, seed=5)
    stream(buffer, [length])
    counts = torch.zeros(length, dtype=torch.float64)
    for _ in range(draws):
        (_, _), meta = buffer.sample(k)
        idx = meta["idx"]
        assert idx.unique().numel() == k
        counts[idx] += 1
    expected = draws * k / length
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # hypergeometric within a draw: the statistic is (length - k) / (length - 1) * chi2(length - 1)
    assert chi2 < chi2_critical(length - 1, 1e-4), chi2


@given(n=st.integers(1, 300), k=st.integers(1, 300), seed=st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_draw_distinct(n: int, k: int, seed: int) -> None:
    idx = _draw_distinct(n, k, torch.Generator().manual_seed(seed))
    assert idx.dtype == torch.int64 and idx.numel() == min(n, k)
    assert idx.unique().numel() == idx.numel()
    assert bool((idx >= 0).all()) and bool((idx < n).all())


@pytest.mark.parametrize(
    ("first", "factor"),
    [(1, 64), (10**9, 64), (1, 1)],
    ids=["draws-first", "permutation", "redraw"],
)
def test_draw_distinct_is_uniform_over_ordered_tuples(monkeypatch, first, factor):
    """Chi-square over all ordered tuples of 3 distinct values of 12: exact for draws accepted
    when distinct mixed with the permutation fallback, for the permutation alone, and for the
    redraw of repeats (the regime of n > 64 k, forced here on a small n)."""
    import renate_events.memory.draws as buffers

    monkeypatch.setattr(buffers, "_DRAWS_FIRST", first)
    monkeypatch.setattr(buffers, "_PERMUTATION_FACTOR", factor)
    n, k = 12, 3
    generator = torch.Generator().manual_seed(11)
    counts: dict[tuple[int, ...], int] = {}
    draws = 60_000
    for _ in range(draws):
        key = tuple(_draw_distinct(n, k, generator).tolist())
        counts[key] = counts.get(key, 0) + 1
    cells = math.perm(n, k)
    assert all(len(set(key)) == k and max(key) < n for key in counts)
    expected = draws / cells
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    chi2 += (cells - len(counts)) * expected  # tuples never drawn
    assert chi2 < chi2_critical(cells - 1, 1e-4), chi2
    # Each position alone is uniform over the n values (a sharper test of small biases).
    for position in range(k):
        per_value = [0] * n
        for key, count in counts.items():
            per_value[key[position]] += count
        chi2 = sum((c - draws / n) ** 2 / (draws / n) for c in per_value)
        assert chi2 < chi2_critical(n - 1, 1e-4), (position, per_value)


# ------------------------------------------------------------------------------------ state dicts


def checkpoint_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """Store a state dict the way the trainer's checkpoints do (safetensors + JSON skeleton)."""
    from safetensors.torch import load, save

    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = value.contiguous()
            return {"$tensor": name}
        if isinstance(value, dict):
            return {k: encode(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [encode(v) for v in value]
        assert value is None or isinstance(value, (bool, int, float, str)), type(value)
        return value

    skeleton = json.dumps(encode(state))
    loaded = load(save(tensors))

    def decode(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"$tensor"}:
                return loaded[value["$tensor"]]
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    return decode(json.loads(skeleton))


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("filled", [0, 5, 40])
def test_round_trip_is_bit_exact(kind: type[DataBuffer], filled: int) -> None:
    original = make(kind, size=16, seed=11)
    start = 0
    if filled:
        start = stream(original, [filled])
        original.sample(3)
    state = original.state_dict()
    assert state["length"] == len(original)
    for tensor in [*state["inputs"], state["targets"]] if filled else []:
        assert tensor.shape[0] == len(original)  # only the filled rows
    restored = make(kind, size=16, seed=999)
    restored.load_state_dict(checkpoint_round_trip(state))
    assert restored.seed == 11
    assert_tree_equal(original.state_dict(), restored.state_dict())
    for step in range(6):
        for buffer in (original, restored):
            buffer.update(*batch(start, 7))
        start += 7
        a, b = original.sample(5), restored.sample(5)
        assert_tree_equal(a, b, f"sample {step}")
        assert_tree_equal(original.state_dict(), restored.state_dict(), f"state {step}")


def test_state_dict_is_a_snapshot() -> None:
    buffer = SlidingWindowBuffer(4)
    stream(buffer, [4])
    state = buffer.state_dict()
    saved = state["inputs"][0].clone()
    stream(buffer, [4], start=4)
    assert torch.equal(state["inputs"][0], saved)


def test_no_pickle_in_sources() -> None:
    import importlib
    import inspect
    import pkgutil

    import renate_events.memory as memory

    names = [info.name for info in pkgutil.iter_modules(memory.__path__)]
    for module in [importlib.import_module(f"renate_events.memory.{name}") for name in names]:
        source = inspect.getsource(module)
        for word in ("pickle", "torch.save", "torch.load"):
            assert word not in source, (module.__name__, word)


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"max_size": 0}, ValueError, ["max_size", ">= 1", "0"]),
        ({"max_size": -5}, ValueError, ["max_size", "-5"]),
        ({"max_size": 2.0}, TypeError, ["max_size", "2.0"]),
        ({"max_size": True}, TypeError, ["max_size"]),
        ({"max_size": 3, "seed": -1}, ValueError, ["seed", "-1"]),
        ({"max_size": 3, "seed": 2**64}, ValueError, ["seed"]),
        ({"max_size": 3, "seed": "1"}, TypeError, ["seed"]),
        ({"max_size": 3, "device": 3}, TypeError, ["device"]),
        ({"max_size": 3, "device": "no-such-device"}, ValueError, ["device", "no-such-device"]),
    ],
)
@pytest.mark.parametrize("kind", BOUNDED)
def test_invalid_constructor_arguments(
    kind: type[DataBuffer], kwargs: dict, error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as info:
        kind(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_invalid_infinite_arguments_and_frozen_fields() -> None:
    with pytest.raises(ValueError, match="initial_capacity"):
        InfiniteBuffer(initial_capacity=0)
    buffer = ReservoirBuffer(3)
    with pytest.raises(attrs.exceptions.FrozenAttributeError):
        buffer.max_size = 5
    with pytest.raises(attrs.exceptions.FrozenAttributeError):
        buffer.seed = 5


def nested(x0: torch.Tensor, x1: torch.Tensor) -> dict:
    return {"a": x0, "b": (x1, x1)}


@pytest.mark.parametrize(
    ("second", "words"),
    [
        # per-sample shape of a nested leaf
        (
            lambda: (nested(torch.zeros(2, 3), torch.zeros(2, 5)), None, None),
            ["inputs['b'][0]", "(4,)", "(5,)"],
        ),
        # dtype of a leaf
        (
            lambda: (nested(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 4)), None, None),
            ["inputs['a']", "torch.float32", "torch.float64"],
        ),
        # structure: another key
        (lambda: ({"a": torch.zeros(2, 3), "c": torch.zeros(2, 4)}, None, None), ["inputs", "'b'"]),
        # structure: tuple of another length
        (
            lambda: ({"a": torch.zeros(2, 3), "b": (torch.zeros(2, 4),)}, None, None),
            ["inputs['b']", "length 2"],
        ),
        # metadata shape
        (
            lambda: (None, None, {"logits": torch.zeros(2, 7)}),
            ["metadata['logits']", "(5,)", "(7,)"],
        ),
        # metadata dtype
        (
            lambda: (None, None, {"logits": torch.zeros(2, 5, dtype=torch.float16)}),
            ["metadata['logits']", "torch.float16"],
        ),
        # metadata keys
        (lambda: (None, None, {}), ["metadata['logits']", "missing"]),
        (
            lambda: (None, None, {"logits": torch.zeros(2, 5), "other": torch.zeros(2)}),
            ["metadata['other']"],
        ),
        # targets
        (lambda: (None, torch.zeros(2, dtype=torch.float64), None), ["targets", "float64"]),
        # batch sizes disagree
        (
            lambda: (nested(torch.zeros(3, 3), torch.zeros(2, 4)), None, None),
            ["inputs['a']", "batch size 2", "3"],
        ),
    ],
)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_mismatched_batches_name_the_key(kind: type[DataBuffer], second: Any, words: list) -> None:
    buffer = make(kind, size=4)
    good = (
        nested(torch.zeros(2, 3), torch.zeros(2, 4)),
        torch.zeros(2, dtype=torch.long),
        {"logits": torch.zeros(2, 5)},
    )
    buffer.update(*good)
    before = buffer.state_dict()
    inputs, targets, meta = second()
    with pytest.raises((ValueError, TypeError)) as info:
        buffer.update(
            good[0] if inputs is None else inputs,
            good[1] if targets is None else targets,
            good[2] if meta is None else meta,
        )
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert_tree_equal(before, buffer.state_dict())  # nothing stored


@pytest.mark.parametrize(
    ("args", "error", "word"),
    [
        ((torch.zeros(2, 3), torch.tensor(1)), ValueError, "targets"),
        ((torch.zeros(2, 3), [0, 1]), TypeError, "targets"),
        (([], torch.zeros(2)), ValueError, "inputs"),
        (("text", torch.zeros(2)), TypeError, "inputs"),
        (({1: torch.zeros(2, 3)}, torch.zeros(2)), TypeError, "inputs"),
        ((torch.zeros(2, 3), torch.zeros(2), {"idx": torch.zeros(2)}), ValueError, "idx"),
        ((torch.zeros(2, 3), torch.zeros(2), {"m": [1, 2]}), TypeError, "metadata['m']"),
        ((torch.zeros(2, 3), torch.zeros(2), [torch.zeros(2)]), TypeError, "metadata"),
        ((torch.tensor(1.0), torch.zeros(2)), ValueError, "inputs"),
    ],
)
def test_bad_first_batches(args: tuple, error: type[Exception], word: str) -> None:
    buffer = ReservoirBuffer(4)
    with pytest.raises(error, match=None) as info:
        buffer.update(*args)
    assert word in str(info.value)
    assert len(buffer) == 0 and buffer.num_seen == 0 and buffer.state_dict()["inputs"] == []


@pytest.mark.parametrize(
    "targets",
    [torch.zeros(2), torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.bool)],
)
def test_greedy_needs_integer_labels(targets: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="targets"):
        GreedyClassBalancingBuffer(4).update(torch.zeros(2, 3), targets)


def test_sample_errors() -> None:
    buffer = ReservoirBuffer(4)
    with pytest.raises(RuntimeError, match="empty"):
        buffer.sample(2)
    stream(buffer, [2])
    with pytest.raises(ValueError, match="batch_size"):
        buffer.sample(0)
    with pytest.raises(TypeError, match="batch_size"):
        buffer.sample(2.0)  # type: ignore[arg-type]


def test_metadata_errors() -> None:
    buffer = ReservoirBuffer(4)
    stream(buffer, [3])
    with pytest.raises(ValueError, match="'nope'"):
        buffer.get_metadata("nope", torch.tensor([0]))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        buffer.set_metadata("logits", torch.tensor([3]), torch.zeros(1, 5))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        buffer.get_metadata("logits", torch.tensor([-1]))
    with pytest.raises(ValueError, match="values for metadata"):
        buffer.set_metadata("logits", torch.tensor([0, 1]), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="float64"):
        buffer.set_metadata("logits", torch.tensor([0]), torch.zeros(1, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="idx"):
        buffer.set_metadata("logits", torch.tensor([0.0]), torch.zeros(1, 5))
    with pytest.raises(TypeError, match="idx"):
        buffer.get_metadata("logits", [0])  # type: ignore[arg-type]
    before = buffer.state_dict()
    assert_tree_equal(before, buffer.state_dict())


def _corrupt(state: dict, path: tuple, value: Any) -> dict:
    state = {**state}
    target = state
    for key in path[:-1]:
        target[key] = dict(target[key]) if isinstance(target[key], dict) else list(target[key])
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return state


_DELETE = object()

BAD_STATES = [
    (("length",), _DELETE, "length"),
    (("surprise",), 1, "surprise"),
    (("format_version",), 2, "format_version"),
    (("buffer_type",), "SlidingWindowBuffer", "buffer_type"),
    (("config", "max_size"), 7, "max_size"),
    (("config", "seed"), -3, "seed"),
    (("num_seen",), 2, "length"),
    (("length",), 3, "length"),
    (("generator_state",), torch.zeros(10, dtype=torch.uint8), "generator_state"),
    (("sample_generator_state",), torch.zeros(5056, dtype=torch.int64), "sample_generator_state"),
    (("inputs",), [], "inputs"),
    (("inputs", 0), torch.zeros(3, 2), "inputs"),
    (("targets",), torch.zeros(2), "targets"),
    (("metadata", "logits"), torch.zeros(4), "metadata"),
    (("metadata", "idx"), torch.zeros(5), "idx"),
    (("inputs_structure",), {"kind": "set", "items": []}, "inputs_structure"),
    (("inputs_structure",), None, "inputs_structure"),
    (("extra",), {"x": 1}, "extra"),
]


@pytest.mark.all_or_nothing
@pytest.mark.parametrize(("path", "value", "word"), BAD_STATES)
def test_bad_state_leaves_buffer_untouched(path: tuple, value: Any, word: str) -> None:
    source = ReservoirBuffer(8, seed=1)
    stream(source, [5])
    state = _corrupt(source.state_dict(), path, value)
    target = ReservoirBuffer(8, seed=2)
    stream(target, [6], start=100)
    target.sample(2)
    before = target.state_dict()
    with pytest.raises(ValueError) as info:
        target.load_state_dict(state)
    assert word in str(info.value), str(info.value)
    assert_tree_equal(before, target.state_dict())
    # the buffer still behaves exactly as before
    twin = ReservoirBuffer(8, seed=2)
    twin.load_state_dict(before)
    assert_tree_equal(twin.sample(4), target.sample(4))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("class_order", [0, 0]),
        ("class_counts", [5, 1]),
        ("class_slots", torch.tensor([0, 0, 1, 2, 3, 4, 5, 6])),
        ("class_slots", torch.arange(8)),
    ],
)
def test_bad_greedy_state(key: str, value: Any) -> None:
    source = GreedyClassBalancingBuffer(8, seed=1)
    source.update(torch.zeros(8, 1), torch.tensor([0, 1, 0, 1, 0, 1, 0, 0]))
    state = _corrupt(source.state_dict(), ("extra", key), value)
    target = GreedyClassBalancingBuffer(8)
    with pytest.raises(ValueError, match=key):
        target.load_state_dict(state)
    assert len(target) == 0 and target.class_counts() == {}


def test_load_state_type_errors() -> None:
    with pytest.raises(TypeError, match="state"):
        ReservoirBuffer(3).load_state_dict([1, 2])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ devices


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_cuda_storage_draws_like_cpu(kind: Any) -> None:
    """The generators live on the CPU: a CUDA buffer keeps and samples what a CPU one does."""
    cpu = make(kind, size=16, seed=4)
    if kind is InfiniteBuffer:
        cuda: DataBuffer = InfiniteBuffer(seed=4, initial_capacity=16, device="cuda")
    else:
        cuda = kind(16, seed=4, device="cuda")
    start = 0
    for _ in range(8):
        inputs, targets, meta = batch(start, 9)
        cpu.update(inputs, targets, meta)
        cuda.update(inputs.cuda(), targets.cuda(), {k: v.cuda() for k, v in meta.items()})
        start += 9
        (ci, ct), cm = cpu.sample(6)
        (gi, gt), gm = cuda.sample(6)
        assert gm["idx"].device.type == "cuda" and gi.device.type == "cuda"
        assert torch.equal(ci, gi.cpu()) and torch.equal(ct, gt.cpu())
        assert torch.equal(cm["idx"], gm["idx"].cpu())
        cuda.set_metadata("logits", gm["idx"], gm["logits"] * 0.5)
        cpu.set_metadata("logits", cm["idx"], cm["logits"] * 0.5)
    state = cuda.state_dict()
    back = make(kind, size=16, seed=0)
    back.load_state_dict(state)
    assert_tree_equal(cpu.state_dict(), back.state_dict())
    assert cuda.to("cpu").device == torch.device("cpu")
    assert_tree_equal(cpu.state_dict(), cuda.state_dict())
