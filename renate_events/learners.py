"""Experience-replay learners: one base step, methods as ordered lists of components.

A learner owns a model, a memory buffer and an ordered list of named components, and drives a
:class:`trainer.Trainer`: it supplies the training step, subscribes itself (to update the buffer)
and then its components (in list order, under their names) as listeners. ``learner.fit(data)`` is
one model update; calling it again on the next task's data continues with the same buffer and
components.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, cast

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from renate_events.components import (
    Component,
    ElasticWeightConsolidationComponent,
    ICaRLLossComponent,
    IntermediateRepresentations,
    LearningWithoutForgettingComponent,
    NearestMeanOfExemplarsClassifier,
    ShrinkAndPerturbReinitializationComponent,
    WeightedCLSLossComponent,
    WeightedCustomLossComponent,
    WeightedMeanSquaredErrorLossComponent,
    WeightedPooledOutputDistillationLossComponent,
    check_class_means,
    copy_without_hooks,
    exemplar_means,
    module_features,
)
from renate_events.inference import forward, inference, model_device, takes_task_id
from renate_events.memory import (
    BufferDataset,
    DataBuffer,
    GreedyClassBalancingBuffer,
    HerdingBuffer,
    InfiniteBuffer,
    ReservoirBuffer,
)
from renate_events.models import MultiHeadClassificationModel
from trainer import FitResult, TensorLoader, Trainer, validators
from trainer.data import to_device

__all__ = [
    "BUFFER_FILLINGS",
    "BaseExperienceReplayLearner",
    "CLSExperienceReplayLearner",
    "DarkExperienceReplayLearner",
    "ElasticWeightConsolidationLearner",
    "ExperienceReplayLearner",
    "FineTuningLearner",
    "GDumbLearner",
    "ICaRLLearner",
    "JointLearner",
    "LearningWithoutForgettingLearner",
    "OfflineExperienceReplayLearner",
    "PooledOutputDistillationExperienceReplayLearner",
    "RepeatedDistillationLearner",
    "SuperExperienceReplayLearner",
    "double_distillation_loss",
    "forward",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

BUFFER_FILLINGS = ("step", "end")
"""The values of the learners' ``buffer_filling``: offer each trained batch to the buffer after
its step, or the whole update's data at its end with the final model's logits."""


def _check_task_ids(task_ids: Any, size: int, where: str) -> None:
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


def _samples_independent(model: nn.Module) -> bool:
    """Whether ``model`` has no batch-normalisation layer (whose training-time statistics make
    one sample's output depend on the others in its batch)."""
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


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


def _derived_seed(seed: int, stream: int) -> int:
    """A distinct seed per random stream of one learner (buffer 0, CLS 1, shrink-perturb 2), so
    that its generators never draw the same sequence."""
    return (seed * 1_000_003 + stream * 7_919) % 2**63


def _reset_parameters(model: nn.Module) -> None:
    """Re-initialise every submodule that has ``reset_parameters`` (Renate's
    ``reinitialize_model_parameters``), drawing from torch's global RNG."""
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _buffer_copy(buffer: DataBuffer) -> dict[str, Any] | None:
    """The buffer's state as an in-memory copy, to put back after a failed update; ``None`` for
    a buffer whose ``state_dict`` is its own (a memory-mapped one writes a snapshot generation
    to disk, and an extra generation would delete the one the last checkpoint names)."""
    return buffer.state_dict() if type(buffer).state_dict is DataBuffer.state_dict else None


def _buffer_loader(data: BufferDataset, batch_size: int, shuffle: bool) -> DataLoader[Any]:
    """Stacked batches straight from a buffer's storage, shuffled at iteration time."""
    sampler = _LiveShuffle(data) if shuffle else None
    return DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=data.collate)


