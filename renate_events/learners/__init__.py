"""The experience-replay learner every method is a preset of, and the helpers presets share.

:class:`BaseExperienceReplayLearner` is made of parts with one job each: its arguments and the
wiring of an update to the trainer (:mod:`~renate_events.learners.base`), the replay step
(:class:`ReplayStep`), the filling of the buffer (:class:`BufferFilling`), the checks of its
arguments and data (:class:`DataChecks`) and the undo of a failed update
(:class:`FailedUpdateUndo`). The named methods (ER, DER++, ...) are its subclasses in
:mod:`renate_events.methods`, one module each.

Example:
    >>> import torch
    >>> from trainer import Trainer
    >>> learner = BaseExperienceReplayLearner(model=torch.nn.Linear(4, 3), memory_size=0,
    ...                                       trainer=Trainer(max_epochs=1))
    >>> data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    >>> learner.fit(data).steps
    1
"""

from __future__ import annotations

from renate_events.learners.base import BaseExperienceReplayLearner
from renate_events.learners.batches import buffer_loader, refuse_task_data, unpack, unpack_task
from renate_events.learners.checks import (
    TRANSFORM_EXAMPLE,
    DataChecks,
    ModelRefusedError,
    check_task_ids,
)
from renate_events.learners.filling import BUFFER_FILLINGS, BufferFilling, buffer_metadata
from renate_events.learners.loaded import LoadLimits, loading_limits
from renate_events.learners.seeding import derived_seed, reset_parameters, rng_kept
from renate_events.learners.split_checks import (
    SampleList,
    as_dataset,
    check_labels,
    check_split,
    check_splits,
)
from renate_events.learners.step import (
    ReplayOnlyForMemoryLosses,
    ReplayStep,
    TransformError,
    TransformTypeError,
)
from renate_events.learners.undo import FailedUpdateUndo, buffer_copy

__all__ = [
    "BUFFER_FILLINGS",
    "TRANSFORM_EXAMPLE",
    "BaseExperienceReplayLearner",
    "BufferFilling",
    "DataChecks",
    "FailedUpdateUndo",
    "LoadLimits",
    "ModelRefusedError",
    "ReplayOnlyForMemoryLosses",
    "ReplayStep",
    "SampleList",
    "TransformError",
    "TransformTypeError",
    "as_dataset",
    "buffer_copy",
    "buffer_loader",
    "buffer_metadata",
    "check_labels",
    "check_split",
    "check_splits",
    "check_task_ids",
    "derived_seed",
    "loading_limits",
    "refuse_task_data",
    "reset_parameters",
    "rng_kept",
    "unpack",
    "unpack_task",
]
