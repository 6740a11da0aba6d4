"""A learner's checks: of its arguments when it is built, and of the data (labels, task ids, the
heads, the buffer's storage, the transforms) before anything of an update trains."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import attrs
import torch

from renate_events.components import WeightedPooledOutputDistillationLossComponent
from renate_events.inference import model_device, takes_task_id
from renate_events.learners.filling import buffer_metadata
from renate_events.learners.seeding import rng_kept
from renate_events.memory import DataBuffer
from renate_events.models import MultiHeadClassificationModel
from trainer import validators

__all__ = [
    "TRANSFORM_EXAMPLE",
    "DataChecks",
    "ModelRefusedError",
    "check_task_ids",
    "model_refused",
    "output_classes",
]

TRANSFORM_EXAMPLE = (
    "e.g. lambda x: x.float() / 255 for uint8 images, or the presets of "
    "renate_events.transforms (docs/images.rst, 'Transforms'; docs/own_model.rst, 'The contract')"
)
"""Where a missing transform's error points: the docs' example of a transform."""


def check_task_ids(task_ids: Any, size: int, where: str) -> None:
    """``task_ids`` must be an ``int64`` tensor of shape ``(size,)`` (shape and dtype only, no
    synchronisation)."""
    if not isinstance(task_ids, torch.Tensor):
        raise validators.WrongTypeError(
            f"{where} must be an int64 tensor of one task id per sample, got "
            f"{type(task_ids).__name__}"
        )
    if task_ids.dtype != torch.int64 or task_ids.shape != (size,):
        raise ValueError(
            f"{where} must be an int64 tensor of shape ({size},), one task id per sample, got "
            f"dtype {task_ids.dtype} and shape {tuple(task_ids.shape)}; convert them with "
            "torch.as_tensor(ids, dtype=torch.int64)"
        )


class ModelRefusedError(ValueError):
    """A model failing on a split's inputs, in :func:`model_refused`'s words; ``batch`` holds the
    inputs as the model was given them (after the transform), for a caller's advice."""

    def __init__(self, message: str, batch: torch.Tensor) -> None:
        super().__init__(message)
        self.batch = batch


def model_refused(learner: Any, name: str, batch: torch.Tensor, split: str, exc: Exception) -> str:
    """The message of a model failing on a split's batch (through the transform ``name``): where
    no transform makes the raw (``uint8``) inputs floats, the transform to define."""
    shown = f"{str(batch.dtype).replace('torch.', '')} {tuple(batch.shape)}"
    raised = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    where = f"the {split} data" + (
        " as the buffer replays it" if name == "buffer_transform" else ""
    )
    if getattr(learner, name) is not None:
        return f"{where}: the model fails on its inputs through {name} ({shown}): {raised}"
    floating = any(p.dtype.is_floating_point for p in learner.model.parameters())
    if floating and not batch.dtype.is_floating_point:
        return (
            f"{where}: the model fails on the raw {shown} inputs ({raised}); no {name} is set to "
            f"make them floats: define {name} (the learner's argument, or the function {name}() "
            f"of a config file), {TRANSFORM_EXAMPLE}"
        )
    return f"{where}: the model fails on its inputs ({shown}, no {name}): {raised}"


def output_classes(outputs: Any) -> int:
    """The number of classes of a model's ``outputs`` for class labels: ``(batch, classes)``
    logits. Another shape (``(batch, 4, 1)``) is refused with the shape: the losses, the
    buffer's logits and evaluation read the classes along dimension 1."""
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2:
        shown = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs)
        raise ValueError(
            f"the model's outputs have the shape {shown}; class labels need (batch, classes) "
            "logits: flatten the outputs (e.g. end the model with torch.nn.Flatten())"
        )
    return int(outputs.shape[1])


def _check_labels(labels: torch.Tensor, classes: int, what: str) -> None:
    """Class labels (an integer tensor of one per sample) in ``0..classes - 1``; other targets
    (soft labels for the user's loss) are left to it."""
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dim() != 1:
        return
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= classes:
        raise ValueError(
            f"{what} range over [{low}, {high}], but the model has {classes} outputs (labels "
            f"0..{classes - 1}); widen the model's last layer or remap the labels"
        )