def _unpack(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(inputs, targets)`` of a batch that carries no task ids."""
    inputs, targets, task_ids = _unpack_task(batch)
    if task_ids is not None:
        raise TypeError(
            "this learner trains on batches of (inputs, targets); got a batch with task ids "
            "(inputs, targets, task_ids). Drop the third tensor, or use a learner that carries "
            "task ids (docs: 'Task-incremental training with heads')"
        )
    return inputs, targets


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


def _unpack_task(batch: Any) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """``(inputs, targets, task_ids)`` of a batch ``(inputs, targets)`` (task ids None) or
    ``(inputs, targets, task_ids)``."""
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return batch[0], batch[1], (batch[2] if len(batch) == 3 else None)
    shape = f"a {type(batch).__name__}" + (
        f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else ""
    )
    raise TypeError(
        f"learners train on batches of (inputs, targets) or (inputs, targets, task_ids); got "
        f"{shape}. Give fit() a dataset whose items are (inputs, target) pairs (or triples with "
        "an int64 task id), or a loader yielding such batches"
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


def _refuse_task_data(learner: Any, data: Any) -> None:
    """Data with task ids (three tensors) for a learner that trains on its buffer's
    ``(inputs, targets)`` samples (Joint, GDumb, repeated distillation): refused."""
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 3:
        raise ValueError(
            f"{type(learner).__name__} trains on its buffer's (inputs, targets) samples, which "
            "carry no task ids; give (inputs, targets) data, or use a replay learner (er, "
            "der, ...) for task-incremental data"
        )


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
class BaseExperienceReplayLearner:
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
    same tensor). An update that fails before its first batch went through leaves no trace: the
    buffer's sampling generator, the stored logits and the classes seen are put back.

    Memory batches are tensor operations on the buffer's device; no DataLoader is built per step.
    A buffer on another device than the model is allowed (its batches are copied to the model's
    device); pass ``buffer=ReservoirBuffer(..., device="cuda")`` to keep it on the GPU.

    Args:
        model: The model; called as ``model(x)``, ``model(*x)`` or ``model(**x)`` (see
            :func:`forward`).
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
        >>> from renate_events.learners import ExperienceReplayLearner
        >>> from trainer import Trainer
        >>> model = torch.nn.Linear(4, 3)
        >>> learner = ExperienceReplayLearner(model=model, memory_size=20, memory_batch_size=4,
        ...                                   batch_size=8, trainer=Trainer(max_epochs=1))
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
                max_size=self.memory_size, seed=_derived_seed(self.seed, 0)
            )
        self._check_buffer_filling()
        if self.feature_modules:
            self._recorder = IntermediateRepresentations(self.model, list(self.feature_modules))
        if self.trainer.seed is None:
            self.trainer.seed = self.seed
        self.trainer.subscribe(self, name="learner")
        for name, component in self.components.items():
            self.trainer.subscribe(component, name=name)

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
            raise ValueError(
                f"`{type(self).__name__}.buffer_filling` is 'end' (fill the memory at the end of "
                "each update), but the learner has no memory (memory_size=0 and no buffer); set "
                "memory_size >= 1 or buffer_filling='step'"
            )

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
            self.check_data(train_data)
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
        except BaseException:
            self._remove_heads(self._added_heads)  # when the fit failed before train_start
            raise
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
        _check_task_ids(tensors[2], len(tensors[1]), "the training data's task ids")
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

    def check_data(self, data: Any) -> None:
        """Reject empty data and labels outside the model's outputs before anything trains.

        ``fit`` calls it first; :class:`~renate_events.updater.ModelUpdater` calls it before an
        update, with its other checks. Raises ``ValueError`` naming what is wrong.
        """
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
                probe = inputs[:1].to(model_device(self.model))
                with self._rng_kept(probe):
                    probe = self._transformed("train_transform", probe, 1)
                classes = self._probe_classes(probe, task_ids)
        finally:
            self.model.train(was_training)
        for name in ("train_target_transform", "buffer_target_transform"):
            # the labels the losses see: the raw ones, or the target transform's
            if name == "buffer_target_transform" and self.buffer is None:
                continue
            labels, what = targets, "the training labels"
            if getattr(self, name) is not None:
                on_device = targets.to(model_device(self.model))  # where the transform runs
                with self._rng_kept(on_device):
                    labels = self._transformed(name, on_device, len(targets))
                what = f"the training labels through {name}"
            _check_labels(labels, classes, what)

    def _check_against_buffer(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """A sample of the data against the buffer's storage (shape and dtype of inputs and
        targets), before a forward pass could change the model (batch-norm statistics)."""
        buffer = self.buffer
        if buffer is None or len(buffer) == 0:
            return
        slot = torch.zeros(1, dtype=torch.int64, device=buffer.device)
        stored = {key: buffer.get_metadata(key, slot) for key in buffer.metadata_keys}
        buffer.check_batch(inputs[:1], targets[:1], stored)

    def _probe_classes(self, probe: Any, task_ids: torch.Tensor | None) -> int:
        """The model's outputs for ``probe`` (through the head of the first sample's task id; a
        head still to be added has the model's ``num_outputs``)."""
        if task_ids is None:
            return self._forward(probe).shape[-1]
        model, first = self.model, int(task_ids[0])
        if isinstance(model, MultiHeadClassificationModel) and str(first) not in model.heads:
            return cast(int, model.num_outputs)
        return self._forward(probe, task_ids[:1].to(model_device(model))).shape[-1]

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
        _check_task_ids(task_ids, size, name)
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

    def _loader(self, data: Any, shuffle: bool) -> Iterable[Any]:
        tensors = getattr(data, "tensors", None)
        if isinstance(data, Dataset) and isinstance(tensors, tuple) and tensors:
            # In-memory tensors: batches by indexing, no per-sample fetch and collate.
            return TensorLoader(tensors, batch_size=self._new_batch_size, shuffle=shuffle)
        if isinstance(data, Dataset):
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

    # -- the step -------------------------------------------------------------------------------

    def training_step(self, batch: Any) -> dict[str, Any]:
        """Loss of one batch of new data plus the components' losses on memory batches."""
        if self._batch_checked:
            return self._step(batch)
        # The first step of an update: note how to put back what it changes before its batch
        # trains, for on_exception (the loss may still be refused after the step returns).
        self._note_first_step()
        outputs = self._step(batch)
        self._batch_checked = True
        return outputs

    def _step(self, batch: Any) -> dict[str, Any]:
        """Forward the new batch (with the first memory batch where they share a pass), then add
        the components' losses on memory batches."""
        raw_inputs, raw_targets, task_ids = _unpack_task(batch)
        if not self._batch_checked:
            self._check_buffer_transforms(raw_inputs, raw_targets)
            if task_ids is not None:
                _check_task_ids(task_ids, len(raw_targets), "a batch's task ids (third item)")
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
            logits = outputs.masked_fill(~self._seen(targets, outputs.shape[-1]), float("-inf"))
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
        result = transform(value)
        if not isinstance(result, torch.Tensor):
            raise validators.WrongTypeError(
                f"`{type(self).__name__}.{name}` must return a tensor, got "
                f"{type(result).__name__} (from {transform!r})"
            )
        if result.dim() == 0 or result.shape[0] != rows:
            raise ValueError(
                f"`{type(self).__name__}.{name}` must keep the batch size {rows}, got shape "
                f"{tuple(result.shape)} (from {transform!r})"
            )
        return result

    @staticmethod
    def _rng_kept(like: Any) -> Any:
        """A context in which torch's global RNG (CPU, and ``like``'s CUDA device) is put back
        afterwards: a probe of a transform draws nothing from the run's random stream."""
        device = like.device if isinstance(like, torch.Tensor) else torch.device("cpu")
        devices = [device] if device.type == "cuda" else []
        return torch.random.fork_rng(devices=devices)

    def _check_buffer_transforms(self, inputs: Any, targets: torch.Tensor) -> None:
        """Try the buffer transforms on a raw sample of the new batch (the buffer stores raw
        samples like it), before anything trains, without drawing from the RNG."""
        if self.buffer is None or (
            self.buffer_transform is None and self.buffer_target_transform is None
        ):
            return
        with self._rng_kept(targets):
            if isinstance(inputs, torch.Tensor):
                self._transformed("buffer_transform", inputs[:1], 1)
            self._transformed("buffer_target_transform", targets[:1], 1)

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
            metadata = self._metadata(outputs, features, task_ids)
            self.buffer.check_batch(inputs, targets, metadata)

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
            weights = torch.full((n + m,), per_memory, dtype=like.dtype, device=like.device)
            weights[:n] = per_new
            self._weights, self._weights_key = weights, key
        return cast(torch.Tensor, self._weights)

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
            buffer = cast(DataBuffer, self.buffer)
            gamma, idx, stored = self.ema_memory_update_gamma, metadata["idx"], metadata["logits"]
            if self._undo is not None and not self._batch_checked:  # the first step: undoable
                previous = stored.clone()
                self._undo.append(
                    lambda: buffer.set_metadata("logits", idx, previous, distinct=True)
                )
            updated = gamma * stored + (1.0 - gamma) * outputs_memory.detach()
            buffer.set_metadata("logits", idx, updated, distinct=True)

    def _note_first_step(self) -> None:
        """Open the undo entries of the update's first step: the buffer's sampling generator and
        the classes seen (the stored logits it overwrites are noted by :meth:`_ema_update`)."""
        undo = self._undo
        if undo is None:
            return  # a step called outside fit
        buffer, seen = self.buffer, self._seen_classes
        if isinstance(buffer, DataBuffer):
            undo.append(functools.partial(buffer.set_sampling_state, buffer.sampling_state()))
        undo.append(functools.partial(self._restore_seen_classes, seen))

    def _restore_seen_classes(self, seen: torch.Tensor | None) -> None:
        self._seen_classes = seen

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """``loss`` and ``accuracy`` of a batch (reported as ``val_loss``, ``val_accuracy``)."""
        inputs, targets, task_ids = _unpack_task(batch)
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

    def _seen(self, targets: torch.Tensor, classes: int) -> torch.Tensor:
        seen = self._seen_classes
        if seen is None or seen.numel() != classes or seen.device != targets.device:
            grown = torch.zeros(classes, dtype=torch.bool, device=targets.device)
            if seen is not None:
                grown[: min(classes, seen.numel())] = seen[:classes].to(targets.device)
            seen = grown
        self._seen_classes = seen.index_fill(0, targets.reshape(-1), True)
        return self._seen_classes

    # -- listener hooks ---------------------------------------------------------------------------

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
        self._undo = []
        added, self._added_heads = self._added_heads, []
        if added:  # the heads fit added for new task ids go again if no batch trains
            self._undo.append(functools.partial(self._remove_heads, added))
        self._filled, self._failed, self._fill_undo = False, False, None
        if self.buffer_filling == "end" and isinstance(buffer, DataBuffer):
            # Put back by on_exception: a failed update leaves the buffer as it was (its
            # contents, the logits an EMA moved, its generators); one copy per update.
            self._fill_undo = _buffer_copy(buffer)

    def on_batch_end(self, batch: Any, outputs: Mapping[str, Any], state: Any) -> None:
        """Offer the batch, its unmasked logits and its features to the buffer (with
        ``buffer_filling="step"``)."""
        self._undo = None  # a batch went through: the update is under way
        if self.buffer is None or state.batch_skipped or self.buffer_filling == "end":
            return
        self._add_to_buffer(batch, outputs)

    def on_exception(self, exception: BaseException | None = None) -> None:
        """The update failed before a batch went through: put back what it changed (the buffer's
        sampling generator, stored logits, the classes seen), so that it leaves no trace.

        With ``buffer_filling="end"`` a failed update, even one failing during or after its
        fill, gets the whole buffer back as it was when the update started; an interrupted one
        (``KeyboardInterrupt``) is not filled and keeps the buffer's draws, so that a checkpoint
        written at its ``train_end`` resumes exactly."""
        undo, self._undo = self._undo, None
        for action in reversed(undo or ()):
            action()
        self._failed = True
        saved, self._fill_undo = self._fill_undo, None
        if saved is not None and (self._filled or not isinstance(exception, KeyboardInterrupt)):
            cast(DataBuffer, self.buffer).load_state_dict(saved)
            self._filled = False

    def on_train_end(self, model: nn.Module) -> None:
        """With ``buffer_filling="end"``: offer the update's data to the buffer, once, unless the
        update failed or was interrupted (a ``KeyboardInterrupt`` also ends in ``train_end``)."""
        buffer, data = self.buffer, self._update_data
        if buffer is None or data is None or self._failed or self._filled:
            return
        self._filled = True  # from here on a failure, even a KeyboardInterrupt, takes it back
        self._fill_buffer(model, buffer, data)

    def _fill_buffer(self, model: nn.Module, buffer: DataBuffer, data: Any) -> None:
        """Offer every raw sample of ``data`` to ``buffer``, in order, with ``model``'s logits
        (eval mode, no gradients, inputs through ``test_transform``) and recorded features."""

        device = model_device(model)
        with inference(model):
            for batch in self._loader(data, shuffle=False):
                inputs, targets, task_ids = _unpack_task(batch)
                shown = to_device(inputs, device)
                shown = self._transformed("test_transform", shown, len(targets))
                ids = None if task_ids is None else task_ids.to(device)
                logits = forward(model, shown, ids)
                metadata = self._metadata(logits, self._features(), task_ids)
                buffer.update(inputs, targets, metadata)

    def _add_to_buffer(self, batch: Any, outputs: Mapping[str, Any]) -> None:
        inputs, targets, task_ids = _unpack_task(batch)
        metadata = self._metadata(outputs["logits"], outputs["features"], task_ids)
        cast(DataBuffer, self.buffer).update(inputs, targets, metadata)

    @staticmethod
    def _metadata(
        logits: torch.Tensor,
        features: Sequence[torch.Tensor],
        task_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """What the buffer stores beside each sample: ``logits``, the intermediate
        representations and, for task-incremental data, ``task_id`` (so that a replayed sample
        goes through its own head)."""
        # detach() and float() dispatch even on a tensor they would return as it is.
        if logits.requires_grad:
            logits = logits.detach()
        if logits.dtype != torch.float32:
            logits = logits.float()  # full precision under bf16/16-mixed
        metadata = {"logits": logits}
        for i, feature in enumerate(features):
            metadata[f"intermediate_representation_{i}"] = feature.detach()
        if task_ids is not None:
            metadata["task_id"] = task_ids
        return metadata

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
        if self.buffer is not None:
            if "buffer" not in checkpoint:
                raise ValueError(
                    "the checkpoint has no buffer for this learner; it was written by a learner "
                    "without memory (memory_size=0)"
                )
            self.buffer.load_state_dict(checkpoint["buffer"])
        seen = checkpoint.get("seen_classes")
        self._seen_classes = None if seen is None else seen.clone()
        self._filled = filled


@attrs.define(eq=False)
class FineTuningLearner(BaseExperienceReplayLearner):
    """Plain fine-tuning on each update's data: no memory, no components (a lower baseline)."""

    memory_size: int = attrs.field(default=0, validator=validators.int_at_least(0))


@attrs.define(eq=False)
class ExperienceReplayLearner(BaseExperienceReplayLearner):
    """Experience replay: the loss on a fresh memory batch, weighted by ``alpha``.

    Chaudhry et al., "On Tiny Episodic Memories in Continual Learning", arXiv:1902.10486, 2019.
    Renate's default ``alpha = 1.0``.
    """

    alpha: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))

    def default_components(self) -> dict[str, Component]:
        return {
            "memory_loss": WeightedCustomLossComponent(
                loss_fn=self.loss_fn, weight=self.alpha, sample_new_memory_batch=True
            )
        }


