"""The checks of a learner's checkpoint contents against the learner itself, run once per load
before the learner's own state changes: the model and optimizer state the trainer restored are
finite, and the buffer's stored samples fit the model (targets within its outputs, logits as
wide as its outputs, inputs of the recorded sample shape, a plausible count of samples seen).

A refusal raises ``ValueError`` inside the trainer's load, which then rolls the model, optimizer
and every listener back: the learner is left exactly as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch

from renate_events.inference import forward, model_device
from renate_events.learners.seeding import rng_kept
from renate_events.memory import DataBuffer
from renate_events.memory.state import ParsedState, check_stored

__all__ = [
    "LoadLimits",
    "buffer_expectation",
    "check_restored_tensors",
    "load_buffer",
    "loading_limits",
]


@attrs.frozen
class LoadLimits:
    """What a checkpoint's contents may hold, known from outside it (a state folder's manifest).

    Attributes:
        samples_seen: The most samples the updates so far can have shown the buffer, or None.
        signature: One sample's ``{"inputs": [shape, dtype], "targets": ...}`` as the updates
            recorded it, or None.
        source: Where ``signature`` comes from (a file and key), for messages.
    """

    samples_seen: int | None = None
    signature: Mapping[str, Any] | None = None
    source: str = "the recorded sample signature"


@contextlib.contextmanager
def loading_limits(learner: Any, limits: LoadLimits) -> Iterator[None]:
    """A context in which the learner's loads (``load_checkpoint``) check its buffer against
    ``limits`` too; afterwards (a resumed fit's load, say) only against the model."""
    learner.load_limits = limits
    try:
        yield
    finally:
        learner.load_limits = LoadLimits()


def check_restored_tensors(model: torch.nn.Module, optimizer: Any) -> None:
    """No NaN or infinity in the model's tensors or the optimizer's state (one reduction per
    tensor): a model holding one serves NaN, an optimizer state holding one trains to NaN."""
    for name, tensor in model.state_dict().items():
        _check_finite(tensor, f"the model's {name!r}")
    if optimizer is None:
        return
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                _check_finite(value, f"the optimizer's state[{index}][{key!r}]")


def _check_finite(tensor: torch.Tensor, where: str) -> None:
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{where} holds NaN or infinite values")


def load_buffer(learner: Any, checkpoint: Any, limits: LoadLimits) -> None:
    """Load the learner's checkpoint section ``buffer`` into its buffer (if it has one), checked
    against the learner's model and ``limits`` before it is committed (a buffer of this
    library's; any other as it loads)."""
    buffer = learner.buffer
    if buffer is None:
        return
    if "buffer" not in checkpoint:
        raise ValueError(
            "the checkpoint has no buffer for this learner; it was written by a learner "
            "without memory (memory_size=0)"
        )
    state = checkpoint["buffer"]
    if not isinstance(buffer, DataBuffer):
        buffer.load_state_dict(state)
        return
    # stored targets reach the loss through buffer_target_transform: the raw ones may be any
    labels = learner.buffer_target_transform is None
    expect = buffer_expectation(learner.model, learner.buffer_transform, limits, labels=labels)
    buffer.load_state_dict(state, expect=expect)


def buffer_expectation(
    model: torch.nn.Module,
    transform: Callable[[Any], Any] | None,
    limits: LoadLimits,
    *,
    labels: bool = True,
) -> Callable[[ParsedState], None]:
    """The check a buffer runs on its parsed state before committing it: the recorded sample
    shape and count first, then the model's number of outputs, found by one forward pass (in
    eval mode, without gradients, torch's RNG kept) on one stored sample through ``transform``
    (the learner's buffer transform): integer targets (if ``labels``) within them, stored logits
    as wide."""

    def expect(parsed: ParsedState) -> None:
        check_stored(
            parsed,
            signature=limits.signature,
            source=limits.source,
            max_seen=limits.samples_seen,
        )
        if parsed.length == 0 or len(parsed.inputs) != 1:
            return
        classes = _outputs(model, transform, parsed)
        # buffer_metadata stores logits in float32 whatever the precision
        rows = {"logits": (classes, torch.float32)}
        check_stored(parsed, classes=classes if labels else None, rows=rows)

    return expect


def _outputs(
    model: torch.nn.Module, transform: Callable[[Any], Any] | None, parsed: ParsedState
) -> int:
    sample = parsed.inputs[0][:1].to(model_device(model))
    ids = parsed.metadata.get("task_id")
    task_ids = None if ids is None else ids[:1].to(sample.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), rng_kept(sample):
            if transform is not None:
                sample = transform(sample)
            return int(forward(model, sample, task_ids).shape[-1])
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise ValueError(
            f"state['inputs'][0]: the model cannot take the stored samples ({exc})"
        ) from exc
    finally:
        model.train(was_training)
