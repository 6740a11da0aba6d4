"""Prompting a frozen Vision Transformer: the machinery the prompt methods share.

The prompt methods keep a pretrained ViT frozen and learn only small prompts, their keys and the
classifier head. Their prompts live in a prompt module attached to the model's
:class:`~renate_events.vision_transformer.ViTBackbone` (its parameters are the model's, so
checkpoints and state folders hold them like every other weight), which the backbone's forward
runs through. This module holds what the methods share: the check that a model can be prompted
(:func:`prompted_backbone`), key-query matching (:func:`key_similarity`,
:func:`top_k_keys`, :func:`batchwise_keys`, :func:`pull_loss`), the orthogonal initialisation and
penalty of CODA-Prompt's components (:func:`orthogonal_rows_`, :func:`orthogonality_penalty`),
the prompt modules' base (:class:`PromptModule`, which counts the tasks and records the
auxiliary loss of a training forward), the component adding that loss (:class:`PromptLoss`) and
the learner every prompt method is a preset of (:class:`PromptLearner`).

Key-query matching runs on device tensors only: no host synchronisation per step (the task
index is a buffer of the module, compared on the device).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from renate_events.components import Component
from renate_events.learners import BaseExperienceReplayLearner, ReplayOnlyForMemoryLosses
from renate_events.vision_transformer import ViTBackbone
from trainer import validators

__all__ = [
    "PromptLearner",
    "PromptLoss",
    "PromptModelError",
    "PromptModule",
    "batchwise_keys",
    "check_layers",
    "key_similarity",
    "orthogonal_rows_",
    "orthogonality_penalty",
    "prompted_backbone",
    "pull_loss",
    "top_k_keys",
]


class PromptModelError(validators.WrongTypeError):
    """Raised when a prompt method is given a model it cannot prompt (not a supported ViT)."""


def prompted_backbone(model: nn.Module, learner: str) -> ViTBackbone:
    """The model's :class:`~renate_events.vision_transformer.ViTBackbone`.

    Supported: a zoo ``vit`` (``renate_events.models.vit``), a Hugging Face ViT loaded with
    :func:`renate_events.pretrained.pretrained_vit`, either of them multi-head.

    Raises:
        PromptModelError: ``model`` has no such backbone.
    """
    backbone = getattr(model, "backbone", None)
    if not isinstance(backbone, ViTBackbone):
        found = (
            "without a 'backbone'"
            if backbone is None
            else f"whose backbone is a {type(backbone).__name__}"
        )
        raise PromptModelError(
            f"{learner} prompts a frozen Vision Transformer: the model must have a ViTBackbone "
            f"as its 'backbone' (renate_events.models.vit, or a Hugging Face ViT loaded with "
            f"renate_events.pretrained.pretrained_vit; on the command line --model vit on an "
            f"image scenario), got a {type(model).__name__} {found}"
        )
    return backbone


def check_layers(learner: str, name: str, layers: Any, depth: int) -> tuple[int, ...]:
    """``layers`` as a tuple of distinct block indices of a ViT of ``depth`` blocks."""
    where = f"{learner}.{name}"
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple)):
        raise validators.WrongTypeError(f"{where} must be a list of block indices, got {layers!r}")
    for layer in layers:
        validators.check_int(f"{where} (each block index)", layer, 0, depth)
    if len(set(layers)) != len(layers):
        raise ValueError(f"{where} names a block twice: {list(layers)}")
    return tuple(layers)


# -- key-query matching ---------------------------------------------------------------------------


def key_similarity(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each query ``(batch, dim)`` to each key ``(pool, dim)``:
    ``(batch, pool)``."""
    return F.normalize(query, dim=-1) @ F.normalize(keys, dim=-1).t()


