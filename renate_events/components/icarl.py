"""iCaRL: sigmoid distillation loss and the nearest-mean-of-exemplars classifier.

Rebuffi, Kolesnikov, Sperl and Lampert, "iCaRL: Incremental Classifier and Representation
Learning", CVPR 2017. The exemplar memory (herding) is
:class:`renate_events.memory.HerdingBuffer`; the learner is
:class:`renate_events.learners.ICaRLLearner`.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from renate_events.components.component import BatchMemory, call_model
from renate_events.components.features import IntermediateRepresentations
from renate_events.components.lwf import OldModelDistillation
from trainer import validators as v

__all__ = [
    "ICaRLLossComponent",
    "NearestMeanOfExemplarsClassifier",
    "check_class_means",
    "exemplar_means",
    "icarl_loss",
    "module_features",
]


def icarl_loss(
    outputs: torch.Tensor,
    targets: torch.Tensor,
    old_outputs: torch.Tensor | None = None,
    old_classes: torch.Tensor | None = None,
) -> torch.Tensor:
    """iCaRL's classification and distillation loss: binary cross-entropy on sigmoid outputs.

    The target of every output is the one-hot label, except for the old classes (the boolean
    mask ``old_classes`` over the outputs), whose targets are the previous model's sigmoid
    outputs ``sigmoid(old_outputs)`` (also for samples of new classes). The mean over samples and
    classes, as Avalanche's iCaRL loss (which Renate wraps); computed from the logits, so it stays
    finite for saturated sigmoids.

    Args:
        outputs: ``(N, K)`` logits of the model being trained.
        targets: ``(N,)`` integer labels in ``[0, K)``.
        old_outputs: ``(N, K)`` logits of the previous model, or ``None`` (the first update).
        old_classes: ``(K,)`` bool mask of the classes of earlier updates, or ``None``.

    Example:
        >>> import torch
        >>> logits = torch.zeros(1, 2)
        >>> round(float(icarl_loss(logits, torch.tensor([1]))), 4)  # log 2 per output
        0.6931
    """
    target = torch.zeros_like(outputs, dtype=torch.float32)
    target.scatter_(1, targets.reshape(-1, 1).long(), 1.0)
    if old_outputs is not None and old_classes is not None:
        target = torch.where(old_classes, torch.sigmoid(old_outputs.float()), target)
    return F.binary_cross_entropy_with_logits(outputs.float(), target)


def module_features(model: nn.Module, module: str, inputs: Any) -> torch.Tensor:
    """The output of ``model``'s submodule ``module`` when ``model`` runs on ``inputs``, as
    ``(batch, d)`` (flattened after the batch dimension).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        >>> module_features(model, "1", torch.ones(5, 4)).shape
        torch.Size([5, 3])
    """
    with IntermediateRepresentations(model, [module]) as recorder:
        call_model(model, inputs)
        output = recorder.representations[0]
    if not isinstance(output, torch.Tensor) or output.dim() == 0:
        raise ValueError(
            f"the feature module {module!r} must output a tensor with the batch first, got "
            f"{type(output).__name__ if not isinstance(output, torch.Tensor) else output.shape}"
        )
    return output.flatten(1) if output.dim() > 1 else output.unsqueeze(1)


def exemplar_means(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """iCaRL's class prototypes: the mean of each class's L2-normalised features, re-normalised.

    Args:
        features: ``(n, d)`` features of the exemplars.
        labels: ``(n,)`` their labels in ``[0, num_classes)``.
        num_classes: ``K``.

    Returns:
        ``(means, known)``: ``(K, d)`` float32 means (zero rows for classes without exemplars)
        and the ``(K,)`` bool mask of the classes that have exemplars.

    Example:
        >>> import torch
        >>> means, known = exemplar_means(torch.tensor([[2.0, 0.0], [0.0, 3.0]]),
        ...                               torch.tensor([0, 0]), 2)
        >>> [round(x, 4) for x in means[0].tolist()], known.tolist()
        ([0.7071, 0.7071], [True, False])
    """
    phi = F.normalize(features.detach().float(), dim=1)
    labels = labels.to(phi.device).long()
    sums = torch.zeros(num_classes, phi.shape[1], device=phi.device).index_add_(0, labels, phi)
    counts = torch.bincount(labels, minlength=num_classes)[:num_classes]
    return F.normalize(sums, dim=1), counts > 0


class NearestMeanOfExemplarsClassifier(nn.Module):
    """iCaRL's classifier: the class whose exemplar mean is nearest to the sample's feature.

    Its output is a score per class, ``-|| phi(x) - mu_y ||**2`` with ``phi(x)`` the
    L2-normalised output of ``feature_module`` and ``mu_y`` the (normalised) class means, and
    ``-inf`` for classes without exemplars, so that the argmax is iCaRL's prediction
    ``argmin_y || phi(x) - mu_y ||`` and :func:`renate_events.evaluation.evaluate` takes it as
    a model (task-incremental masking included). The model is shared, not copied.

    Args:
        model: The model whose submodule ``feature_module`` gives the features.
        feature_module: A name from ``model.named_modules()``.
        class_means: ``(K, d)`` class means.
        known: ``(K,)`` bool mask of the classes that have a mean (at least one).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(2, 2))
        >>> nme = NearestMeanOfExemplarsClassifier(
        ...     model, "0", torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([True, True]))
        >>> nme(torch.tensor([[3.0, 1.0], [0.0, 2.0]])).argmax(dim=1).tolist()
        [0, 1]
    """

    class_means: torch.Tensor
    known: torch.Tensor

    def __init__(
        self,
        model: nn.Module,
        feature_module: str,
        class_means: torch.Tensor,
        known: torch.Tensor,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise v.WrongTypeError(
                f"NearestMeanOfExemplarsClassifier: model must be a torch.nn.Module, got "
                f"{type(model).__name__}"
            )
        check_class_means(class_means, known, "NearestMeanOfExemplarsClassifier")
        if not bool(known.any()):
            raise ValueError(
                "NearestMeanOfExemplarsClassifier: no class has exemplars yet; train an update "
                "first (the class means are computed at the end of each update)"
            )
        self.model = model
        self.feature_module = feature_module
        self.register_buffer("class_means", class_means.detach().float().clone())
        self.register_buffer("known", known.detach().clone())

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        inputs: Any = kwargs if kwargs else (args[0] if len(args) == 1 else args)
        phi = F.normalize(module_features(self.model, self.feature_module, inputs).float(), dim=1)
        if phi.shape[1] != self.class_means.shape[1]:
            raise ValueError(
                f"NearestMeanOfExemplarsClassifier: the feature module {self.feature_module!r} "
                f"gives {phi.shape[1]} features, the class means have "
                f"{self.class_means.shape[1]}"
            )
        scores = -torch.cdist(phi, self.class_means.to(phi.device)).square()
        return scores.masked_fill(~self.known.to(phi.device), float("-inf"))


def check_class_means(means: Any, known: Any, where: str) -> None:
    """Raise a ``ValueError`` (starting with ``where``) unless ``means`` is a finite ``(K, d)``
    float tensor and ``known`` a ``(K,)`` bool tensor: class means read back are untrusted."""
    if (
        not isinstance(means, torch.Tensor)
        or means.dim() != 2
        or not means.dtype.is_floating_point
        or not bool(torch.isfinite(means).all())
    ):
        got = tuple(means.shape) if isinstance(means, torch.Tensor) else type(means).__name__
        raise ValueError(f"{where}: class means must be a finite (K, d) float tensor, got {got}")
    if (
        not isinstance(known, torch.Tensor)
        or known.dtype != torch.bool
        or tuple(known.shape) != (means.shape[0],)
    ):
        got = tuple(known.shape) if isinstance(known, torch.Tensor) else type(known).__name__
        raise ValueError(
            f"{where}: the mask of known classes must be a ({means.shape[0]},) bool tensor, "
            f"got {got}"
        )


@attrs.define(eq=False)
class ICaRLLossComponent(OldModelDistillation):
    """iCaRL's loss (:func:`icarl_loss`) on the new batch and, weighted by ``weight``, on a
    memory batch of exemplars.

    At the start of every update (``train_start``) a frozen copy of the model is taken; from
    the second update on, the targets of the classes seen in earlier updates (the labels of the
    new batches trained on) are that copy's sigmoid outputs, the others one-hot. The new-data
    term comes through :meth:`~renate_events.components.Component.new_data_loss`; the memory
    term through :meth:`loss`. The copy and the classes are stored in checkpoints.

    Args:
        weight: Weight of the loss on memory batches (default 1).
        sample_new_memory_batch: See :class:`~renate_events.components.Component` (default
            ``True``).

    Example:
        >>> import torch
        >>> component = ICaRLLossComponent()
        >>> model = torch.nn.Linear(3, 2)
        >>> component.on_train_start(model=model)
        >>> batch = (torch.zeros(4, 3), torch.tensor([0, 1, 0, 1]))
        >>> float(component.new_data_loss(model(batch[0]), batch, None).detach()) > 0
        True
    """

    weight: float = attrs.field(default=1.0, validator=v.real_in_range(0))
    sample_new_memory_batch: bool = attrs.field(default=True, validator=v.boolean)

    @property
    def calls_model(self) -> bool:
        """The frozen copy of the model gives the old classes' targets on every batch."""
        return True

    def _loss(self, outputs: torch.Tensor, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if self._old_model is None or self._old_classes is None:
            return icarl_loss(outputs, targets)
        old_outputs = self._old_outputs(inputs)
        classes = self._old_classes
        if classes.device != outputs.device or classes.numel() != outputs.shape[-1]:
            grown = torch.zeros(outputs.shape[-1], dtype=torch.bool, device=outputs.device)
            count = min(classes.numel(), outputs.shape[-1])
            grown[:count] = classes[:count].to(outputs.device)
            classes = self._old_classes = grown
        return icarl_loss(outputs, targets, old_outputs, classes)

    def new_data_loss(
        self,
        outputs: torch.Tensor,
        batch: tuple[Any, torch.Tensor],
        intermediate_representations: list[torch.Tensor] | None,
    ) -> torch.Tensor | None:
        inputs, targets = batch
        self._note_classes(targets, outputs.shape[-1])
        return self._loss(outputs, inputs, targets)

    def loss(
        self,
        outputs_memory: torch.Tensor,
        batch_memory: BatchMemory,
        intermediate_representation_memory: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        if self.weight == 0:
            return outputs_memory.new_zeros(())
        (inputs, targets), _ = batch_memory
        loss = self._loss(outputs_memory, inputs, targets)
        return loss if self.weight == 1 else loss * self.weight