@attrs.define(eq=False)
class DarkExperienceReplayLearner(BaseExperienceReplayLearner):
    """Dark Experience Replay++: cross-entropy (``beta``) and logit MSE (``alpha``) on memory.

    Buzzega et al., "Dark Experience for General Continual Learning: a Strong, Simple Baseline",
    NeurIPS 2020. ``beta = 0`` is DER. Renate's defaults ``alpha = beta = 1.0``; the components
    are ``memory_loss`` (fresh memory batch) then ``mse_loss`` (same batch), as in Renate.
    """

    alpha: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
    beta: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))

    def default_components(self) -> dict[str, Component]:
        return {
            "memory_loss": WeightedCustomLossComponent(
                loss_fn=self.loss_fn, weight=self.beta, sample_new_memory_batch=True
            ),
            "mse_loss": WeightedMeanSquaredErrorLossComponent(
                weight=self.alpha, sample_new_memory_batch=False
            ),
        }


@attrs.define(eq=False)
class PooledOutputDistillationExperienceReplayLearner(BaseExperienceReplayLearner):
    """Pooled output distillation of the recorded intermediate representations (PODNet).

    Douillard et al., "PODNet: Pooled Outputs Distillation for Small-Tasks Incremental Learning",
    ECCV 2020. Set ``feature_modules`` to the submodules to distil. Renate's defaults: ``alpha =
    1.0``, ``distillation_type = "spatial"``, ``normalize = True``.
    """

    alpha: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
    distillation_type: str = attrs.field(default="spatial", kw_only=True)
    normalize: bool = attrs.field(default=True, kw_only=True)

    def default_components(self) -> dict[str, Component]:
        return {
            "pod_loss": WeightedPooledOutputDistillationLossComponent(
                weight=self.alpha,
                sample_new_memory_batch=True,
                distillation_type=self.distillation_type,
                normalize=self.normalize,
            )
        }