@attrs.define(eq=False)
class DataChecks:
    """The checks of :class:`~renate_events.learners.BaseExperienceReplayLearner` (a mixin of it,
    not usable alone; its state is the base learner's fields).

    A preset adds its own checks by extending :meth:`check_data` (the data, before an update) or
    :meth:`_check_first_batch` (once per update, on its first batch).
    """

    def _check_feature_modules(self) -> None:
        """A POD component needs recorded features: refuse it without ``feature_modules``."""
        pod = [
            name
            for name, c in self.components.items()
            if isinstance(c, WeightedPooledOutputDistillationLossComponent) and c.weight > 0
        ]
        if pod and not self.feature_modules:
            raise ValueError(
                f"{type(self).__name__}: the component {pod[0]!r} distils intermediate "
                "representations, but feature_modules is empty; pass the names of the submodules "
                "to record, e.g. feature_modules=['layer1', 'layer2'] (see model.named_modules())"
            )

    def _check_buffer_filling(self) -> None:
        """``buffer_filling="end"`` needs a buffer to fill, and a learner that does not fill its
        buffer its own way (Joint, GDumb and repeated distillation put the update's data in
        before training on it; iCaRL herds its exemplars at the end)."""
        if self.buffer_filling != "step" and self._fills_own_buffer:
            raise ValueError(
                f"`{type(self).__name__}.buffer_filling` must be 'step' (the default): this "
                "learner fills its buffer its own way (the update's data before training, or "
                f"herding at the end), got {self.buffer_filling!r}; leave buffer_filling unset"
            )
        if self.buffer_filling == "end" and self.buffer is None:
            # suggest 'step' only to a learner that takes it (X-DER fills at the end only)
            step = " or buffer_filling='step'" if self._takes_buffer_filling("step") else ""
            raise ValueError(
                f"`{type(self).__name__}.buffer_filling` is 'end' (fill the memory at the end of "
                "each update), but the learner has no memory (memory_size=0 and no buffer); set "
                f"memory_size >= 1{step}"
            )

    def _takes_buffer_filling(self, value: str) -> bool:
        """Whether the learner's ``buffer_filling`` field accepts ``value``."""
        field = attrs.fields_dict(type(self))["buffer_filling"]
        try:
            if field.validator is not None:
                field.validator(self, field, value)
        except (ValueError, TypeError):
            return False
        return True

    def _split_batch(self) -> None:
        """The sizes of the new-data and memory batches (``batch_memory_frac`` splits one)."""
        if self.batch_memory_frac is not None:
            memory = min(self.memory_size, int(self.batch_memory_frac * self.batch_size))
            if memory < 1 or memory >= self.batch_size:
                raise ValueError(
                    f"batch_memory_frac={self.batch_memory_frac} with batch_size={self.batch_size} "
                    f"and memory_size={self.memory_size} leaves a memory batch of {memory} and a "
                    f"new-data batch of {self.batch_size - memory}; both must be >= 1"
                )
            self.memory_batch_size, self._new_batch_size = memory, self.batch_size - memory
            return
        self._new_batch_size = self.batch_size
        if 0 < self.memory_size < self.memory_batch_size and self.components:
            raise ValueError(
                f"memory_batch_size={self.memory_batch_size} is larger than memory_size="
                f"{self.memory_size}: the buffer could never serve a memory batch and replay "
                "would silently never happen; lower memory_batch_size or raise memory_size"
            )

    def check_updates(self, count: int) -> None:
        """Raise ``ValueError`` if the learner cannot take ``count`` more updates: nothing for
        most methods; a method with a pool of one prompt per update checks the pool. ``run``
        checks its number of tasks before the first update, :meth:`check_data` one more."""

    def check_data(self, data: Any) -> None:
        """Reject a learner that cannot take another update (:meth:`check_updates`), empty
        data and labels outside the model's outputs before anything trains.

        ``fit`` calls it first; :class:`~renate_events.updater.ModelUpdater` calls it before an
        update, with its other checks. Raises ``ValueError`` naming what is wrong.
        """
        self.check_updates(1)
        try:
            size = len(data)
        except TypeError:
            return  # an iterable without len(): checked batch by batch by the trainer
        if size == 0:
            raise ValueError(
                f"{type(self).__name__}.fit got an empty training set; pass data for the update"
            )
        tensors = getattr(data, "tensors", None)
        if not isinstance(tensors, tuple) or len(tensors) not in (2, 3):
            return
        inputs, targets = tensors[:2]
        task_ids = tensors[2] if len(tensors) == 3 else None
        self._check_task_data(task_ids, len(targets))
        self._check_against_buffer(inputs, targets)
        if targets.dtype.is_floating_point or targets.dim() != 1:
            return  # not class labels
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                probe = inputs[:2].to(model_device(self.model))
                with rng_kept(probe):
                    probe = self.probe_transform("train_transform", probe)
                try:
                    classes = self._probe_classes(probe, task_ids)
                except ValueError:
                    raise
                except (
                    Exception
                ) as exc:  # the model refuses the sample: said as check_split says it
                    raise ModelRefusedError(
                        model_refused(self, "train_transform", probe, "training", exc), probe
                    ) from None
        finally:
            self.model.train(was_training)
        for name in ("train_target_transform", "buffer_target_transform"):
            # the labels the losses see: the raw ones, or the target transform's
            if name == "buffer_target_transform" and self.buffer is None:
                continue
            labels, what = targets, "the training labels"
            if getattr(self, name) is not None:
                on_device = targets.to(model_device(self.model))  # where the transform runs
                with rng_kept(on_device):
                    labels = self._transformed(name, on_device, len(targets))
                what = f"the training labels through {name}"
            _check_labels(labels, classes, what)

    def _check_against_buffer(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """A sample of the data against the buffer's storage (shape and dtype of inputs and
        targets), before a forward pass could change the model (batch-norm statistics)."""
        buffer = self.buffer
        if buffer is None or len(buffer) == 0:
            return
        slot = torch.zeros(1, dtype=torch.int64)  # checked on the CPU: no read from a GPU
        stored = {key: buffer.get_metadata(key, slot) for key in buffer.metadata_keys}
        buffer.check_batch(inputs[:1], targets[:1], stored)

    def _probe_classes(self, probe: Any, task_ids: torch.Tensor | None) -> int:
        """The model's outputs for ``probe`` (through the head of the first sample's task id; a
        head still to be added has the model's ``num_outputs``)."""
        if task_ids is None:
            return output_classes(self._forward(probe))
        model, first = self.model, int(task_ids[0])
        if isinstance(model, MultiHeadClassificationModel) and str(first) not in model.heads:
            return cast(int, model.num_outputs)
        return output_classes(self._forward(probe, task_ids[:1].to(model_device(model))))

    def _check_task_data(self, task_ids: torch.Tensor | None, size: int) -> None:
        """Task ids of a dataset (or their absence) against the model, the components, the
        buffer and the heads, before anything changes."""
        held = self.buffer is not None and len(self.buffer) > 0
        stored = held and "task_id" in cast(DataBuffer, self.buffer).metadata_keys
        if task_ids is None:
            if stored:
                raise ValueError(
                    f"{type(self).__name__}: the buffer holds task ids (earlier updates were "
                    "task-incremental), but this data has none; give (inputs, targets, task_ids)"
                )
            return
        name = f"{type(self).__name__}.fit: the training data's task ids (third tensor)"
        check_task_ids(task_ids, size, name)
        if not takes_task_id(self.model):
            raise ValueError(
                f"{name}: the model's forward takes no task_id argument, so the ids cannot "
                "reach it; use renate_events.models.MultiHeadClassificationModel (or a forward(x, "
                "task_id)), or give (inputs, targets) data"
            )
        if held and not stored:
            raise ValueError(
                f"{name}: the buffer was filled without task ids (earlier updates gave (inputs, "
                "targets)), so its samples could not reach their heads; start from an empty "
                "buffer or give (inputs, targets) data"
            )
        low, high = int(task_ids.min()), int(task_ids.max())
        if low < 0 or high > 10**9:
            raise ValueError(f"{name} must lie in [0, 10**9], got ids in [{low}, {high}]")
        self._check_components_take_task_ids(name)
        if isinstance(self.model, MultiHeadClassificationModel):
            self._check_heads(self.model, torch.unique(task_ids).tolist(), name)

    def _check_components_take_task_ids(self, name: str) -> None:
        """A component that calls the model itself (CLS-ER's and LwF's copies, EWC's Fisher
        pass, iCaRL's old model: :attr:`Component.calls_model`) would call it without task ids:
        refused."""
        for key, component in self.components.items():
            if component.calls_model:
                raise ValueError(
                    f"{name}: the component {key!r} ({type(component).__name__}) calls the model "
                    "(or copies of it) on its own, without task ids, so it cannot train on "
                    "task-incremental data; choose another learner or give (inputs, targets) data"
                )

    def _check_heads(
        self, model: MultiHeadClassificationModel, task_ids: Sequence[int], name: str
    ) -> None:
        """The heads of ``task_ids`` can exist (added with ``num_outputs``, by an optimizer
        factory) and all heads have one size (batches mix tasks; stored logits share a width)."""
        missing = [t for t in task_ids if str(t) not in model.heads]
        if missing and model.num_outputs is None:
            raise ValueError(
                f"{name}: task ids {missing} have no head and the model has no num_outputs to "
                f"add one with (heads exist for {list(model.task_ids)}); add them with "
                "model.add_task_params(task_id, num_outputs) or build the model with num_outputs"
            )
        if missing and isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"{name}: task ids {missing} need new heads, which an optimizer instance would "
                "not train; pass an optimizer factory f(parameters) (the default), or add the "
                "heads before building the optimizer"
            )
        sizes = {int(head.out_features) for head in model.heads.values()}
        sizes |= {cast(int, model.num_outputs)} if missing else set()
        if len(sizes) > 1:
            raise ValueError(
                f"{name}: the heads have different numbers of outputs {sorted(sizes)}; a batch "
                "mixes the samples of several tasks and the buffer stores one width of logits, "
                "so every head needs the same number of outputs"
            )

    def _check_buffer_transforms(self, inputs: Any, targets: torch.Tensor) -> None:
        """Try the buffer transforms on a raw sample of the new batch (the buffer stores raw
        samples like it), before anything trains, without drawing from the RNG."""
        if self.buffer is None or (
            self.buffer_transform is None and self.buffer_target_transform is None
        ):
            return
        with rng_kept(targets):
            if isinstance(inputs, torch.Tensor):
                self._transformed("buffer_transform", inputs[:1], 1)
            self._transformed("buffer_target_transform", targets[:1], 1)

    def probe_transform(self, name: str, batch: torch.Tensor) -> Any:
        """The first sample of ``batch`` through the transform ``name``, its contract (a tensor of
        the batch's rows) checked on that sample and on the first two: a transform that returns a
        fixed number of rows (``x[:1]``) keeps a batch of one. Returns the one-sample result."""
        first = self._transformed(name, batch[:1], 1)
        if len(batch) > 1:
            self._transformed(name, batch[:2], 2)
        return first

    def _check_first_batch(
        self,
        inputs: Any,
        targets: torch.Tensor,
        outputs: torch.Tensor,
        features: Sequence[torch.Tensor],
        *,
        task_ids: torch.Tensor | None = None,
    ) -> None:
        """Once per update, before anything trains: the batch must fit the buffer's storage."""
        if not self._batch_checked and self.buffer is not None:
            metadata = buffer_metadata(outputs, features, task_ids)
            self.buffer.check_batch(inputs, targets, metadata)
