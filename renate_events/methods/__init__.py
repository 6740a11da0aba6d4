"""Continual-learning methods: one spec per method in one registry.

Every method is declared by a :class:`MethodSpec` (name, learner class, buffers, what it needs
from the model, how it is evaluated); :data:`METHODS` holds them all and :data:`LEARNERS` maps each
name to its learner class.

Example:
    >>> from renate_events.methods import LEARNERS, method
    >>> method("der").learner is LEARNERS["der"]
    True
"""

from __future__ import annotations

from renate_events.learners import (
    CLSExperienceReplayLearner,
    DarkExperienceReplayLearner,
    ElasticWeightConsolidationLearner,
    ExperienceReplayLearner,
    FineTuningLearner,
    GDumbLearner,
    ICaRLLearner,
    JointLearner,
    LearningWithoutForgettingLearner,
    OfflineExperienceReplayLearner,
    PooledOutputDistillationExperienceReplayLearner,
    RepeatedDistillationLearner,
    SuperExperienceReplayLearner,
)
from renate_events.methods._registry import (
    BUFFER_KINDS,
    CLASSIFIERS,
    FEATURES,
    LEARNER_OBJECTS,
    METHODS,
    MethodSpec,
    MethodSpecError,
    learner_arguments,
    method,
    method_of,
    register,
)

__all__ = [
    "BUFFER_KINDS",
    "CLASSIFIERS",
    "FEATURES",
    "LEARNERS",
    "LEARNER_OBJECTS",
    "METHODS",
    "MethodSpec",
    "MethodSpecError",
    "learner_arguments",
    "method",
    "method_of",
    "register",
]

_MEMORY_FREE = {"uses_memory": False}
for _spec in (
    MethodSpec("fine-tuning", FineTuningLearner, "fine-tuning: no replay", **_MEMORY_FREE),
    MethodSpec("er", ExperienceReplayLearner, "experience replay (Chaudhry et al. 2019)"),
    MethodSpec("der", DarkExperienceReplayLearner, "DER++ (Buzzega et al., NeurIPS 2020)"),
    MethodSpec(
        "pod-er",
        PooledOutputDistillationExperienceReplayLearner,
        "PODNet distillation with replay (Douillard et al., ECCV 2020)",
        features="hidden",
    ),
    MethodSpec("cls-er", CLSExperienceReplayLearner, "CLS-ER (Arani et al., ICLR 2022)"),
    MethodSpec(
        "super-er",
        SuperExperienceReplayLearner,
        "Renate's Super-ER: DER++, POD, CLS-ER and shrink-perturb together",
        features="hidden",
    ),
    MethodSpec(
        "joint",
        JointLearner,
        "joint training on all data so far",
        own_buffer=True,
        **_MEMORY_FREE,
    ),
    MethodSpec(
        "ewc",
        ElasticWeightConsolidationLearner,
        "EWC (Kirkpatrick et al., PNAS 2017)",
        **_MEMORY_FREE,
    ),
    MethodSpec(
        "lwf",
        LearningWithoutForgettingLearner,
        "LwF (Li and Hoiem, TPAMI 2017)",
        **_MEMORY_FREE,
    ),
    MethodSpec("offline-er", OfflineExperienceReplayLearner, "Offline-ER (Renate)"),
    MethodSpec(
        "gdumb",
        GDumbLearner,
        "GDumb (Prabhu et al., ECCV 2020)",
        buffers=("greedy-class-balancing",),
        default_buffer="greedy-class-balancing",
    ),
    MethodSpec(
        "icarl",
        ICaRLLearner,
        "iCaRL (Rebuffi et al., CVPR 2017)",
        buffers=("herding",),
        default_buffer="herding",
        features="last-hidden",
        classifier="nme",
    ),
    MethodSpec(
        "repeated-distill",
        RepeatedDistillationLearner,
        "repeated distillation (Renate)",
    ),
):
    register(_spec)

LEARNERS = {name: spec.learner for name, spec in METHODS.items()}
"""Learner classes by method name. ``"der"`` is :class:`DarkExperienceReplayLearner` with
Renate's defaults (DER++); pass ``beta=0`` for DER."""
