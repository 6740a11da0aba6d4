"""The undo of a failed update: what an update changes before its first batch went through is
noted, and put back if it fails, so that a refused or failed update leaves no trace."""

from __future__ import annotations

import functools
from typing import Any, cast

import attrs
import torch

from renate_events.memory import DataBuffer

__all__ = ["FailedUpdateUndo", "buffer_copy"]


def buffer_copy(buffer: DataBuffer) -> dict[str, Any] | None:
    """The buffer's state as an in-memory copy, to put back after a failed update; ``None`` for
    a buffer whose ``state_dict`` is its own (a memory-mapped one writes a snapshot generation
    to disk, and an extra generation would delete the one the last checkpoint names)."""
    return buffer.state_dict() if type(buffer).state_dict is DataBuffer.state_dict else None


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
