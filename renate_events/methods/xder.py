"""X-DER: dark experience replay whose stored logits are updated with later knowledge.

Boschini, Bonicelli, Buzzega, Porrello and Calderara, "Class-Incremental Continual Learning into
the eXtended DER-verse", TPAMI 2022; semantics from the paper and the authors' reference code
(Mammoth, ``models/xder.py``). What is implemented and what is not is listed in the learner's
docstring and in ``docs/methods.rst``.
"""

from __future__ import annotations

from typing import Any, cast

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from renate_events.components import (
    Component,
    WeightedCustomLossComponent,
    WeightedMeanSquaredErrorLossComponent,
)
from renate_events.inference import forward, inference, model_device
from renate_events.learners import BaseExperienceReplayLearner, derived_seed
from renate_events.memory import DataBuffer, GreedyClassBalancingBuffer
from renate_events.methods.registry import MethodSpec, register
from trainer import validators
from trainer.capture import eager
from trainer.data import to_device

__all__ = ["SPEC", "ExtendedDarkExperienceReplayLearner", "transplant_logits"]


def transplant_logits(
    stored: torch.Tensor,
    current: torch.Tensor,
    targets: torch.Tensor,
    block: torch.Tensor,
    gamma: float,
) -> torch.Tensor:
    """X-DER's logit update: ``stored`` with the columns of ``block`` taken from ``current``.

    Mammoth's ``update_logits``: where the largest transplanted logit of a row exceeds the
    stored logit of its label, the transplanted logits are scaled by ``gamma * stored[label] /
    max``, so that the label keeps the largest stored logit. A row whose largest transplanted
    logit is 0 is not scaled (the reference code divides by it). As in the reference code, a
    negative label logit below a positive largest one gives a negative factor (the
    transplanted logits change sign).

    Args:
        stored: ``(N, C)`` logits stored with the samples.
        current: ``(N, C)`` logits to transplant (the current model's).
        targets: ``(N,)`` labels of the samples.
        block: ``(C,)`` bool mask of the columns replaced.
        gamma: The scale of the label's logit the transplanted ones stay below.

    Example:
        >>> stored = torch.tensor([[2.0, 0.0, 0.0]])
        >>> current = torch.tensor([[5.0, 4.0, 8.0]])
        >>> block = torch.tensor([False, True, True])
        >>> transplant_logits(stored, current, torch.tensor([0]), block, 0.5)
        tensor([[2.0000, 0.5000, 1.0000]])
    """
    label = stored.gather(1, targets.reshape(-1, 1)).squeeze(1)
    largest = current.masked_fill(~block, float("-inf")).amax(dim=1)
    divisor = torch.where(largest == 0, torch.ones_like(largest), largest)
    scale = torch.where(largest > label, gamma * label / divisor, torch.ones_like(largest))
    return torch.where(block, current * scale.unsqueeze(1), stored)


