"""Random draws of a replay buffer: distinct slots to sample, and the slots an update writes.

Every function here is vectorised and costs ``O(k)`` for ``k`` samples, whatever the buffer's
size. Randomness always comes from a CPU ``torch.Generator`` the caller owns, so draws do not
depend on the storage device.
"""

from __future__ import annotations

import torch

__all__ = ["RAND_HIGH", "SAMPLE_SEED_OFFSET", "draw_distinct", "indices_to", "last_occurrences"]

RAND_HIGH = 2**62
"""Exclusive upper bound of the raw random integers drawn for update decisions.

A decision "uniform in ``[0, m)``" is taken as ``r % m`` for a raw ``r`` uniform in
``[0, 2**62)``; the modulo bias is below ``m / 2**62`` (under ``1e-12`` for any realistic stream
length), far below anything a test or a training run could detect.
"""

SAMPLE_SEED_OFFSET = 0x9E3779B97F4A7C15
"""Mixed into ``seed`` to seed the sampling generator, so both generators draw unrelated streams."""


def indices_to(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy CPU-drawn indices to ``device``; to a GPU through pinned memory, without waiting.

    Indices already on an accelerator (given by the caller, e.g. ``set_metadata`` with the
    ``idx`` that ``sample`` returned) are moved with a plain ``to``: only CPU tensors can be
    pinned, and ``torch.device("cuda")`` differs from the ``cuda:0`` a tensor reports.
    """
    if indices.device.type == "cpu" and device.type == "cuda":
        return indices.pin_memory().to(device, non_blocking=True)
    return indices.to(device)


_PERMUTATION_FACTOR = 64
""":func:`draw_distinct` falls back to a cut permutation (not to redrawing repeats) when
``n <= _PERMUTATION_FACTOR * k``."""
_DRAWS_FIRST = 1024
""":func:`draw_distinct` tries ``k`` draws with replacement first from this ``n`` on, even when
``n <= _PERMUTATION_FACTOR * k`` (if ``k * k < n``): below it a permutation costs about as much as
drawing and checking (~4 µs on a CPU)."""


def draw_distinct(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Draw ``min(k, n)`` distinct indices uniformly from ``[0, n)`` in ``O(k)`` expected time.

    ``k`` indices are first drawn with replacement, unless ``n <= 64 k`` and either collisions
    are likely (``k * k >= n``: probability ``>= 1 - e**-0.5``, about 40 %) or a permutation is
    cheap (``n < 1024``). When they are distinct they are the sample: conditioned on being
    distinct, ``k`` uniform draws are uniform over the ordered tuples of distinct values, so
    accepting them is exact. Otherwise, when ``n <= 64 k``, a permutation of ``[0, n)`` is cut
    (``O(n) = O(k)``; also uniform over those tuples, so the mixture of the two stays exact); when
    ``n > 64 k``, every later occurrence of a repeated value is redrawn until all are distinct:
    each draw is uniform and the rule only looks at equality and positions, so relabelling the
    values maps the procedure onto itself and every ordered tuple of distinct values is equally
    likely. With ``n > 64 k`` a round repeats under ``k / 128`` values on average, so one round
    almost always suffices. The distinctness check reads the (CPU) draws into a Python set.
    """
    k = min(k, n)
    permute = n <= _PERMUTATION_FACTOR * k
    if permute and (k * k >= n or n < _DRAWS_FIRST):
        return torch.randperm(n, generator=generator)[:k]
    idx = torch.randint(0, n, (k,), generator=generator)
    if k == 1 or len(set(idx.tolist())) == k:
        return idx
    if permute:
        return torch.randperm(n, generator=generator)[:k]
    while True:
        sorted_idx, order = torch.sort(idx, stable=True)
        repeated = sorted_idx[1:] == sorted_idx[:-1]
        if not bool(repeated.any()):
            return idx
        later = order[1:][repeated]
        idx[later] = torch.randint(0, n, (later.numel(),), generator=generator)


def last_occurrences(slots: torch.Tensor) -> torch.Tensor | None:
    """Ascending positions of the last occurrence of each value of 1-D ``slots``.

    Returns ``None`` when the values are all distinct (the common case), so callers skip the
    selection.
    """
    count = slots.numel()
    if count <= 1:
        return None
    if slots.device.type == "cpu" and len(set(slots.tolist())) == count:
        return None  # a set of the values: ~1 µs against ~9 for the sort and compare below
    sorted_slots, order = torch.sort(slots, stable=True)
    differs = sorted_slots[1:] != sorted_slots[:-1]
    if bool(differs.all()):
        return None
    # Within a run of equal values a stable sort keeps batch order: the run's end is the latest.
    is_last = torch.cat([differs, torch.ones(1, dtype=torch.bool, device=slots.device)])
    return torch.sort(order[is_last]).values
