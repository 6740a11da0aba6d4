"""Super-ER: Renate's combination of DER++, CLS-ER, shrink-and-perturb and POD in one learner.

Renate (Amazon's continual-learning library); its parts cite Buzzega et al., NeurIPS 2020
(DER++), Arani et al., ICLR 2022 (CLS-ER), Ash and Adams, "On Warm-Starting Neural Network
Training", NeurIPS 2020 (shrink and perturb) and Douillard et al., ECCV 2020 (POD).
"""

from __future__ import annotations

import attrs

from renate_events.components import (
    Component,
    ShrinkAndPerturbReinitializationComponent,
    WeightedCLSLossComponent,
    WeightedCustomLossComponent,
    WeightedMeanSquaredErrorLossComponent,
    WeightedPooledOutputDistillationLossComponent,
)
from renate_events.learners import BaseExperienceReplayLearner, derived_seed
from renate_events.methods.registry import MethodSpec, register
from trainer import validators

__all__ = ["SPEC", "SuperExperienceReplayLearner"]


@attrs.define(eq=False)
class SuperExperienceReplayLearner(BaseExperienceReplayLearner):
    """Renate's combination: DER++, CLS-ER, shrink-and-perturb and POD in one learner.

    Renate's defaults: ``der_alpha = der_beta = 1.0``, ``sp_shrink_factor = 0.95``,
    ``sp_sigma = 0.001``, ``cls_alpha = 0.1`` with CLS update weights 0.999/0.999 and
    probabilities 0.7/0.9, ``pod_alpha = 1.0`` (``"spatial"``, normalised). POD needs
    ``feature_modules``; with ``pod_alpha = 0`` it is skipped.
    """

    der_alpha: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
    der_beta: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
    sp_shrink_factor: float = attrs.field(default=0.95, kw_only=True)
    sp_sigma: float = attrs.field(default=0.001, kw_only=True)
    cls_alpha: float = attrs.field(default=0.1, kw_only=True, validator=validators.real_in_range(0))
    cls_stable_model_update_weight: float = attrs.field(default=0.999, kw_only=True)
    cls_plastic_model_update_weight: float = attrs.field(default=0.999, kw_only=True)
    cls_stable_model_update_probability: float = attrs.field(default=0.7, kw_only=True)
    cls_plastic_model_update_probability: float = attrs.field(default=0.9, kw_only=True)
    pod_alpha: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
    pod_distillation_type: str = attrs.field(default="spatial", kw_only=True)
    pod_normalize: bool = attrs.field(default=True, kw_only=True)

    def default_components(self) -> dict[str, Component]:
        return {
            "mse_loss": WeightedMeanSquaredErrorLossComponent(
                weight=self.der_alpha, sample_new_memory_batch=True
            ),
            "memory_loss": WeightedCustomLossComponent(
                loss_fn=self.loss_fn, weight=self.der_beta, sample_new_memory_batch=True
            ),
            "cls_loss": WeightedCLSLossComponent(
                weight=self.cls_alpha,
                sample_new_memory_batch=False,
                stable_model_update_weight=self.cls_stable_model_update_weight,
                plastic_model_update_weight=self.cls_plastic_model_update_weight,
                stable_model_update_probability=self.cls_stable_model_update_probability,
                plastic_model_update_probability=self.cls_plastic_model_update_probability,
                seed=derived_seed(self.seed, 1),
            ),
            "shrink_perturb": ShrinkAndPerturbReinitializationComponent(
                shrink_factor=self.sp_shrink_factor,
                sigma=self.sp_sigma,
                seed=derived_seed(self.seed, 2),
            ),
            "pod_loss": WeightedPooledOutputDistillationLossComponent(
                weight=self.pod_alpha,
                sample_new_memory_batch=True,
                distillation_type=self.pod_distillation_type,
                normalize=self.pod_normalize,
            ),
        }


SPEC = register(
    MethodSpec(
        name="super-er",
        learner=SuperExperienceReplayLearner,
        summary="Renate's Super-ER: DER++ (Buzzega et al., NeurIPS 2020), CLS-ER (Arani et al., "
        "ICLR 2022), shrink and perturb (Ash and Adams, 'On Warm-Starting Neural Network "
        "Training', NeurIPS 2020) and POD (Douillard et al., ECCV 2020) together",
        features="hidden",
    )
)
