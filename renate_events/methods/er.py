"""Experience replay (ER): the learner's loss on a memory batch beside the new one.

Chaudhry, Rohrbach, Elhoseiny, Ajanthan, Dokania, Torr and Ranzato, "On Tiny Episodic Memories in
Continual Learning", arXiv:1902.10486, 2019.
"""

from __future__ import annotations

import attrs

from renate_events.components import Component, WeightedCustomLossComponent
from renate_events.learners import BaseExperienceReplayLearner
from renate_events.methods.registry import MethodSpec, register
from trainer import validators

__all__ = ["SPEC", "ExperienceReplayLearner"]


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


SPEC = register(
    MethodSpec(
        name="er",
        learner=ExperienceReplayLearner,
        summary="experience replay: the loss on a memory batch beside the new one (Chaudhry et "
        "al., 'On Tiny Episodic Memories in Continual Learning', arXiv:1902.10486, 2019)",
    )
)
