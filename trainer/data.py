"""Batches from tensors in memory, without a DataLoader's per-sample fetch and collate.

For data that is already a set of tensors (a ``TensorDataset``, a replay buffer's storage), a
batch is one ``index_select`` per tensor. ``TensorLoader`` does that, shuffles with torch's
global random generator (which the trainer seeds and saves in checkpoints, so a resumed epoch
replays the same order) and can keep the whole data set on the training device.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

__all__ = ["TensorLoader", "resolve_device", "to_device"]


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is CUDA when available, else the CPU; anything else goes to ``torch.device``."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device must be 'auto', a torch.device or a device string such as 'cpu' or 'cuda:0'; "
            f"got {device!r}"
        ) from exc


def to_device(
    value: Any, device: torch.device, *, pin: bool = False, channels_last: bool = False
) -> Any:
    """Move nested tuples, lists, namedtuples and dicts of tensors to ``device``.

    Tensors already there are returned as they are. A copy from the CPU to a GPU is asynchronous
    when its source is in pinned memory; with ``pin=True`` a CPU tensor that is not pinned is
    staged in pinned memory first (worth it for rows gathered from a CPU replay buffer; a
    DataLoader with ``pin_memory=True`` pins its batches itself). With ``channels_last=True``
    every tensor of four dimensions (a batch of images) comes out in the
    ``torch.channels_last`` memory format (same values, channels stored last).

    Example:
        >>> batch = to_device((torch.zeros(2), {"y": torch.ones(2)}), torch.device("cpu"))
        >>> batch[1]["y"].device.type
        'cpu'
    """
    if isinstance(value, torch.Tensor):
        if value.device != device:
            cuda = device.type == "cuda"
            if pin and cuda and value.device.type == "cpu" and not value.is_pinned():
                value = value.pin_memory()
            value = value.to(device, non_blocking=cuda and value.is_pinned())
        if channels_last and value.dim() == 4:  # on the device: the copy stays asynchronous
            value = value.contiguous(memory_format=torch.channels_last)
        return value
    if isinstance(value, (list, tuple)):
        moved = [to_device(item, device, pin=pin, channels_last=channels_last) for item in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*moved)
        return type(value)(moved) if isinstance(value, tuple) else moved
    if isinstance(value, Mapping):
        return {
            key: to_device(item, device, pin=pin, channels_last=channels_last)
            for key, item in value.items()
        }
    return value


def _tensors(instance: object, attribute: attrs.Attribute[object], value: object) -> None:
    if not isinstance(value, tuple) or not value:
        raise TypeError(f"TensorLoader needs one or more tensors, got {value!r}")
    lengths = set()
    for i, tensor in enumerate(value):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            raise TypeError(
                f"TensorLoader tensor {i} must be a tensor with a sample dimension, got {tensor!r}"
            )
        lengths.add(tensor.shape[0])
    if len(lengths) != 1:
        raise ValueError(
            f"TensorLoader tensors must have the same number of samples, got {sorted(lengths)}"
        )


@attrs.define(eq=False)
class TensorLoader:
    """Iterate over mini-batches of tensors by indexing them.

    Args:
        tensors: Tensors with the samples along their first dimension (e.g. inputs, targets).
        batch_size: Samples per batch.
        shuffle: Draw a new order every epoch with ``torch.randperm`` (global RNG).
        drop_last: Drop the last, smaller batch.
        device: Move the tensors there once (e.g. ``"cuda"``); batches are then made on it.
        rank: This process's rank when sharded for distributed training (set by the trainer).
        world_size: Number of ranks sharing the data; above 1 each rank iterates over the
            strided slice ``order[rank::world_size]`` of one order, padded by wrapping around to
            a multiple of ``world_size`` so that every rank gets the same number of batches.
            The order is drawn from a generator seeded with ``seed + epoch`` (see
            :meth:`set_epoch`), identical on every rank. With ``shuffle=False`` the ranks'
            batches ``i`` together are exactly batch ``i`` of one process with
            ``world_size * batch_size``.
        seed: When set, each epoch's order is drawn from a generator seeded with
            ``seed + epoch`` instead of the global RNG (always when sharded: the trainer passes
            its own seed, or 0, unless one is set here).

    Example:
        >>> import torch
        >>> loader = TensorLoader.from_dataset(
        ...     torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10)), batch_size=4)
        >>> len(loader), [len(y) for _, y in loader]
        (3, [4, 4, 2])
    """

    tensors: tuple[torch.Tensor, ...] = attrs.field(converter=tuple, validator=_tensors)
    batch_size: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    shuffle: bool = True
    drop_last: bool = False
    device: str | torch.device | None = None
    rank: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    world_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    seed: int | None = None
    _epoch: int = attrs.field(init=False, default=0, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.device is not None:
            self.tensors = tuple(t.to(self.device) for t in self.tensors)

    @classmethod
    def from_dataset(
        cls, dataset: torch.utils.data.TensorDataset, **kwargs: object
    ) -> TensorLoader:
        """Build one from a ``TensorDataset`` (anything with a ``tensors`` tuple)."""
        return cls(tuple(dataset.tensors), **kwargs)  # type: ignore[arg-type]

    @property
    def num_samples(self) -> int:
        """Samples this rank iterates over per epoch (all of them when not sharded)."""
        n = int(self.tensors[0].shape[0])
        return -(-n // self.world_size) if self.world_size > 1 else n

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shared order a sharded loader iterates (the trainer calls it)."""
        self._epoch = epoch

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _order(self) -> torch.Tensor:
        n = int(self.tensors[0].shape[0])
        device = self.tensors[0].device
        if self.world_size == 1 and (self.seed is None or not self.shuffle):
            if self.shuffle:  # drawn on the CPU, copied to a GPU through pinned memory
                return to_device(torch.randperm(n), device, pin=True)
            return torch.arange(n, device=device)
        if self.shuffle:
            generator = torch.Generator().manual_seed((self.seed or 0) + self._epoch)
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        padded = self.num_samples * self.world_size
        if self.world_size == 1:
            return to_device(order, device, pin=True)
        if padded > n:
            order = torch.cat([order, order[: padded - n]])
        return to_device(order[self.rank :: self.world_size], device, pin=True)

    def __iter__(self) -> Iterator[Sequence[torch.Tensor]]:
        n, size = self.num_samples, self.batch_size
        order = self._order()
        stop = n - n % size if self.drop_last else n
        for start in range(0, stop, size):
            index = order[start : start + size]
            yield tuple(t.index_select(0, index) for t in self.tensors)
