"""Renate-style continual learning (experience replay) on the event-driven ``trainer`` loop.

Subpackages and modules:
    components: the seed's ``Component`` and the components several methods share.
    memory: replay buffers stored in preallocated tensors.
    learners: ``BaseExperienceReplayLearner``, the one experience-replay step every method is a
        preset of.
    methods: one module per method (ER, DER++, POD, CLS-ER, Super-ER, EWC, LwF, iCaRL, ... and
        the fine-tuning and joint baselines), each registering its spec; ``LEARNERS``.
    scenarios, datasets, evaluation: tasks from a dataset, offline data readers, metrics.
    updater: ``ModelUpdater``, one update per new chunk of data through state folders.
    settings: every option of the command line, defined once.
    cli: the ``renate-events`` command.

Every learner class of :data:`renate_events.methods.LEARNERS` is importable from here.

Example:
    >>> import torch
    >>> from renate_events import ExperienceReplayLearner
    >>> learner = ExperienceReplayLearner(model=torch.nn.Linear(4, 2), memory_size=100)
"""

from renate_events.components import Component
from renate_events.evaluation import AccuracyMatrix, evaluate
from renate_events.learners import BaseExperienceReplayLearner
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

# Every method's learner class under its own name, as renate_events.methods exports them: a new
# method module is exported here too, with no change to this file.
globals().update({learner.__name__: learner for learner in LEARNERS.values()})

__all__ = [
    "LEARNERS",
    "SCENARIOS",
    "AccuracyMatrix",
    "BaseExperienceReplayLearner",
    "Component",
    "DataBuffer",
    "GreedyClassBalancingBuffer",
    "InfiniteBuffer",
    "ModelUpdater",
    "ReservoirBuffer",
    "SlidingWindowBuffer",
    "Task",
    "__version__",
    "evaluate",
]
__all__ += [learner.__name__ for learner in LEARNERS.values()]
__all__.sort()
