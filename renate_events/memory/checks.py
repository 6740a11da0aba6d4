"""Checks of what a replay buffer is given: devices, batches, slot indices and metadata values.

Every check raises before the buffer changes, with a message that names the offending key
(``inputs[1]``, ``metadata['logits']``, ``idx``) and says what was expected and what was given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from renate_events.memory import structure
from renate_events.memory.draws import indices_to

__all__ = [
    "as_device",
    "check_batch_tensor",
    "check_device",
    "check_metadata_values",
    "check_slots",
    "shape",
    "validate_batch",
]


def as_device(value: Any) -> torch.device:
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


def check_device(instance: Any, attribute: attrs.Attribute, value: torch.device) -> None:
    """attrs validator: ``value`` is a device this process can allocate on."""
    try:
        torch.empty(0, device=value)
    except (RuntimeError, AssertionError) as exc:
        raise ValueError(
            f"{attribute.name} must be a device this process can allocate on, got {str(value)!r} "
            f"({exc})"
        ) from exc


def shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of ``t`` as a plain tuple, for messages and comparisons."""
    return tuple(t.shape)


def check_batch_tensor(
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
            f"(shape {shape(value)})"
        )
    if stored is not None and (value.shape[1:] != stored.shape[1:] or value.dtype != stored.dtype):
        raise ValueError(
            f"{name}: expected per-sample shape {shape(stored)[1:]} and dtype {stored.dtype} "
            f"(fixed by the first batch), got per-sample shape {shape(value)[1:]} and dtype "
            f"{value.dtype}"
        )
    return value


def _check_metadata_keys(metadata: Any) -> Mapping[str, torch.Tensor]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(
            f"metadata: expected a dict of str to tensors or None, got {type(metadata).__name__}"
        )
    for key in metadata:
        if not isinstance(key, str):
            raise TypeError(f"metadata: keys must be str, got {key!r}")
        if key == "idx":
            raise ValueError(
                "metadata['idx']: the name 'idx' is reserved for the slot indices that "
                "sample() returns"
            )
    return metadata


def _stored_keys_only(
    metadata: Mapping[str, torch.Tensor], stored: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``metadata`` in the order of the stored keys, which it must carry exactly."""
    for key in metadata:
        if key not in stored:
            raise ValueError(
                f"metadata[{key!r}]: not stored by this buffer; the first batch fixed the "
                f"metadata keys to {list(stored)}"
            )
    missing = [k for k in stored if k not in metadata]
    if missing:
        raise ValueError(
            f"metadata[{missing[0]!r}]: missing; every batch must carry the metadata keys "
            f"of the first batch {list(stored)}"
        )
    return {k: metadata[k] for k in stored}


def validate_batch(
    inputs: Any,
    targets: Any,
    metadata: Mapping[str, torch.Tensor] | None,
    spec: dict[str, Any] | None,
    names: list[str],
    stored_inputs: list[torch.Tensor],
    stored_targets: torch.Tensor | None,
    stored_metadata: dict[str, torch.Tensor],
) -> tuple[
    dict[str, Any] | None, list[str], list[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]
]:
    """Check a batch against a buffer's storage (``spec`` ``None``: nothing stored yet).

    Returns:
        ``(spec, names, leaves, targets, metadata)``: the inputs' structure, its leaf names, the
        input leaves, the targets and the metadata in the stored order, ready to be written.
    """
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets: expected a tensor, got {type(targets).__name__}")
    if targets.dim() == 0:
        raise ValueError("targets: expected a batch dimension, got a 0-d tensor")
    batch_size = targets.shape[0]
    check_batch_tensor("targets", targets, batch_size, stored_targets)
    metadata = _check_metadata_keys(metadata)
    if spec is None:
        spec, leaves, names = structure.flatten_new(inputs, "inputs")
        stored_leaves: list[torch.Tensor | None] = [None] * len(leaves)
        meta = dict(metadata)
        stored_meta: dict[str, torch.Tensor | None] = dict.fromkeys(meta)
    else:
        leaves = structure.flatten_like(inputs, spec, "inputs")
        stored_leaves = list(stored_inputs)
        meta = _stored_keys_only(metadata, stored_metadata)
        stored_meta = dict(stored_metadata)
    for name, leaf, stored in zip(names, leaves, stored_leaves):
        check_batch_tensor(name, leaf, batch_size, stored)
    for key, value in meta.items():
        check_batch_tensor(f"metadata[{key!r}]", value, batch_size, stored_meta[key])
    return spec, names, leaves, targets, meta


def check_slots(idx: Any, device: torch.device, length: int) -> torch.Tensor:
    """``idx`` as int64 slots on ``device``, checked to be 1-D and in ``[0, length)``.

    Slots on the CPU are checked there and then copied without waiting (pinned, non-blocking);
    slots given on a GPU are checked by reading their smallest and largest back from it.
    """
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a 1-D integer tensor, got {type(idx).__name__}")
    if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype.is_complex:
        raise TypeError(
            f"idx must be a 1-D integer tensor, got dtype {idx.dtype} and shape {shape(idx)}"
        )
    if idx.dtype == torch.bool:
        raise TypeError("idx must be a 1-D integer tensor of slots, got a bool tensor")
    idx = idx.to(dtype=torch.int64)
    if idx.numel() > 0:
        low, high = (int(v) for v in torch.aminmax(idx))
        if low < 0 or high >= length:
            raise ValueError(
                f"idx must hold slots in [0, {length}) (the filled part of the buffer), "
                f"got values in [{low}, {high}]"
            )
    return indices_to(idx, device)


def check_metadata_values(key: str, values: Any, rows: int, stored: torch.Tensor) -> None:
    """``values`` for ``rows`` slots of the stored metadata ``key`` have its shape and dtype."""
    name = f"values for metadata[{key!r}]"
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(values).__name__}")
    expected = (rows, *shape(stored)[1:])
    if shape(values) != expected or values.dtype != stored.dtype:
        raise ValueError(
            f"{name}: expected shape {expected} and dtype {stored.dtype}, got shape "
            f"{shape(values)} and dtype {values.dtype}"
        )
