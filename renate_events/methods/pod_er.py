"""Pooled output distillation with replay (PODNet's POD on the memory's stored features).

Douillard, Cord, Ollion, Robert and Valle, "PODNet: Pooled Outputs Distillation for Small-Tasks
Incremental Learning", ECCV 2020.
"""

from __future__ import annotations

import attrs

from renate_events.components import Component, WeightedPooledOutputDistillationLossComponent
from renate_events.learners import BaseExperienceReplayLearner
from renate_events.methods.registry import MethodSpec, register
from trainer import validators

__all__ = ["SPEC", "PooledOutputDistillationExperienceReplayLearner"]


@attrs.define(eq=False)
class PooledOutputDistillationExperienceReplayLearner(BaseExperienceReplayLearner):
    """Pooled output distillation of the recorded intermediate representations (PODNet).

    Douillard et al., "PODNet: Pooled Outputs Distillation for Small-Tasks Incremental Learning",
    ECCV 2020. Set ``feature_modules`` to the submodules to distil. Renate's defaults: ``alpha =
    1.0``, ``distillation_type = "spatial"``, ``normalize = True``.
    """

    alpha: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
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


SPEC = register(
    MethodSpec(
        name="pod-er",
        learner=PooledOutputDistillationExperienceReplayLearner,
        summary="pooled output distillation of intermediate features with replay (Douillard et "
        "al., 'PODNet: Pooled Outputs Distillation for Small-Tasks Incremental Learning', ECCV "
        "2020)",
        features="hidden",
    )
)
