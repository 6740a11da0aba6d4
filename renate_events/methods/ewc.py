"""Elastic weight consolidation (EWC): a quadratic penalty weighted by the diagonal Fisher
information, and its memory-free learner.

Kirkpatrick et al., "Overcoming catastrophic forgetting in neural networks", PNAS 2017; the
online variant with a decaying Fisher sum is from Schwarz et al., "Progress & Compress: A
scalable framework for continual learning", ICML 2018.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from renate_events.components import Component
from renate_events.inference import call_model
from renate_events.learners import BaseExperienceReplayLearner, ReplayOnlyForMemoryLosses
from renate_events.methods.registry import MethodSpec, register
from trainer import validators as v
from trainer.data import to_device

__all__ = [
    "EWC_MODES",
    "SPEC",
    "ElasticWeightConsolidationComponent",
    "ElasticWeightConsolidationLearner",
    "empirical_fisher",
]

#: ``"separate"``: one penalty per earlier update (its Fisher and its parameters);
#: ``"online"``: one penalty with ``F = decay_factor * F_old + F_new`` around the last parameters.
EWC_MODES = ("separate", "online")


def empirical_fisher(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    transform: Callable[[Any], Any] | None = None,
    target_transform: Callable[[Any], Any] | None = None,
) -> dict[str, torch.Tensor]:
    """The diagonal empirical Fisher of ``model`` over ``batches`` of ``(inputs, targets)``.

    The per-batch approximation Avalanche's EWC uses: for every batch the gradient ``g`` of the
    batch's mean loss, and ``F = mean over batches of g ** 2`` (squares of batch gradients, not
    of per-sample gradients: one backward pass per batch). The model runs in eval mode (no
    dropout, fixed batch-norm statistics) and gets its mode and its ``.grad`` back. ``transform``
    and ``target_transform`` (a learner's ``train_transform`` and ``train_target_transform``)
    are applied to each batch on the model's device, as the training step applies them.

    Raises:
        ValueError: No batch (the Fisher information of no data is undefined).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2, bias=False)
        >>> batches = [(torch.ones(1, 2), torch.tensor([0]))]
        >>> sorted(empirical_fisher(model, batches))
        ['weight']
    """
    parameters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    device = next(iter(parameters.values())).device if parameters else torch.device("cpu")
    fisher = {n: torch.zeros_like(p) for n, p in parameters.items()}
    grads = {n: p.grad for n, p in parameters.items()}
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    count = 0
    try:
        for batch in batches:
            inputs, targets = batch
            inputs, targets = to_device(inputs, device), targets.to(device)
            if transform is not None:
                inputs = transform(inputs)
            if target_transform is not None:
                targets = target_transform(targets)
            model.zero_grad(set_to_none=True)
            loss = loss_fn(call_model(model, inputs), targets)
            (loss if loss.dim() == 0 else loss.mean()).backward()
            for name, parameter in parameters.items():
                if parameter.grad is not None:
                    fisher[name].add_(parameter.grad.detach().square())
            count += 1
    finally:
        for module, training in modes:
            module.training = training
        for name, parameter in parameters.items():
            parameter.grad = grads[name]
    if count == 0:
        raise ValueError(
            "empirical_fisher: no batch of data was given; the Fisher information needs the "
            "update's training data"
        )
    return {name: value.div_(count) for name, value in fisher.items()}


@attrs.define(eq=False)
class ElasticWeightConsolidationComponent(Component):
    """EWC's penalty ``ewc_lambda / 2 * sum_i F_i (theta_i - theta*_i) ** 2`` on every step.

    At the end of every update (the trainer's ``train_end``) the diagonal empirical Fisher
    ``F`` of the update's training data is computed (:func:`empirical_fisher`, one backward pass
    per batch of the training loader) and the parameters ``theta*`` are kept. The penalty is
    added through :meth:`~renate_events.components.Component.new_data_loss`, so it needs no
    memory; in the first update there is none. Fisher and anchors are stored in checkpoints
    (safetensors), checked against the model's parameters on load.

    Note the factor ``1/2`` of the paper: Avalanche's ``EWCPlugin`` (which Renate wraps) adds
    ``ewc_lambda * sum F (theta - theta*)^2``, so an Avalanche ``ewc_lambda`` equals twice
    this one.

    Args:
        ewc_lambda: Strength of the penalty (Renate's default 0.4).
        mode: ``"separate"`` (Avalanche's default: one term per earlier update) or ``"online"``
            (Schwarz et al. 2018: one decayed Fisher sum around the latest parameters).
        decay_factor: In ``(0, 1]``, the decay of the online Fisher sum; needed by ``"online"``.
        loss_fn: The loss whose gradients make the Fisher (``(outputs, targets) -> loss``).
        transform: Applied to the inputs of the Fisher pass (the learner's ``train_transform``;
            the trainer's loader gives raw batches).
        target_transform: Applied to its targets (the learner's ``train_target_transform``).

    Example:
        >>> import torch
        >>> ewc = ElasticWeightConsolidationComponent(ewc_lambda=2.0)
        >>> ewc.has_fisher
        False
    """

    ewc_lambda: float = attrs.field(default=0.4, validator=v.real_in_range(0))
    mode: str = attrs.field(default="separate", validator=v.one_of(*EWC_MODES))
    decay_factor: float | None = attrs.field(
        default=None, validator=v.real_in_range(0, 1, low_open=True, optional=True)
    )
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = attrs.field(
        default=F.cross_entropy, validator=v.is_callable("(outputs, targets) -> loss")
    )
    transform: Callable[[Any], Any] | None = attrs.field(
        default=None, validator=attrs.validators.optional(v.is_callable("f(inputs) -> inputs"))
    )
    target_transform: Callable[[Any], Any] | None = attrs.field(
        default=None, validator=attrs.validators.optional(v.is_callable("f(targets) -> targets"))
    )
    _model: nn.Module | None = attrs.field(init=False, default=None)
    _loader: Any = attrs.field(init=False, default=None)
    # One {parameter name: tensor} per penalty term ("online": at most one).
    _fishers: list[dict[str, torch.Tensor]] = attrs.field(init=False, factory=list)
    _anchors: list[dict[str, torch.Tensor]] = attrs.field(init=False, factory=list)

    @property
    def calls_model(self) -> bool:
        """The Fisher pass at ``train_end`` runs the model (with ``ewc_lambda > 0``)."""
        return self.ewc_lambda > 0

    def __attrs_post_init__(self) -> None:
        if self.mode == "online" and self.decay_factor is None:
            raise ValueError(
                f"{type(self).__name__}.decay_factor must be set (a real number in (0, 1]) with "
                "mode='online', got None"
            )
        if self.mode != "online" and self.decay_factor is not None:
            raise ValueError(
                f"{type(self).__name__}.decay_factor acts only with mode='online' (the learner's "
                f"ewc_mode='online'), got decay_factor={self.decay_factor!r} with mode="
                f"{self.mode!r}; set the online mode or leave decay_factor unset"
            )

    @property
    def has_fisher(self) -> bool:
        """Whether an update has finished, so that there is Fisher information."""
        return bool(self._fishers)

    def fisher_information(self) -> list[dict[str, torch.Tensor]]:
        """The Fisher diagonals of the penalty terms (one per update, or one in online mode).

        Raises:
            ValueError: Before any update finished: no data was seen yet.
        """
        if not self._fishers:
            raise ValueError(
                f"{type(self).__name__}: no Fisher information yet; it is computed from an "
                "update's training data at the end of the update (fit the learner first)"
            )
        return [dict(f) for f in self._fishers]

    def on_train_start(self, model: nn.Module, train_loader: Any = None) -> None:
        """Note the model and the update's training batches (for the Fisher at its end)."""
        self._model, self._loader = model, train_loader

    def on_train_end(self, model: nn.Module) -> None:
        """Compute the Fisher of the update's data and keep the parameters as the anchor."""
        if self._loader is None:
            raise ValueError(
                f"{type(self).__name__}: the update's training data is unknown; the component "
                "computes the Fisher information from the trainer's train_loader"
            )
        fisher = empirical_fisher(
            model, self._loader, self.loss_fn, self.transform, self.target_transform
        )
        anchor = {n: p.detach().clone() for n, p in model.named_parameters() if n in fisher}
        self._loader = None
        if self.mode == "online" and self._fishers:
            decay = float(self.decay_factor)  # type: ignore[arg-type]  # set in online mode
            previous = self._fishers[0]
            for key, value in fisher.items():
                if key in previous:
                    value.add_(previous[key].to(value.device), alpha=decay)
            self._fishers, self._anchors = [fisher], [anchor]
            return
        self._fishers.append(fisher)
        self._anchors.append(anchor)

    def penalty(self, model: nn.Module) -> torch.Tensor:
        """``ewc_lambda / 2 * sum_k sum_i F_k,i (theta_i - theta*_k,i) ** 2`` (0 with no term)."""
        parameters = dict(model.named_parameters())
        first = next(iter(parameters.values()), None)
        total = torch.zeros((), device=first.device if first is not None else None)
        for fisher, anchor in zip(self._fishers, self._anchors):
            for name, f in fisher.items():
                parameter = parameters[name]
                if f.device != parameter.device:
                    f = fisher[name] = f.to(parameter.device)
                    anchor[name] = anchor[name].to(parameter.device)
                total = total + (f * (parameter - anchor[name]).square()).sum()
        return total * (self.ewc_lambda / 2)

    def new_data_loss(
        self,
        outputs: torch.Tensor,
        batch: tuple[Any, torch.Tensor],
        intermediate_representations: list[torch.Tensor] | None,
    ) -> torch.Tensor | None:
        """The penalty, once an update has finished and ``ewc_lambda > 0``."""
        if not self._fishers or self.ewc_lambda == 0 or self._model is None:
            return None
        return self.penalty(self._model)

    def on_save_checkpoint(self, checkpoint: MutableMapping[str, Any]) -> None:
        checkpoint["mode"] = self.mode
        checkpoint["fisher"] = [dict(f) for f in self._fishers]
        checkpoint["anchors"] = [dict(a) for a in self._anchors]

    def on_load_checkpoint(self, checkpoint: Mapping[str, Any], model: nn.Module) -> None:
        """Restore Fisher and anchors, each checked against ``model``'s parameters."""
        name = type(self).__name__
        if checkpoint.get("mode") != self.mode:
            raise ValueError(
                f"{name}: the checkpoint's EWC mode is {checkpoint.get('mode')!r}, this "
                f"component's {self.mode!r}; use the mode the checkpoint was written with"
            )
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        terms = []
        for key in ("fisher", "anchors"):
            value = checkpoint.get(key)
            if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
                raise ValueError(f"{name}: checkpoint key {key!r} must be a list of mappings")
            for index, term in enumerate(value):
                self._check_term(term, shapes, f"{key}[{index}]")
            terms.append([{n: t.clone() for n, t in term.items()} for term in value])
        fishers, anchors = terms
        if len(fishers) != len(anchors) or (self.mode == "online" and len(fishers) > 1):
            raise ValueError(
                f"{name}: checkpoint holds {len(fishers)} Fisher terms and {len(anchors)} "
                f"anchors (mode {self.mode!r}); they must pair up"
            )
        self._fishers, self._anchors = fishers, anchors
        self._model = model

    def _check_term(
        self, term: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str
    ) -> None:
        for key, tensor in term.items():
            if key not in shapes:
                raise ValueError(
                    f"{type(self).__name__}: checkpoint {where} names {key!r}, which is not a "
                    "parameter of the model"
                )
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ValueError(
                    f"{type(self).__name__}: checkpoint {where}[{key!r}] must be a float tensor"
                )
            if tuple(tensor.shape) != shapes[key]:
                raise ValueError(
                    f"{type(self).__name__}: checkpoint {where}[{key!r}] has shape "
                    f"{tuple(tensor.shape)}, the parameter {shapes[key]}"
                )


@attrs.define(eq=False)
class ElasticWeightConsolidationLearner(ReplayOnlyForMemoryLosses, BaseExperienceReplayLearner):
    """EWC: fine-tuning plus a Fisher-weighted quadratic penalty towards earlier parameters.

    Kirkpatrick et al., "Overcoming catastrophic forgetting in neural networks", PNAS 2017;
    ``ewc_mode="online"`` with ``decay_factor`` is online EWC (Schwarz et al., "Progress &
    Compress", ICML 2018). Renate's default ``ewc_lambda = 0.4``; Avalanche's ``mode =
    "separate"``. The component is ``ewc``
    (:class:`ElasticWeightConsolidationComponent`); no memory by default, and with a memory no
    replay unless a component of your own has a memory weight.
    """

    memory_size: int = attrs.field(default=0, validator=v.int_at_least(0))
    ewc_lambda: float = attrs.field(default=0.4, kw_only=True, validator=v.real_in_range(0))
    ewc_mode: str = attrs.field(
        default="separate", kw_only=True, validator=v.one_of("separate", "online")
    )
    decay_factor: float | None = attrs.field(
        default=None,
        kw_only=True,
        validator=v.real_in_range(0, 1, low_open=True, optional=True),
    )

    def default_components(self) -> dict[str, Component]:
        return {
            "ewc": ElasticWeightConsolidationComponent(
                ewc_lambda=self.ewc_lambda,
                mode=self.ewc_mode,
                decay_factor=self.decay_factor,
                loss_fn=self.loss_fn,
                transform=self.train_transform,
                target_transform=self.train_target_transform,
            )
        }


SPEC = register(
    MethodSpec(
        name="ewc",
        learner=ElasticWeightConsolidationLearner,
        summary="EWC: a Fisher-weighted penalty towards earlier parameters, no memory (Kirkpatrick "
        "et al., 'Overcoming catastrophic forgetting in neural networks', PNAS 2017)",
        uses_memory=False,
    )
)
