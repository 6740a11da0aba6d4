"""The base experience-replay learner: its arguments and how one model update is wired to the
trainer (fit, the train-start hook, checkpoints).

A learner owns a model, a memory buffer and an ordered list of named components, and drives a
:class:`trainer.Trainer`: it supplies the training step, subscribes itself (to update the buffer)
and then its components (in list order, under their names) as listeners. ``learner.fit(data)`` is
one model update; calling it again on the next task's data continues with the same buffer and
components. The step, the buffer filling, the data checks and the undo of a failed update are
the mixins this class is made of (:mod:`renate_events.learners.step`, ``filling``, ``checks``,
``undo``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, cast

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from renate_events.components import (
    Component,
    IntermediateRepresentations,
    WeightedCustomLossComponent,
)
from renate_events.learners.checks import DataChecks, check_task_ids
from renate_events.learners.filling import BUFFER_FILLINGS, BufferFilling
from renate_events.learners.loaded import LoadLimits, check_restored_tensors, load_buffer
from renate_events.learners.seeding import derived_seed
from renate_events.learners.split_checks import as_dataset, check_splits
from renate_events.learners.step import ReplayStep
from renate_events.learners.undo import FailedUpdateUndo
from renate_events.memory import DataBuffer, ReservoirBuffer
from renate_events.models import MultiHeadClassificationModel
from trainer import FitResult, TensorLoader, Trainer, validators

__all__ = ["BaseExperienceReplayLearner"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""``f(parameters) -> optimizer``: the optimizer factory a learner calls at every ``fit``."""


