"""GDumb: a greedy class-balancing memory, and a model trained from scratch on it alone.

Prabhu, Torr and Dokania, "GDumb: A Simple Approach that Questions Our Progress in Continual
Learning", ECCV 2020.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import attrs
import torch
from torch.utils.data import DataLoader

from renate_events.inference import model_device
from renate_events.learners import BaseExperienceReplayLearner, derived_seed, rng_kept
from renate_events.memory import DataBuffer, GreedyClassBalancingBuffer
from renate_events.methods.joint import JointLearner
from renate_events.methods.registry import MethodSpec, register
from trainer import validators

__all__ = ["SPEC", "GDumbLearner"]


@attrs.define(eq=False)
class GDumbLearner(JointLearner):
    """GDumb: a greedy class-balancing memory, and at every update a model trained from scratch
    on the memory alone.

    Prabhu, Torr and Dokania, "GDumb: A Simple Approach that Questions Our Progress in Continual
    Learning", ECCV 2020 (Renate's ``GDumbLearner``). Every ``fit`` first offers the update's
    data to a :class:`~renate_events.memory.GreedyClassBalancingBuffer` of ``memory_size`` slots
    (Renate's default 32), re-initialises the model (``reset_model``) and trains on the buffer.
    A buffer smaller than the model's number of classes is refused before training, as is
    ``memory_size = 0``; an update that fails before its first batch trained gives the buffer
    back as it was.
    """

    memory_size: int = attrs.field(default=32, validator=validators.int_at_least(1))
    # The buffer's state before this update's data went in, until the first batch trained.
    _saved_buffer: dict[str, Any] | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.buffer is None:
            self.buffer = GreedyClassBalancingBuffer(
                max_size=self.memory_size, seed=derived_seed(self.seed, 0)
            )
        if not isinstance(self.buffer, GreedyClassBalancingBuffer):
            raise ValueError(
                f"`{type(self).__name__}.buffer` must be a GreedyClassBalancingBuffer (GDumb's "
                f"class-balanced memory), got a {type(self.buffer).__name__}; leave buffer unset "
                "(ModelUpdater: buffer='greedy-class-balancing'; on the command line: --buffer "
                "greedy-class-balancing)"
            )
        super().__attrs_post_init__()

    def check_data(self, data: Any) -> None:
        super().check_data(data)
        tensors = getattr(data, "tensors", None)
        if not isinstance(tensors, tuple) or len(tensors) != 2 or not len(data):
            return
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                probe = tensors[0][:2].to(model_device(self.model))
                with rng_kept(probe):  # the model's input, as in training
                    probe = self.probe_transform("train_transform", probe)
                classes = self._forward(probe).shape[-1]
        finally:
            self.model.train(was_training)
        slots = cast(DataBuffer, self.buffer).max_size
        if slots is not None and slots < classes:
            raise ValueError(
                f"`{type(self).__name__}.memory_size` must be at least the model's number of "
                f"classes ({classes}) for a class-balanced memory, got a buffer of {slots}"
            )

    def _add_update_data(self, data: Any) -> None:
        buffer = cast(DataBuffer, self.buffer)
        self._saved_buffer = buffer.state_dict()
        for inputs, targets in DataLoader(data, batch_size=1024):
            buffer.update(inputs, targets)

    def _drop_update_data(self) -> None:
        saved, self._saved_buffer = self._saved_buffer, None
        if saved is not None:
            cast(DataBuffer, self.buffer).load_state_dict(saved)

    def on_train_start(self) -> None:
        """As the base learner's; the buffer is put back by :meth:`on_exception` if the update
        fails before a batch went through."""
        BaseExperienceReplayLearner.on_train_start(self)
        if self._saved_buffer is not None and self._undo is not None:
            saved, self._saved_buffer = self._saved_buffer, None
            self._undo.append(
                functools.partial(cast(DataBuffer, self.buffer).load_state_dict, saved)
            )


SPEC = register(
    MethodSpec(
        name="gdumb",
        learner=GDumbLearner,
        summary="GDumb: a class-balanced memory and a model trained from scratch on it (Prabhu et "
        "al., 'GDumb: A Simple Approach that Questions Our Progress in Continual Learning', "
        "ECCV 2020)",
        buffers=("greedy-class-balancing",),
        default_buffer="greedy-class-balancing",
    )
)
