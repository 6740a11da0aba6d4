"""CLS-ER: replay with consistency towards a stable and a plastic moving average of the model.

Arani, Sarfraz and Zonooz, "Learning Fast, Learning Slow: A General Continual Learning Method
based on Complementary Learning System", ICLR 2022.
"""

from __future__ import annotations

import attrs

from renate_events.components import (
    Component,
    WeightedCLSLossComponent,
    WeightedCustomLossComponent,
)
from renate_events.learners import BaseExperienceReplayLearner, derived_seed
from renate_events.methods.registry import MethodSpec, register
from trainer import validators

__all__ = ["SPEC", "CLSExperienceReplayLearner"]


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
                seed=derived_seed(self.seed, 1),
            ),
        }


SPEC = register(
    MethodSpec(
        name="cls-er",
        learner=CLSExperienceReplayLearner,
        summary="CLS-ER: replay with stable and plastic moving-average models (Arani et al., "
        "'Learning Fast, Learning Slow: A General Continual Learning Method based on "
        "Complementary Learning System', ICLR 2022)",
    )
)
