"""Renate-style continual learning (experience replay) on the event-driven ``trainer`` loop.

Subpackages and modules:
    components: the seed's ``Component`` and the loss / reinitialisation components.
    memory: replay buffers stored in preallocated tensors.
    learners: ``BaseExperienceReplayLearner`` and its presets (ER, DER++, POD, CLS-ER, Super-ER),
        plus the fine-tuning and joint baselines.
    scenarios, datasets, evaluation: tasks from a dataset, offline data readers, metrics.
    updater: ``ModelUpdater``, one update per new chunk of data through state folders.
    settings: every option of the command line, defined once.
    cli: the ``renate-events`` command.

Example:
    >>> import torch
    >>> from renate_events import ExperienceReplayLearner
    >>> learner = ExperienceReplayLearner(model=torch.nn.Linear(4, 2), memory_size=100)
"""

from renate_events.components import Component
from renate_events.evaluation import AccuracyMatrix, evaluate
from renate_events.learners import (
    BaseExperienceReplayLearner,
    CLSExperienceReplayLearner,
    DarkExperienceReplayLearner,
    ExperienceReplayLearner,
    FineTuningLearner,
    JointLearner,
    PooledOutputDistillationExperienceReplayLearner,
    SuperExperienceReplayLearner,
)
from renate_events.memory import (
    DataBuffer,
    GreedyClassBalancingBuffer,
    InfiniteBuffer,
    ReservoirBuffer,
    SlidingWindowBuffer,
)
from renate_events.methods import LEARNERS
from renate_events.scenarios import SCENARIOS, Task
from renate_events.updater import ModelUpdater

__version__ = "0.1.0.dev0"

__all__ = [
    "LEARNERS",
    "SCENARIOS",
    "AccuracyMatrix",
    "BaseExperienceReplayLearner",
    "CLSExperienceReplayLearner",
    "Component",
    "DarkExperienceReplayLearner",
    "DataBuffer",
    "ExperienceReplayLearner",
    "FineTuningLearner",
    "GreedyClassBalancingBuffer",
    "InfiniteBuffer",
    "JointLearner",
    "ModelUpdater",
    "PooledOutputDistillationExperienceReplayLearner",
    "ReservoirBuffer",
    "SlidingWindowBuffer",
    "SuperExperienceReplayLearner",
    "Task",
    "__version__",
    "evaluate",
]
