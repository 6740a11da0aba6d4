"""iCaRL: herding exemplars, a sigmoid distillation loss and the nearest-mean-of-exemplars
classifier.

Rebuffi, Kolesnikov, Sperl and Lampert, "iCaRL: Incremental Classifier and Representation
Learning", CVPR 2017. The exemplar memory (herding) is
:class:`renate_events.memory.HerdingBuffer`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, cast

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from renate_events.components import (
    BatchMemory,
    Component,
    IntermediateRepresentations,
    OldModelDistillation,
)
from renate_events.inference import call_model, inference, model_device
from renate_events.learners import BaseExperienceReplayLearner, derived_seed, unpack
from renate_events.memory import HerdingBuffer
from renate_events.methods.registry import MethodSpec, register
from trainer import FitResult
from trainer import validators as v
from trainer.data import to_device

__all__ = [
    "SPEC",
    "ICaRLLearner",
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


@attrs.define(eq=False)
class ICaRLLearner(BaseExperienceReplayLearner):
    """iCaRL: herding exemplars, sigmoid distillation and a nearest-mean-of-exemplars classifier.

    Rebuffi, Kolesnikov, Sperl and Lampert, "iCaRL: Incremental Classifier and Representation
    Learning", CVPR 2017 (Renate's ``AvalancheICaRLLearner``, whose only own hyperparameter is
    ``memory_size``). Each step adds :func:`icarl_loss` (binary
    cross-entropy on sigmoid outputs, the old classes' targets being the outputs of the model
    as it was when the update started) on the new batch and on a memory batch of exemplars: the
    component ``icarl`` (:class:`ICaRLLossComponent`). The learner's
    own cross-entropy is off (``loss_weight = 0``). At the end of every update (``train_end``)
    the final model's features of the update's data fill a
    :class:`~renate_events.memory.HerdingBuffer` of ``memory_size`` exemplars (``m =
    memory_size // classes`` per class, earlier classes reduced to their first ``m``), and the
    class means of the exemplars' normalised features are computed and kept in checkpoints:
    :meth:`nme_classifier` is iCaRL's classifier over them.

    The features are the output of the last of ``feature_modules`` or, with none, of the model's
    ``backbone`` (the zoo models of :mod:`renate_events.models`); a model with neither is
    refused when the learner is built, as is a ``memory_size`` below the model's number of
    classes when an update starts. Inputs must be tensors; the update's raw inputs are held in
    memory at its end, for the herding.

    Args:
        memory_size: ``K``, the total number of exemplars (the paper's 2000 by default).
        loss_weight: Weight of the learner's ``loss_fn`` on new data (0: iCaRL's loss alone).

    Example:
        >>> import torch
        >>> from renate_events.evaluation import evaluate
        >>> from renate_events.scenarios import ClassIncrementalScenario
        >>> from trainer import Trainer
        >>> data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.arange(40) % 4)
        >>> tasks = ClassIncrementalScenario(data, [[0, 1], [2, 3]]).tasks()
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...                             torch.nn.Linear(8, 4))
        >>> learner = ICaRLLearner(model=model, memory_size=8, memory_batch_size=4,
        ...                        feature_modules=["1"], trainer=Trainer(max_epochs=1))
        >>> for task in tasks:
        ...     _ = learner.fit(task.train)
        >>> learner.buffer.class_counts()
        {0: 2, 1: 2, 2: 2, 3: 2}
        >>> len(evaluate(learner.nme_classifier(), tasks))
        2
    """

    memory_size: int = attrs.field(default=2000, validator=v.int_at_least(1))
    loss_weight: float = attrs.field(default=0.0, validator=v.real_in_range(0))
    _feature_module: str = attrs.field(init=False, default="")
    _class_means: torch.Tensor | None = attrs.field(init=False, default=None)
    _known_classes: torch.Tensor | None = attrs.field(init=False, default=None)
    _herding_data: Any = attrs.field(init=False, default=None)
    _fills_own_buffer: ClassVar[bool] = True  # herding at the end of each update

    def __attrs_post_init__(self) -> None:
        if self.buffer is None:
            self.buffer = HerdingBuffer(max_size=self.memory_size, seed=derived_seed(self.seed, 0))
        if not isinstance(self.buffer, HerdingBuffer):
            raise ValueError(
                f"`{type(self).__name__}.buffer` must be a HerdingBuffer (iCaRL's exemplars), got "
                f"a {type(self.buffer).__name__}; leave buffer unset (ModelUpdater: "
                "buffer='herding'; on the command line: --buffer herding)"
            )
        self._feature_module = self._feature_extractor()
        super().__attrs_post_init__()

    def _feature_extractor(self) -> str:
        """The module whose output is iCaRL's feature: the last feature module, else
        ``backbone``."""
        names = tuple(self.feature_modules)
        if names:
            return names[-1]
        if isinstance(getattr(self.model, "backbone", None), nn.Module):
            return "backbone"
        raise ValueError(
            f"{type(self).__name__} needs a feature extractor for its herding and its "
            "nearest-mean-of-exemplars classifier, but feature_modules is empty and the model "
            f"({type(self.model).__name__}) has no `backbone` submodule; pass "
            "feature_modules=['<name>'] naming the submodule whose output is the feature (the "
            "last one is used; see model.named_modules()); on the command line "
            "--feature-modules '[\"<name>\"]' (run without --config-file: --hidden sizes)"
        )

    def default_components(self) -> dict[str, Component]:
        return {"icarl": ICaRLLossComponent(weight=1.0, sample_new_memory_batch=True)}

    def fit(
        self,
        train_data: Dataset[Any] | Iterable[Any],
        val_data: Dataset[Any] | Iterable[Any] | None = None,
        *,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> FitResult:
        self._herding_data = train_data
        try:
            return super().fit(train_data, val_data, resume_from=resume_from)
        finally:
            self._herding_data = None

    def check_data(self, data: Any) -> None:
        """As the base learner's; also refuses a memory smaller than the model's classes."""
        super().check_data(data)
        tensors = getattr(data, "tensors", None)
        if not isinstance(tensors, tuple) or len(tensors) != 2 or not len(data):
            return

        with inference(self.model):
            probe = tensors[0][:2].to(model_device(self.model))
            classes = self._forward(self.probe_transform("test_transform", probe)).shape[-1]
        if self.memory_size < classes:
            raise ValueError(
                f"`{type(self).__name__}.memory_size` must be at least the model's number of "
                f"classes ({classes}): iCaRL keeps memory_size // classes exemplars of each; got "
                f"{self.memory_size}"
            )

    @property
    def feature_module(self) -> str:
        """The name of the submodule whose output is iCaRL's feature."""
        return self._feature_module

    @property
    def class_means(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(means, known)`` of the exemplars after the last update (``None`` before one):
        ``(K, d)`` normalised class means and the ``(K,)`` mask of classes with exemplars."""
        if self._class_means is None or self._known_classes is None:
            return None
        return self._class_means.clone(), self._known_classes.clone()

    def nme_classifier(self) -> NearestMeanOfExemplarsClassifier:
        """iCaRL's nearest-mean-of-exemplars classifier on the current model and class means
        (a module; pass it to :func:`renate_events.evaluation.evaluate` as the model).

        Raises:
            ValueError: No update has ended yet, so there are no class means.
        """
        if self._class_means is None or self._known_classes is None:
            raise ValueError(
                f"{type(self).__name__}.nme_classifier: no class means yet; they are computed "
                "at the end of each update (call fit first)"
            )
        device = model_device(self.model)
        return NearestMeanOfExemplarsClassifier(
            self.model,
            self._feature_module,
            self._class_means.to(device),
            self._known_classes.to(device),
        )

    def _check_first_batch(
        self,
        inputs: Any,
        targets: torch.Tensor,
        outputs: torch.Tensor,
        features: Sequence[torch.Tensor],
        *,
        task_ids: torch.Tensor | None = None,
    ) -> None:
        """Once per update, before anything trains: tensor inputs that fit the exemplars (task
        ids never get here: iCaRL's loss component refuses task-incremental data)."""
        if self._batch_checked:
            return
        if not isinstance(inputs, torch.Tensor):
            raise v.WrongTypeError(
                f"{type(self).__name__} needs tensor inputs (its herding holds the update's "
                f"inputs), got {type(inputs).__name__}"
            )
        cast(HerdingBuffer, self.buffer).check_batch(inputs, targets)

    def _add_to_buffer(self, batch: Any, outputs: Mapping[str, Any]) -> None:
        """Nothing per step: the exemplars are chosen at the end of the update."""

    def on_train_end(self, model: nn.Module) -> None:
        """Herd the update's exemplars with the final model and compute the class means; if
        the means fail, the buffer is put back as it was."""
        buffer, data = cast(HerdingBuffer, self.buffer), self._herding_data
        if data is None:
            return

        with inference(model):
            inputs, targets, features = self._embedded(model, self._loader(data, shuffle=False))
            saved = buffer.state_dict()
            buffer.herd(inputs, targets, features)
            try:
                view = buffer.dataset()
                exemplars = DataLoader(view, batch_size=self.batch_size, collate_fn=view.collate)
                _, labels, features = self._embedded(model, exemplars)
                probe = to_device(inputs[:1], model_device(model))
                classes = self._forward(self._transformed("test_transform", probe, 1)).shape[-1]
                means, known = exemplar_means(features, labels, classes)
            except BaseException:
                buffer.load_state_dict(saved)
                raise
        self._class_means, self._known_classes = means.cpu(), known.cpu()

    def _embedded(
        self, model: nn.Module, batches: Iterable[Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The raw inputs, the targets and the features (through ``test_transform``) of every
        batch, concatenated."""
        device = model_device(model)
        inputs, targets, features = [], [], []
        for batch in batches:
            raw, labels = unpack(batch)
            shown = self._transformed("test_transform", to_device(raw, device), len(labels))
            features.append(module_features(model, self._feature_module, shown))
            inputs.append(raw)
            targets.append(labels)
        if not targets:
            raise ValueError(
                f"{type(self).__name__}: the update's data gave no batches at the end of the "
                "update, for the herding; pass a dataset or a loader that can be iterated again"
            )
        return torch.cat(inputs), torch.cat(targets), torch.cat(features)

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._class_means is not None and self._known_classes is not None:
            checkpoint["class_means"] = self._class_means
            checkpoint["known_classes"] = self._known_classes

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        """As the base learner's, with the class means (checked before anything is restored)."""
        means, known = checkpoint.get("class_means"), checkpoint.get("known_classes")
        if (means is None) != (known is None):
            raise ValueError(
                f"{type(self).__name__}: the checkpoint has only one of 'class_means' and "
                "'known_classes'; it must have both or neither"
            )
        if means is not None:
            check_class_means(means, known, f"{type(self).__name__}: checkpoint 'class_means'")
        super().on_load_checkpoint(checkpoint)
        self._class_means = None if means is None else means.float().clone()
        self._known_classes = None if known is None else known.clone()


SPEC = register(
    MethodSpec(
        name="icarl",
        learner=ICaRLLearner,
        summary="iCaRL: herding exemplars, sigmoid distillation and a nearest-mean-of-exemplars "
        "classifier (Rebuffi et al., 'iCaRL: Incremental Classifier and Representation "
        "Learning', CVPR 2017)",
        buffers=("herding",),
        default_buffer="herding",
        features="last-hidden",
        classifier="nme",
    )
)