@attrs.define(eq=False)
class CLSExperienceReplayLearner(BaseExperienceReplayLearner):
    """CLS-ER: memory cross-entropy (``alpha``) plus consistency with stable/plastic EMA models.

    Arani et al., "Learning Fast, Learning Slow", ICLR 2022. Renate's defaults: ``alpha = 0.5``,
    ``beta = 0.1``, update weights 0.999 and 0.999, update probabilities 0.7 (stable), 0.9
    (plastic).
    """

    alpha: float = attrs.field(default=0.5, kw_only=True, validator=validators.real_in_range(0))
    beta: float = attrs.field(default=0.1, kw_only=True, validator=validators.real_in_range(0))
    stable_model_update_weight: float = attrs.field(default=0.999, kw_only=True)
    plastic_model_update_weight: float = attrs.field(default=0.999, kw_only=True)
    stable_model_update_probability: float = attrs.field(default=0.7, kw_only=True)
    plastic_model_update_probability: float = attrs.field(default=0.9, kw_only=True)

    def default_components(self) -> dict[str, Component]:
        return {
            "memory_loss": WeightedCustomLossComponent(
                loss_fn=self.loss_fn, weight=self.alpha, sample_new_memory_batch=True
            ),
            "cls_loss": WeightedCLSLossComponent(
                weight=self.beta,
                sample_new_memory_batch=False,
                stable_model_update_weight=self.stable_model_update_weight,
                plastic_model_update_weight=self.plastic_model_update_weight,
                stable_model_update_probability=self.stable_model_update_probability,
                plastic_model_update_probability=self.plastic_model_update_probability,
                seed=_derived_seed(self.seed, 1),
            ),
        }


@attrs.define(eq=False)
class SuperExperienceReplayLearner(BaseExperienceReplayLearner):
    """Renate's combination: DER++, CLS-ER, shrink-and-perturb and POD in one learner.

    Renate's defaults: ``der_alpha = der_beta = 1.0``, ``sp_shrink_factor = 0.95``,
    ``sp_sigma = 0.001``, ``cls_alpha = 0.1`` with CLS update weights 0.999/0.999 and
    probabilities 0.7/0.9, ``pod_alpha = 1.0`` (``"spatial"``, normalised). POD needs
    ``feature_modules``; with ``pod_alpha = 0`` it is skipped.
    """

    der_alpha: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
    der_beta: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
    sp_shrink_factor: float = attrs.field(default=0.95, kw_only=True)
    sp_sigma: float = attrs.field(default=0.001, kw_only=True)
    cls_alpha: float = attrs.field(default=0.1, kw_only=True, validator=validators.real_in_range(0))
    cls_stable_model_update_weight: float = attrs.field(default=0.999, kw_only=True)
    cls_plastic_model_update_weight: float = attrs.field(default=0.999, kw_only=True)
    cls_stable_model_update_probability: float = attrs.field(default=0.7, kw_only=True)
    cls_plastic_model_update_probability: float = attrs.field(default=0.9, kw_only=True)
    pod_alpha: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
    pod_distillation_type: str = attrs.field(default="spatial", kw_only=True)
    pod_normalize: bool = attrs.field(default=True, kw_only=True)

    def default_components(self) -> dict[str, Component]:
        return {
            "mse_loss": WeightedMeanSquaredErrorLossComponent(
                weight=self.der_alpha, sample_new_memory_batch=True
            ),
            "memory_loss": WeightedCustomLossComponent(
                loss_fn=self.loss_fn, weight=self.der_beta, sample_new_memory_batch=True
            ),
            "cls_loss": WeightedCLSLossComponent(
                weight=self.cls_alpha,
                sample_new_memory_batch=False,
                stable_model_update_weight=self.cls_stable_model_update_weight,
                plastic_model_update_weight=self.cls_plastic_model_update_weight,
                stable_model_update_probability=self.cls_stable_model_update_probability,
                plastic_model_update_probability=self.cls_plastic_model_update_probability,
                seed=_derived_seed(self.seed, 1),
            ),
            "shrink_perturb": ShrinkAndPerturbReinitializationComponent(
                shrink_factor=self.sp_shrink_factor,
                sigma=self.sp_sigma,
                seed=_derived_seed(self.seed, 2),
            ),
            "pod_loss": WeightedPooledOutputDistillationLossComponent(
                weight=self.pod_alpha,
                sample_new_memory_batch=True,
                distillation_type=self.pod_distillation_type,
                normalize=self.pod_normalize,
            ),
        }