def _largest(logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The largest logit of each row among ``columns`` (``-inf`` where there is none)."""
    return logits.masked_fill(~columns, float("-inf")).amax(dim=1)


def _margins(logits: torch.Tensor, future: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """``max(future logits) - max(own logits)`` per row; ``-inf`` (never positive) for a row
    without future or own classes."""
    low = torch.full_like(logits[:, 0], float("-inf"))
    top, own_top = _largest(logits, future), _largest(logits, own)
    return torch.where(torch.isfinite(top) & torch.isfinite(own_top), top - own_top, low)


@attrs.define(eq=False)
class ExtendedDarkExperienceReplayLearner(BaseExperienceReplayLearner):
    """X-DER: DER++ whose stored logits learn about classes that came later.

    Boschini et al., "Class-Incremental Continual Learning into the eXtended DER-verse", TPAMI
    2022 (the reference code: Mammoth's ``xder.py``). "Past" classes are those of the samples in
    the buffer when an update starts (the buffer is filled at the end of each update, so these
    are the classes of earlier updates), "present" those of this update's batches so far and
    "future" the model's other outputs. One step:

    1. the cross-entropy of the new batch over the present classes only (the base learner's
       ``mask_unused_classes``, on by default; Mammoth's "present head");
    2. ``alpha`` times the MSE between the logits of a memory batch and its stored logits (all
       classes), ``beta`` times the cross-entropy of a second memory batch over the past classes
       only (two draws, as in the reference code);
    3. the *future-past* update: for each replayed sample, with probability ``1 / n`` at its
       ``n``-th replay in this update, its stored logits of the present and future classes are
       replaced by the current model's (:func:`transplant_logits`, scaled by
       ``logit_update_gamma`` below its label's stored logit); on the device, without a
       synchronisation;
    4. with ``future_constraint``, ``constraint_eta`` times the mean of the positive margins
       ``max(future logits) + constraint_margin - max(own logits)`` over the new batch (own:
       present classes) and the replayed samples (own: the past classes);
    5. with ``past_constraint``, ``constraint_eta`` times the mean of the positive margins
       ``max(past probabilities) + constraint_margin - max(present probabilities)`` over the
       new batch, its probabilities a softmax over the past and present classes, the past side
       detached (Mammoth's "past logits constraint": without it the present classes' logits of
       a new sample stay below the past ones' and the newest classes are hardly predicted).

    The terms are summed (``loss_normalization=False``, as the reference code). At the end of
    an update the buffer is filled class-balanced with the final model's logits
    (``buffer_filling="end"``, a :class:`~renate_events.memory.GreedyClassBalancingBuffer` by
    default); then, once, every stored sample of a past class gets its present and future
    logits from the final model, and every new sample has its past logits scaled below its
    label's (both with :func:`transplant_logits`).

    Not implemented (documented in ``docs/methods.rst``): the SupCon consistency loss on the
    future heads (it needs strong image augmentations), the distance-preserving loss
    (``dp_weight``, 0 by default in Mammoth), the BatchNorm alignment (``align_bn``) and the
    RPC classifier of the X-DER RPC variant.
    Where Mammoth's replayed samples keep their own task's head in the future constraint, here
    it is every past class (updates need not be tasks of fixed size), and a sample drawn in both
    memory batches of a step is updated twice. The replay counts start at 0 with each update
    and are in the learner's checkpoint (key ``replay_counts``), so a resumed update continues
    with them.

    Args:
        alpha: Weight of the logit MSE on memory (DER's ``alpha``).
        beta: Weight of the past-class cross-entropy on memory (DER++'s ``beta``).
        logit_update_gamma: Scale of the label's stored logit that transplanted logits stay
            below (Mammoth's ``gamma``, "weight for logit update", 0.85).
        future_constraint: Add the margin loss that keeps future logits below the own ones.
        past_constraint: Add the margin loss that keeps a new sample's present-class
            probabilities above its past-class ones (always on in the paper's code, a flag off
            by default in later Mammoth versions).
        constraint_eta: Weight of both margin losses (Mammoth's ``constr_eta``).
        constraint_margin: Their margin (Mammoth's ``constr_margin``; for the past constraint a
            margin of probabilities).

    Example:
        >>> import torch
        >>> from trainer import Trainer
        >>> learner = ExtendedDarkExperienceReplayLearner(
        ...     model=torch.nn.Linear(4, 4), memory_size=8, memory_batch_size=4, batch_size=8,
        ...     trainer=Trainer(max_epochs=1))
        >>> for classes in ([0, 1], [2, 3]):
        ...     labels = torch.tensor(classes * 4)
        ...     _ = learner.fit(torch.utils.data.TensorDataset(torch.randn(8, 4), labels))
        >>> learner.buffer.class_counts()
        {0: 2, 1: 2, 2: 2, 3: 2}
    """

    alpha: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
    beta: float = attrs.field(default=1.0, kw_only=True, validator=validators.real_in_range(0))
    logit_update_gamma: float = attrs.field(
        default=0.85, kw_only=True, validator=validators.real_in_range(0, low_open=True)
    )
    future_constraint: bool = attrs.field(default=True, kw_only=True, validator=validators.boolean)
    past_constraint: bool = attrs.field(default=True, kw_only=True, validator=validators.boolean)
    constraint_eta: float = attrs.field(
        default=0.1, kw_only=True, validator=validators.real_in_range(0)
    )
    constraint_margin: float = attrs.field(
        default=0.3, kw_only=True, validator=validators.real_in_range(0)
    )
    loss_normalization: bool = attrs.field(default=False, validator=validators.boolean)
    mask_unused_classes: bool = attrs.field(default=True, validator=validators.boolean)
    buffer_filling: str = attrs.field(
        default="end", kw_only=True, validator=validators.one_of("end")
    )
    # The classes in the buffer when the update started, their (C,) mask on the device, the
    # replay count of every slot in this update, the step's replayed outputs and new outputs.
    _past_labels: torch.Tensor | None = attrs.field(init=False, default=None)
    _past: torch.Tensor | None = attrs.field(init=False, default=None)
    _counts: torch.Tensor | None = attrs.field(init=False, default=None)
    _replayed: list[torch.Tensor] = attrs.field(init=False, factory=list)
    _new_outputs: torch.Tensor | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.buffer is None and self.memory_size > 0:  # Mammoth's class-balanced memory
            self.buffer = GreedyClassBalancingBuffer(
                max_size=self.memory_size, seed=derived_seed(self.seed, 0)
            )
        super().__attrs_post_init__()

    def default_components(self) -> dict[str, Component]:
        return {
            "mse_loss": WeightedMeanSquaredErrorLossComponent(
                weight=self.alpha, sample_new_memory_batch=True
            ),
            "memory_loss": WeightedCustomLossComponent(
                loss_fn=self.past_cross_entropy, weight=self.beta, sample_new_memory_batch=True
            ),
        }

    def past_cross_entropy(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The cross-entropy of memory samples over the past classes only (the "past heads")."""
        past = self._past_mask(outputs.shape[-1], outputs.device)
        return F.cross_entropy(outputs.masked_fill(~past, float("-inf")), targets)

    # -- the update's classes -------------------------------------------------------------------

    def on_train_start(self) -> None:
        """A new update: the past classes are those in the buffer (read once per update), every
        slot's replay count starts at 0."""
        super().on_train_start()
        self._note_past_classes()
        self._counts = None

    def _note_past_classes(self) -> None:
        """The classes in the buffer now are the update's past classes (one read of the
        buffer's targets; the buffer is filled at the end of an update only)."""
        buffer = self.buffer
        labels = None
        if isinstance(buffer, DataBuffer) and len(buffer) > 0:
            counts = getattr(buffer, "class_counts", None)
            if callable(counts):  # class-balanced buffers count their classes
                labels = torch.tensor(sorted(counts()), dtype=torch.int64)
            else:  # the targets, a chunk at a time (the inputs come along)
                view, chunk = buffer.dataset(), 4096
                found = [
                    torch.unique(view.__getitems__(list(range(i, min(i + chunk, len(buffer)))))[1])
                    for i in range(0, len(buffer), chunk)
                ]
                labels = torch.unique(torch.cat(found))
        self._past_labels, self._past = labels, None

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        """The base learner's state, and this update's replay count of every slot."""
        super().on_save_checkpoint(checkpoint)
        if self._counts is not None:
            checkpoint["replay_counts"] = self._counts

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        """The base learner's state; the past classes read from the loaded buffer (a resumed
        update continues with the buffer it started with) and the replay counts, checked:
        a 1-D float tensor of finite counts >= 0, at least one per filled slot of the buffer."""
        counts = checkpoint.get("replay_counts")
        if counts is not None:
            buffer = checkpoint.get("buffer")
            filled = buffer.get("length", 0) if isinstance(buffer, dict) else 0
            if not (
                isinstance(counts, torch.Tensor)
                and counts.dtype == torch.float32
                and counts.dim() == 1
                and isinstance(filled, int)
                and counts.numel() >= filled
                and bool(torch.isfinite(counts).all())
                and bool((counts >= 0).all())
            ):
                shown = tuple(counts.shape) if isinstance(counts, torch.Tensor) else counts
                raise ValueError(
                    f"{type(self).__name__}: checkpoint key 'replay_counts' must be a 1-D "
                    "float32 tensor of finite counts >= 0, one per filled buffer slot, got "
                    f"{getattr(counts, 'dtype', type(counts).__name__)} {shown}"
                )
        super().on_load_checkpoint(checkpoint)
        self._note_past_classes()
        self._counts = None if counts is None else counts.clone()

    @eager
    def _past_mask(self, classes: int, device: torch.device) -> torch.Tensor:
        """The ``(classes,)`` bool mask of the past classes on ``device`` (made once per update)."""
        past = self._past
        if past is None or past.numel() != classes or past.device != device:
            past = torch.zeros(classes, dtype=torch.bool, device=device)
            if self._past_labels is not None:
                labels = self._past_labels.to(device)
                past = past.index_fill(0, labels[labels < classes], True)
            self._past = past
        return past

    # -- the step -------------------------------------------------------------------------------

    def _step(self, batch: Any) -> dict[str, Any]:
        """The base step, plus the future constraint on the new and the replayed logits and the
        past constraint on the new ones."""
        self._clear_step_notes()
        result = super()._step(batch)
        outputs = self._new_outputs
        if self.constraint_eta > 0 and outputs is not None:
            if self.future_constraint:
                result["loss"] = result["loss"] + self._constraint(outputs)
            if self.past_constraint:
                result["loss"] = result["loss"] + self._past_constraint(outputs)
        self._clear_step_notes()
        return result

    @eager
    def _clear_step_notes(self) -> None:
        """Forget the step's outputs (eager: a captured step writes no attribute of the learner,
        see :func:`trainer.capture.eager`)."""
        self._replayed, self._new_outputs = [], None

    @eager
    def _note_new_outputs(self, outputs: torch.Tensor) -> None:
        """Keep the new batch's outputs for the future constraint (eager, as above)."""
        self._new_outputs = outputs

    def _forward_new_and_memory(
        self, net: nn.Module, inputs: Any, replay: bool, task_ids: torch.Tensor | None = None
    ) -> Any:
        """The base's passes; the new batch's outputs kept for the future constraint."""
        passes = super()._forward_new_and_memory(net, inputs, replay, task_ids)
        self._note_new_outputs(passes.outputs)
        return passes

    def _past_and_present(self, outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(C,)`` masks of the past and the present classes of ``outputs``' columns (no
        present class with ``mask_unused_classes=False``: the step does not note them)."""
        classes = outputs.shape[-1]
        past = self._past_mask(classes, outputs.device)
        present = self._seen_classes
        if present is None or present.numel() != classes:  # mask_unused_classes=False
            present = torch.zeros_like(past)
        return past, present

    def _constraint(self, outputs: torch.Tensor) -> torch.Tensor:
        """``constraint_eta`` times the mean positive margin of future over own logits."""
        past, present = self._past_and_present(outputs)
        future = ~(past | present)
        margins = [_margins(outputs, future, present)]
        margins += [_margins(o, future, past) for o in self._replayed]
        return self._mean_positive(torch.cat(margins) + self.constraint_margin)

    def _past_constraint(self, outputs: torch.Tensor) -> torch.Tensor:
        """``constraint_eta`` times the mean positive margin ``max p_old + constraint_margin -
        max p_present`` of the new batch, ``p`` its softmax over the past and present classes.

        Mammoth's past constraint: the largest probability among the present classes is pushed
        a margin above the largest among the past ones (that side detached: the gradient goes
        through the present side's probability only). A class of the buffer that this update's
        data shows again counts as present, not as past ("old" is past and not present).
        """
        past, present = self._past_and_present(outputs)
        old = past & ~present
        kept = old | present
        # Where no column is kept (no present class noted) the softmax is taken over every
        # class rather than over none (NaN); those rows have no finite margin below anyway.
        kept = torch.where(kept.any(), kept, torch.ones_like(kept))
        probabilities = F.softmax(outputs.float().masked_fill(~kept, float("-inf")), dim=1)
        bad, good = _largest(probabilities.detach(), old), _largest(probabilities, present)
        finite = torch.isfinite(bad) & torch.isfinite(good)
        margin = torch.where(finite, bad - good, torch.full_like(bad, float("-inf")))
        return self._mean_positive(margin + self.constraint_margin)

    def _mean_positive(self, margin: torch.Tensor) -> torch.Tensor:
        """``constraint_eta`` times the mean of the positive ``margin`` entries (0 if none;
        counted on the device, without a synchronisation)."""
        positive = margin > 0  # a row without the classes compared (-inf) is not positive
        total = torch.where(positive, margin, torch.zeros_like(margin)).sum()
        return self.constraint_eta * total / positive.sum().clamp(min=1)

    @eager
    def _ema_update(self, batch_memory: Any, outputs_memory: torch.Tensor) -> None:
        """The base's EMA, then the future-past update of the replayed samples' stored logits
        (eager: it writes the buffer and the counts)."""
        super()._ema_update(batch_memory, outputs_memory)
        self._replayed.append(outputs_memory)
        (_, targets), metadata = batch_memory
        if "logits" not in metadata:
            return
        buffer = cast(DataBuffer, self.buffer)
        idx, stored = metadata["idx"], metadata["logits"]
        counts = self._counts
        if counts is None:
            counts = torch.zeros(buffer.capacity, device=idx.device)
        elif counts.device != idx.device:  # loaded from a checkpoint onto the CPU
            counts = counts.to(idx.device)
        seen = counts.index_select(0, idx) + 1
        self._counts = counts.index_copy(0, idx, seen)  # a new tensor: the undo keeps the old
        current = outputs_memory.detach().to(stored.device, stored.dtype)
        past = self._past_mask(current.shape[-1], stored.device)
        targets = targets.to(stored.device)
        draw = torch.rand(len(idx), device=stored.device)
        chosen = past[targets] & (draw * seen.to(stored.device) < 1)
        updated = transplant_logits(stored, current, targets, ~past, self.logit_update_gamma)
        if self._undo is not None and not self._batch_checked:  # the first step: undoable
            previous = stored.clone()
            self._undo.append(lambda: buffer.set_metadata("logits", idx, previous, distinct=True))
        values = torch.where(chosen.unsqueeze(1), updated, stored)
        buffer.set_metadata("logits", idx, values, distinct=True)

    # -- the end of the update ------------------------------------------------------------------

    def on_train_end(self, model: nn.Module) -> None:
        """The base's end fill, then, once, the stored logits of every slot updated (past
        classes: present and future logits from the final model; new samples: past logits
        scaled below the label's)."""
        filled = self._filled
        super().on_train_end(model)
        if self._filled and not filled:
            self._update_stored_logits(model)

    def _update_stored_logits(self, model: nn.Module) -> None:
        buffer = cast(DataBuffer, self.buffer)
        if len(buffer) == 0 or "logits" not in buffer.metadata_keys:
            return
        device = model_device(model)
        view = buffer.dataset()
        with inference(model):
            for start in range(0, len(buffer), self.batch_size):
                rows = list(range(start, min(start + self.batch_size, len(buffer))))
                inputs, targets = view.__getitems__(rows)
                slots = torch.tensor(rows, device=buffer.device)
                ids = None
                if "task_id" in buffer.metadata_keys:
                    ids = buffer.get_metadata("task_id", slots).to(device)
                shown = self._transformed("test_transform", to_device(inputs, device), len(slots))
                current = forward(model, shown, ids).float()
                stored = buffer.get_metadata("logits", slots).to(device)
                past = self._past_mask(current.shape[-1], device)
                targets = targets.to(device)
                later = transplant_logits(stored, current, targets, ~past, self.logit_update_gamma)
                capped = transplant_logits(stored, stored, targets, past, self.logit_update_gamma)
                values = torch.where(past[targets].unsqueeze(1), later, capped)
                buffer.set_metadata("logits", slots, values, distinct=True)


SPEC = register(
    MethodSpec(
        name="xder",
        learner=ExtendedDarkExperienceReplayLearner,
        summary="X-DER: DER++ whose stored logits of past samples are updated with the classes "
        "learnt later, with a present-class cross-entropy and a future-logit margin (Boschini "
        "et al., 'Class-Incremental Continual Learning into the eXtended DER-verse', TPAMI 2022)",
        default_buffer="greedy-class-balancing",
    )
)
