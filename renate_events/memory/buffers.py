"""Replay memory buffers: preallocated tensor storage with vectorised, O(batch) updates.

Every buffer stores whole batches in tensors that are allocated once, when the first batch arrives
(its structure, per-sample shapes and dtypes fix those of the storage). What differs between the
buffers is only *which slot* each incoming sample goes to, if any:

* :class:`ReservoirBuffer` keeps a uniform random subset of everything seen so far,
* :class:`SlidingWindowBuffer` keeps the most recent samples,
* :class:`GreedyClassBalancingBuffer` keeps the class counts as even as it can (GDumb),
* :class:`InfiniteBuffer` keeps everything.

All of them share the sampling, metadata and state-dict machinery of :class:`DataBuffer`.

Randomness comes from two CPU ``torch.Generator`` objects owned by the buffer, one for the update
decisions and one for :meth:`DataBuffer.sample`, so that (a) results do not depend on the storage
device and (b) how often a trainer samples from the memory never changes *what* the memory keeps.
Both generator states are part of the state dict.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Mapping
from typing import Any, cast

import attrs
import torch

from renate_events.memory import _structure
from trainer import validators

__all__ = [
    "BatchMemory",
    "DataBuffer",
    "GreedyClassBalancingBuffer",
    "InfiniteBuffer",
    "ReservoirBuffer",
    "SlidingWindowBuffer",
]

BatchMemory = tuple[tuple[Any, torch.Tensor], Mapping[str, torch.Tensor]]
"""A memory batch, as :meth:`DataBuffer.sample` returns it and components receive it:
``((inputs, targets), metadata)``. ``metadata`` holds ``"idx"`` (the slots) and every stored key;
the learners store ``"logits"`` and, with ``feature_modules``, ``"intermediate_representation_{i}"``
(their memory batches also offer the logits under Renate's key ``"outputs"``)."""

STATE_FORMAT_VERSION = 1
"""Version of the layout written by :meth:`DataBuffer.state_dict`."""

_RAND_HIGH = 2**62
"""Exclusive upper bound of the raw random integers drawn for update decisions.

A decision "uniform in ``[0, m)``" is taken as ``r % m`` for a raw ``r`` uniform in
``[0, 2**62)``; the modulo bias is below ``m / 2**62`` (under ``1e-12`` for any realistic stream
length), far below anything a test or a training run could detect.
"""

_SAMPLE_SEED_OFFSET = 0x9E3779B97F4A7C15
"""Mixed into ``seed`` to seed the sampling generator, so both generators draw unrelated streams."""

_STATE_KEYS = (
    "format_version",
    "buffer_type",
    "config",
    "num_seen",
    "length",
    "generator_state",
    "sample_generator_state",
    "inputs_structure",
    "inputs",
    "targets",
    "metadata",
    "extra",
)


# --------------------------------------------------------------------------------------------
# Validators and small helpers
# --------------------------------------------------------------------------------------------


def _indices_to(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy CPU-drawn indices to ``device``; to a GPU through pinned memory, without waiting."""
    if indices.device == device:
        return indices
    if device.type == "cuda":
        return indices.pin_memory().to(device, non_blocking=True)
    return indices.to(device)


def _as_device(value: Any) -> torch.device:
    """Resolve a ``device`` argument (a str or a ``torch.device``) to a ``torch.device``."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError as exc:
            raise ValueError(
                f"device must name a torch device such as 'cpu' or 'cuda:0', got {value!r}"
            ) from exc
    raise TypeError(
        f"device must be a str or torch.device, got {value!r} of type {type(value).__name__}"
    )


def _check_device(instance: Any, attribute: attrs.Attribute, value: torch.device) -> None:
    try:
        torch.empty(0, device=value)
    except (RuntimeError, AssertionError) as exc:
        raise ValueError(
            f"{attribute.name} must be a device this process can allocate on, got {str(value)!r} "
            f"({exc})"
        ) from exc


_PERMUTATION_FACTOR = 64
""":func:`_draw_distinct` falls back to a cut permutation (not to redrawing repeats) when
``n <= _PERMUTATION_FACTOR * k``."""
_DRAWS_FIRST = 1024
""":func:`_draw_distinct` tries ``k`` draws with replacement first from this ``n`` on, even when
``n <= _PERMUTATION_FACTOR * k`` (if ``k * k < n``): below it a permutation costs about as much as
drawing and checking (~4 µs on a CPU)."""


def _draw_distinct(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
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


def _last_occurrences(slots: torch.Tensor) -> torch.Tensor | None:
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


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_batch_tensor(
    name: str, value: Any, batch_size: int, stored: torch.Tensor | None
) -> torch.Tensor:
    """Check one tensor of a batch against the storage it goes into (``None`` before allocation)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(value).__name__}")
    if value.layout is not torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {value.layout}")
    if value.dim() == 0:
        raise ValueError(f"{name}: expected a batch dimension, got a 0-d tensor")
    if value.shape[0] != batch_size:
        raise ValueError(
            f"{name}: expected batch size {batch_size} (that of targets), got {value.shape[0]} "
            f"(shape {_shape(value)})"
        )
    if stored is not None and (value.shape[1:] != stored.shape[1:] or value.dtype != stored.dtype):
        raise ValueError(
            f"{name}: expected per-sample shape {_shape(stored)[1:]} and dtype {stored.dtype} "
            f"(fixed by the first batch), got per-sample shape {_shape(value)[1:]} and dtype "
            f"{value.dtype}"
        )
    return value


def _check_generator_state(value: Any, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        got = (
            f"a {value.dtype} tensor of shape {_shape(value)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise ValueError(
            f"{where}: expected a 1-D uint8 tensor from torch.Generator.get_state(), got {got}"
        )
    value = value.detach().cpu().contiguous()
    try:
        torch.Generator().set_state(value)
    except RuntimeError as exc:
        raise ValueError(f"{where}: not a valid CPU generator state ({exc})") from exc
    return value


def _check_state_tensor(value: Any, where: str, length: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}: expected a tensor, got {type(value).__name__}")
    if value.layout is not torch.strided or value.dim() == 0 or value.shape[0] != length:
        raise ValueError(
            f"{where}: expected a dense tensor with {length} rows (state['length']), got shape "
            f"{_shape(value)} and layout {value.layout}"
        )
    return value


@attrs.define(eq=False)
class _ParsedState:
    """A fully validated state dict, ready to be committed without further checks."""

    seed: int
    num_seen: int
    length: int
    generator_state: torch.Tensor
    sample_generator_state: torch.Tensor
    spec: dict[str, Any] | None
    inputs: list[torch.Tensor]
    targets: torch.Tensor | None
    metadata: dict[str, torch.Tensor]
    extra: Any


# --------------------------------------------------------------------------------------------
# Base class
# --------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class DataBuffer(abc.ABC):
    """Abstract replay memory over preallocated tensor storage.

    A buffer receives whole batches through :meth:`update` and hands out uniform random batches
    through :meth:`sample`, in the ``((inputs, targets), metadata)`` layout of Renate's
    ``batch_memory``. ``inputs`` may be a tensor or tuples/lists/dicts (string keys) nesting
    tensors; ``targets`` is a tensor; ``metadata`` maps names to tensors (``"logits"``,
    ``"intermediate_representation_0"``, ...). The first batch fixes the structure, per-sample
    shapes and dtypes; later batches must match them. The slots ``0 .. len(buffer) - 1`` are always
    the filled ones.

    Subclasses decide which slot each incoming sample goes to (:meth:`_plan`). Every update and
    every sample costs ``O(batch)`` work, whatever the buffer's size.

    Args:
        seed: Seeds the buffer's random generators (CPU ``torch.Generator``), an int in
            ``[0, 2**64)``.
        device: Where the storage lives (``"cpu"``, ``"cuda:0"``, a ``torch.device``). Incoming
            batches may live elsewhere; they are copied.

    Example:
        >>> import torch
        >>> buffer = ReservoirBuffer(max_size=4, seed=1)
        >>> buffer.update(torch.randn(3, 2), torch.tensor([0, 1, 2]),
        ...               metadata={"logits": torch.zeros(3, 5)})
        >>> (inputs, targets), metadata = buffer.sample(2)
        >>> inputs.shape, sorted(metadata)
        (torch.Size([2, 2]), ['idx', 'logits'])
    """

    seed: int = attrs.field(
        default=0,
        kw_only=True,
        validator=validators.int_at_least(0, 2**64),
        on_setattr=attrs.setters.frozen,
    )
    device: torch.device = attrs.field(
        default=torch.device("cpu"),
        kw_only=True,
        converter=_as_device,
        validator=_check_device,
        on_setattr=attrs.setters.frozen,
    )

    _num_seen: int = attrs.field(init=False, default=0, repr=False)
    _length: int = attrs.field(init=False, default=0, repr=False)
    _capacity: int = attrs.field(init=False, default=0, repr=False)
    _spec: dict[str, Any] | None = attrs.field(init=False, default=None, repr=False)
    _input_names: list[str] = attrs.field(init=False, factory=list, repr=False)
    _inputs: list[torch.Tensor] = attrs.field(init=False, factory=list, repr=False)
    _targets: torch.Tensor | None = attrs.field(init=False, default=None, repr=False)
    _metadata: dict[str, torch.Tensor] = attrs.field(init=False, factory=dict, repr=False)
    _generator: torch.Generator = attrs.field(init=False, factory=torch.Generator, repr=False)
    _sample_generator: torch.Generator = attrs.field(
        init=False, factory=torch.Generator, repr=False
    )

    def __attrs_post_init__(self) -> None:
        self._generator.manual_seed(self.seed)
        self._sample_generator.manual_seed((self.seed + _SAMPLE_SEED_OFFSET) % 2**64)

    # ---------------------------------------------------------------- subclass hooks

    @abc.abstractmethod
    def _bound(self) -> int | None:
        """The most samples the buffer keeps, or ``None`` for no bound."""

    @abc.abstractmethod
    def _plan(self, batch_size: int, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide where the samples of a batch go and update the subclass's own bookkeeping.

        Called after the batch was validated, with ``len(self)`` and ``num_seen`` still those
        before the batch.

        Returns:
            ``(slots, positions)``: CPU int64 tensors of equal length; sample ``positions[i]`` of
            the batch is written to slot ``slots[i]``. Slots are distinct and positions strictly
            increasing.
        """

    def _initial_capacity(self, batch_size: int) -> int:
        """Rows to allocate at the first update (the bound; unbounded buffers override this)."""
        bound = self._bound()
        if bound is None:
            raise NotImplementedError(f"{type(self).__name__} must override _initial_capacity")
        return bound

    def _capacity_for_length(self, length: int) -> int:
        """Rows to allocate when restoring a state with ``length`` filled rows."""
        return self._initial_capacity(length)

    def _ensure_capacity(self, length: int) -> None:
        """Make room for ``length`` rows (only unbounded buffers grow)."""
        return None

    def _check_first_targets(self, targets: torch.Tensor, where: str) -> None:
        """Extra checks on the targets of the first batch (or of a restored state)."""
        return None

    def _config(self) -> dict[str, Any]:
        """Constructor arguments that a restored state must agree with."""
        return {}

    def _extra_state(self) -> Any:
        return None

    def _parse_extra_state(self, extra: Any, targets: torch.Tensor | None, length: int) -> Any:
        if extra is not None:
            raise ValueError(f"state['extra']: {type(self).__name__} stores none, got {extra!r}")
        return None

    def _load_extra_state(self, parsed: Any) -> None:
        """Commit what :meth:`_parse_extra_state` returned."""
        return None

    # ---------------------------------------------------------------- public API

    @property
    def max_size(self) -> int | None:
        """The most samples the buffer keeps (``None`` for :class:`InfiniteBuffer`)."""
        return self._bound()

    @property
    def num_seen(self) -> int:
        """How many samples were offered to :meth:`update` so far (kept or not)."""
        return self._num_seen

    @property
    def capacity(self) -> int:
        """How many rows the storage currently has allocated (0 before the first update)."""
        return self._capacity

    @property
    def metadata_keys(self) -> tuple[str, ...]:
        """The metadata names stored for every sample, in the order of the first batch."""
        return tuple(self._metadata)

    def __len__(self) -> int:
        return self._length

    def update(
        self,
        inputs: Any,
        targets: torch.Tensor,
        metadata: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Offer a batch of samples to the buffer.

        Args:
            inputs: A tensor, or tuples/lists/dicts (string keys) nesting tensors, each with the
                batch as first dimension.
            targets: A tensor with the batch as first dimension.
            metadata: Optional per-sample tensors by name (``"idx"`` is reserved). Every batch
                must carry the keys of the first one.

        Raises:
            ValueError: When the structure, a per-sample shape or a dtype differs from the first
                batch's, or batch sizes disagree; the message names the key (``inputs[1]``,
                ``metadata['logits']``) with the expected and the given shape/dtype. Nothing is
                stored then.
            TypeError: When something is not a tensor (or a supported container of tensors).
        """
        spec, names, leaves, targets, meta = self._validate_batch(inputs, targets, metadata)
        batch_size = targets.shape[0]
        if self._spec is None:
            self._check_first_targets(targets, "targets")
            self._allocate(
                cast(dict, spec),
                names,
                [(_shape(t)[1:], t.dtype) for t in leaves],
                (_shape(targets)[1:], targets.dtype),
                {k: (_shape(v)[1:], v.dtype) for k, v in meta.items()},
                self._initial_capacity(batch_size),
            )
        if batch_size == 0:
            return
        slots, positions = self._plan(batch_size, targets)
        total = self._num_seen + batch_size
        bound = self._bound()
        new_length = total if bound is None else min(bound, total)
        self._ensure_capacity(new_length)
        if slots.numel() > 0:
            self._write(slots, positions, batch_size, [*leaves, targets, *meta.values()])
        self._num_seen = total
        self._length = new_length

    def check_batch(
        self,
        inputs: Any,
        targets: torch.Tensor,
        metadata: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Raise the error :meth:`update` would raise for this batch, without storing anything.

        Lets a caller reject a batch before it trains on it (the learners do so on the first step
        of every update).
        """
        self._validate_batch(inputs, targets, metadata)

    def sample(self, batch_size: int) -> BatchMemory:
        """Draw a uniform random batch from the buffer, without replacement.

        Draws ``min(batch_size, len(self))`` distinct slots in ``O(batch_size)`` expected time
        with the buffer's sampling generator: a cut permutation when the buffer is small (at most
        ``64 * batch_size`` samples, and under 1024 or at most ``batch_size**2``), else uniform
        draws kept when distinct, with a cut permutation or the repeats redrawn when not (see
        :func:`_draw_distinct`; never an ``O(max_size)`` permutation).

        Args:
            batch_size: How many samples to draw, an int >= 1.

        Returns:
            ``((inputs, targets), metadata)`` where ``inputs`` has the structure of the stored
            inputs and ``metadata`` holds ``"idx"`` (the int64 slot indices, on the storage
            device; pass them to :meth:`set_metadata`) and every stored metadata key.

        Raises:
            RuntimeError: When the buffer is empty.
        """
        validators.check_int(f"{type(self).__name__}.sample: batch_size", batch_size, 1)
        if self._length == 0:
            raise RuntimeError(
                f"cannot sample from an empty {type(self).__name__}: call update() first"
            )
        spec, stored_targets = cast(dict, self._spec), cast(torch.Tensor, self._targets)
        idx = _indices_to(
            _draw_distinct(self._length, batch_size, self._sample_generator), self.device
        )
        inputs = _structure.unflatten(spec, [s.index_select(0, idx) for s in self._inputs])
        targets = stored_targets.index_select(0, idx)
        metadata = {"idx": idx}
        for key, stored in self._metadata.items():
            metadata[key] = stored.index_select(0, idx)
        return (inputs, targets), metadata

    @property
    def samples_on_storage_device(self) -> bool:
        """Whether :meth:`sample` returns its tensors on :attr:`device` (its batch needs no copy
        there).

        True for :class:`DataBuffer`'s own ``sample``; a subclass that overrides ``sample`` gets
        False unless it overrides this property too.
        """
        return type(self).sample is DataBuffer.sample

    def sampling_state(self) -> torch.Tensor:
        """A copy of the sampling generator's state (a uint8 tensor), for
        :meth:`set_sampling_state`.

        Lets a caller take back draws: the learners put it back when the first step of an update
        fails. A subclass whose ``sample`` draws from other generators overrides both methods.
        """
        return self._sample_generator.get_state()

    def set_sampling_state(self, state: torch.Tensor) -> None:
        """Put the sampling generator back to a state returned by :meth:`sampling_state`.

        Raises:
            ValueError: ``state`` is not a state of a CPU ``torch.Generator``.
        """
        self._sample_generator.set_state(_check_generator_state(state, "set_sampling_state"))

    def get_metadata(self, key: str, idx: torch.Tensor) -> torch.Tensor:
        """Return a copy of the metadata ``key`` of the slots ``idx``.

        Args:
            key: A stored metadata name (see :attr:`metadata_keys`).
            idx: A 1-D integer tensor of slots in ``[0, len(self))``, e.g. ``metadata["idx"]``
                from :meth:`sample`.
        """
        stored = self._stored_metadata(key)
        return stored.index_select(0, self._check_idx(idx))

    def set_metadata(
        self, key: str, idx: torch.Tensor, values: torch.Tensor, *, distinct: bool = False
    ) -> None:
        """Overwrite the metadata ``key`` of the slots ``idx`` in place.

        Used for instance to keep an exponential moving average of stored logits::

            (_, _), meta = buffer.sample(32)
            new = gamma * meta["logits"] + (1 - gamma) * model_logits
            buffer.set_metadata("logits", meta["idx"], new)

        Where ``idx`` repeats a slot, the last value for it wins.

        Args:
            key: A stored metadata name.
            idx: A 1-D integer tensor of slots in ``[0, len(self))``.
            values: A tensor of shape ``(len(idx), *per_sample_shape)`` with the stored dtype.

            distinct: Promise that ``idx`` holds distinct in-range slots (as ``sample`` returns
                them); skips the validation, which reads values back from the device.

        Raises:
            ValueError: For an unknown key, out-of-range slots, or values of the wrong shape or
                dtype. Nothing is written then.
        """
        stored = self._stored_metadata(key)
        if distinct:  # slots from sample(): in range and unique; skip the checks that sync
            stored.index_copy_(0, idx, values.detach().to(stored.device, stored.dtype))
            return
        idx = self._check_idx(idx)
        name = f"values for metadata[{key!r}]"
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(values).__name__}")
        expected = (idx.numel(), *_shape(stored)[1:])
        if _shape(values) != expected or values.dtype != stored.dtype:
            raise ValueError(
                f"{name}: expected shape {expected} and dtype {stored.dtype}, got shape "
                f"{_shape(values)} and dtype {values.dtype}"
            )
        values = values.detach().to(stored.device)
        keep = _last_occurrences(idx)
        if keep is not None:
            idx, values = idx.index_select(0, keep), values.index_select(0, keep)
        stored.index_copy_(0, idx, values)

    def dataset(self) -> BufferDataset:
        """A map-style ``Dataset`` view of the filled slots: item ``i`` is ``(inputs, target)``.

        The view reads the live storage, so it follows later updates and
        :meth:`load_state_dict`. A ``DataLoader`` over it fetches each batch with one indexing
        operation per stored tensor (``__getitems__``).
        """
        return BufferDataset(self)

    def to(self, device: str | torch.device) -> DataBuffer:
        """Move the storage to ``device`` (in place; ``O(capacity)`` copy) and return the buffer.

        The random generators stay on the CPU, so draws do not change.
        """
        device = _as_device(device)
        _check_device(self, attrs.fields(DataBuffer).device, device)
        self._inputs = [t.to(device) for t in self._inputs]
        if self._targets is not None:
            self._targets = self._targets.to(device)
        self._metadata = {k: v.to(device) for k, v in self._metadata.items()}
        object.__setattr__(self, "device", device)
        return self

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the buffer exactly, as tensors and JSON-able values.

        Only the filled rows of the storage are included (as copies). The generator states are
        included too, so a restored buffer draws exactly what this one would.

        Returns:
            A dict with the keys ``format_version``, ``buffer_type``, ``config`` (``seed`` and the
            size arguments), ``num_seen``, ``length``, ``generator_state``,
            ``sample_generator_state`` (uint8 tensors), ``inputs_structure`` (a JSON-able spec or
            ``None`` before the first update), ``inputs`` (a list of tensors, one per leaf),
            ``targets``, ``metadata`` (a dict of tensors) and ``extra`` (buffer-specific).
        """
        n = self._length
        return {
            "format_version": STATE_FORMAT_VERSION,
            "buffer_type": type(self).__name__,
            "config": {"seed": self.seed, **self._config()},
            "num_seen": self._num_seen,
            "length": n,
            "generator_state": self._generator.get_state(),
            "sample_generator_state": self._sample_generator.get_state(),
            "inputs_structure": copy.deepcopy(self._spec),
            "inputs": [t[:n].clone() for t in self._inputs],
            "targets": None if self._targets is None else self._targets[:n].clone(),
            "metadata": {k: v[:n].clone() for k, v in self._metadata.items()},
            "extra": self._extra_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, into fresh storage on this buffer's device.

        The whole state is validated before anything changes: on error the buffer is untouched.

        Raises:
            ValueError: When ``state`` is malformed, was written by another kind of buffer or one
                with another ``max_size``; the message names the offending key.
            TypeError: When ``state`` is not a mapping.
        """
        parsed = self._parse_state(state)
        object.__setattr__(self, "seed", parsed.seed)
        self._generator.set_state(parsed.generator_state)
        self._sample_generator.set_state(parsed.sample_generator_state)
        if parsed.spec is None:
            self._release_storage()
        else:
            parsed_targets = cast(torch.Tensor, parsed.targets)
            self._allocate(
                parsed.spec,
                _structure.leaf_names(parsed.spec, "inputs"),
                [(_shape(t)[1:], t.dtype) for t in parsed.inputs],
                (_shape(parsed_targets)[1:], parsed_targets.dtype),
                {k: (_shape(v)[1:], v.dtype) for k, v in parsed.metadata.items()},
                self._capacity_for_length(parsed.length),
            )
            n = parsed.length
            for stored, saved in zip(
                self._storage(), [*parsed.inputs, parsed_targets, *parsed.metadata.values()]
            ):
                stored[:n].copy_(saved)
        self._num_seen = parsed.num_seen
        self._length = parsed.length
        self._load_extra_state(parsed.extra)

    # ---------------------------------------------------------------- internals

    def _stored_metadata(self, key: str) -> torch.Tensor:
        if key not in self._metadata:
            raise ValueError(
                f"metadata[{key!r}] is not stored by this buffer; stored keys: "
                f"{list(self._metadata)}"
            )
        return self._metadata[key]

    def _check_idx(self, idx: Any) -> torch.Tensor:
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"idx must be a 1-D integer tensor, got {type(idx).__name__}")
        if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype.is_complex:
            raise TypeError(
                f"idx must be a 1-D integer tensor, got dtype {idx.dtype} and shape {_shape(idx)}"
            )
        if idx.dtype == torch.bool:
            raise TypeError("idx must be a 1-D integer tensor of slots, got a bool tensor")
        idx = idx.to(device=self.device, dtype=torch.int64)
        if idx.numel() > 0:
            low, high = (int(v) for v in torch.aminmax(idx))
            if low < 0 or high >= self._length:
                raise ValueError(
                    f"idx must hold slots in [0, {self._length}) (the filled part of the buffer), "
                    f"got values in [{low}, {high}]"
                )
        return idx

    def _validate_batch(
        self, inputs: Any, targets: Any, metadata: Mapping[str, torch.Tensor] | None
    ) -> tuple[
        dict[str, Any] | None, list[str], list[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]
    ]:
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets: expected a tensor, got {type(targets).__name__}")
        if targets.dim() == 0:
            raise ValueError("targets: expected a batch dimension, got a 0-d tensor")
        batch_size = targets.shape[0]
        _check_batch_tensor("targets", targets, batch_size, self._targets)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, Mapping):
            raise TypeError(
                f"metadata: expected a dict of str to tensors or None, "
                f"got {type(metadata).__name__}"
            )
        for key in metadata:
            if not isinstance(key, str):
                raise TypeError(f"metadata: keys must be str, got {key!r}")
            if key == "idx":
                raise ValueError(
                    "metadata['idx']: the name 'idx' is reserved for the slot indices that "
                    "sample() returns"
                )
        spec: dict[str, Any] | None
        if self._spec is None:
            spec, leaves, names = _structure.flatten_new(inputs, "inputs")
            stored_leaves: list[torch.Tensor | None] = [None] * len(leaves)
            meta = dict(metadata)
            stored_meta: dict[str, torch.Tensor | None] = dict.fromkeys(meta)
        else:
            spec, names = self._spec, self._input_names
            leaves = _structure.flatten_like(inputs, spec, "inputs")
            stored_leaves = list(self._inputs)
            for key in metadata:
                if key not in self._metadata:
                    raise ValueError(
                        f"metadata[{key!r}]: not stored by this buffer; the first batch fixed the "
                        f"metadata keys to {list(self._metadata)}"
                    )
            missing = [k for k in self._metadata if k not in metadata]
            if missing:
                raise ValueError(
                    f"metadata[{missing[0]!r}]: missing; every batch must carry the metadata keys "
                    f"of the first batch {list(self._metadata)}"
                )
            meta = {k: metadata[k] for k in self._metadata}
            stored_meta = dict(self._metadata)
        for name, leaf, stored in zip(names, leaves, stored_leaves):
            _check_batch_tensor(name, leaf, batch_size, stored)
        for key, value in meta.items():
            _check_batch_tensor(f"metadata[{key!r}]", value, batch_size, stored_meta[key])
        return spec, names, leaves, targets, meta

    def _allocate(
        self,
        spec: dict[str, Any],
        names: list[str],
        input_layout: list[tuple[tuple[int, ...], torch.dtype]],
        target_layout: tuple[tuple[int, ...], torch.dtype],
        metadata_layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
        capacity: int,
    ) -> None:
        layouts = [*input_layout, target_layout, *metadata_layout.values()]
        # Storage must be a normal tensor even when the first batch arrives in inference mode,
        # or later in-place writes outside inference mode would fail.
        with torch.inference_mode(False):
            storage = self._new_storage([(capacity, *shape) for shape, _ in layouts],
                                        [dtype for _, dtype in layouts])  # fmt: skip
        inputs = storage[: len(input_layout)]
        targets = storage[len(input_layout)]
        metadata = dict(zip(metadata_layout, storage[len(input_layout) + 1 :]))
        self._spec, self._input_names = copy.deepcopy(spec), list(names)
        self._inputs, self._targets, self._metadata = inputs, targets, metadata
        self._capacity = capacity

    def _new_storage(
        self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]
    ) -> list[torch.Tensor]:
        """Fresh, uninitialised storage tensors (input leaves, targets, metadata, in this order).

        A storage option overrides it: the memory-mapped buffers of
        :mod:`renate_events.memory.mapped` return tensors backed by files.
        """
        return [
            torch.empty(shape, dtype=dtype, device=self.device)
            for shape, dtype in zip(shapes, dtypes)
        ]

    def _release_storage(self) -> None:
        """Back to no storage at all, as before the first update (the next batch fixes it)."""
        self._spec, self._input_names, self._inputs = None, [], []
        self._targets, self._metadata, self._capacity = None, {}, 0

    def _storage(self) -> list[torch.Tensor]:
        """Every storage tensor: input leaves, targets, metadata (only once allocated)."""
        return [*self._inputs, cast(torch.Tensor, self._targets), *self._metadata.values()]

    def _write(
        self,
        slots: torch.Tensor,
        positions: torch.Tensor,
        batch_size: int,
        sources: list[torch.Tensor],
    ) -> None:
        device_slots = _indices_to(slots, self.device)
        whole_batch = positions.numel() == batch_size  # positions are then 0 .. batch_size - 1
        moved_positions: dict[torch.device, torch.Tensor] = {}
        for stored, source in zip(self._storage(), sources):
            # detach() and to() are dispatcher calls even when they return the tensor as it is;
            # this runs for every stored tensor on every update.
            if source.requires_grad:
                source = source.detach()
            if not whole_batch:
                pos = moved_positions.get(source.device)
                if pos is None:
                    pos = moved_positions[source.device] = _indices_to(positions, source.device)
                source = source.index_select(0, pos)
            if source.device != stored.device:
                source = source.to(stored.device)
            stored.index_copy_(0, device_slots, source)

    def _parse_state(self, state: Any) -> _ParsedState:
        self._check_state_header(state)
        seed = self._parse_config(state["config"])
        num_seen, length = self._parse_counts(state["num_seen"], state["length"])
        generator_state = _check_generator_state(
            state["generator_state"], "state['generator_state']"
        )
        sample_generator_state = _check_generator_state(
            state["sample_generator_state"], "state['sample_generator_state']"
        )
        spec, inputs, targets, metadata = self._parse_storage(state, length)
        extra = self._parse_extra_state(state["extra"], targets, length)
        return _ParsedState(
            seed, num_seen, length, generator_state, sample_generator_state, spec, inputs,
            targets, metadata, extra,
        )  # fmt: skip

    def _check_state_header(self, state: Any) -> None:
        """The keys, the format version and the buffer type of a state dict."""
        if not isinstance(state, Mapping):
            raise TypeError(
                f"state must be a mapping from state_dict(), got {type(state).__name__}"
            )
        for key in _STATE_KEYS:
            if key not in state:
                raise ValueError(f"state[{key!r}]: missing (not a {type(self).__name__} state?)")
        unknown = sorted(set(state) - set(_STATE_KEYS))
        if unknown:
            raise ValueError(f"state[{unknown[0]!r}]: unexpected key; expected {list(_STATE_KEYS)}")
        if state["format_version"] != STATE_FORMAT_VERSION:
            raise ValueError(
                f"state['format_version']: expected {STATE_FORMAT_VERSION}, "
                f"got {state['format_version']!r}"
            )
        if state["buffer_type"] != type(self).__name__:
            raise ValueError(
                f"state['buffer_type']: this is a {type(self).__name__}, the state was written "
                f"by {state['buffer_type']!r}"
            )

    def _parse_config(self, config: Any) -> int:
        """The seed of ``state['config']``, whose size arguments must be this buffer's."""
        own = {"seed": None, **self._config()}
        if not isinstance(config, Mapping) or set(config) != set(own):
            raise ValueError(
                f"state['config']: expected a dict with keys {sorted(own)}, got {config!r}"
            )
        seed = config["seed"]
        validators.check_int("state['config']['seed']", seed, 0, 2**64)  # a ValueError either way
        for key, value in self._config().items():
            if config[key] != value:
                raise ValueError(
                    f"state['config'][{key!r}]: the state was written by a buffer with "
                    f"{key}={config[key]!r}, this buffer has {key}={value!r}"
                )
        return seed

    def _parse_counts(self, num_seen: Any, length: Any) -> tuple[int, int]:
        for key, value in (("num_seen", num_seen), ("length", length)):
            if not validators.is_int(value) or value < 0:
                raise ValueError(f"state[{key!r}]: expected an int >= 0, got {value!r}")
        bound = self._bound()
        expected_length = num_seen if bound is None else min(bound, num_seen)
        if length != expected_length:
            raise ValueError(
                f"state['length']: expected {expected_length} for num_seen={num_seen} "
                f"(max_size={bound}), got {length}"
            )
        return num_seen, length

    def _parse_storage(
        self, state: Mapping[str, Any], length: int
    ) -> tuple[
        dict[str, Any] | None, list[torch.Tensor], torch.Tensor | None, dict[str, torch.Tensor]
    ]:
        """The inputs structure and the stored tensors, ``length`` rows each."""
        raw_spec, inputs, targets, metadata = (
            state["inputs_structure"],
            state["inputs"],
            state["targets"],
            state["metadata"],
        )
        if not isinstance(inputs, (list, tuple)):
            raise ValueError(f"state['inputs']: expected a list of tensors, got {inputs!r}")
        if not isinstance(metadata, Mapping):
            raise ValueError(f"state['metadata']: expected a dict of tensors, got {metadata!r}")
        if raw_spec is None:
            if length != 0 or inputs or targets is not None or metadata:
                raise ValueError(
                    "state['inputs_structure']: None (nothing stored yet) requires length 0, "
                    "no inputs, targets None and no metadata"
                )
            return None, [], None, {}
        spec = _structure.validate_spec(raw_spec, "state['inputs_structure']")
        names = _structure.leaf_names(spec, "inputs")
        if len(inputs) != len(names):
            raise ValueError(
                f"state['inputs']: the structure has {len(names)} tensors, got {len(inputs)}"
            )
        inputs = [
            _check_state_tensor(t, f"state['inputs'][{i}] ({name})", length)
            for i, (t, name) in enumerate(zip(inputs, names))
        ]
        targets = _check_state_tensor(targets, "state['targets']", length)
        self._check_first_targets(targets, "state['targets']")
        parsed_meta = {}
        for key, value in metadata.items():
            if not isinstance(key, str) or key == "idx":
                raise ValueError(f"state['metadata']: invalid key {key!r}")
            parsed_meta[key] = _check_state_tensor(value, f"state['metadata'][{key!r}]", length)
        return spec, inputs, targets, parsed_meta


