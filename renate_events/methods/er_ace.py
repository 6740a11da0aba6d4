"""ER-ACE: experience replay with the asymmetric cross-entropy.

Caccia, Aljundi, Asadi, Tuytelaars, Pineau and Belilovsky, "New Insights on Reducing Abrupt
Representation Change in Online Continual Learning", ICLR 2022. The loss on the incoming batch is
a cross-entropy over the logits of the classes present in that batch only (the others masked
out), so that the new classes do not push the old classes' logits down; the loss on the replayed
memory batch is the ordinary cross-entropy over all classes.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from renate_events.methods.er import ExperienceReplayLearner
from renate_events.methods.registry import MethodSpec, register
from trainer import validators

__all__ = ["SPEC", "AsymmetricCrossEntropyExperienceReplayLearner"]


@attrs.define(eq=False)
class AsymmetricCrossEntropyExperienceReplayLearner(ExperienceReplayLearner):
    """ER-ACE: ER whose loss on new data sees only the classes of the incoming batch.

    Caccia et al., "New Insights on Reducing Abrupt Representation Change in Online Continual
    Learning", ICLR 2022. ER's preset (``memory_loss``, the learner's ``loss_fn`` on a fresh
    memory batch, weighted by ``alpha``) with the base step's ``mask_unused_classes`` on, whose
    mask is here the classes of the current batch of new data alone (not, as for the base
    learner, every class of the update so far): a ``(classes,)`` boolean mask filled from the
    targets on the device, without a synchronisation. The memory loss and the stored logits stay
    unmasked. With ``loss_normalization`` (the default, as for ER) the two terms are averaged
    with the weights ``loss_weight`` and ``alpha``; the paper sums them (``loss_normalization=
    False``). ``mask_unused_classes=False`` is plain ER. The targets must be class labels.

    Example:
        >>> import torch
        >>> from trainer import Trainer
        >>> learner = AsymmetricCrossEntropyExperienceReplayLearner(
        ...     model=torch.nn.Linear(4, 3), memory_size=20, memory_batch_size=4, batch_size=8,
        ...     trainer=Trainer(max_epochs=1))
        >>> data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
        >>> learner.fit(data).steps
        2
    """

    mask_unused_classes: bool = attrs.field(default=True, validator=validators.boolean)

    def _seen(self, targets: torch.Tensor, classes: int) -> torch.Tensor:
        """The classes of this batch of new data (the asymmetric cross-entropy's mask)."""
        mask = torch.zeros(classes, dtype=torch.bool, device=targets.device)
        return mask.index_fill_(0, targets.reshape(-1), True)

    def check_data(self, data: Any) -> None:
        """As the base learner's; targets that are not class labels are refused (the mask is
        made of the labels of each batch)."""
        super().check_data(data)
        tensors = getattr(data, "tensors", None)
        if isinstance(tensors, tuple) and len(tensors) >= 2 and self.mask_unused_classes:
            targets = tensors[1]
            if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dim() != 1:
                raise ValueError(
                    f"{type(self).__name__} masks the new-data loss to the classes of each "
                    "batch, so its targets must be class labels (an integer tensor of one label "
                    f"per sample), got dtype {targets.dtype} and shape {tuple(targets.shape)}; "
                    "pass mask_unused_classes=False for other targets (plain ER)"
                )


SPEC = register(
    MethodSpec(
        name="er-ace",
        learner=AsymmetricCrossEntropyExperienceReplayLearner,
        summary="ER-ACE: experience replay whose new-data cross-entropy is restricted to the "
        "classes of the incoming batch (Caccia et al., 'New Insights on Reducing Abrupt "
        "Representation Change in Online Continual Learning', ICLR 2022)",
    )
)
