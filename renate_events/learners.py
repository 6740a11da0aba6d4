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
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from renate_events.components import (
    Component,
    IntermediateRepresentations,
    ShrinkAndPerturbReinitializationComponent,
    WeightedCLSLossComponent,
    WeightedCustomLossComponent,
    WeightedMeanSquaredErrorLossComponent,
    WeightedPooledOutputDistillationLossComponent,
)
from renate_events.memory import BufferDataset, DataBuffer, InfiniteBuffer, ReservoirBuffer
from trainer import FitResult, TensorLoader, Trainer

__all__ = [
    "BaseExperienceReplayLearner",
    "CLSExperienceReplayLearner",
    "DarkExperienceReplayLearner",
    "ExperienceReplayLearner",
    "FineTuningLearner",
    "JointLearner",
    "PooledOutputDistillationExperienceReplayLearner",
    "SuperExperienceReplayLearner",
    "forward",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def forward(model: nn.Module, inputs: Any) -> torch.Tensor:
    """Call ``model`` on inputs: ``model(x)``, ``model(*x)`` for a tuple/list, ``model(**x)`` for
    a dict (the same convention the CLS component uses for its model copies)."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _to_device(value: Any, device: torch.device) -> Any:
    """Move a nested memory batch to the model's device (a no-op where it already is).

    From a CPU buffer to a GPU the rows are staged in pinned memory first, so that the copy is
    asynchronous (a copy from pageable memory makes the host wait).
    """
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        if device.type == "cuda" and value.device.type == "cpu" and not value.is_pinned():
            value = value.pin_memory()
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(item, device) for item in value)
    return value


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


def _model_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _derived_seed(seed: int, stream: int) -> int:
    """A distinct seed per random stream of one learner (buffer 0, CLS 1, shrink-perturb 2), so
    that its generators never draw the same sequence."""
    return (seed * 1_000_003 + stream * 7_919) % 2**63


def _unpack(batch: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    shape = f"a {type(batch).__name__}" + (
        f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else ""
    )
    raise TypeError(
        f"learners train on batches of (inputs, targets); got {shape}. Give fit() a dataset "
        "whose items are (inputs, target) pairs, or a loader yielding such batches"
    )


def _number_in(low: float, high: float | None, *, low_open: bool = False, high_open: bool = False):
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        if ok:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value < high if high_open else value <= high
        if not ok:
            left = "(" if low_open else "["
            right = "inf)" if high is None else (f"{high})" if high_open else f"{high}]")
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name} must be a number in "
                f"{left}{low}, {right}, got {value!r}"
            )

    return check


def _int_at_least(low: int):
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name} must be an int >= {low}, got {value!r}"
            )

    return check


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _named_components(components: Any) -> dict[str, Component]:
    if isinstance(components, Mapping):
        named = dict(components)
    elif isinstance(components, Sequence):
        named, counts = {}, {}
        for component in components:
            base = _snake(type(component).__name__)
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
        if not isinstance(name, str) or not _NAME.match(name) or name == "learner":
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
       components (only while memory is used);
    4. after the optimizer step (the trainer's ``batch_end``) the buffer is updated with the batch,
       its unmasked logits and its intermediate representations, then the components'
       ``on_train_batch_end`` run.

    Memory batches are tensor operations on the buffer's device; no DataLoader is built per step.
    A buffer on another device than the model is allowed (its batches are copied to the model's
    device); pass ``buffer=ReservoirBuffer(..., device="cuda")`` to keep it on the GPU.

    Args:
        model: The model; called as ``model(x)``, ``model(*x)`` or ``model(**x)`` (see
            :func:`forward`).
        loss_fn: ``loss_fn(outputs, targets)``, per-sample or scalar; its mean is the loss.
        optimizer: An optimizer factory ``f(parameters)`` called at the start of every
            ``fit`` (Renate's behaviour: each update starts with fresh optimizer state), or an
            optimizer instance reused across fits. Default: Adam with learning rate 3e-4.
        components: Named components (a mapping, kept in order) or a sequence (named after their
            classes).
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
        trainer: The trainer to drive (epochs, device, precision, ...); subscribe your own
            listeners to it.
        memory_forward: How the new batch and the step's first memory batch go through the model:
            ``"separate"`` runs two forward passes (Renate's way); ``"concatenated"`` runs one
            pass over both batches stacked and splits the outputs (and the recorded intermediate
            representations, which must then have the batch first), saving a forward pass and
            making the backward pass one graph; ``"auto"`` (default) concatenates unless the
            model has batch-normalisation layers (whose batch statistics would then mix new and
            memory samples) or ``feature_modules`` are recorded. Other layers that mix the
            samples of a batch (``F.batch_norm`` called directly, batch-level statistics, expert
            capacity limits) are not detected: pass ``"separate"`` for such models. For a
            model whose samples do not interact the losses are the same either way (up to
            floating-point rounding); dropout draws differ. Memory batches of later components with
            ``sample_new_memory_batch`` always get a pass of their own. When the only component
            is a plain ``WeightedCustomLossComponent`` with a positive weight, it and ``loss_fn``
            are both ``torch.nn.functional.cross_entropy`` (``ExperienceReplayLearner``'s
            defaults, without ``mask_unused_classes`` or ``feature_modules``) and the outputs
            are ``(N, C)`` logits, the one pass is followed by one cross-entropy over both
            batches, each sample weighted so that the value is the weighted, normalised sum of
            the two means (the same value up to rounding); class labels are then expected in
            ``0..K-1`` (as ``fit`` checks for datasets) or as probabilities: a label equal to
            ``cross_entropy``'s ``ignore_index`` would shift the weights of the means.

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
        default=F.cross_entropy, validator=attrs.validators.is_callable()
    )
    optimizer: torch.optim.Optimizer | OptimizerFactory = attrs.field(
        default=functools.partial(torch.optim.Adam, lr=3e-4)
    )
    components: Mapping[str, Component] | Sequence[Component] = attrs.field(
        factory=dict, converter=_named_components
    )
    memory_size: int = attrs.field(default=32, validator=_int_at_least(0))
    memory_batch_size: int = attrs.field(default=32, validator=_int_at_least(1))
    batch_size: int = attrs.field(default=32, validator=_int_at_least(1))
    batch_memory_frac: float | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(_number_in(0, 1, low_open=True, high_open=True)),
    )
    loss_weight: float = attrs.field(default=1.0, validator=_number_in(0, None))
    ema_memory_update_gamma: float = attrs.field(
        default=1.0, validator=_number_in(0, 1, low_open=True)
    )
    loss_normalization: bool = attrs.field(
        default=True, validator=attrs.validators.instance_of(bool)
    )
    mask_unused_classes: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    buffer: DataBuffer | None = attrs.field(default=None)
    feature_modules: Sequence[str] = attrs.field(default=(), converter=tuple)
    learning_rate_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    learning_rate_scheduler_interval: str = attrs.field(
        default="epoch", validator=attrs.validators.in_(("epoch", "step"))
    )
    seed: int = attrs.field(default=0, validator=_int_at_least(0))
    trainer: Trainer = attrs.field(factory=Trainer)
    memory_forward: str = attrs.field(
        default="auto",
        kw_only=True,
        validator=attrs.validators.in_(("auto", "concatenated", "separate")),
    )

    _optimizer_instance: torch.optim.Optimizer | None = attrs.field(init=False, default=None)
    _recorder: IntermediateRepresentations | None = attrs.field(init=False, default=None)
    _seen_classes: torch.Tensor | None = attrs.field(init=False, default=None)
    _new_batch_size: int = attrs.field(init=False, default=0)
    _batch_checked: bool = attrs.field(init=False, default=False)
    _concatenate: bool = attrs.field(init=False, default=False)
    _fused: WeightedCustomLossComponent | None = attrs.field(init=False, default=None)
    _samples_on_storage: bool = attrs.field(init=False, default=False)
    _weights: torch.Tensor | None = attrs.field(init=False, default=None)
    _weights_key: tuple[Any, ...] | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if not self.components:
            self.components = _named_components(self.default_components())
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
        if self.batch_memory_frac is not None:
            memory = min(self.memory_size, int(self.batch_memory_frac * self.batch_size))
            if memory < 1 or memory >= self.batch_size:
                raise ValueError(
                    f"batch_memory_frac={self.batch_memory_frac} with batch_size={self.batch_size} "
                    f"and memory_size={self.memory_size} leaves a memory batch of {memory} and a "
                    f"new-data batch of {self.batch_size - memory}; both must be >= 1"
                )
            self.memory_batch_size, self._new_batch_size = memory, self.batch_size - memory
        else:
            self._new_batch_size = self.batch_size
            if 0 < self.memory_size < self.memory_batch_size and self.components:
                raise ValueError(
                    f"memory_batch_size={self.memory_batch_size} is larger than memory_size="
                    f"{self.memory_size}: the buffer could never serve a memory batch and replay "
                    "would silently never happen; lower memory_batch_size or raise memory_size"
                )
        if self.buffer is None and self.memory_size > 0:
            self.buffer = ReservoirBuffer(
                max_size=self.memory_size, seed=_derived_seed(self.seed, 0)
            )
        if self.feature_modules:
            self._recorder = IntermediateRepresentations(self.model, list(self.feature_modules))
        if self.trainer.seed is None:
            self.trainer.seed = self.seed
        self.trainer.subscribe(self, name="learner")
        for name, component in self.components.items():
            self.trainer.subscribe(component, name=name)

    def default_components(self) -> dict[str, Component]:
        """The ordered, named components used when none are given (a preset's list).

        Override it in a subclass to extend a preset, e.g.
        ``return {**super().default_components(), "mine": MyComponent()}``. The base learner
        has none.
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
        """
        if resume_from is None:  # a resumed update was checked when it started
            self._check_data(train_data)
        train_loader = self._loader(train_data, shuffle=True)
        val_loader = None if val_data is None else self._loader(val_data, shuffle=False)
        optimizer = self._make_optimizer()
        scheduler = None
        if self.learning_rate_scheduler is not None:
            scheduler = self.learning_rate_scheduler(optimizer)
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

    def _check_data(self, data: Any) -> None:
        """Reject empty data and labels outside the model's outputs before anything trains."""
        try:
            size = len(data)
        except TypeError:
            return  # an iterable without len(): checked batch by batch by the trainer
        if size == 0:
            raise ValueError(
                f"{type(self).__name__}.fit got an empty training set; pass data for the update"
            )
        tensors = getattr(data, "tensors", None)
        if not isinstance(tensors, tuple) or len(tensors) != 2:
            return
        inputs, targets = tensors
        if targets.dtype.is_floating_point or targets.dim() != 1:
            return  # not class labels
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                classes = self._forward(inputs[:1].to(_model_device(self.model))).shape[-1]
        finally:
            self.model.train(was_training)
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= classes:
            raise ValueError(
                f"the training labels range over [{low}, {high}], but the model has {classes} "
                f"outputs (labels 0..{classes - 1}); widen the model's last layer or remap the "
                "labels"
            )

    def _loader(self, data: Any, shuffle: bool) -> Iterable[Any]:
        tensors = getattr(data, "tensors", None)
        if isinstance(data, Dataset) and isinstance(tensors, tuple) and tensors:
            # In-memory tensors: batches by indexing, no per-sample fetch and collate.
            return TensorLoader(tensors, batch_size=self._new_batch_size, shuffle=shuffle)
        if isinstance(data, Dataset):
            return DataLoader(data, batch_size=self._new_batch_size, shuffle=shuffle)
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
        sampling = None if self._batch_checked else getattr(self.buffer, "_sample_generator", None)
        if sampling is None:
            return self._step(batch)
        # The first step of an update may refuse its batch after drawing a memory batch: put the
        # buffer's sampling generator back then, so that a refused fit leaves no trace.
        state = sampling.get_state()
        try:
            return self._step(batch)
        except BaseException:
            sampling.set_state(state)
            raise

    def _step(self, batch: Any) -> dict[str, Any]:
        """The step itself (:meth:`training_step` guards the first one of an update)."""
        inputs, targets = _unpack(batch)
        # In a distributed fit the trainer's DistributedDataParallel wrapper, so that the
        # gradients are averaged over the ranks while the backward pass runs.
        net = self.trainer.training_model
        net = self.model if net is None else net
        buffer = self.buffer
        replay = buffer is not None and bool(self.components)
        replay = replay and len(buffer) >= self._memory_batch()  # type: ignore[arg-type]
        batch_memory = outputs_memory = features_memory = None
        if replay and self._concatenate and isinstance(inputs, torch.Tensor):
            # One pass over [new; memory]: the first memory batch rides along with the new one
            # (when the two stack; a mismatch is left to the separate path and its checks).
            batch_memory = self._sample_memory(inputs.device)
            if _stackable(inputs, batch_memory[0][0]):
                both, features_both = self._concatenated_forward(net, inputs, batch_memory[0][0])
                fused = self._fused
                if fused is not None and fused.weight > 0 and both.dim() == 2 and len(inputs):
                    return self._fused_step(inputs, targets, both, batch_memory, fused)
                outputs, outputs_memory, features, features_memory = _split_at(
                    len(inputs), both, features_both
                )
        if outputs_memory is None:
            outputs = forward(net, inputs)
            features = self._features()
        logits = outputs
        if self.mask_unused_classes:
            logits = outputs.masked_fill(~self._seen(targets, outputs.shape[-1]), float("-inf"))
        self._check_first_batch(inputs, targets, outputs, features)
        loss = _scaled(_mean(self.loss_fn(logits, targets)), self.loss_weight)
        if replay:
            total_weight = self.loss_weight
            for i, component in enumerate(self.components.values()):
                if i == 0 or component.sample_new_memory_batch:
                    if i > 0 or batch_memory is None:
                        batch_memory = self._sample_memory(outputs.device)
                    if i > 0 or outputs_memory is None:
                        outputs_memory = forward(net, batch_memory[0][0])
                        features_memory = self._features()
                    self._ema_update(batch_memory, outputs_memory)
                loss = loss + _mean(component.loss(outputs_memory, batch_memory, features_memory))
                total_weight += component.weight
            if self.loss_normalization and total_weight > 0:
                loss = loss if total_weight == 1 else loss / total_weight
        return {
            "loss": loss,
            "logits": outputs.detach(),
            "features": [f.detach() for f in features],
        }

    def _sample_memory(self, device: torch.device) -> Any:
        """A memory batch on ``device`` (the model's)."""
        buffer = cast(DataBuffer, self.buffer)
        batch = buffer.sample(self._memory_batch())
        if self._samples_on_storage and buffer.device == device:
            return batch  # DataBuffer.sample returns tensors on the storage's device
        return _to_device(batch, device)

    def _check_first_batch(
        self,
        inputs: Any,
        targets: torch.Tensor,
        outputs: torch.Tensor,
        features: Sequence[torch.Tensor],
    ) -> None:
        """Once per update, before anything trains: the batch must fit the buffer's storage."""
        if self._batch_checked:
            return
        if self.buffer is not None and not isinstance(self, JointLearner):
            self.buffer.check_batch(inputs, targets, self._metadata(outputs, features))
        self._batch_checked = True

    def _concatenated_forward(
        self, net: nn.Module, inputs: torch.Tensor, inputs_memory: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward ``[inputs; inputs_memory]`` once; check that outputs and features can be split
        at the seam (the batch is their first dimension)."""
        n, total = inputs.shape[0], inputs.shape[0] + inputs_memory.shape[0]
        outputs = forward(net, torch.cat([inputs, inputs_memory]))
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
        both: torch.Tensor,
        batch_memory: Any,
        component: WeightedCustomLossComponent,
    ) -> dict[str, Any]:
        """The step's loss as one cross-entropy over ``[new; memory]`` (see :meth:`_fusable`).

        ``(w * mean(CE_new) + w_c * mean(CE_memory)) / (w + w_c)`` is a weighted sum of
        per-sample cross-entropies: with equal weights per sample (equal loss weights and batch
        sizes, the default) it is ``CE(both).mean()`` exactly, otherwise ``CE(both, reduction=
        "none")`` weighted. Same value up to rounding as the component's own loss, with one
        cross-entropy and no split in the backward pass. Taken for outputs of shape ``(N, C)``, a
        non-empty new batch and a positive component weight (a zero weight skips the memory
        cross-entropy altogether on the component's path, which a weighted sum cannot).
        """
        n, m = len(inputs), len(both) - len(inputs)
        outputs, outputs_memory = both.detach().split([n, m])
        self._check_first_batch(inputs, targets, outputs, [])
        self._ema_update(batch_memory, outputs_memory)
        (_, targets_memory), _ = batch_memory
        weight, weight_memory = self.loss_weight, component.weight
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
        ``ExperienceReplayLearner``'s defaults). The step checks the rest (see :meth:`_step`).
        """
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
            gamma = self.ema_memory_update_gamma
            updated = gamma * metadata["logits"] + (1.0 - gamma) * outputs_memory.detach()
            self.buffer.set_metadata("logits", metadata["idx"], updated, distinct=True)  # type: ignore[union-attr]

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """``loss`` and ``accuracy`` of a batch (reported as ``val_loss``, ``val_accuracy``)."""
        inputs, targets = _unpack(batch)
        outputs = self._forward(inputs)
        return {
            "loss": self.loss_fn(outputs, targets).mean(),
            "accuracy": (outputs.argmax(dim=-1) == targets).float().mean(),
        }

    def _memory_batch(self) -> int:
        limit = self.memory_size if self.memory_size > 0 else self.memory_batch_size
        return min(self.memory_batch_size, limit)

    def _forward(self, inputs: Any) -> torch.Tensor:
        return forward(self.model, inputs)

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
        first batch is checked against the buffer's storage before it trains, and
        ``memory_forward="auto"`` looks at the model's layers."""
        self._seen_classes = None
        self._batch_checked = False
        self._concatenate = self.memory_forward == "concatenated" or (
            self.memory_forward == "auto"
            and not self.feature_modules
            and _samples_independent(self.model)
        )
        self._fused = self._fusable()
        self._samples_on_storage = (
            isinstance(self.buffer, DataBuffer) and type(self.buffer).sample is DataBuffer.sample
        )

    def on_batch_end(self, batch: Any, outputs: Mapping[str, Any], state: Any) -> None:
        """Offer the batch, its unmasked logits and its features to the buffer."""
        if self.buffer is None or state.batch_skipped:
            return
        inputs, targets = _unpack(batch)
        self.buffer.update(inputs, targets, self._metadata(outputs["logits"], outputs["features"]))

    @staticmethod
    def _metadata(
        logits: torch.Tensor, features: Sequence[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        # detach() and float() dispatch even on a tensor they would return as it is.
        if logits.requires_grad:
            logits = logits.detach()
        if logits.dtype != torch.float32:
            logits = logits.float()  # full precision under bf16/16-mixed
        metadata = {"logits": logits}
        for i, feature in enumerate(features):
            metadata[f"intermediate_representation_{i}"] = feature.detach()
        return metadata

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        if self.buffer is not None:
            checkpoint["buffer"] = self.buffer.state_dict()
        if self._seen_classes is not None:
            checkpoint["seen_classes"] = self._seen_classes

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        if self.buffer is not None:
            if "buffer" not in checkpoint:
                raise ValueError(
                    "the checkpoint has no buffer for this learner; it was written by a learner "
                    "without memory (memory_size=0)"
                )
            self.buffer.load_state_dict(checkpoint["buffer"])
        seen = checkpoint.get("seen_classes")
        self._seen_classes = None if seen is None else seen.clone()


@attrs.define(eq=False)
class FineTuningLearner(BaseExperienceReplayLearner):
    """Plain fine-tuning on each update's data: no memory, no components (a lower baseline)."""

    memory_size: int = attrs.field(default=0, validator=_int_at_least(0))


@attrs.define(eq=False)
class ExperienceReplayLearner(BaseExperienceReplayLearner):
    """Experience replay: the loss on a fresh memory batch, weighted by ``alpha``.

    Chaudhry et al., "On Tiny Episodic Memories in Continual Learning", arXiv:1902.10486, 2019.
    Renate's default ``alpha = 1.0``.
    """

    alpha: float = attrs.field(default=1.0, kw_only=True, validator=_number_in(0, None))

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

    alpha: float = attrs.field(default=1.0, kw_only=True, validator=_number_in(0, None))
    beta: float = attrs.field(default=1.0, kw_only=True, validator=_number_in(0, None))

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

    alpha: float = attrs.field(default=1.0, kw_only=True, validator=_number_in(0, None))
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

    alpha: float = attrs.field(default=0.5, kw_only=True, validator=_number_in(0, None))
    beta: float = attrs.field(default=0.1, kw_only=True, validator=_number_in(0, None))
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

    der_alpha: float = attrs.field(default=1.0, kw_only=True, validator=_number_in(0, None))
    der_beta: float = attrs.field(default=1.0, kw_only=True, validator=_number_in(0, None))
    sp_shrink_factor: float = attrs.field(default=0.95, kw_only=True)
    sp_sigma: float = attrs.field(default=0.001, kw_only=True)
    cls_alpha: float = attrs.field(default=0.1, kw_only=True, validator=_number_in(0, None))
    cls_stable_model_update_weight: float = attrs.field(default=0.999, kw_only=True)
    cls_plastic_model_update_weight: float = attrs.field(default=0.999, kw_only=True)
    cls_stable_model_update_probability: float = attrs.field(default=0.7, kw_only=True)
    cls_plastic_model_update_probability: float = attrs.field(default=0.9, kw_only=True)
    pod_alpha: float = attrs.field(default=1.0, kw_only=True, validator=_number_in(0, None))
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

    memory_size: int = attrs.field(default=0, validator=_int_at_least(0))
    reset_model: bool = attrs.field(default=True, kw_only=True)

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
        if resume_from is None:
            self._check_data(train_data)
            for inputs, targets in DataLoader(train_data, batch_size=1024):  # type: ignore[arg-type]
                buffer.update(inputs, targets)
            if self.reset_model:
                for module in self.model.modules():
                    if hasattr(module, "reset_parameters"):
                        module.reset_parameters()
        return super().fit(buffer.dataset(), val_data, resume_from=resume_from)

    def _loader(self, data: Any, shuffle: bool) -> Iterable[Any]:
        if isinstance(data, BufferDataset):  # stacked batches straight from the buffer's storage
            sampler = _LiveShuffle(data) if shuffle else None
            return DataLoader(
                data, batch_size=self._new_batch_size, sampler=sampler, collate_fn=data.collate
            )
        return super()._loader(data, shuffle)

    def on_batch_end(self, batch: Any, outputs: Mapping[str, Any], state: Any) -> None:
        """The buffer already holds every training sample; nothing to add per step."""


class _LiveShuffle(torch.utils.data.Sampler[int]):
    """Shuffles with torch's global RNG over the dataset's length at iteration time, so that a
    buffer filled or restored after the loader was built is sampled in full."""

    def __init__(self, data: BufferDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(len(self.data)).tolist())
