"""Weighted loss components computed on memory batches (custom loss, DER, PODNet)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from renate_events.components.component import BatchMemory, Component, real_from
from trainer import validators as v

#: The pooling variants of :class:`WeightedPooledOutputDistillationLossComponent`.
DISTILLATION_TYPES = ("pixel", "channel", "width", "height", "gap", "spatial")


@attrs.define(eq=False)
class WeightedLossComponent(Component):
    """Base class of losses scaled by ``weight``.

    Subclasses implement :meth:`_component_loss`; :meth:`loss` returns
    ``weight * _component_loss(...)`` and, when ``weight == 0``, a zero without calling it.

    Args:
        weight: Non-negative scale of the loss (default ``1.0``).
        sample_new_memory_batch: Whether the loop should draw a fresh memory batch for this loss.
    """

    weight: float = attrs.field(default=1.0, validator=real_from(0.0))
    sample_new_memory_batch: bool = attrs.field(default=False, validator=v.boolean)

    def loss(
        self,
        outputs_memory: torch.Tensor,
        batch_memory: BatchMemory,
        intermediate_representation_memory: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        """Returns ``weight * _component_loss(...)``, or a zero scalar if ``weight == 0``."""
        if self.weight == 0:
            return outputs_memory.new_zeros(())
        loss = self._component_loss(
            outputs_memory, batch_memory, intermediate_representation_memory
        )
        # A weight of 1 adds no operation (and no autograd node) to the step.
        return loss if self.weight == 1 else self.weight * loss

    @abc.abstractmethod
    def _component_loss(
        self,
        outputs_memory: torch.Tensor,
        batch_memory: BatchMemory,
        intermediate_representation_memory: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        """Returns the unweighted scalar loss; arguments as in :meth:`Component.loss`."""


@attrs.define(eq=False)
class WeightedCustomLossComponent(WeightedLossComponent):
    """A user-supplied loss ``loss_fn(outputs_memory, targets_memory)`` on the memory batch.

    Args:
        loss_fn: Callable ``(logits, targets) -> scalar tensor``, e.g.
            ``torch.nn.functional.cross_entropy``.
        weight: Non-negative scale of the loss.
        sample_new_memory_batch: Whether the loop should draw a fresh memory batch for this loss.

    Example:
        >>> import torch
        >>> ce = WeightedCustomLossComponent(torch.nn.functional.cross_entropy, weight=0.5)
        >>> logits, targets = torch.zeros(2, 4), torch.tensor([0, 3])
        >>> batch = ((torch.zeros(2, 8), targets), {"idx": torch.tensor([5, 9])})
        >>> ce.loss(logits, batch, None)  # 0.5 * log(4)
        tensor(0.6931)
    """

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = attrs.field(
        validator=v.is_callable("(outputs, targets) -> loss tensor")
    )
    weight: float = attrs.field(default=1.0, validator=real_from(0.0))
    sample_new_memory_batch: bool = attrs.field(default=False, validator=v.boolean)

    def _component_loss(
        self,
        outputs_memory: torch.Tensor,
        batch_memory: BatchMemory,
        intermediate_representation_memory: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        (_, targets_memory), _ = batch_memory
        return self.loss_fn(outputs_memory, targets_memory)


@attrs.define(eq=False)
class WeightedMeanSquaredErrorLossComponent(WeightedLossComponent):
    """Mean squared error between the current logits and the logits stored with each sample.

    This is the logit-matching term of Dark Experience Replay: Buzzega et al., "Dark Experience
    for General Continual Learning: a Strong, Simple Baseline", NeurIPS 2020. The stored logits
    are read from ``metadata["logits"]`` of the memory batch.

    Args:
        weight: Non-negative scale of the loss (DER's ``alpha``).
        sample_new_memory_batch: Whether the loop should draw a fresh memory batch for this loss.

    Example:
        >>> import torch
        >>> der = WeightedMeanSquaredErrorLossComponent(weight=2.0)
        >>> batch = ((torch.zeros(1, 3), torch.tensor([0])), {"logits": torch.tensor([[1.0, 0.0]])})
        >>> der.loss(torch.tensor([[0.0, 0.0]]), batch, None)  # 2 * (1 + 0) / 2
        tensor(1.)
    """

    def _component_loss(
        self,
        outputs_memory: torch.Tensor,
        batch_memory: BatchMemory,
        intermediate_representation_memory: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        _, metadata = batch_memory
        stored = _metadata_tensor(metadata, "logits", type(self).__name__, "the logits")
        if stored.shape != outputs_memory.shape:
            raise ValueError(
                f"{type(self).__name__}: stored logits have shape {tuple(stored.shape)} but the "
                f"current logits have shape {tuple(outputs_memory.shape)}"
            )
        stored = stored.to(device=outputs_memory.device, dtype=outputs_memory.dtype)
        return F.mse_loss(outputs_memory, stored)


@attrs.define(eq=False)
class WeightedPooledOutputDistillationLossComponent(WeightedLossComponent):
    """Pooled-output distillation (POD) of intermediate representations.

    Douillard et al., "PODNet: Pooled Outputs Distillation for Small-Tasks Incremental
    Learning", ECCV 2020. For every recorded layer ``i`` the current features
    (``intermediate_representation_memory[i]``) are compared with those stored with the sample
    (``metadata["intermediate_representation_{i}"]``). As in the PODNet and Renate code, both are
    squared element-wise and then pooled according to ``distillation_type``; for a feature map of
    shape ``(N, C, H, W)``:

    * ``"pixel"``: no pooling, the ``C*H*W`` values.
    * ``"channel"``: sum over channels, an ``H*W`` map.
    * ``"width"``: sum over the height axis, a ``C*W`` profile along the width.
    * ``"height"``: sum over the width axis, a ``C*H`` profile along the height.
    * ``"gap"``: global average over ``H`` and ``W``, ``C`` values.
    * ``"spatial"``: the ``"height"`` and ``"width"`` profiles concatenated (PODNet's default).

    Each pooled vector is optionally L2-normalised; the layer's loss is the batch mean of the
    Euclidean distance between current and stored vectors, and the loss is the mean over layers.

    2-D features ``(N, D)`` (e.g. from an MLP) are treated as ``(N, D, 1, 1)`` maps, i.e. ``D``
    channels without spatial extent: ``"pixel"``, ``"width"``, ``"height"`` and ``"gap"`` then
    all compare the ``D`` squared features, ``"spatial"`` compares them twice (with normalisation
    this equals ``"pixel"``; without it, it is ``sqrt(2)`` times ``"pixel"``) and ``"channel"``
    leaves one number per sample. ``"channel"`` with ``normalize=True`` on features without
    spatial extent would be identically zero, so it raises ``ValueError``. Other ranks raise too.

    Args:
        weight: Non-negative scale of the loss.
        sample_new_memory_batch: Whether the loop should draw a fresh memory batch for this loss.
        distillation_type: One of ``"pixel"``, ``"channel"``, ``"width"``, ``"height"``,
            ``"gap"``, ``"spatial"`` (default, as in Renate).
        normalize: Whether to L2-normalise the pooled vectors (default ``True``, as in Renate).

    Raises:
        ValueError: From :meth:`loss` if no intermediate representations are given: record them
            with :class:`~renate_events.components.features.IntermediateRepresentations` and
            store them with the samples in the memory buffer.

    Example:
        >>> import torch
        >>> pod = WeightedPooledOutputDistillationLossComponent(distillation_type="gap")
        >>> stored = torch.ones(2, 3, 4, 4)
        >>> batch = ((None, None), {"intermediate_representation_0": stored})
        >>> pod.loss(torch.zeros(2, 5), batch, [stored.clone()])
        tensor(0.)
    """

    distillation_type: str = attrs.field(default="spatial", validator=v.one_of(*DISTILLATION_TYPES))
    normalize: bool = attrs.field(default=True, validator=v.boolean)

    def _component_loss(
        self,
        outputs_memory: torch.Tensor,
        batch_memory: BatchMemory,
        intermediate_representation_memory: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        name = type(self).__name__
        if not intermediate_representation_memory:
            raise ValueError(
                f"{name} got no intermediate representations "
                f"(intermediate_representation_memory={intermediate_representation_memory!r}). "
                "Record the outputs of the layers to distil with "
                "renate_events.components.IntermediateRepresentations(model, module_names=[...]) "
                "and store them in the memory buffer as "
                "metadata['intermediate_representation_{i}']."
            )
        _, metadata = batch_memory
        total = outputs_memory.new_zeros(())
        for i, current in enumerate(intermediate_representation_memory):
            key = f"intermediate_representation_{i}"
            if not isinstance(current, torch.Tensor):
                raise ValueError(
                    f"{name}: intermediate representation {i} is {type(current).__name__}, not a "
                    "tensor (did the recorded module run in this forward pass?)"
                )
            stored = _metadata_tensor(metadata, key, name, "the stored intermediate representation")
            if stored.shape != current.shape:
                raise ValueError(
                    f"{name}: metadata[{key!r}] has shape {tuple(stored.shape)} but the current "
                    f"intermediate representation {i} has shape {tuple(current.shape)}"
                )
            stored = stored.to(device=current.device, dtype=current.dtype)
            total = total + self._layer_loss(current, stored)
        return total / len(intermediate_representation_memory)

    def _layer_loss(self, current: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        pooled_current = self._pool(self._as_feature_map(current).pow(2))
        pooled_stored = self._pool(self._as_feature_map(stored).pow(2))
        if self.normalize:
            pooled_current = F.normalize(pooled_current, p=2, dim=1)
            pooled_stored = F.normalize(pooled_stored, p=2, dim=1)
        return torch.linalg.vector_norm(pooled_current - pooled_stored, dim=1).mean()

    def _as_feature_map(self, features: torch.Tensor) -> torch.Tensor:
        if features.dim() == 2:
            features = features[:, :, None, None]
        elif features.dim() != 4:
            raise ValueError(
                f"{type(self).__name__} needs intermediate representations of shape (N, C, H, W) "
                f"or (N, D), got shape {tuple(features.shape)}"
            )
        if (
            self.distillation_type == "channel"
            and self.normalize
            and features.shape[2] * features.shape[3] == 1
        ):
            raise ValueError(
                f"{type(self).__name__}: distillation_type='channel' with normalize=True is "
                f"identically zero for features without spatial extent (shape "
                f"{tuple(features.shape)}); use 'pixel' or 'gap', or normalize=False"
            )
        return features

    def _pool(self, squared: torch.Tensor) -> torch.Tensor:
        n = squared.shape[0]
        kind = self.distillation_type
        if kind == "pixel":
            return squared.reshape(n, -1)
        if kind == "channel":
            return squared.sum(dim=1).reshape(n, -1)
        if kind == "width":
            return squared.sum(dim=2).reshape(n, -1)
        if kind == "height":
            return squared.sum(dim=3).reshape(n, -1)
        if kind == "gap":
            return squared.mean(dim=(2, 3))
        along_height = squared.sum(dim=3).reshape(n, -1)
        along_width = squared.sum(dim=2).reshape(n, -1)
        return torch.cat([along_height, along_width], dim=1)


def _metadata_tensor(metadata: Mapping[str, Any], key: str, owner: str, what: str) -> torch.Tensor:
    try:
        value = metadata[key]
    except (KeyError, TypeError):
        available = sorted(metadata) if isinstance(metadata, Mapping) else metadata
        raise ValueError(
            f"{owner} needs {what} in the memory batch metadata under {key!r}; the buffer must "
            f"store it with each sample (metadata keys: {available})"
        ) from None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{owner}: metadata[{key!r}] must be a tensor, got {type(value).__name__}")
    return value