@attrs.define(eq=False)
class JointLearner(BaseExperienceReplayLearner):
    """Trains on all data seen so far at every update (an upper baseline).

    Every ``fit`` adds the new data to an :class:`~renate_events.memory.InfiniteBuffer` (stored in
    checkpoints like any buffer) and trains on the whole buffer; with ``reset_model`` (default)
    the model's parameters are re-initialised first, so each update is joint training from
    scratch. ``fit`` needs a dataset whose items are ``(inputs, target)`` tensors.
    """

    memory_size: int = attrs.field(default=0, validator=validators.int_at_least(0))
    reset_model: bool = attrs.field(default=True, kw_only=True)
    # Where this update's data starts in the buffer, until on_train_start notes it for undo.
    _added_from: int | None = attrs.field(init=False, default=None)
    _fills_own_buffer: ClassVar[bool] = True

    def __attrs_post_init__(self) -> None:
        if self.buffer is None:
            self.buffer = InfiniteBuffer(seed=_derived_seed(self.seed, 0))
        super().__attrs_post_init__()

    def fit(
        self,
        train_data: Dataset[Any] | Iterable[Any],
        val_data: Dataset[Any] | Iterable[Any] | None = None,
        *,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> FitResult:
        buffer = self.buffer
        if buffer is None:  # pragma: no cover - set in __attrs_post_init__
            raise RuntimeError("JointLearner has no buffer")
        try:
            if resume_from is None:
                self.check_data(train_data)
                self._add_update_data(train_data)
                if self.reset_model:
                    _reset_parameters(self.model)
            return super().fit(buffer.dataset(), val_data, resume_from=resume_from)
        except BaseException:
            self._drop_update_data()  # when the fit failed before train_start noted it
            raise

    def check_data(self, data: Any) -> None:
        """As the base learner's; data with task ids (three tensors) is refused: the buffer's
        dataset, which this learner trains on, yields ``(inputs, targets)``."""
        _refuse_task_data(self, data)
        super().check_data(data)

    def _add_update_data(self, data: Any) -> None:
        """Add the update's data to the buffer; with an :class:`InfiniteBuffer`, note where it
        starts, so that an update failing before any of its batches trained takes it back."""
        buffer = cast(DataBuffer, self.buffer)
        if isinstance(buffer, InfiniteBuffer):
            self._added_from = len(buffer)
        for inputs, targets in DataLoader(data, batch_size=1024):
            buffer.update(inputs, targets)

    def _drop_update_data(self) -> None:
        start, self._added_from = self._added_from, None
        if start is not None:
            cast(InfiniteBuffer, self.buffer).truncate(start)

    def on_train_start(self) -> None:
        """As the base learner's; the update's data is then taken back by :meth:`on_exception`
        if the update fails before a batch went through."""
        super().on_train_start()
        if self._added_from is not None and self._undo is not None:
            start, self._added_from = self._added_from, None
            self._undo.append(functools.partial(cast(InfiniteBuffer, self.buffer).truncate, start))

    def _loader(self, data: Any, shuffle: bool) -> Iterable[Any]:
        if isinstance(data, BufferDataset):  # stacked batches straight from the buffer's storage
            return _buffer_loader(data, self._new_batch_size, shuffle)
        return super()._loader(data, shuffle)

    def _check_first_batch(
        self,
        inputs: Any,
        targets: torch.Tensor,
        outputs: torch.Tensor,
        features: Sequence[torch.Tensor],
        *,
        task_ids: torch.Tensor | None = None,
    ) -> None:
        """Nothing to check: the batches come from the buffer's own storage."""

    def _add_to_buffer(self, batch: Any, outputs: Mapping[str, Any]) -> None:
        """Nothing to add per step: the buffer already holds every training sample."""


class _LiveShuffle(torch.utils.data.Sampler[int]):
    """Shuffles with torch's global RNG over the dataset's length at iteration time, so that a
    buffer filled or restored after the loader was built is sampled in full."""

    def __init__(self, data: BufferDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(len(self.data)).tolist())


@attrs.define(eq=False)
class ElasticWeightConsolidationLearner(BaseExperienceReplayLearner):
    """EWC: fine-tuning plus a Fisher-weighted quadratic penalty towards earlier parameters.

    Kirkpatrick et al., "Overcoming catastrophic forgetting in neural networks", PNAS 2017;
    ``ewc_mode="online"`` with ``decay_factor`` is online EWC (Schwarz et al., "Progress &
    Compress", ICML 2018). Renate's default ``ewc_lambda = 0.4``; Avalanche's ``mode =
    "separate"``. The component is ``ewc``
    (:class:`~renate_events.components.ElasticWeightConsolidationComponent`); no memory by
    default.
    """

    memory_size: int = attrs.field(default=0, validator=validators.int_at_least(0))
    ewc_lambda: float = attrs.field(
        default=0.4, kw_only=True, validator=validators.real_in_range(0)
    )
    ewc_mode: str = attrs.field(
        default="separate", kw_only=True, validator=validators.one_of("separate", "online")
    )
    decay_factor: float | None = attrs.field(
        default=None,
        kw_only=True,
        validator=validators.real_in_range(0, 1, low_open=True, optional=True),
    )

    def default_components(self) -> dict[str, Component]:
        return {
            "ewc": ElasticWeightConsolidationComponent(
                ewc_lambda=self.ewc_lambda,
                mode=self.ewc_mode,
                decay_factor=self.decay_factor,
                loss_fn=self.loss_fn,
                transform=self.train_transform,
                target_transform=self.train_target_transform,
            )
        }

    def _replay_ready(self) -> bool:
        """Replay only for a component with a memory weight: the preset's own adds nothing on
        memory batches (a ``memory_size`` given by ``ModelUpdater`` or the command line would
        otherwise forward a memory batch per step for nothing)."""
        return any(c.weight > 0 for c in self.components.values()) and super()._replay_ready()


@attrs.define(eq=False)
class LearningWithoutForgettingLearner(BaseExperienceReplayLearner):
    """LwF: fine-tuning plus distillation of the previous model's outputs on the new data.

    Li and Hoiem, "Learning without Forgetting", ECCV 2016. Renate's defaults ``alpha = 1``,
    ``temperature = 2``. The component is ``lwf``
    (:class:`~renate_events.components.LearningWithoutForgettingComponent`); no memory by
    default.
    """

    memory_size: int = attrs.field(default=0, validator=validators.int_at_least(0))
    alpha: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
    temperature: float = attrs.field(
        default=2.0, kw_only=True, validator=validators.real_in_range(0, low_open=True)
    )

    def default_components(self) -> dict[str, Component]:
        return {
            "lwf": LearningWithoutForgettingComponent(
                alpha=self.alpha, temperature=self.temperature
            )
        }

    def _replay_ready(self) -> bool:
        """Replay only for a component with a memory weight: the preset's own adds nothing on
        memory batches (a ``memory_size`` given by ``ModelUpdater`` or the command line would
        otherwise forward a memory batch per step for nothing)."""
        return any(c.weight > 0 for c in self.components.values()) and super()._replay_ready()


@attrs.define(eq=False)
class OfflineExperienceReplayLearner(BaseExperienceReplayLearner):
    """Offline-ER (Renate's ``OfflineExperienceReplayLearner``): the buffer is filled at the end
    of each update, and the loss is ``w * L_new + (1 - w) * L_memory``.

    During an update the buffer holds only earlier updates' data; at the trainer's
    ``train_end`` every sample of the update's data is offered to it with the final model's
    logits (``buffer_filling="end"``, this learner's default: the base learner's end fill).
    ``loss_weight_new_data`` is ``w`` in ``[0, 1]``, or ``None`` (Renate's default) for
    ``w = N_t / (N_t + N_memory)``: the update's size over itself plus the buffer's, fixed when
    the update starts. Without a memory batch yet (the first update) the loss is ``L_new``, as in
    Renate. The memory loss is ``memory_loss`` (the learner's loss function, a fresh batch).
    Renate's defaults: ``memory_size = 32``, ``loss_weight_new_data = None``.
    """

    loss_weight_new_data: float | None = attrs.field(
        default=None,
        kw_only=True,
        validator=validators.real_in_range(0, 1, optional=True),
    )
    buffer_filling: str = attrs.field(
        default="end", kw_only=True, validator=validators.one_of(*BUFFER_FILLINGS)
    )

    def default_components(self) -> dict[str, Component]:
        return {
            "memory_loss": WeightedCustomLossComponent(
                loss_fn=self.loss_fn, weight=0.0, sample_new_memory_batch=True
            )
        }

    def fit(
        self,
        train_data: Dataset[Any] | Iterable[Any],
        val_data: Dataset[Any] | Iterable[Any] | None = None,
        *,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> FitResult:
        memory_loss = self.components.get("memory_loss")
        weights = (self.loss_weight, None if memory_loss is None else memory_loss.weight)
        self._set_weights(train_data)
        try:
            return super().fit(train_data, val_data, resume_from=resume_from)
        except BaseException:  # a refused or failed update leaves the weights as they were
            self.loss_weight = weights[0]
            if memory_loss is not None and weights[1] is not None:
                memory_loss.weight = weights[1]
            raise

    def _set_weights(self, train_data: Any) -> None:
        """``loss_weight = w`` and the memory loss's weight ``1 - w`` for this update."""
        buffer = self.buffer
        held = 0 if buffer is None else len(buffer)
        weight = self.loss_weight_new_data
        if held < self._memory_batch():
            weight = 1.0  # no memory batch yet: the new-data loss alone
        elif weight is None:
            try:
                size = len(train_data)
            except TypeError:
                raise ValueError(
                    f"{type(self).__name__}.loss_weight_new_data=None weighs the update by its "
                    "size, but the training data has no len(); pass a dataset or set "
                    "loss_weight_new_data to a number in [0, 1]"
                ) from None
            weight = size / (size + held)
        self.loss_weight = float(weight)
        memory_loss = self.components.get("memory_loss")
        if isinstance(memory_loss, WeightedCustomLossComponent):
            memory_loss.weight = 1.0 - float(weight)

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["loss_weight"] = self.loss_weight

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        """As the base learner's; a resumed update keeps the weights it started with."""
        super().on_load_checkpoint(checkpoint)
        weight = checkpoint.get("loss_weight")
        if weight is not None:
            if not validators.is_real(weight) or not 0 <= weight <= 1:
                raise ValueError(
                    f"{type(self).__name__}: checkpoint key 'loss_weight' must be a real number "
                    f"in [0, 1], got {weight!r}"
                )
            self.loss_weight = float(weight)
            memory_loss = self.components.get("memory_loss")
            if isinstance(memory_loss, WeightedCustomLossComponent):
                memory_loss.weight = 1.0 - float(weight)


def double_distillation_loss(
    predicted_logits: torch.Tensor, target_logits: torch.Tensor
) -> torch.Tensor:
    """Renate's double distillation loss: per sample, half the mean squared difference between
    the predicted logits and the target logits centred over the classes.

    ``0.5 * mean_c (predicted - (target - mean_c target))^2``, of shape ``(B,)`` for logits of
    shape ``(B, C)``. Centring the targets makes logits of several teachers comparable (Zhang et
    al., "Class-incremental Learning via Deep Model Consolidation", WACV 2020).

    Example:
        >>> import torch
        >>> double_distillation_loss(torch.zeros(1, 2), torch.tensor([[1.0, 3.0]]))
        tensor([0.5000])
    """
    centred = target_logits - target_logits.mean(dim=1, keepdim=True)
    return 0.5 * (predicted_logits - centred).pow(2).mean(dim=1)


class _DistillationData(BufferDataset):
    """A buffer's filled slots as ``(inputs, target, logits)``: the stored logits are the
    distillation targets."""

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        inputs, target = super().__getitem__(index)
        slot = torch.tensor([index % len(self.buffer)])
        return inputs, target, self.buffer.get_metadata("logits", slot)[0]

    def __getitems__(self, indices: list[int]) -> tuple[Any, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        inputs, targets = super().__getitems__(indices)
        slots = torch.as_tensor(indices, dtype=torch.int64)
        return inputs, targets, self.buffer.get_metadata("logits", slots)


@attrs.define(eq=False)
class RepeatedDistillationLearner(BaseExperienceReplayLearner):
    """Repeated Distillation (Renate's ``RepeatedDistillationModelUpdater``): an expert trained
    on the new data alone, then a freshly initialised model distilled from the memory.

    After Deep Model Consolidation (Zhang et al., "Class-incremental Learning via Deep Model
    Consolidation", WACV 2020), as Renate adapts it: every ``fit``

    1. trains an expert, a copy of the model with re-initialised parameters, on the update's
       data with ``loss_fn`` (a plain learner: same optimizer factory, scheduler, batch size,
       ``train_transform`` and trainer settings, no listeners, no validation);
    2. offers the update's data to the buffer with the expert's logits (the previous updates'
       samples keep the logits of the model they consolidated into);
    3. re-initialises the model and trains it on the whole buffer (shuffled, batches of
       ``batch_size`` through ``buffer_transform``) with :func:`double_distillation_loss`
       against the stored logits;
    4. at ``train_end`` replaces every stored logit with the consolidated model's.

    Logits are taken in eval mode on the inputs through ``test_transform`` (Renate takes them on
    the raw inputs and, for the buffer, through its transform). Renate draws the
    re-initialisations from the global RNG; here they are seeded from ``seed``, so that an update
    in another process is reproducible. The buffer holds ``memory_size`` samples (reservoir by
    default; at least 1); ``components``, ``feature_modules`` and an optimizer instance (the
    expert needs a factory) are refused. A failed update, in either phase, leaves the model and
    the buffer (from in-memory copies; not a memory-mapped buffer) as they were; a checkpoint of
    the distillation phase resumes exactly.

    Example:
        >>> import torch
        >>> from trainer import Trainer
        >>> learner = RepeatedDistillationLearner(
        ...     model=torch.nn.Linear(4, 3), memory_size=16, batch_size=8,
        ...     trainer=Trainer(max_epochs=1, device="cpu"))
        >>> data = torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
        >>> learner.fit(data).steps, len(learner.buffer)
        (2, 12)
    """

    memory_size: int = attrs.field(default=32, validator=validators.int_at_least(1))
    _fills_own_buffer: ClassVar[bool] = True

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if self.components:
            raise ValueError(
                f"`{name}.components` must be empty: its loss is the distillation loss alone, "
                f"got {sorted(self.components)}"
            )
        if self.feature_modules:
            raise ValueError(
                f"`{name}.feature_modules` must be empty: it distils logits only, got "
                f"{list(self.feature_modules)}"
            )
        if isinstance(self.optimizer, torch.optim.Optimizer):
            raise validators.WrongTypeError(
                f"`{name}.optimizer` must be a factory f(parameters): every update trains a new "
                f"expert model, got an instance of {type(self.optimizer).__name__}; pass e.g. "
                "functools.partial(torch.optim.Adam, lr=3e-4)"
            )
        super().__attrs_post_init__()

    def fit(
        self,
        train_data: Dataset[Any] | Iterable[Any],
        val_data: Dataset[Any] | Iterable[Any] | None = None,
        *,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> FitResult:
        """One update: the expert, the buffer, then the distillation (only the distillation when
        resuming its checkpoint). ``train_data`` must be a dataset of ``(inputs, target)``."""
        buffer = cast(DataBuffer, self.buffer)
        model = {key: value.clone() for key, value in self.model.state_dict().items()}
        saved = _buffer_copy(buffer)
        try:
            if resume_from is None:
                self.check_data(train_data)
                expert = self._train_expert(train_data)
                self._fill_buffer(expert, buffer, train_data)
                self._reinitialize(self.model, stream=4)
            distillation = _DistillationData(buffer)
            return super().fit(distillation, val_data, resume_from=resume_from)
        except BaseException:
            self.model.load_state_dict(model)
            if saved is not None:
                buffer.load_state_dict(saved)
            raise

    def check_data(self, data: Any) -> None:
        """As the base learner's; data with task ids is refused (the distillation trains on the
        buffer's ``(inputs, targets)`` samples)."""
        _refuse_task_data(self, data)
        super().check_data(data)

    def _reinitialize(self, model: nn.Module, stream: int) -> None:
        """Re-initialise ``model`` from a seed of its own (the global RNG is left as it was)."""
        parameter = next(model.parameters(), None)
        with self._rng_kept(parameter):
            torch.manual_seed(_derived_seed(self.seed, stream))
            _reset_parameters(model)

    def _train_expert(self, data: Any) -> nn.Module:
        """A re-initialised copy of the model, trained on ``data`` alone."""
        expert = copy_without_hooks(self.model)
        self._reinitialize(expert, stream=3)
        settings = {f.alias: getattr(self.trainer, f.name) for f in attrs.fields(Trainer) if f.init}
        learner = BaseExperienceReplayLearner(
            model=expert,
            loss_fn=self.loss_fn,
            optimizer=self.optimizer,
            memory_size=0,
            batch_size=self.batch_size,
            learning_rate_scheduler=self.learning_rate_scheduler,
            learning_rate_scheduler_interval=self.learning_rate_scheduler_interval,
            seed=self.seed,
            trainer=Trainer(**settings),
            collate_fn=self.collate_fn,
            train_transform=self.train_transform,
            train_target_transform=self.train_target_transform,
            test_transform=self.test_transform,
        )
        learner.fit(data)
        return expert

    def _loader(self, data: Any, shuffle: bool) -> Iterable[Any]:
        if isinstance(data, BufferDataset):
            return _buffer_loader(data, self._new_batch_size, shuffle)
        return super()._loader(data, shuffle)

    def training_step(self, batch: Any) -> dict[str, Any]:
        """:func:`double_distillation_loss` of the model's outputs on a buffer batch against its
        stored logits."""
        inputs, targets, logits = batch
        inputs = self._transformed("buffer_transform", inputs, len(targets))
        net = self.trainer.training_model
        outputs = forward(self.model if net is None else net, inputs)
        loss = double_distillation_loss(outputs, logits).mean()
        return {"loss": loss, "logits": outputs.detach(), "features": []}

    def _add_to_buffer(self, batch: Any, outputs: Mapping[str, Any]) -> None:
        """Nothing per step: the buffer got the update's data before the distillation."""

    def on_train_end(self, model: nn.Module) -> None:
        """Store the consolidated model's logits for every buffered sample (not after a failed
        or interrupted distillation)."""
        if self._failed:
            return

        buffer = cast(DataBuffer, self.buffer)
        device, start = model_device(model), 0
        with inference(model):
            for inputs, targets in _buffer_loader(buffer.dataset(), self._new_batch_size, False):
                shown = self._transformed("test_transform", to_device(inputs, device), len(targets))
                logits = self._metadata(forward(model, shown), [])["logits"]
                slots = torch.arange(start, start + len(targets), device=buffer.device)
                buffer.set_metadata("logits", slots, logits, distinct=True)
                start += len(targets)


@attrs.define(eq=False)
class GDumbLearner(JointLearner):
    """GDumb: a greedy class-balancing memory, and at every update a model trained from scratch
    on the memory alone.

    Prabhu, Torr and Dokania, "GDumb: A Simple Approach that Questions Our Progress in Continual
    Learning", ECCV 2020 (Renate's ``GDumbLearner``). Every ``fit`` first offers the update's
    data to a :class:`~renate_events.memory.GreedyClassBalancingBuffer` of ``memory_size`` slots
    (Renate's default 32), re-initialises the model (``reset_model``) and trains on the buffer.
    A buffer smaller than the model's number of classes is refused before training, as is
    ``memory_size = 0``; an update that fails before its first batch trained gives the buffer
    back as it was.
    """

    memory_size: int = attrs.field(default=32, validator=validators.int_at_least(1))
    # The buffer's state before this update's data went in, until the first batch trained.
    _saved_buffer: dict[str, Any] | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.buffer is None:
            self.buffer = GreedyClassBalancingBuffer(
                max_size=self.memory_size, seed=_derived_seed(self.seed, 0)
            )
        if not isinstance(self.buffer, GreedyClassBalancingBuffer):
            raise ValueError(
                f"`{type(self).__name__}.buffer` must be a GreedyClassBalancingBuffer (GDumb's "
                f"class-balanced memory), got a {type(self.buffer).__name__}; leave buffer unset "
                "(ModelUpdater: buffer='greedy-class-balancing'; on the command line: --buffer "
                "greedy-class-balancing)"
            )
        super().__attrs_post_init__()

    def check_data(self, data: Any) -> None:
        super().check_data(data)
        tensors = getattr(data, "tensors", None)
        if not isinstance(tensors, tuple) or len(tensors) != 2 or not len(data):
            return
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                probe = tensors[0][:1].to(model_device(self.model))
                with self._rng_kept(probe):  # the model's input, as in training
                    probe = self._transformed("train_transform", probe, 1)
                classes = self._forward(probe).shape[-1]
        finally:
            self.model.train(was_training)
        slots = cast(DataBuffer, self.buffer).max_size
        if slots is not None and slots < classes:
            raise ValueError(
                f"`{type(self).__name__}.memory_size` must be at least the model's number of "
                f"classes ({classes}) for a class-balanced memory, got a buffer of {slots}"
            )

    def _add_update_data(self, data: Any) -> None:
        buffer = cast(DataBuffer, self.buffer)
        self._saved_buffer = buffer.state_dict()
        for inputs, targets in DataLoader(data, batch_size=1024):
            buffer.update(inputs, targets)

    def _drop_update_data(self) -> None:
        saved, self._saved_buffer = self._saved_buffer, None
        if saved is not None:
            cast(DataBuffer, self.buffer).load_state_dict(saved)

    def on_train_start(self) -> None:
        """As the base learner's; the buffer is put back by :meth:`on_exception` if the update
        fails before a batch went through."""
        BaseExperienceReplayLearner.on_train_start(self)
        if self._saved_buffer is not None and self._undo is not None:
            saved, self._saved_buffer = self._saved_buffer, None
            self._undo.append(
                functools.partial(cast(DataBuffer, self.buffer).load_state_dict, saved)
            )


@attrs.define(eq=False)
class ICaRLLearner(BaseExperienceReplayLearner):
    """iCaRL: herding exemplars, sigmoid distillation and a nearest-mean-of-exemplars classifier.

    Rebuffi, Kolesnikov, Sperl and Lampert, "iCaRL: Incremental Classifier and Representation
    Learning", CVPR 2017 (Renate's ``AvalancheICaRLLearner``, whose only own hyperparameter is
    ``memory_size``). Each step adds :func:`~renate_events.components.icarl_loss` (binary
    cross-entropy on sigmoid outputs, the old classes' targets being the outputs of the model
    as it was when the update started) on the new batch and on a memory batch of exemplars: the
    component ``icarl`` (:class:`~renate_events.components.ICaRLLossComponent`). The learner's
    own cross-entropy is off (``loss_weight = 0``). At the end of every update (``train_end``)
    the final model's features of the update's data fill a
    :class:`~renate_events.memory.HerdingBuffer` of ``memory_size`` exemplars (``m =
    memory_size // classes`` per class, earlier classes reduced to their first ``m``), and the
    class means of the exemplars' normalised features are computed and kept in checkpoints:
    :meth:`nme_classifier` is iCaRL's classifier over them.

    The features are the output of the last of ``feature_modules`` or, with none, of the model's
    ``backbone`` (the zoo models of :mod:`renate_events.models`); a model with neither is
    refused when the learner is built, as is a ``memory_size`` below the model's number of
    classes when an update starts. Inputs must be tensors; the update's raw inputs are held in
    memory at its end, for the herding.

    Args:
        memory_size: ``K``, the total number of exemplars (the paper's 2000 by default).
        loss_weight: Weight of the learner's ``loss_fn`` on new data (0: iCaRL's loss alone).

    Example:
        >>> import torch
        >>> from renate_events.evaluation import evaluate
        >>> from renate_events.scenarios import ClassIncrementalScenario
        >>> from trainer import Trainer
        >>> data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.arange(40) % 4)
        >>> tasks = ClassIncrementalScenario(data, [[0, 1], [2, 3]]).tasks()
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...                             torch.nn.Linear(8, 4))
        >>> learner = ICaRLLearner(model=model, memory_size=8, memory_batch_size=4,
        ...                        feature_modules=["1"], trainer=Trainer(max_epochs=1))
        >>> for task in tasks:
        ...     _ = learner.fit(task.train)
        >>> learner.buffer.class_counts()
        {0: 2, 1: 2, 2: 2, 3: 2}
        >>> len(evaluate(learner.nme_classifier(), tasks))
        2
    """

    memory_size: int = attrs.field(default=2000, validator=validators.int_at_least(1))
    loss_weight: float = attrs.field(default=0.0, validator=validators.real_in_range(0))
    _feature_module: str = attrs.field(init=False, default="")
    _class_means: torch.Tensor | None = attrs.field(init=False, default=None)
    _known_classes: torch.Tensor | None = attrs.field(init=False, default=None)
    _herding_data: Any = attrs.field(init=False, default=None)
    _fills_own_buffer: ClassVar[bool] = True  # herding at the end of each update

    def __attrs_post_init__(self) -> None:
        if self.buffer is None:
            self.buffer = HerdingBuffer(max_size=self.memory_size, seed=_derived_seed(self.seed, 0))
        if not isinstance(self.buffer, HerdingBuffer):
            raise ValueError(
                f"`{type(self).__name__}.buffer` must be a HerdingBuffer (iCaRL's exemplars), got "
                f"a {type(self.buffer).__name__}; leave buffer unset (ModelUpdater: "
                "buffer='herding'; on the command line: --buffer herding)"
            )
        self._feature_module = self._feature_extractor()
        super().__attrs_post_init__()

    def _feature_extractor(self) -> str:
        """The module whose output is iCaRL's feature: the last feature module, else
        ``backbone``."""
        names = tuple(self.feature_modules)
        if names:
            return names[-1]
        if isinstance(getattr(self.model, "backbone", None), nn.Module):
            return "backbone"
        raise ValueError(
            f"{type(self).__name__} needs a feature extractor for its herding and its "
            "nearest-mean-of-exemplars classifier, but feature_modules is empty and the model "
            f"({type(self.model).__name__}) has no `backbone` submodule; pass "
            "feature_modules=['<name>'] naming the submodule whose output is the feature (the "
            "last one is used; see model.named_modules()); on the command line "
            "--feature-modules '[\"<name>\"]' (run without --config-file: --hidden sizes)"
        )

    def default_components(self) -> dict[str, Component]:
        return {"icarl": ICaRLLossComponent(weight=1.0, sample_new_memory_batch=True)}

    def fit(
        self,
        train_data: Dataset[Any] | Iterable[Any],
        val_data: Dataset[Any] | Iterable[Any] | None = None,
        *,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> FitResult:
        self._herding_data = train_data
        try:
            return super().fit(train_data, val_data, resume_from=resume_from)
        finally:
            self._herding_data = None

    def check_data(self, data: Any) -> None:
        """As the base learner's; also refuses a memory smaller than the model's classes."""
        super().check_data(data)
        tensors = getattr(data, "tensors", None)
        if not isinstance(tensors, tuple) or len(tensors) != 2 or not len(data):
            return

        with inference(self.model):
            probe = tensors[0][:1].to(model_device(self.model))
            classes = self._forward(self._transformed("test_transform", probe, 1)).shape[-1]
        if self.memory_size < classes:
            raise ValueError(
                f"`{type(self).__name__}.memory_size` must be at least the model's number of "
                f"classes ({classes}): iCaRL keeps memory_size // classes exemplars of each; got "
                f"{self.memory_size}"
            )

    @property
    def feature_module(self) -> str:
        """The name of the submodule whose output is iCaRL's feature."""
        return self._feature_module

    @property
    def class_means(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(means, known)`` of the exemplars after the last update (``None`` before one):
        ``(K, d)`` normalised class means and the ``(K,)`` mask of classes with exemplars."""
        if self._class_means is None or self._known_classes is None:
            return None
        return self._class_means.clone(), self._known_classes.clone()

    def nme_classifier(self) -> NearestMeanOfExemplarsClassifier:
        """iCaRL's nearest-mean-of-exemplars classifier on the current model and class means
        (a module; pass it to :func:`renate_events.evaluation.evaluate` as the model).

        Raises:
            ValueError: No update has ended yet, so there are no class means.
        """
        if self._class_means is None or self._known_classes is None:
            raise ValueError(
                f"{type(self).__name__}.nme_classifier: no class means yet; they are computed "
                "at the end of each update (call fit first)"
            )
        device = model_device(self.model)
        return NearestMeanOfExemplarsClassifier(
            self.model,
            self._feature_module,
            self._class_means.to(device),
            self._known_classes.to(device),
        )

    def _check_first_batch(
        self,
        inputs: Any,
        targets: torch.Tensor,
        outputs: torch.Tensor,
        features: Sequence[torch.Tensor],
        *,
        task_ids: torch.Tensor | None = None,
    ) -> None:
        """Once per update, before anything trains: tensor inputs that fit the exemplars (task
        ids never get here: iCaRL's loss component refuses task-incremental data)."""
        if self._batch_checked:
            return
        if not isinstance(inputs, torch.Tensor):
            raise validators.WrongTypeError(
                f"{type(self).__name__} needs tensor inputs (its herding holds the update's "
                f"inputs), got {type(inputs).__name__}"
            )
        cast(HerdingBuffer, self.buffer).check_batch(inputs, targets)

    def _add_to_buffer(self, batch: Any, outputs: Mapping[str, Any]) -> None:
        """Nothing per step: the exemplars are chosen at the end of the update."""

    def on_train_end(self, model: nn.Module) -> None:
        """Herd the update's exemplars with the final model and compute the class means; if
        the means fail, the buffer is put back as it was."""
        buffer, data = cast(HerdingBuffer, self.buffer), self._herding_data
        if data is None:
            return

        with inference(model):
            inputs, targets, features = self._embedded(model, self._loader(data, shuffle=False))
            saved = buffer.state_dict()
            buffer.herd(inputs, targets, features)
            try:
                view = buffer.dataset()
                exemplars = DataLoader(view, batch_size=self.batch_size, collate_fn=view.collate)
                _, labels, features = self._embedded(model, exemplars)
                probe = to_device(inputs[:1], model_device(model))
                classes = self._forward(self._transformed("test_transform", probe, 1)).shape[-1]
                means, known = exemplar_means(features, labels, classes)
            except BaseException:
                buffer.load_state_dict(saved)
                raise
        self._class_means, self._known_classes = means.cpu(), known.cpu()

    def _embedded(
        self, model: nn.Module, batches: Iterable[Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The raw inputs, the targets and the features (through ``test_transform``) of every
        batch, concatenated."""
        device = model_device(model)
        inputs, targets, features = [], [], []
        for batch in batches:
            raw, labels = _unpack(batch)
            shown = self._transformed("test_transform", to_device(raw, device), len(labels))
            features.append(module_features(model, self._feature_module, shown))
            inputs.append(raw)
            targets.append(labels)
        if not targets:
            raise ValueError(
                f"{type(self).__name__}: the update's data gave no batches at the end of the "
                "update, for the herding; pass a dataset or a loader that can be iterated again"
            )
        return torch.cat(inputs), torch.cat(targets), torch.cat(features)

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._class_means is not None and self._known_classes is not None:
            checkpoint["class_means"] = self._class_means
            checkpoint["known_classes"] = self._known_classes

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        """As the base learner's, with the class means (checked before anything is restored)."""
        means, known = checkpoint.get("class_means"), checkpoint.get("known_classes")
        if (means is None) != (known is None):
            raise ValueError(
                f"{type(self).__name__}: the checkpoint has only one of 'class_means' and "
                "'known_classes'; it must have both or neither"
            )
        if means is not None:
            check_class_means(means, known, f"{type(self).__name__}: checkpoint 'class_means'")
        super().on_load_checkpoint(checkpoint)
        self._class_means = None if means is None else means.float().clone()
        self._known_classes = None if known is None else known.clone()
