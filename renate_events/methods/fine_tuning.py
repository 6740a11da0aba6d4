"""Fine-tuning: training on each update's data alone, with no memory (the lower baseline)."""

from __future__ import annotations

import attrs

from renate_events.learners import BaseExperienceReplayLearner
from renate_events.methods.registry import MethodSpec, register
from trainer import validators

__all__ = ["SPEC", "FineTuningLearner"]


@attrs.define(eq=False)
class FineTuningLearner(BaseExperienceReplayLearner):
    """Plain fine-tuning on each update's data: no memory, no components (a lower baseline)."""

    memory_size: int = attrs.field(default=0, validator=validators.int_at_least(0))


SPEC = register(
    MethodSpec(
        name="fine-tuning",
        learner=FineTuningLearner,
        summary="fine-tuning on each update's data alone, no replay: the lower baseline of every "
        "continual-learning comparison",
        uses_memory=False,
    )
)