# --------------------------------------------------------------------------------------------
# Bounded buffers
# --------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class _BoundedBuffer(DataBuffer):
    """A buffer holding at most ``max_size`` samples in storage allocated once."""

    max_size: int = attrs.field(
        validator=validators.int_at_least(1), on_setattr=attrs.setters.frozen
    )

    def _bound(self) -> int:
        return self.max_size

    def _config(self) -> dict[str, Any]:
        return {"max_size": self.max_size}


@attrs.define(eq=False)
class ReservoirBuffer(_BoundedBuffer):
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
        raw = torch.randint(0, _RAND_HIGH, (batch_size,), generator=self._generator)
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
        keep = _last_occurrences(slots)  # several picks of one slot: the latest wins
        if keep is not None:
            slots, positions = slots.index_select(0, keep), positions.index_select(0, keep)
        return slots, positions


@attrs.define(eq=False)
class SlidingWindowBuffer(_BoundedBuffer):
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
class GreedyClassBalancingBuffer(_BoundedBuffer):
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
                f"{_shape(targets)} and dtype {targets.dtype}"
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
        raw = torch.randint(0, _RAND_HIGH, (batch_size, 2), generator=self._generator).tolist()
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
            or _shape(slots) != (length,)
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
        n = self._length
        grown = []
        with torch.inference_mode(False):
            for stored in self._storage():
                new = torch.empty(
                    (capacity, *stored.shape[1:]), dtype=stored.dtype, device=stored.device
                )
                new[:n].copy_(stored[:n])
                grown.append(new)
        num_inputs = len(self._inputs)
        self._inputs = grown[:num_inputs]
        self._targets = grown[num_inputs]
        self._metadata = dict(zip(self._metadata, grown[num_inputs + 1 :]))
        self._capacity = capacity

    def _plan(self, batch_size: int, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(batch_size, dtype=torch.int64)
        return positions + self._length, positions


class BufferDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The filled slots of a :class:`DataBuffer` as a dataset of ``(inputs, target)``.

    Indexing one item returns one sample. ``__getitems__`` returns a whole batch, already stacked,
    with one ``index_select`` per stored tensor; a ``DataLoader`` uses it when given
    ``collate_fn=BufferDataset.collate`` (which passes the batch through).

    Example:
        >>> import torch
        >>> buffer = InfiniteBuffer()
        >>> buffer.update(torch.zeros(3, 2), torch.tensor([0, 1, 2]))
        >>> view = buffer.dataset()
        >>> len(view), view[2][1]
        (3, tensor(2))
        >>> loader = torch.utils.data.DataLoader(view, batch_size=2, collate_fn=view.collate)
        >>> [targets.tolist() for _, targets in loader]
        [[0, 1], [2]]
    """

    def __init__(self, buffer: DataBuffer) -> None:
        self.buffer = buffer

    def __len__(self) -> int:
        return len(self.buffer)

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor]:
        buffer = self.buffer
        if not -len(buffer) <= index < len(buffer) or buffer._spec is None:
            raise IndexError(f"index {index} is out of range for {len(buffer)} samples")
        index = index % len(buffer)
        inputs = _structure.unflatten(buffer._spec, [s[index] for s in buffer._inputs])
        return inputs, cast(torch.Tensor, buffer._targets)[index]

    def __getitems__(self, indices: list[int]) -> tuple[Any, torch.Tensor]:
        buffer = self.buffer
        idx = torch.as_tensor(indices, dtype=torch.int64)
        if buffer._spec is None or (
            idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(buffer))
        ):
            raise IndexError(f"indices must be in [0, {len(buffer)})")
        idx = idx.to(buffer.device)
        inputs = _structure.unflatten(
            buffer._spec, [s.index_select(0, idx) for s in buffer._inputs]
        )
        return inputs, cast(torch.Tensor, buffer._targets).index_select(0, idx)

    @staticmethod
    def collate(batch: Any) -> Any:
        """``collate_fn`` for a ``DataLoader`` over this dataset: batches come stacked already."""
        return batch
