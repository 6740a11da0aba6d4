"""The undo of a failed update: a snapshot of the learner taken once when an update starts and
put back if it fails at any step (:meth:`FailedUpdateUndo.all_or_nothing`), and the older, finer
undo of what an update changes before its first batch went through."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, cast

import attrs
import torch

from renate_events.memory import DataBuffer
from renate_events.memory.mapped import (
    MappedGreedyClassBalancingBuffer,
    MappedInfiniteBuffer,
    MappedReservoirBuffer,
    MappedSlidingWindowBuffer,
)
from renate_events.models import MultiHeadClassificationModel
from trainer.exceptions import add_note
from trainer.rollback import FitSnapshot, roll_back_fit, take_fit_snapshot

__all__ = ["FailedUpdateUndo", "UpdateSnapshot", "buffer_copy"]


def buffer_copy(buffer: DataBuffer) -> dict[str, Any] | None:
    """The buffer's state as an in-memory copy, to put back after a failed update; ``None`` for
    a buffer whose ``state_dict`` is its own (a memory-mapped one writes a snapshot generation
    to disk, and an extra generation would delete the one the last checkpoint names)."""
    return buffer.state_dict() if type(buffer).state_dict is DataBuffer.state_dict else None


@attrs.define(eq=False)
class UpdateSnapshot:
    """What a learner's update can change, copied once when it starts (see
    :meth:`FailedUpdateUndo.all_or_nothing`).

    Attributes:
        fit: The trainer's part: the model's tensors, a reused optimizer's state, the RNGs, the
            attachments and every listener's checkpoint state (the learner's buffer, the classes
            seen, the components' state).
        fields: The attributes of the learner and of its components (attrs classes), put back
            before their checkpoint state, so that what an update made (a model copy, a
            component's first state) goes again.
        heads: The task heads of a multi-head model (heads added by the update are removed).
    """

    fit: FitSnapshot
    fields: list[tuple[Any, dict[str, Any]]]
    heads: frozenset[str] | None


_MAPPED = (
    MappedReservoirBuffer,
    MappedSlidingWindowBuffer,
    MappedGreedyClassBalancingBuffer,
    MappedInfiniteBuffer,
)


def _fields(instance: Any) -> dict[str, Any]:
    return {a.name: getattr(instance, a.name) for a in attrs.fields(type(instance))}


@attrs.define(eq=False)
class FailedUpdateUndo:
    """The undo part of :class:`~renate_events.learners.BaseExperienceReplayLearner` (a mixin of
    it, not usable alone; its state is the base learner's fields).

    At ``train_start`` an update opens a list of undo actions (the base learner's ``_undo``):
    the heads ``fit`` added, the buffer's sampling generator and the classes seen (noted by the
    first step), the stored logits the first step's EMA overwrites. The first batch that goes
    through closes it (``_undo = None``); an update failing before that runs it backwards.
    With ``buffer_filling="end"`` a copy of the whole buffer is kept for the update instead.
    A preset that changes more before training (the update's data put into the buffer first)
    appends its own action to ``_undo`` in its ``on_train_start``.

    Since ``fit`` runs in :meth:`all_or_nothing`, whose snapshot puts everything back after a
    failure at any step, these finer actions only matter while the ``exception`` event is
    dispatched (a listener of it sees the buffer already put back).
    """

    def _open_undo(self) -> None:
        """Start the update's undo list (called by ``on_train_start``)."""
        self._undo = []
        added, self._added_heads = self._added_heads, []
        if added:  # the heads fit added for new task ids go again if no batch trains
            self._undo.append(functools.partial(self._remove_heads, added))
        self._filled, self._failed, self._fill_undo = False, False, None
        buffer = self.buffer
        if self.buffer_filling == "end" and isinstance(buffer, DataBuffer):
            # Put back by on_exception: a failed update leaves the buffer as it was (its
            # contents, the logits an EMA moved, its generators); one copy per update.
            self._fill_undo = buffer_copy(buffer)

    def _note_first_step(self) -> None:
        """Open the undo entries of the update's first step: the buffer's sampling generator and
        the classes seen (the stored logits it overwrites are noted by :meth:`_ema_update`)."""
        undo = self._undo
        if undo is None:
            return  # a step called outside fit
        buffer, seen = self.buffer, self._seen_classes
        if isinstance(buffer, DataBuffer):
            undo.append(functools.partial(buffer.set_sampling_state, buffer.sampling_state()))
        undo.append(functools.partial(self._restore_seen_classes, seen))

    def _restore_seen_classes(self, seen: torch.Tensor | None) -> None:
        self._seen_classes = seen

    def on_exception(self, exception: BaseException | None = None) -> None:
        """The update failed before a batch went through: put back what it changed (the buffer's
        sampling generator, stored logits, the classes seen), so that it leaves no trace.

        With ``buffer_filling="end"`` a failed update, even one failing during or after its
        fill, gets the whole buffer back as it was when the update started; an interrupted one
        (``KeyboardInterrupt``) is not filled and keeps the buffer's draws, so that a checkpoint
        written at its ``train_end`` resumes exactly."""
        undo, self._undo = self._undo, None
        for action in reversed(undo or ()):
            action()
        self._failed = True
        saved, self._fill_undo = self._fill_undo, None
        if saved is not None and (self._filled or not isinstance(exception, KeyboardInterrupt)):
            cast(DataBuffer, self.buffer).load_state_dict(saved)
            self._filled = False

    @contextlib.contextmanager
    def all_or_nothing(self) -> Iterator[None]:
        """A block after which the learner is either changed by the whole block or exactly as
        before it: if anything in it raises (a failed or interrupted ``fit``, a step's NaN, a
        listener, the caller's own code after the fit), the model (its tensors and heads), the
        buffer, the components and listeners, a reused optimizer, the trainer and the global RNGs
        are put back as they were when the block started.

        ``fit`` runs in one; a caller that does more around ``fit`` (``ModelUpdater.update``)
        opens its own, and the ``fit`` inside it then takes no second snapshot. The snapshot is
        taken once per block: one copy of the model and of the listeners' checkpoint states (a
        memory-mapped buffer's rows as an unnamed file, a reflink where the file system can).
        """
        if self._update_snapshot is not None:  # inside a block that has its snapshot
            yield
            return
        snapshot = self._take_update_snapshot()
        self._update_snapshot = snapshot
        try:
            yield
        except BaseException as exc:
            try:
                self._roll_back_update(snapshot)
            except Exception as inner:  # the error being raised stays the one to report
                add_note(exc, f"while putting the learner back as it was: {inner!r}")
            raise
        finally:
            self._update_snapshot = None
            self._release_snapshot(snapshot)

    def _take_update_snapshot(self) -> UpdateSnapshot:
        model, optimizer = self.model, self.optimizer
        reused = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        owners = [self, *self.components.values()]
        fields = [(o, _fields(o)) for o in owners if attrs.has(type(o))]
        heads = None
        if isinstance(model, MultiHeadClassificationModel):
            heads = frozenset(model.heads)
        snapshot = UpdateSnapshot(take_fit_snapshot(self.trainer, model, reused), fields, heads)
        state = snapshot.fit.listeners.get("learner", {}).get("buffer")
        if isinstance(self.buffer, _MAPPED) and state is not None:
            self.buffer.pin_snapshot(state)  # kept however many checkpoints the update writes
        return snapshot

    def _roll_back_update(self, snapshot: UpdateSnapshot) -> None:
        model = self.model
        if snapshot.heads is not None:
            heads = cast(MultiHeadClassificationModel, model).heads
            for key in [k for k in heads if k not in snapshot.heads]:
                heads.pop(key)
        for owner, values in snapshot.fields:
            for name, value in values.items():
                object.__setattr__(owner, name, value)  # as it was, past validators and frozen
        roll_back_fit(self.trainer, snapshot.fit)

    def _release_snapshot(self, snapshot: UpdateSnapshot) -> None:
        """A mapped buffer's snapshot is files: let them go once the block is over."""
        buffer = self.buffer
        state = snapshot.fit.listeners.get("learner", {}).get("buffer")
        if isinstance(buffer, _MAPPED) and state is not None:
            buffer.release_snapshot(state)
