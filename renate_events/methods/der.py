"""Dark experience replay (DER, DER++): the memory's labels and stored logits replayed.

Buzzega, Boschini, Porrello, Abati and Calderara, "Dark Experience for General Continual
Learning: a Strong, Simple Baseline", NeurIPS 2020.
"""

from __future__ import annotations

import attrs

from renate_events.components import (
    Component,
    WeightedCustomLossComponent,
    WeightedMeanSquaredErrorLossComponent,
)
from renate_events.learners import BaseExperienceReplayLearner
from renate_events.methods.registry import MethodSpec, register
from trainer import validators

__all__ = ["SPEC", "DarkExperienceReplayLearner"]


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


SPEC = register(
    MethodSpec(
        name="der",
        learner=DarkExperienceReplayLearner,
        summary="DER++: cross-entropy and logit matching on memory (Buzzega et al., 'Dark "
        "Experience for General Continual Learning: a Strong, Simple Baseline', NeurIPS 2020)",
    )
)
