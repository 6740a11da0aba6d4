"""The replay buffer's base: preallocated tensor storage, vectorised update and sampling.

:class:`DataBuffer` stores whole batches in tensors that are allocated once, when the first batch
arrives (its structure, per-sample shapes and dtypes fix those of the storage), hands out uniform
random batches, reads and writes per-sample metadata, and writes and restores its state dict.
What differs between the buffer kinds (:mod:`renate_events.memory.buffers`) is only *which slot*
each incoming sample goes to, if any: the :meth:`DataBuffer._plan` hook.

Randomness comes from two CPU ``torch.Generator`` objects owned by the buffer, one for the update
decisions and one for :meth:`DataBuffer.sample`, so that (a) results do not depend on the storage
device and (b) how often a trainer samples from the memory never changes *what* the memory keeps.
Both generator states are part of the state dict.

The checks of batches and slots live in :mod:`renate_events.memory.checks`, the state dict's
layout and its checks in :mod:`renate_events.memory.state`, the random draws in
:mod:`renate_events.memory.draws`.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Mapping
from typing import Any, cast

import attrs
import torch

from renate_events.memory import checks, storage, structure
from renate_events.memory.draws import (
    SAMPLE_SEED_OFFSET,
    draw_distinct,
    indices_to,
    last_occurrences,
)
from renate_events.memory.state import (
    STATE_FORMAT_VERSION,
    Expect,
    check_generator_state,
    parse_state,
)
from trainer import validators

__all__ = ["BatchMemory", "BoundedBuffer", "BufferDataset", "DataBuffer"]

BatchMemory = tuple[tuple[Any, torch.Tensor], Mapping[str, torch.Tensor]]
"""A memory batch, as :meth:`DataBuffer.sample` returns it and components receive it:
``((inputs, targets), metadata)``. ``metadata`` holds ``"idx"`` (the slots) and every stored key;
the learners store ``"logits"`` and, with ``feature_modules``, ``"intermediate_representation_{i}"``
(their memory batches also offer the logits under Renate's key ``"outputs"``)."""


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
        >>> from renate_events.memory import ReservoirBuffer
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
        converter=checks.as_device,
        validator=checks.check_device,
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
        self._sample_generator.manual_seed((self.seed + SAMPLE_SEED_OFFSET) % 2**64)

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
        spec, names, leaves, targets, meta = checks.validate_batch(
            inputs, targets, metadata, self._spec, self._input_names, self._inputs,
            self._targets, self._metadata,
        )  # fmt: skip
        batch_size = targets.shape[0]
        if self._spec is None:
            self._check_first_targets(targets, "targets")
            capacity = self._initial_capacity(batch_size)
            self._allocate(cast(dict, spec), names, leaves, targets, meta, capacity)
        if batch_size == 0:
            return
        slots, positions = self._plan(batch_size, targets)
        total = self._num_seen + batch_size
        bound = self._bound()
        new_length = total if bound is None else min(bound, total)
        self._ensure_capacity(new_length)
        if slots.numel() > 0:
            sources = [*leaves, targets, *meta.values()]
            storage.write_rows(self._storage(), sources, slots, positions, batch_size)
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
        checks.validate_batch(
            inputs, targets, metadata, self._spec, self._input_names, self._inputs,
            self._targets, self._metadata,
        )  # fmt: skip

    def sample(self, batch_size: int) -> BatchMemory:
        """Draw a uniform random batch from the buffer, without replacement.

        Draws ``min(batch_size, len(self))`` distinct slots in ``O(batch_size)`` expected time
        with the buffer's sampling generator: a cut permutation when the buffer is small (at most
        ``64 * batch_size`` samples, and under 1024 or at most ``batch_size**2``), else uniform
        draws kept when distinct, with a cut permutation or the repeats redrawn when not (see
        :func:`~renate_events.memory.draws.draw_distinct`; never an ``O(max_size)`` permutation).

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
        idx = indices_to(
            draw_distinct(self._length, batch_size, self._sample_generator), self.device
        )
        inputs = structure.unflatten(spec, [s.index_select(0, idx) for s in self._inputs])
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
        self._sample_generator.set_state(check_generator_state(state, "set_sampling_state"))

    def get_metadata(self, key: str, idx: torch.Tensor) -> torch.Tensor:
        """Return a copy of the metadata ``key`` of the slots ``idx``.

        Args:
            key: A stored metadata name (see :attr:`metadata_keys`).
            idx: A 1-D integer tensor of slots in ``[0, len(self))``, e.g. ``metadata["idx"]``
                from :meth:`sample`.
        """
        stored = self._stored_metadata(key)
        return stored.index_select(0, checks.check_slots(idx, self.device, self._length))

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
        idx = checks.check_slots(idx, self.device, self._length)
        checks.check_metadata_values(key, values, idx.numel(), stored)
        values = values.detach().to(stored.device)
        keep = last_occurrences(idx)
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
        device = checks.as_device(device)
        checks.check_device(self, attrs.fields(DataBuffer).device, device)
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

    def load_state_dict(self, state: Mapping[str, Any], *, expect: Expect | None = None) -> None:
        """Restore what :meth:`state_dict` returned, into fresh storage on this buffer's device.

        The whole state is validated (and given to ``expect``) before anything changes: on
        error the buffer is untouched.

        Raises:
            ValueError: When ``state`` is malformed, was written by another kind of buffer or one
                with another ``max_size``; the message names the offending key.
            TypeError: When ``state`` is not a mapping.
        """
        parsed = parse_state(
            state, type(self).__name__, self._config(), self._bound(), self._check_first_targets,
            self._parse_extra_state, expect,
        )  # fmt: skip
        object.__setattr__(self, "seed", parsed.seed)
        self._generator.set_state(parsed.generator_state)
        self._sample_generator.set_state(parsed.sample_generator_state)
        if parsed.spec is None:
            self._release_storage()
        else:
            names = structure.leaf_names(parsed.spec, "inputs")
            targets, n = cast(torch.Tensor, parsed.targets), parsed.length
            capacity = self._capacity_for_length(n)
            self._allocate(parsed.spec, names, parsed.inputs, targets, parsed.metadata, capacity)
            for stored, saved in zip(
                self._storage(), [*parsed.inputs, targets, *parsed.metadata.values()]
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

    def _allocate(
        self,
        spec: dict[str, Any],
        names: list[str],
        inputs: list[torch.Tensor],
        targets: torch.Tensor,
        metadata: Mapping[str, torch.Tensor],
        capacity: int,
    ) -> None:
        """Fresh storage of ``capacity`` rows shaped like the rows of the tensors given."""
        new = storage.allocate(self._new_storage, [*inputs, targets, *metadata.values()], capacity)
        self._spec, self._input_names = copy.deepcopy(spec), list(names)
        self._inputs, self._targets = new[: len(inputs)], new[len(inputs)]
        self._metadata = dict(zip(metadata, new[len(inputs) + 1 :]))
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


@attrs.define(eq=False)
class BoundedBuffer(DataBuffer):
    """A buffer holding at most ``max_size`` samples in storage allocated once.

    The base of every bounded buffer kind: a subclass adds its ``_plan`` (which slot each sample
    of a batch goes to) and, where it keeps bookkeeping of its own, the extra-state hooks.

    Args:
        max_size: Number of slots, an int >= 1.
        seed: See :class:`DataBuffer`.
        device: See :class:`DataBuffer`.
    """

    max_size: int = attrs.field(
        validator=validators.int_at_least(1), on_setattr=attrs.setters.frozen
    )

    def _bound(self) -> int:
        return self.max_size

    def _config(self) -> dict[str, Any]:
        return {"max_size": self.max_size}


class BufferDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The filled slots of a :class:`DataBuffer` as a dataset of ``(inputs, target)``.

    Indexing one item returns one sample. ``__getitems__`` returns a whole batch, already stacked,
    with one ``index_select`` per stored tensor; a ``DataLoader`` uses it when given
    ``collate_fn=BufferDataset.collate`` (which passes the batch through).

    Example:
        >>> import torch
        >>> from renate_events.memory import InfiniteBuffer
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
        inputs = structure.unflatten(buffer._spec, [s[index] for s in buffer._inputs])
        return inputs, cast(torch.Tensor, buffer._targets)[index]

    def __getitems__(self, indices: list[int]) -> tuple[Any, torch.Tensor]:
        buffer = self.buffer
        idx = torch.as_tensor(indices, dtype=torch.int64)
        if buffer._spec is None or (
            idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(buffer))
        ):
            raise IndexError(f"indices must be in [0, {len(buffer)})")
        idx = indices_to(idx, buffer.device)  # pinned and non-blocking: no wait per batch
        inputs = structure.unflatten(buffer._spec, [s.index_select(0, idx) for s in buffer._inputs])
        return inputs, cast(torch.Tensor, buffer._targets).index_select(0, idx)

    @staticmethod
    def collate(batch: Any) -> Any:
        """``collate_fn`` for a ``DataLoader`` over this dataset: batches come stacked already."""
        return batch