def _samples_independent(model: nn.Module) -> bool:
    """Whether ``model`` has no batch-normalisation layer (whose training-time statistics make
    one sample's output depend on the others in its batch)."""
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _metric_functions(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """``{name: fn(outputs, targets)}``, named as listeners are, other than loss and accuracy."""
    name = validators.field_name(instance, attribute)
    for key, function in value.items():
        if not (isinstance(key, str) and validators.NAME_PATTERN.fullmatch(key)):
            raise validators.WrongTypeError(
                f"{name} keys must be names of letters, digits and _ (reported as "
                f"val_<name>), got {key!r}"
            )
        if key in ("loss", "accuracy"):
            raise ValueError(f"{name}: {key!r} is reported already; choose another name")
        if not callable(function):
            raise validators.WrongTypeError(
                f"{name}[{key!r}] must be a function (outputs, targets) -> scalar, got {function!r}"
            )


def _named_components(components: Any) -> dict[str, Component]:
    if isinstance(components, Mapping):
        named = dict(components)
    elif isinstance(components, Sequence):
        named, counts = {}, {}
        for component in components:
            base = validators.snake_case(type(component).__name__)
            counts[base] = counts.get(base, -1) + 1
            named[f"{base}_{counts[base]}"] = component
    else:
        raise TypeError(
            "components must be a mapping of names to Component or a sequence of Component, "
            f"got {type(components).__name__}"
        )
    for name, component in named.items():
        if not isinstance(component, Component):
            raise TypeError(
                f"component {name!r} is a {type(component).__name__}, not a Component; "
                "subclass renate_events.components.Component"
            )
        if (
            not isinstance(name, str)
            or not validators.NAME_PATTERN.match(name)
            or name == "learner"
        ):
            raise ValueError(
                f"component name {name!r} is not valid: use letters, digits, '_' and '-' and do "
                "not use 'learner' (the learner's own checkpoint key)"
            )
    return named


@attrs.define(eq=False)
class BaseExperienceReplayLearner(ReplayStep, BufferFilling, DataChecks, FailedUpdateUndo):
    """Experience replay with an ordered list of components (Renate's step semantics).

    One training step:

    1. the model runs on the new batch; its loss ``loss_fn(outputs, targets).mean()`` is scaled by
       ``loss_weight`` (with ``mask_unused_classes``, logits of classes not yet seen in this
       update are set to ``-inf`` for this loss only);
    2. once the buffer holds a memory batch, for each component in order a memory batch is sampled
       and forwarded if the component asks for it (``sample_new_memory_batch``) or if none was
       sampled in this step yet, and ``component.loss(outputs_memory, batch_memory,
       intermediate_representation_memory)`` is added; with ``ema_memory_update_gamma < 1`` the
       stored logits of the sampled slots move towards the current ones
       (``gamma * stored + (1 - gamma) * current``);
    3. with ``loss_normalization`` the total is divided by ``loss_weight`` plus the weights of the
       components (only while memory is used); then each component's
       :meth:`~renate_events.components.Component.new_data_loss` on the new batch is added (a
       hook for memory-free methods, EWC and LwF; ``None`` by default);
    4. after the optimizer step (the trainer's ``batch_end``) the buffer is updated with the batch,
       its unmasked logits and its intermediate representations (``buffer_filling="step"``; with
       ``"end"`` the whole update's data is offered at ``train_end`` instead, with the final
       model's logits), then the components' ``on_train_batch_end`` run.

    Memory batches carry the stored logits under ``"logits"`` and Renate's ``"outputs"`` (the
    same tensor). An update that fails or is interrupted, at any step, leaves no trace: the model,
    buffer, components, listeners and trainer are put back as they were (see
    :meth:`~renate_events.learners.FailedUpdateUndo.all_or_nothing`).

    Memory batches are tensor operations on the buffer's device; no DataLoader is built per step.
    A buffer on another device than the model is allowed (its batches are copied to the model's
    device); pass ``buffer=ReservoirBuffer(..., device="cuda")`` to keep it on the GPU.

    Args:
        model: The model; called as ``model(x)``, ``model(*x)`` or ``model(**x)`` (see
            :func:`~renate_events.inference.forward`).
        loss_fn: ``loss_fn(outputs, targets)``, per-sample or scalar; its mean is the loss.
        optimizer: An optimizer factory ``f(parameters)`` called at the start of every
            ``fit`` (Renate's behaviour: each update starts with fresh optimizer state), or an
            optimizer instance reused across fits. Default: Adam with learning rate 1e-3.
        components: Named components (a mapping, kept in order) or a sequence (named after their
            classes). A preset (``ExperienceReplayLearner``, ...) runs them after its own; one
            under the name of a preset component (``"memory_loss"``, ...) takes that
            component's place, and the preset's arguments for it no longer apply.
        memory_size: Slots of the default reservoir buffer; 0 disables memory.
        memory_batch_size: Samples per memory batch.
        batch_size: Samples per batch of new data when ``fit`` receives a dataset.
        batch_memory_frac: If set, split ``batch_size`` as Renate documents it: the memory batch
            is ``min(memory_size, int(batch_memory_frac * batch_size))`` and the new-data batch
            the rest.
        loss_weight: Weight of the loss on new data.
        ema_memory_update_gamma: In (0, 1]; below 1 the stored logits are updated in place.
        loss_normalization: Divide the loss by the sum of the weights.
        mask_unused_classes: In the new-data loss, mask the logits of classes that this update's
            data has not shown so far (Renate's behaviour: classes of earlier updates are
            masked); stored logits and memory losses stay unmasked.
        buffer: A buffer to use instead of the default ``ReservoirBuffer(memory_size, seed)``.
        feature_modules: Names of submodules whose outputs are recorded as intermediate
            representations (stored with each sample, given to the components).
        learning_rate_scheduler: Optional factory ``f(optimizer)`` of a scheduler.
        learning_rate_scheduler_interval: ``"epoch"`` or ``"step"``.
        seed: Seeds the default buffer and the trainer (when it has no seed of its own).
        metrics: ``{name: fn(outputs, targets)}``, each reported by validation as ``val_<name>``
            (the mean over batches) beside ``val_loss`` and ``val_accuracy``.
        collate_fn: The ``DataLoader`` collate function for datasets that are not a
            ``TensorDataset``.
        train_transform: Renate's name: ``f(inputs) -> inputs`` on each whole batch of new data,
            on the training device, before the model (e.g.
            :func:`renate_events.transforms.cifar_train_transform`); the buffer stores the raw,
            untransformed inputs (``uint8`` images stay ``uint8``).
        train_target_transform: ``f(targets) -> targets`` on each batch of new data's targets.
        buffer_transform: ``f(inputs) -> inputs`` on each memory batch when it is sampled, so
            every replay of a sample sees a fresh augmentation; it is tried on the raw first
            batch of every update (without drawing from the RNG), so a transform that cannot
            handle the stored dtype fails before anything trains.
        buffer_target_transform: ``f(targets) -> targets`` on each memory batch's targets.
        test_transform: ``f(inputs) -> inputs`` on validation batches (and in ``fit``'s check of
            the data against the model). Every transform must return a tensor with the batch's
            number of rows; random ones draw from torch's global RNG, which the trainer
            checkpoints, so a resumed update repeats the same augmentations.
        trainer: The trainer to drive (epochs, device, precision, ...); subscribe your own
            listeners to it.
        memory_forward: How the new batch and the step's first memory batch go through the
            model: ``"separate"``, two forward passes (Renate's way); ``"concatenated"``, one pass
            over both batches stacked, split at the seam afterwards (recorded features must then
            have the batch first); ``"auto"`` (default), concatenated unless the model has
            batch-normalisation layers or ``feature_modules`` are recorded. For a model whose
            samples do not interact both give the same losses up to rounding (dropout draws
            differ); pass ``"separate"`` for a model that mixes the samples of a batch in another
            way (``F.batch_norm`` called directly, batch statistics, expert capacity limits).
        buffer_filling: When the update's samples go into the buffer. ``"step"`` (default,
            Renate's ER/DER behaviour): each trained batch after its optimizer step, with the
            logits and features of that step. ``"end"``: at the trainer's ``train_end``, every
            sample of the update's data, with the logits and features of the final model (in eval
            mode, on the inputs through ``test_transform``; the raw inputs are stored), so that
            during an update the buffer holds only earlier updates' data (as Renate's Offline-ER
            and Avalanche's DER do). Reservoir or class-balanced filling is the buffer's choice
            (``buffer=GreedyClassBalancingBuffer(...)``). The end fill happens once per update:
            not after an interrupted or failed update (a failed update puts the buffer back as
            it was, from an in-memory copy taken at ``train_start``; not for a memory-mapped
            buffer, whose state is files), and a resumed update fills at its end as an
            uninterrupted one would. Needs a buffer (``memory_size >= 1``).

    Example:
        >>> import torch
        >>> from renate_events.components import WeightedCustomLossComponent
        >>> from trainer import Trainer
        >>> replay = WeightedCustomLossComponent(loss_fn=torch.nn.functional.cross_entropy,
        ...                                      weight=1.0, sample_new_memory_batch=True)
        >>> learner = BaseExperienceReplayLearner(
        ...     model=torch.nn.Linear(4, 3), components={"memory_loss": replay}, memory_size=20,
        ...     memory_batch_size=4, batch_size=8, trainer=Trainer(max_epochs=1))
        >>> data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
        >>> learner.fit(data).steps
        2
    """

    model: nn.Module = attrs.field(validator=attrs.validators.instance_of(nn.Module))
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = attrs.field(
        default=F.cross_entropy, validator=validators.is_callable("(outputs, targets) -> loss")
    )
    optimizer: torch.optim.Optimizer | OptimizerFactory = attrs.field(
        default=functools.partial(torch.optim.Adam, lr=1e-3)
    )
    components: Mapping[str, Component] | Sequence[Component] = attrs.field(
        factory=dict, converter=_named_components
    )
    memory_size: int = attrs.field(default=200, validator=validators.int_at_least(0))
    memory_batch_size: int = attrs.field(default=32, validator=validators.int_at_least(1))
    batch_size: int = attrs.field(default=32, validator=validators.int_at_least(1))
    batch_memory_frac: float | None = attrs.field(
        default=None,
        validator=validators.real_in_range(0, 1, low_open=True, high_open=True, optional=True),
    )
    loss_weight: float = attrs.field(default=1.0, validator=validators.real_in_range(0))
    ema_memory_update_gamma: float = attrs.field(
        default=1.0, validator=validators.real_in_range(0, 1, low_open=True)
    )
    loss_normalization: bool = attrs.field(default=True, validator=validators.boolean)
    mask_unused_classes: bool = attrs.field(default=False, validator=validators.boolean)
    buffer: DataBuffer | None = attrs.field(default=None)
    feature_modules: Sequence[str] = attrs.field(default=(), converter=tuple)
    learning_rate_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    learning_rate_scheduler_interval: str = attrs.field(
        default="epoch", validator=validators.one_of("epoch", "step")
    )
    seed: int = attrs.field(default=0, validator=validators.int_at_least(0))
    trainer: Trainer = attrs.field(factory=Trainer)
    memory_forward: str = attrs.field(
        default="auto",
        kw_only=True,
        validator=validators.one_of("auto", "concatenated", "separate"),
    )
    metrics: Mapping[str, Callable[[torch.Tensor, torch.Tensor], Any]] = attrs.field(
        factory=dict, kw_only=True, converter=dict, validator=_metric_functions
    )
    collate_fn: Callable[[list[Any]], Any] | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(validators.is_callable("collate_fn(samples) -> batch")),
    )
    train_transform: Callable[[Any], torch.Tensor] | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(validators.is_callable("f(inputs) -> inputs")),
    )
    train_target_transform: Callable[[torch.Tensor], torch.Tensor] | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(validators.is_callable("f(targets) -> targets")),
    )
    buffer_transform: Callable[[Any], torch.Tensor] | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(validators.is_callable("f(inputs) -> inputs")),
    )
    buffer_target_transform: Callable[[torch.Tensor], torch.Tensor] | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(validators.is_callable("f(targets) -> targets")),
    )
    test_transform: Callable[[Any], torch.Tensor] | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(validators.is_callable("f(inputs) -> inputs")),
    )
    buffer_filling: str = attrs.field(
        default="step", kw_only=True, validator=validators.one_of(*BUFFER_FILLINGS)
    )

    _optimizer_instance: torch.optim.Optimizer | None = attrs.field(init=False, default=None)
    _recorder: IntermediateRepresentations | None = attrs.field(init=False, default=None)
    _seen_classes: torch.Tensor | None = attrs.field(init=False, default=None)
    _new_batch_size: int = attrs.field(init=False, default=0)
    _batch_checked: bool = attrs.field(init=False, default=False)
    # How to put back what an update changed before its first batch trained (None once it has).
    _undo: list[Callable[[], None]] | None = attrs.field(init=False, default=None)
    _update_snapshot: Any = attrs.field(init=False, default=None)  # all_or_nothing's, if open
    _concatenate: bool = attrs.field(init=False, default=False)
    _fused: WeightedCustomLossComponent | None = attrs.field(init=False, default=None)
    _samples_on_storage: bool = attrs.field(init=False, default=False)
    _weights: torch.Tensor | None = attrs.field(init=False, default=None)
    _weights_key: tuple[Any, ...] | None = attrs.field(init=False, default=None)
    # Heads fit added for new task ids, until on_train_start notes them for undo.
    _added_heads: list[int] = attrs.field(init=False, factory=list)
    # buffer_filling="end": the update's data, whether its fill is done, how to take it back.
    _update_data: Any = attrs.field(init=False, default=None)
    _filled: bool = attrs.field(init=False, default=False)
    _failed: bool = attrs.field(init=False, default=False)
    _fill_undo: dict[str, Any] | None = attrs.field(init=False, default=None)
    # What loaded contents may hold beyond the checkpoint's rules (loaded.loading_limits).
    load_limits: LoadLimits = attrs.field(init=False, factory=LoadLimits)
    # Whether the learner fills its buffer its own way (the update's data before training, or
    # herding at the end): buffer_filling must then stay "step" (no per-step or end fill).
    _fills_own_buffer: ClassVar[bool] = False

    def __attrs_post_init__(self) -> None:
        # A preset's own components first; the given ones after them, or in their place.
        self.components = {**_named_components(self.default_components()), **self.components}
        self._check_feature_modules()
        self._split_batch()
        if self.buffer is None and self.memory_size > 0:
            self.buffer = ReservoirBuffer(
                max_size=self.memory_size, seed=derived_seed(self.seed, 0)
            )
        self._check_buffer_filling()
        if self.feature_modules:
            self._recorder = IntermediateRepresentations(self.model, list(self.feature_modules))
        if self.trainer.seed is None:
            self.trainer.seed = self.seed
        self.trainer.subscribe(self, name="learner")
        for name, component in self.components.items():
            self.trainer.subscribe(component, name=name)

    def default_components(self) -> dict[str, Component]:
        """The ordered, named components of a preset; those given as ``components`` follow them
        (or replace the one of the same name).

        Override it in a subclass to extend a preset, e.g.
        ``return {**super().default_components(), "mine": MyComponent()}``. The base learner
        has none, so its components are exactly the given ones.
        """
        return {}

    # -- one model update -----------------------------------------------------------------------

    def fit(
        self,
        train_data: Dataset[Any] | Iterable[Any],
        val_data: Dataset[Any] | Iterable[Any] | None = None,
        *,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> FitResult:
        """Run one model update on ``train_data`` (a dataset of ``(inputs, target)`` or a loader).

        Datasets are batched with ``batch_size`` (the new-data part of it with
        ``batch_memory_frac``) and shuffled with torch's global RNG, which the trainer seeds and
        checkpoints; a ``TensorDataset`` is batched by indexing its tensors
        (:class:`trainer.TensorLoader`), any other dataset through a ``DataLoader``. Validation
        reports ``val_loss`` and ``val_accuracy``.

        Items ``(inputs, target, task_id)`` (a ``TensorDataset`` of three tensors, the task ids
        ``int64``) are task-incremental data: the model is called as ``model(x, task_id=ids)``
        on new and memory batches, the buffer stores each sample's task id, and a
        :class:`~renate_events.models.MultiHeadClassificationModel` gets a head for every new
        task id before the optimizer is made (docs: "Task-incremental training with heads").
        """
        if resume_from is None:  # a resumed update was checked when it started
            check_splits(self, train_data, val_data)  # every split, every transform
        with self.all_or_nothing():  # a failed fit leaves no trace (FailedUpdateUndo)
            return self._fit(train_data, val_data, resume_from)

    def _fit(self, train_data: Any, val_data: Any, resume_from: Any) -> FitResult:
        self._added_heads = self._add_task_heads(train_data)
        try:
            train_loader = self._loader(train_data, shuffle=True)
            val_loader = None if val_data is None else self._loader(val_data, shuffle=False)
            optimizer = self._make_optimizer()
            scheduler = None
            if self.learning_rate_scheduler is not None:
                scheduler = self.learning_rate_scheduler(optimizer)
            self._update_data = train_data if self.buffer_filling == "end" else None
            return self.trainer.fit(
                self.model,
                optimizer,
                train_loader,
                self.training_step,
                val_loader=val_loader,
                val_step=self.validation_step,
                scheduler=scheduler,
                scheduler_interval=self.learning_rate_scheduler_interval,
                resume_from=resume_from,
            )
        finally:
            self._added_heads = []
            self._update_data, self._fill_undo = None, None

    def _add_task_heads(self, data: Any) -> list[int]:
        """Add a head (of the model's ``num_outputs``) for every task id of a three-tensor
        dataset that has none, for a :class:`MultiHeadClassificationModel`; the ids added."""
        tensors = getattr(data, "tensors", None)
        model = self.model
        if not (isinstance(tensors, tuple) and len(tensors) == 3):
            return []
        check_task_ids(tensors[2], len(tensors[1]), "the training data's task ids")
        if not isinstance(model, MultiHeadClassificationModel):
            return []
        missing = [t for t in torch.unique(tensors[2]).tolist() if str(t) not in model.heads]
        added: list[int] = []
        try:
            for task_id in missing:
                model.add_task_params(task_id)
                added.append(task_id)
        except BaseException:
            self._remove_heads(added)
            raise
        return added

    def _remove_heads(self, task_ids: Sequence[int]) -> None:
        heads = cast(MultiHeadClassificationModel, self.model).heads if task_ids else None
        for task_id in task_ids:
            cast(nn.ModuleDict, heads).pop(str(task_id))

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write the whole learner (model, optimizer, buffer, components, progress) to ``path``."""
        self.trainer.save_checkpoint(path)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore :meth:`save_checkpoint`'s file before the next ``fit``.

        An optimizer (and scheduler) is made as ``fit`` would make it, so that the file's are
        checked against it; the next ``fit`` continues with the restored model, buffer and
        components (with a fresh optimizer when ``optimizer`` is a factory).
        """
        optimizer = self._make_optimizer()
        scheduler = None
        if self.learning_rate_scheduler is not None:
            scheduler = self.learning_rate_scheduler(optimizer)
        self.trainer.load_checkpoint(
            path, model=self.model, optimizer=optimizer, scheduler=scheduler
        )

    def _loader(self, data: Any, shuffle: bool) -> Iterable[Any]:
        tensors = getattr(data, "tensors", None)
        if isinstance(data, Dataset) and isinstance(tensors, tuple) and tensors:
            # In-memory tensors: batches by indexing, no per-sample fetch and collate.
            return TensorLoader(tensors, batch_size=self._new_batch_size, shuffle=shuffle)
        if isinstance(data := as_dataset(data), Dataset):  # a list of samples too
            return DataLoader(
                data, batch_size=self._new_batch_size, shuffle=shuffle, collate_fn=self.collate_fn
            )
        return data

    def _make_optimizer(self) -> torch.optim.Optimizer:
        if isinstance(self.optimizer, torch.optim.Optimizer):
            return self.optimizer
        if not callable(self.optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer or a factory f(parameters), "
                f"got {self.optimizer!r}"
            )
        self._optimizer_instance = self.optimizer(self.model.parameters())
        return self._optimizer_instance

    def on_train_start(self) -> None:
        """A new update: ``mask_unused_classes`` masks the classes absent from this update, the
        first batch is checked against the buffer's storage before it trains,
        ``memory_forward="auto"`` looks at the model's layers, and what the update changes
        before its first batch went through is noted to be put back if it fails."""
        self._seen_classes = None
        self._batch_checked = False
        self._concatenate = self.memory_forward == "concatenated" or (
            self.memory_forward == "auto"
            and not self.feature_modules
            and _samples_independent(self.model)
        )
        self._fused = self._fusable()
        buffer = self.buffer
        self._samples_on_storage = (
            isinstance(buffer, DataBuffer) and buffer.samples_on_storage_device
        )
        self._open_undo()  # the undo of a failed update (FailedUpdateUndo)

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        if self.buffer is not None:
            checkpoint["buffer"] = self.buffer.state_dict()
        if self._seen_classes is not None:
            checkpoint["seen_classes"] = self._seen_classes
        if self._filled:  # written at or after train_end: a resumed fit must not fill again
            checkpoint["buffer_filled"] = True

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        filled = checkpoint.get("buffer_filled", False)
        if not isinstance(filled, bool):
            raise ValueError(
                f"{type(self).__name__}: checkpoint key 'buffer_filled' must be true or false, "
                f"got {filled!r}"
            )
        check_restored_tensors(self.model, self.trainer.optimizer)  # restored before this
        load_buffer(self, checkpoint, self.load_limits)
        seen = checkpoint.get("seen_classes")
        self._seen_classes = None if seen is None else seen.clone()
        self._filled = filled
