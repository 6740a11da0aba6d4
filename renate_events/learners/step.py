"""The experience-replay step: the new batch and the memory batches through the model, the
components' losses, the fused and concatenated paths, memory sampling, transforms and the EMA
of stored logits. This is the hot path: every line here runs once per training step."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from renate_events.components import Component, WeightedCustomLossComponent
from renate_events.inference import forward
from renate_events.learners.batches import unpack_task
from renate_events.learners.checks import check_task_ids
from renate_events.memory import DataBuffer
from trainer import validators
from trainer.capture import eager
from trainer.data import to_device

__all__ = ["ReplayOnlyForMemoryLosses", "ReplayStep", "TransformError", "TransformTypeError"]


class TransformError(ValueError):
    """A batch transform broke its contract (a tensor with the batch's rows), on the probe before
    training or on a later batch: the update is undone; one line on the command line."""


class TransformTypeError(TransformError, validators.WrongTypeError):
    """A batch transform returned something other than a tensor."""


def _mean(loss: torch.Tensor) -> torch.Tensor:
    """The mean of a per-sample loss; a scalar as it is (an operation less in the step)."""
    return loss if loss.dim() == 0 else loss.mean()


def _scaled(loss: torch.Tensor, factor: float) -> torch.Tensor:
    """``loss * factor``, without an operation when the factor is 1."""
    return loss if factor == 1 else loss * factor


def _split_at(
    n: int, outputs: torch.Tensor, features: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Split outputs and features of a pass over ``[new; memory]`` after the first ``n`` rows.

    ``split`` is one autograd node that stacks the two gradients (two slices would each allocate
    a zero gradient of the whole batch).
    """
    sizes = [n, len(outputs) - n]
    new, memory = outputs.split(sizes)
    parts = [feature.split(sizes) for feature in features]
    return new, memory, [p[0] for p in parts], [p[1] for p in parts]


def _stackable(inputs: torch.Tensor, inputs_memory: Any) -> bool:
    """Whether new and memory inputs can be concatenated along the batch."""
    return (
        isinstance(inputs_memory, torch.Tensor)
        and inputs_memory.dtype == inputs.dtype
        and inputs_memory.device == inputs.device
        and inputs_memory.shape[1:] == inputs.shape[1:]
    )


class _Passes(NamedTuple):
    """What :meth:`BaseExperienceReplayLearner._forward_new_and_memory` ran.

    ``outputs`` and ``features`` of the new batch and, when it was drawn there, the step's first
    memory batch with its outputs and features (``None`` when not forwarded yet). ``fused``:
    ``outputs`` are those of ``[new; memory]`` in one tensor, to be scored by one cross-entropy.
    """

    outputs: torch.Tensor
    features: list[torch.Tensor]
    batch_memory: Any = None
    outputs_memory: torch.Tensor | None = None
    features_memory: list[torch.Tensor] | None = None
    fused: bool = False


def _joined_task_ids(
    task_ids: torch.Tensor | None, task_ids_memory: torch.Tensor | None
) -> torch.Tensor | None:
    """The task ids of ``[new; memory]``: both batches carry them or neither does."""
    if task_ids is None and task_ids_memory is None:
        return None
    if task_ids is None or task_ids_memory is None:
        which = (
            "the new batch has none, the buffer's samples have"
            if task_ids is None
            else ("the new batch has them, the buffer's samples have none")
        )
        raise ValueError(
            f"task ids: {which}; give every update (inputs, targets, task_ids) data, or none"
        )
    return torch.cat([task_ids, task_ids_memory])


@attrs.define(eq=False)
class ReplayStep:
    """The training and validation steps of
    :class:`~renate_events.learners.BaseExperienceReplayLearner` (a mixin of it, not usable
    alone; its state is the base learner's fields). The step's semantics are described there.
    """

    def training_step(self, batch: Any) -> dict[str, Any]:
        """Loss of one batch of new data plus the components' losses on memory batches.

        Under a captured trainer (``Trainer(capture="compile")``) the steady steps are traced by
        ``torch.compile``; the first step of an update, the memory sampling, the transforms and
        the writes to the learner's and the buffer's state run eagerly between the compiled
        pieces (see :func:`eager`).
        """
        if self._batch_checked:
            return self._step(batch)
        return self._first_step(batch)

    @eager
    def _first_step(self, batch: Any) -> dict[str, Any]:
        """The first step of an update, eager: its checks run, and what it changes is noted to
        be put back by on_exception (the loss may still be refused after the step returns)."""
        self._note_first_step()
        outputs = self._step(batch)
        self._batch_checked = True
        return outputs

    def _step(self, batch: Any) -> dict[str, Any]:
        """Forward the new batch (with the first memory batch where they share a pass), then add
        the components' losses on memory batches."""
        raw_inputs, raw_targets, task_ids = unpack_task(batch)
        if not self._batch_checked:
            self._check_buffer_transforms(raw_inputs, raw_targets)
            if task_ids is not None:
                check_task_ids(task_ids, len(raw_targets), "a batch's task ids (third item)")
        inputs = self._transformed("train_transform", raw_inputs, len(raw_targets))
        targets = self._transformed("train_target_transform", raw_targets, len(raw_targets))
        # In a distributed fit the trainer's DistributedDataParallel wrapper, so that the
        # gradients are averaged over the ranks while the backward pass runs.
        net = self.trainer.training_model
        net = self.model if net is None else net
        replay = self._replay_ready()
        passes = self._forward_new_and_memory(net, inputs, replay, task_ids)
        if passes.fused:
            return self._fused_step(inputs, targets, passes, (raw_inputs, raw_targets, task_ids))
        outputs, features = passes.outputs, passes.features
        logits = outputs
        if self.mask_unused_classes:
            # the mask first: `outputs.masked_fill` looked up before the eager `_seen` call
            # would be a bound method that dynamo cannot carry over the graph break
            seen = self._seen(targets, outputs.shape[-1])
            logits = outputs.masked_fill(~seen, float("-inf"))
        self._check_first_batch(raw_inputs, raw_targets, outputs, features, task_ids=task_ids)
        loss = _scaled(_mean(self.loss_fn(logits, targets)), self.loss_weight)
        if replay:
            loss = self._memory_losses(net, loss, passes)
        for component in self.components.values():  # memory-free terms (EWC, LwF, ...)
            extra = component.new_data_loss(outputs, (inputs, targets), features)
            if extra is not None:
                loss = loss + extra
        return {
            "loss": loss,
            "logits": outputs.detach(),
            "features": [f.detach() for f in features],
        }

    def _replay_ready(self) -> bool:
        """Whether this step replays: there are components, and a memory batch in the buffer."""
        buffer = self.buffer
        return buffer is not None and bool(self.components) and len(buffer) >= self._memory_batch()

    def _forward_new_and_memory(
        self, net: nn.Module, inputs: Any, replay: bool, task_ids: torch.Tensor | None = None
    ) -> _Passes:
        """Run the model on the new batch and, in the same pass, on the step's first memory
        batch (with ``memory_forward`` concatenating, when the two batches stack); task ids, if
        the data carries them, go with both (the memory batch's from the buffer)."""
        if not (replay and self._concatenate and isinstance(inputs, torch.Tensor)):
            return _Passes(forward(net, inputs, task_ids), self._features())
        batch_memory = self._sample_memory(inputs.device)
        inputs_memory = batch_memory[0][0]
        if not _stackable(inputs, inputs_memory):  # left to separate passes and their checks
            return _Passes(forward(net, inputs, task_ids), self._features(), batch_memory)
        both_ids = _joined_task_ids(task_ids, batch_memory[1].get("task_id"))
        both, features_both = self._concatenated_forward(net, inputs, inputs_memory, both_ids)
        fused = self._fused
        if fused is not None and fused.weight > 0 and both.dim() == 2 and len(inputs):
            return _Passes(both, features_both, batch_memory, fused=True)
        outputs, outputs_memory, features, features_memory = _split_at(
            len(inputs), both, features_both
        )
        return _Passes(outputs, features, batch_memory, outputs_memory, features_memory)

    def _memory_losses(self, net: nn.Module, loss: torch.Tensor, passes: _Passes) -> torch.Tensor:
        """``loss`` plus every component's loss on its memory batch, normalised by the weights.

        The first component, and each with ``sample_new_memory_batch``, gets a memory batch of its
        own (the first one is that of ``passes`` when it was drawn there); the others reuse the
        batch, outputs and features of the component before them.
        """
        batch_memory, outputs_memory = passes.batch_memory, passes.outputs_memory
        features_memory = passes.features_memory
        total_weight = self.loss_weight
        for i, component in enumerate(self.components.values()):
            if i == 0 or component.sample_new_memory_batch:
                if i > 0 or batch_memory is None:
                    batch_memory = self._sample_memory(passes.outputs.device)
                if i > 0 or outputs_memory is None:
                    ids = batch_memory[1].get("task_id")  # each sample through its own head
                    outputs_memory = forward(net, batch_memory[0][0], ids)
                    features_memory = self._features()
                self._ema_update(batch_memory, outputs_memory)
            loss = loss + _mean(component.loss(outputs_memory, batch_memory, features_memory))
            total_weight += component.weight
        if self.loss_normalization and total_weight > 0:
            loss = loss if total_weight == 1 else loss / total_weight
        return loss

    @eager
    def _sample_memory(self, device: torch.device) -> Any:
        """A memory batch on ``device`` (the model's); its stored logits also under Renate's key
        ``"outputs"`` (the same tensor), for components written for Renate."""
        buffer = cast(DataBuffer, self.buffer)
        batch = buffer.sample(self._memory_batch())
        if not (self._samples_on_storage and buffer.device == device):
            batch = to_device(batch, device, pin=True)  # pinned staging from a CPU buffer
        memory, metadata = batch
        if self.buffer_transform is not None or self.buffer_target_transform is not None:
            inputs_memory, targets_memory = memory
            n = len(targets_memory)
            memory = (
                self._transformed("buffer_transform", inputs_memory, n),
                self._transformed("buffer_target_transform", targets_memory, n),
            )
        if "logits" in metadata and "outputs" not in metadata:
            metadata = metadata if isinstance(metadata, dict) else dict(metadata)
            metadata["outputs"] = metadata["logits"]
        return memory, metadata

    def _transformed(self, name: str, value: Any, rows: int) -> Any:
        """``value`` through the transform field ``name`` (as it is when that is ``None``),
        checked to be a tensor of ``rows`` rows."""
        transform = getattr(self, name)
        if transform is None:
            return value
        return self._apply_transform(name, transform, value, rows)

    @eager
    def _apply_transform(self, name: str, transform: Any, value: Any, rows: int) -> Any:
        """``transform(value)``, eager (its random draws are the eager step's)."""
        result = transform(value)
        if not isinstance(result, torch.Tensor):
            raise TransformTypeError(
                f"`{type(self).__name__}.{name}` must return a tensor, got "
                f"{type(result).__name__} (from {transform!r})"
            )
        if result.dim() == 0 or result.shape[0] != rows:
            raise TransformError(
                f"`{type(self).__name__}.{name}` must keep the batch size {rows}, got shape "
                f"{tuple(result.shape)} (from {transform!r})"
            )
        return result

    def _concatenated_forward(
        self,
        net: nn.Module,
        inputs: torch.Tensor,
        inputs_memory: torch.Tensor,
        task_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward ``[inputs; inputs_memory]`` once (with the task ids of both, if any); check
        that outputs and features can be split at the seam (the batch is their first
        dimension)."""
        n, total = inputs.shape[0], inputs.shape[0] + inputs_memory.shape[0]
        outputs = forward(net, torch.cat([inputs, inputs_memory]), task_ids)
        features = self._features()
        for i, feature in enumerate([outputs, *features]):
            if not isinstance(feature, torch.Tensor) or feature.dim() == 0 or len(feature) != total:
                what = (
                    "the model's output" if i == 0 else f"feature {self.feature_modules[i - 1]!r}"
                )
                shape = tuple(feature.shape) if isinstance(feature, torch.Tensor) else feature
                raise ValueError(
                    f"memory_forward='concatenated' splits {what} after the first {n} rows of "
                    f"{total}, but it has shape {shape}: the batch must be its first dimension. "
                    "Use memory_forward='separate' for this model"
                )
        return outputs, features

    def _fused_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        passes: _Passes,
        raw: tuple[Any, torch.Tensor, torch.Tensor | None],
    ) -> Any:
        """The step's loss as one cross-entropy over ``[new; memory]`` (see :meth:`_fusable`).

        ``(w * mean(CE_new) + w_c * mean(CE_memory)) / (w + w_c)`` is a weighted sum of
        per-sample cross-entropies: with equal weights per sample (equal loss weights and batch
        sizes, the default) it is ``CE(both).mean()`` exactly, otherwise ``CE(both, reduction=
        "none")`` weighted. Same value up to rounding as the component's own loss, with one
        cross-entropy and no split in the backward pass. Taken for outputs of shape ``(N, C)``, a
        non-empty new batch and a positive component weight (a zero weight skips the memory
        cross-entropy altogether on the component's path, which a weighted sum cannot).
        """
        both, batch_memory = passes.outputs, passes.batch_memory
        n, m = len(inputs), len(both) - len(inputs)
        outputs, outputs_memory = both.detach().split([n, m])
        self._check_first_batch(raw[0], raw[1], outputs, [], task_ids=raw[2])
        self._ema_update(batch_memory, outputs_memory)
        (_, targets_memory), _ = batch_memory
        weight, weight_memory = self.loss_weight, cast(Component, self._fused).weight
        total = weight + weight_memory
        scale = total if self.loss_normalization and total > 0 else 1.0
        per_new, per_memory = weight / (n * scale), weight_memory / (m * scale)
        all_targets = torch.cat([targets, targets_memory])
        if per_new == per_memory:
            loss = _scaled(F.cross_entropy(both, all_targets), per_new * (n + m))
        else:
            per_sample = F.cross_entropy(both, all_targets, reduction="none")
            loss = (per_sample * self._sample_weights(n, m, per_new, per_memory, per_sample)).sum()
        return {"loss": loss, "logits": outputs, "features": []}

    def _sample_weights(
        self, n: int, m: int, per_new: float, per_memory: float, like: torch.Tensor
    ) -> torch.Tensor:
        """``[per_new] * n + [per_memory] * m`` as a tensor like ``like`` (kept between steps;
        ``like`` is the per-sample loss, in float32 under mixed precision too)."""
        key = (n, m, per_new, per_memory, like.device, like.dtype)
        if self._weights_key != key:
            self._make_sample_weights(key)
        return cast(torch.Tensor, self._weights)

    @eager
    def _make_sample_weights(self, key: tuple[Any, ...]) -> None:
        n, m, per_new, per_memory, device, dtype = key
        weights = torch.full((n + m,), per_memory, dtype=dtype, device=device)
        weights[:n] = per_new
        self._weights, self._weights_key = weights, key

    def _fusable(self) -> WeightedCustomLossComponent | None:
        """The single component whose loss :meth:`_fused_step` computes, if the step allows it.

        That is: one pass over new and memory batch, no class masking, no recorded features, and
        exactly one component, a ``WeightedCustomLossComponent`` itself (not a subclass, whose
        loss may differ) applying the learner's loss function, both
        ``torch.nn.functional.cross_entropy`` (a mean of per-sample terms:
        ``ExperienceReplayLearner``'s defaults). The step checks the rest: ``(N, C)`` outputs, a
        positive weight and a non-empty new batch (see :meth:`_forward_new_and_memory`).
        """
        # The per-sample weights assume class labels in 0..K-1 (as fit checks for datasets) or
        # probabilities: a label equal to cross_entropy's ignore_index (-100) drops out of the
        # mean over both batches and would shift how the two means are weighted. Such data needs
        # memory_forward="separate" (docs/migration.rst says so).
        components = list(self.components.values())
        if (
            not self._concatenate
            or self.mask_unused_classes
            or self.feature_modules
            or len(components) != 1
        ):
            return None
        component = components[0]
        if (
            type(component) is WeightedCustomLossComponent
            and component.loss_fn is F.cross_entropy
            and self.loss_fn is F.cross_entropy
        ):
            return component
        return None

    def _ema_update(self, batch_memory: Any, outputs_memory: torch.Tensor) -> None:
        """Move the stored logits of a freshly forwarded memory batch towards the current ones."""
        (_, _), metadata = batch_memory
        if self.ema_memory_update_gamma < 1.0 and "logits" in metadata:
            self._move_stored_logits(metadata, outputs_memory)

    @eager
    def _move_stored_logits(self, metadata: Any, outputs_memory: torch.Tensor) -> None:
        """The EMA's write into the buffer (eager: it changes the buffer's state)."""
        buffer = cast(DataBuffer, self.buffer)
        gamma, idx, stored = self.ema_memory_update_gamma, metadata["idx"], metadata["logits"]
        if self._undo is not None and not self._batch_checked:  # the first step: undoable
            previous = stored.clone()
            self._undo.append(lambda: buffer.set_metadata("logits", idx, previous, distinct=True))
        updated = gamma * stored + (1.0 - gamma) * outputs_memory.detach()
        buffer.set_metadata("logits", idx, updated, distinct=True)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """``loss`` and ``accuracy`` of a batch (reported as ``val_loss``, ``val_accuracy``)."""
        inputs, targets, task_ids = unpack_task(batch)
        outputs = self._forward(self._transformed("test_transform", inputs, len(targets)), task_ids)
        reported = {
            "loss": self.loss_fn(outputs, targets).mean(),
            "accuracy": (outputs.argmax(dim=-1) == targets).float().mean(),
        }
        for name, metric in self.metrics.items():
            reported[name] = torch.as_tensor(metric(outputs, targets)).float().mean()
        return reported

    def _memory_batch(self) -> int:
        limit = self.memory_size if self.memory_size > 0 else self.memory_batch_size
        return min(self.memory_batch_size, limit)

    def _forward(self, inputs: Any, task_ids: torch.Tensor | None = None) -> torch.Tensor:
        return forward(self.model, inputs, task_ids)

    def _features(self) -> list[torch.Tensor]:
        return [] if self._recorder is None else list(self._recorder.representations)

    @eager
    def _seen(self, targets: torch.Tensor, classes: int) -> torch.Tensor:
        """The ``(classes,)`` bool mask of the logits the new-data loss keeps with
        ``mask_unused_classes``: the classes of this update's batches so far, ``targets``
        included (kept in ``_seen_classes`` and in checkpoints). A preset that masks other
        classes overrides it; it runs once per step, so it must not synchronise with the device.
        """
        seen = self._seen_classes
        if seen is None or seen.numel() != classes or seen.device != targets.device:
            grown = torch.zeros(classes, dtype=torch.bool, device=targets.device)
            if seen is not None:
                grown[: min(classes, seen.numel())] = seen[:classes].to(targets.device)
            seen = grown
        self._seen_classes = seen.index_fill(0, targets.reshape(-1), True)
        return self._seen_classes


@attrs.define(eq=False)
class ReplayOnlyForMemoryLosses:
    """For a memory-free preset whose own component adds nothing on memory batches: replay only
    when some component has a memory weight. Put it before the base learner in the bases.

    A ``memory_size`` given by ``ModelUpdater`` or the command line would otherwise forward a
    memory batch per step for nothing.
    """

    def _replay_ready(self) -> bool:
        return any(c.weight > 0 for c in self.components.values()) and super()._replay_ready()
