"""Composable experience-replay components (losses and model updaters), after Renate.

Components are attrs classes whose ``on_<event>`` methods a training loop calls with keyword
arguments and whose :meth:`~Component.loss` is added to the training loss on memory batches.
The components here are shared by several methods (or meant for your own presets); a component
only one method uses lives in that method's module of :mod:`renate_events.methods` (EWC's, LwF's,
iCaRL's).

Example:
    >>> import torch
    >>> from renate_events.components import WeightedMeanSquaredErrorLossComponent
    >>> der = WeightedMeanSquaredErrorLossComponent(weight=0.5)
    >>> batch = ((torch.zeros(2, 3), torch.tensor([0, 1])), {"logits": torch.zeros(2, 4)})
    >>> der.loss(torch.ones(2, 4), batch, None)
    tensor(0.5000)
"""

from __future__ import annotations

from renate_events.components.cls import WeightedCLSLossComponent
from renate_events.components.component import (
    BatchMemory,
    Component,
    Inputs,
    call_model,
    real_from,
)
from renate_events.components.distillation import OldModelDistillation
from renate_events.components.features import (
    IntermediateRepresentations,
    copy_without_hooks,
    record_intermediate_representations,
)
from renate_events.components.generators import (
    SEED_LIMIT,
    check_seed,
    new_generator,
    restore_generator,
)
from renate_events.components.losses import (
    DISTILLATION_TYPES,
    WeightedCustomLossComponent,
    WeightedLossComponent,
    WeightedMeanSquaredErrorLossComponent,
    WeightedPooledOutputDistillationLossComponent,
)
from renate_events.components.reinitialization import (
    ReinitializationComponent,
    ShrinkAndPerturbReinitializationComponent,
)

__all__ = [
    "DISTILLATION_TYPES",
    "SEED_LIMIT",
    "BatchMemory",
    "Component",
    "Inputs",
    "IntermediateRepresentations",
    "OldModelDistillation",
    "ReinitializationComponent",
    "ShrinkAndPerturbReinitializationComponent",
    "WeightedCLSLossComponent",
    "WeightedCustomLossComponent",
    "WeightedLossComponent",
    "WeightedMeanSquaredErrorLossComponent",
    "WeightedPooledOutputDistillationLossComponent",
    "call_model",
    "check_seed",
    "copy_without_hooks",
    "new_generator",
    "real_from",
    "record_intermediate_representations",
    "restore_generator",
]
