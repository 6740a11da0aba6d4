"""iCaRL's exemplar memory: herding selection and a buffer that keeps a fixed total of exemplars.

Rebuffi, Kolesnikov, Sperl and Lampert, "iCaRL: Incremental Classifier and Representation
Learning", CVPR 2017 (Algorithms 4 and 5: ``ConstructExemplarSet`` and ``ReduceExemplarSet``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import attrs
import torch
import torch.nn.functional as F

from renate_events.memory import structure
from renate_events.memory.base import BoundedBuffer
from trainer import validators

__all__ = ["HerdingBuffer", "herding_selection"]


def herding_selection(features: torch.Tensor, k: int) -> torch.Tensor:
    """The first ``k`` exemplars of a class chosen by herding (iCaRL's Algorithm 4).

    The features are L2-normalised; ``mu`` is their mean. Exemplar ``t`` (from 1) is the sample
    ``x``, not chosen yet, whose feature brings the mean of the exemplars chosen so far closest
    to ``mu``: ``argmin_x || mu - (phi(x) + sum_{j<t} phi(p_j)) / t ||``. Each of the ``k``
    iterations is a few tensor operations over all samples of the class, without reading back
    from the device; ties go to the lowest index.

    Args:
        features: ``(n, d)`` features of one class's samples (a floating-point tensor).
        k: How many exemplars to choose, an int in ``[0, n]``.

    Returns:
        ``k`` distinct int64 row indices into ``features``, in herding order: a prefix of it is
        the best smaller exemplar set, so reducing a set keeps its first ``m``.

    Example:
        >>> import torch
        >>> features = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
        >>> herding_selection(features, 3).tolist()
        [1, 2, 0]
    """
    if not isinstance(features, torch.Tensor) or features.dim() != 2:
        got = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features)
        raise ValueError(f"herding_selection: features must be an (n, d) tensor, got {got}")
    if not features.dtype.is_floating_point:
        raise ValueError(
            f"herding_selection: features must be floating point, got dtype {features.dtype}"
        )
    validators.check_int("herding_selection: k", k, 0, features.shape[0] + 1)
    phi = F.normalize(features.detach().float(), dim=1)
    mu = phi.mean(dim=0)
    chosen = torch.zeros(phi.shape[0], dtype=torch.bool, device=phi.device)
    running = torch.zeros_like(mu)
    order = torch.empty(k, dtype=torch.int64, device=phi.device)
    for t in range(1, k + 1):
        distance = (mu - (running + phi) / t).square().sum(dim=1)
        best = distance.masked_fill(chosen, float("inf")).argmin().reshape(1)
        order[t - 1 : t] = best
        chosen.index_fill_(0, best, True)
        running += phi.index_select(0, best).squeeze(0)
    return order


@attrs.define(eq=False)
class HerdingBuffer(BoundedBuffer):
    """iCaRL's memory: ``max_size`` exemplars split equally over the classes seen, by herding.

    :meth:`herd` is the end of an update (Rebuffi et al., CVPR 2017, Algorithms 4 and 5): with
    ``C`` the classes stored or offered, every class gets ``m = max_size // C`` slots; a class
    already stored keeps its first ``m`` exemplars (its herding order is its priority, and it is
    the slot order of the class), and each class of the offered samples fills its remaining
    slots by :func:`herding_selection` on the features given (those of the final model). The
    classes are visited in ascending order, one loop iteration each. The result is validated
    whole and committed through :meth:`load_state_dict`, so a refused call changes nothing.

    :meth:`update` (the streaming interface of every buffer) appends samples while free slots
    remain, as the lowest-priority exemplars of their classes. After :meth:`herd`,
    :attr:`num_seen` equals the number of exemplars kept (the samples left out are forgotten).

    Targets must be 1-D integer class labels.

    Args:
        max_size: The memory size ``K`` (iCaRL's fixed total of exemplars), an int >= 1.
        seed: See :class:`~renate_events.memory.DataBuffer` (used for sampling).
        device: See :class:`~renate_events.memory.DataBuffer`.

    Example:
        >>> import torch
        >>> buffer = HerdingBuffer(4)
        >>> inputs = torch.arange(6.0).unsqueeze(1)
        >>> buffer.herd(inputs, torch.tensor([0, 0, 0, 1, 1, 1]), torch.randn(6, 3))
        >>> buffer.class_counts()
        {0: 2, 1: 2}
    """

    def class_counts(self) -> dict[int, int]:
        """How many exemplars of each class the buffer holds, by class label (ascending)."""
        if len(self) == 0:
            return {}
        labels, counts = torch.unique(self._stored_targets(), return_counts=True)
        return dict(zip(labels.tolist(), counts.tolist()))

    def _stored_targets(self) -> torch.Tensor:
        return cast(torch.Tensor, self._targets)[: len(self)]

    def _check_first_targets(self, targets: torch.Tensor, where: str) -> None:
        if targets.dim() != 1 or not _is_label_dtype(targets.dtype):
            raise ValueError(
                f"{where}: {type(self).__name__} needs 1-D integer class labels, got shape "
                f"{tuple(targets.shape)} and dtype {targets.dtype}"
            )

    def _plan(self, batch_size: int, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        free = max(0, self.max_size - len(self))
        positions = torch.arange(min(free, batch_size), dtype=torch.int64)
        return positions + len(self), positions

    def herd(
        self,
        inputs: Any,
        targets: torch.Tensor,
        features: torch.Tensor,
        metadata: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Reduce the stored classes to ``max_size // C`` exemplars each and add the offered
        classes' exemplars, chosen by herding on ``features``.

        Args:
            inputs: The candidates (a tensor or a structure of tensors, as :meth:`update`
                takes), typically all of an update's data.
            targets: Their 1-D integer class labels.
            features: ``(n, d)`` features of the candidates from the final model (normalised
                here).
            metadata: Per-sample tensors, required when the stored samples have metadata.

        Raises:
            ValueError: Malformed candidates or features, or fewer slots than classes
                (``max_size < C``); nothing changes then.
        """
        self.check_batch(inputs, targets, metadata)
        self._check_first_targets(targets, "targets")
        n = targets.shape[0]
        if (
            not isinstance(features, torch.Tensor)
            or features.dim() != 2
            or features.shape[0] != n
            or not features.dtype.is_floating_point
        ):
            got = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features)
            raise ValueError(
                f"{type(self).__name__}.herd: features must be a floating-point ({n}, d) tensor "
                f"(one row per target), got {got}"
            )
        if not bool(torch.isfinite(features).all()):
            raise ValueError(f"{type(self).__name__}.herd: features must be finite")
        state = self.state_dict()
        stored = state["targets"]
        stored = torch.empty(0, dtype=torch.int64) if stored is None else stored.cpu().long()
        labels = targets.cpu().long()
        if labels.numel() and int(labels.min()) < 0:
            raise ValueError(
                f"{type(self).__name__}.herd: class labels must be >= 0, got {int(labels.min())}"
            )
        classes = torch.unique(torch.cat([stored, labels]))
        if classes.numel() == 0:
            return  # nothing stored, nothing offered
        per_class = self.max_size // classes.numel()
        if per_class < 1:
            raise ValueError(
                f"{type(self).__name__}.herd: max_size={self.max_size} slots cannot hold an "
                f"exemplar of each of the {classes.numel()} classes seen; raise memory_size to "
                f"at least {classes.numel()}"
            )
        kept = _first_per_class(stored, per_class)
        kept_counts = torch.bincount(stored[kept], minlength=int(classes.max()) + 1)
        chosen = self._herded(labels, features, per_class, kept_counts)
        self.load_state_dict(self._merged_state(state, kept, chosen, inputs, targets, metadata))

    def _herded(
        self,
        labels: torch.Tensor,
        features: torch.Tensor,
        per_class: int,
        kept_counts: torch.Tensor,
    ) -> torch.Tensor:
        """Indices of the offered samples to store: per class (ascending), in herding order."""
        chosen = []
        quota = (per_class - kept_counts).clamp(min=0).tolist()
        for label in torch.unique(labels).tolist():
            rows = torch.nonzero(labels == label).squeeze(1)
            k = min(quota[label], rows.numel())
            if k > 0:
                order = herding_selection(features.index_select(0, rows.to(features.device)), k)
                chosen.append(rows.index_select(0, order.cpu()))
        return torch.cat(chosen) if chosen else torch.empty(0, dtype=torch.int64)

    def _merged_state(
        self,
        state: dict[str, Any],
        kept: torch.Tensor,
        chosen: torch.Tensor,
        inputs: Any,
        targets: torch.Tensor,
        metadata: Mapping[str, torch.Tensor] | None,
    ) -> dict[str, Any]:
        """``state`` with the stored rows ``kept`` followed by the offered rows ``chosen``."""
        spec = state["inputs_structure"]
        if spec is None:
            spec, leaves, _ = structure.flatten_new(inputs, "inputs")
            old_leaves: list[torch.Tensor | None] = [None] * len(leaves)
            old_meta: dict[str, torch.Tensor | None] = dict.fromkeys(metadata or {})
            old_targets = None
        else:
            leaves = structure.flatten_like(inputs, spec, "inputs")
            old_leaves, old_meta = list(state["inputs"]), dict(state["metadata"])
            old_targets = state["targets"]
        meta = dict(metadata or {})

        def rows(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
            picked = new.detach().index_select(0, chosen.to(new.device)).to(self.device)
            if old is None:
                return picked
            return torch.cat([old.index_select(0, kept.to(old.device)), picked])

        length = kept.numel() + chosen.numel()
        return {
            **state,
            "num_seen": length,
            "length": length,
            "inputs_structure": spec,
            "inputs": [rows(old, new) for old, new in zip(old_leaves, leaves)],
            "targets": rows(old_targets, targets),
            "metadata": {key: rows(old_meta[key], meta[key]) for key in old_meta},
        }


def _is_label_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _first_per_class(labels: torch.Tensor, per_class: int) -> torch.Tensor:
    """Ascending positions of the first ``per_class`` occurrences of each label in ``labels``."""
    if labels.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    sorted_labels, order = torch.sort(labels, stable=True)
    starts = torch.ones_like(sorted_labels, dtype=torch.bool)
    starts[1:] = sorted_labels[1:] != sorted_labels[:-1]
    positions = torch.arange(labels.numel())
    group_start = torch.cummax(torch.where(starts, positions, 0), dim=0).values
    keep = (positions - group_start) < per_class
    return torch.sort(order[keep]).values
