"""Repeated distillation (Renate's variant of Deep Model Consolidation): an expert trained on the
new data alone, then a re-initialised model distilled from the memory.

Zhang, Zhang, Ghosh, Li, Tasci, Heck, Zhang and Kuo, "Class-incremental Learning via Deep Model
Consolidation", WACV 2020, as Renate's ``RepeatedDistillationModelUpdater`` adapts it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, cast

import attrs
import torch
from torch import nn
from torch.utils.data import Dataset

from renate_events.components import copy_without_hooks
from renate_events.inference import forward, inference, model_device
from renate_events.learners import (
    BaseExperienceReplayLearner,
    buffer_copy,
    buffer_loader,
    buffer_metadata,
    check_splits,
    derived_seed,
    refuse_task_data,
    reset_parameters,
    rng_kept,
)
from renate_events.memory import BufferDataset, DataBuffer
from renate_events.methods.registry import MethodSpec, register
from trainer import FitResult, Trainer, validators
from trainer.data import to_device

__all__ = ["SPEC", "DistillationData", "RepeatedDistillationLearner", "double_distillation_loss"]


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


class DistillationData(BufferDataset):
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
        saved = buffer_copy(buffer)
        try:
            if resume_from is None:
                check_splits(self, train_data, val_data)
                expert = self._train_expert(train_data)
                self._fill_buffer(expert, buffer, train_data)
                self._reinitialize(self.model, stream=4)
            distillation = DistillationData(buffer)
            return super().fit(distillation, val_data, resume_from=resume_from)
        except BaseException:
            self.model.load_state_dict(model)
            if saved is not None:
                buffer.load_state_dict(saved)
            raise

    def check_data(self, data: Any) -> None:
        """As the base learner's; data with task ids is refused (the distillation trains on the
        buffer's ``(inputs, targets)`` samples)."""
        refuse_task_data(self, data)
        super().check_data(data)

    def _reinitialize(self, model: nn.Module, stream: int) -> None:
        """Re-initialise ``model`` from a seed of its own (the global RNG is left as it was)."""
        parameter = next(model.parameters(), None)
        with rng_kept(parameter):
            torch.manual_seed(derived_seed(self.seed, stream))
            reset_parameters(model)

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
            return buffer_loader(data, self._new_batch_size, shuffle)
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
            for inputs, targets in buffer_loader(buffer.dataset(), self._new_batch_size, False):
                shown = self._transformed("test_transform", to_device(inputs, device), len(targets))
                logits = buffer_metadata(forward(model, shown), [])["logits"]
                slots = torch.arange(start, start + len(targets), device=buffer.device)
                buffer.set_metadata("logits", slots, logits, distinct=True)
                start += len(targets)


SPEC = register(
    MethodSpec(
        name="repeated-distill",
        learner=RepeatedDistillationLearner,
        summary="repeated distillation: an expert on the new data, then a fresh model distilled "
        "from the memory (Renate's variant of Zhang et al., 'Class-incremental Learning via Deep "
        "Model Consolidation', WACV 2020)",
    )
)