def top_k_keys(similarity: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` most similar keys of each query: ``(batch, k)``."""
    return similarity.topk(k, dim=1).indices


def batchwise_keys(indices: torch.Tensor, pool_size: int) -> torch.Tensor:
    """The ``k`` keys chosen most often in the batch, for every sample (the reference
    implementations' ``batchwise_prompt``), counted on the device: ``(batch, k)``."""
    counts = torch.zeros(pool_size, device=indices.device)
    counts.index_add_(0, indices.flatten(), torch.ones(indices.numel(), device=indices.device))
    top = counts.topk(indices.shape[1]).indices
    return top.unsqueeze(0).expand(len(indices), -1)


def pull_loss(similarity: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The surrogate loss pulling the chosen keys to their queries: minus the summed cosine
    similarity of each query to its chosen keys, averaged over the batch."""
    return -similarity.gather(1, indices).sum() / len(similarity)


# -- CODA-Prompt's orthogonality -----------------------------------------------------------------


def orthogonal_rows_(weight: torch.Tensor, start: int, stop: int) -> None:
    """Fill rows ``start:stop`` of ``weight`` (its first dimension; the others flattened) with
    orthonormal rows orthogonal to rows ``:start``, in place (CODA-Prompt's Gram-Schmidt
    initialisation of a new task's components); random unit rows where the row length is too
    short for that many orthogonal rows. Draws from torch's global RNG."""
    with torch.no_grad():
        flat = weight.view(weight.shape[0], -1)
        fresh = torch.randn(stop - start, flat.shape[1], device=weight.device)
        if stop <= flat.shape[1]:
            if start > 0:
                basis = torch.linalg.qr(flat[:start].t().float()).Q  # (length, start)
                fresh = fresh - (fresh @ basis) @ basis.t()
            fresh = torch.linalg.qr(fresh.t()).Q.t()
        else:
            fresh = F.normalize(fresh, dim=1)
        flat[start:stop] = fresh.to(flat.dtype)


def orthogonality_penalty(rows: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """``mean((R R^T - I)^2)`` over the ``active`` rows of ``rows`` (a boolean ``(pool,)``
    mask, kept on the device): CODA-Prompt's penalty on keys, attention vectors and
    components."""
    flat = rows.flatten(1)
    gram = flat @ flat.t() - torch.eye(len(flat), device=flat.device, dtype=flat.dtype)
    pairs = active.unsqueeze(0) & active.unsqueeze(1)
    return (gram.square() * pairs).sum() / pairs.sum()


# -- the prompt module, its loss and the learner --------------------------------------------------


class PromptModule(nn.Module):
    """A prompt module's base: ``module(backbone, images) -> features``.

    ``task`` (a buffer, so the model's state holds it) is the index of the current update:
    ``-1`` before the first, advanced by :meth:`start_task` at the start of every update. A
    training forward (the module in training mode, gradients on) records its auxiliary loss for
    :class:`PromptLoss`; the first recorded since the last :meth:`take_loss` is kept (that of
    the new batch, when memory batches follow it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("task", torch.tensor(-1, dtype=torch.int64))
        self.auxiliary_loss: torch.Tensor | None = None

    def start_task(self) -> None:
        """A new update starts: advance ``task`` and prepare its prompts."""
        self.task += 1
        self.new_task(int(self.task))  # once per update

    def new_task(self, task: int) -> None:
        """Prepare the prompts of update ``task`` (nothing by default)."""

    def check_updates(self, count: int) -> None:
        """Raise ``ValueError`` if the module cannot take ``count`` more updates (nothing by
        default): the learner's :meth:`check_updates`."""

    def check_loaded(self) -> None:
        """Raise ``ValueError`` naming the key if a loaded ``task`` cannot be this module's."""
        task = int(self.task)
        if task < -1:
            raise ValueError(f"key 'backbone.prompt.task' must be -1 or more, got {task}")

    def record(self, loss: torch.Tensor) -> None:
        """Keep ``loss`` as this step's auxiliary loss, in a training forward."""
        if self.training and torch.is_grad_enabled() and self.auxiliary_loss is None:
            self.auxiliary_loss = loss

    def take_loss(self) -> torch.Tensor | None:
        """The recorded auxiliary loss, forgotten once taken."""
        loss, self.auxiliary_loss = self.auxiliary_loss, None
        return loss

    def query(self, backbone: ViTBackbone, images: torch.Tensor) -> torch.Tensor:
        """The frozen model's class-token feature of ``images``, without gradients."""
        with torch.no_grad():
            return backbone.query(images)


@attrs.define(eq=False)
class PromptLoss(Component):
    """Adds the prompt module's auxiliary loss (the key pull, the orthogonality penalty) to the
    new-data loss of every step; its coefficient is the method's (in the module)."""

    prompt: PromptModule | None = attrs.field(default=None, kw_only=True)

    def on_train_start(self, model: nn.Module) -> None:
        if self.prompt is not None:
            self.prompt.auxiliary_loss = None  # nothing of a failed step

    def new_data_loss(
        self,
        outputs: torch.Tensor,
        batch: tuple[Any, torch.Tensor],
        intermediate_representations: list[torch.Tensor] | None,
    ) -> torch.Tensor | None:
        return None if self.prompt is None else self.prompt.take_loss()


@attrs.define(eq=False)
class PromptLearner(ReplayOnlyForMemoryLosses, BaseExperienceReplayLearner):
    """The base of the prompt methods: a frozen ViT, prompts attached to its backbone.

    At construction the model is checked (a :class:`~renate_events.vision_transformer.
    ViTBackbone` as its ``backbone``, else :class:`PromptModelError`), the method's prompt
    module (:meth:`make_prompt`) is attached to the backbone (taking over the state of a module
    of the same kind and shapes attached already: a second learner continues the first's
    prompts) and every parameter of the backbone but the prompts' is frozen (``requires_grad``
    off): only the prompts, their keys and the head train. A loaded state's update index is
    checked once per load (:meth:`PromptModule.check_loaded`). No memory by default (the methods are
    rehearsal-free) and, as in the reference implementations, the new-data loss masks the
    logits of classes this update has not shown (``mask_unused_classes``). The component
    ``prompt_loss`` (:class:`PromptLoss`) adds the method's auxiliary loss.
    """

    memory_size: int = attrs.field(default=0, validator=validators.int_at_least(0))
    mask_unused_classes: bool = attrs.field(default=True, validator=validators.boolean)
    _prompt: PromptModule | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        backbone = prompted_backbone(self.model, name)
        prompt = self.make_prompt(backbone)
        existing = backbone.prompt
        if existing is not None and not _same_prompt(existing, prompt):
            raise PromptModelError(
                f"{name}: the model's backbone carries a {type(existing).__name__} of other "
                f"shapes already; build the model afresh for {name}"
            )
        if existing is not None:  # its learned state, this learner's settings
            prompt.load_state_dict(existing.state_dict())
        self._prompt = prompt
        super().__attrs_post_init__()
        backbone.attach_prompt(prompt)
        prompt_parameters = {id(p) for p in self._prompt.parameters()}
        for parameter in backbone.parameters():
            if id(parameter) not in prompt_parameters:
                parameter.requires_grad_(False)

    def make_prompt(self, backbone: ViTBackbone) -> PromptModule:  # pragma: no cover - abstract
        """The method's prompt module for ``backbone`` (its width and depth)."""
        raise NotImplementedError

    @property
    def prompt(self) -> PromptModule:
        """The prompt module attached to the model's backbone."""
        return self._prompt  # type: ignore[return-value]

    def default_components(self) -> dict[str, Component]:
        return {"prompt_loss": PromptLoss(prompt=self._prompt)}

    def check_updates(self, count: int) -> None:
        """Raise ``ValueError`` if the prompt module cannot take ``count`` more updates (its
        pool holds so many prompts)."""
        self.prompt.check_updates(count)

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        """As the base learner's (the model is restored already), then the prompt module's
        check of its loaded state."""
        super().on_load_checkpoint(checkpoint)
        self.prompt.check_loaded()

    def on_train_start(self) -> None:
        """As the base learner's; then the prompt module starts its task."""
        super().on_train_start()
        self.prompt.start_task()


def _same_prompt(existing: nn.Module, fresh: nn.Module) -> bool:
    """Whether an attached prompt module is of the kind and shapes of ``fresh``."""
    if type(existing) is not type(fresh):
        return False
    ours = {k: v.shape for k, v in existing.state_dict().items()}
    return ours == {k: v.shape for k, v in fresh.state_dict().items()}
