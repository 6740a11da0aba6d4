"""Captured steps: how a fit runs its step functions under ``Trainer(capture=...)``.

Three modes (:data:`CAPTURE_MODES`):

* ``"off"`` (the default): the steps run eagerly, as written.
* ``"compile"``: ``step`` and ``val_step`` are wrapped in ``torch.compile`` (default mode,
  ``fullgraph=False``). The forward passes and the losses run as compiled graphs; as the
  trainer calls ``loss.backward()``, the backward pass of those graphs is compiled too
  (AOTAutograd). Any device.
* ``"graph"``: ``torch.compile(..., mode="reduce-overhead")``: the compiled forward and backward
  graphs are recorded as CUDA graphs and replayed, one launch per graph instead of one per
  kernel; PyTorch copies each batch into the graphs' static input buffers and warms up on a
  side stream itself. CUDA only: asked for without a CUDA device it is refused when the
  ``Trainer`` is made (an explicit CPU device, or ``"auto"`` on a machine without CUDA) and at
  the start of a fit (the device a distributed fit resolves).

In both captured modes the optimizer step, gradient clipping, the non-finite-loss check and the
listeners run eagerly between the steps, exactly as without capture: no event fires between a
step's forward and its optimizer step, so no listener has to be refused. What cannot go into a
graph (a ``.item()``, Python state written by the step, a function marked
``torch.compiler.disable``) splits the step into several graphs with eager code between them
(a "graph break"): slower, never wrong. ``TORCH_LOGS=graph_breaks`` lists them.

Shapes: a graph is specialised to the shapes it saw. A batch of another shape (the last partial
batch of an epoch, a memory batch while the buffer holds fewer samples than ``memory_batch_size``,
the logits of a model that gained a task head) compiles (``"graph"``: records) one more graph
for it the first time it comes and reuses it after; a parameter added to the model fails
torch.compile's guards and recompiles too. Nothing is silently reused for a shape it was not
made for. ``torch._dynamo.config.recompile_limit`` (8 by default) bounds the variants per step
function; beyond it that function runs eagerly.

An error of ``torch.compile`` while it captures the step is raised as :class:`CaptureError`,
naming the step and the eager fallback.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch

from trainer.exceptions import CaptureError

__all__ = [
    "CAPTURE_MODES",
    "capture_mode",
    "capture_steps",
    "check_capture_device",
    "eager",
    "graph_device_problem",
]

CAPTURE_MODES = ("off", "compile", "graph")
"""The values of ``Trainer.capture``."""

_F = TypeVar("_F", bound=Callable[..., Any])


def eager(function: _F) -> _F:
    """Run ``function`` eagerly when a compiled step calls it (``torch.compiler.disable``).

    For the parts of a step that a captured step keeps out of its graph: writes to attrs
    objects (their validating ``__setattr__`` sends ``torch.compile`` into endless recursion,
    ``InternalTorchDynamoError: RecursionError``), draws from CPU generators and random
    transforms (a compiled graph would draw other numbers than the eager step), pinned copies
    and the checks of an update's first step. Each call is a graph break. Outside compilation
    it is the function behind ``torch.compiler.disable``'s wrapper (a few microseconds per call;
    a wrapper of our own that skipped it would itself be traced and recompiled by dynamo).
    """
    return cast(_F, torch.compiler.disable(function))


_FALLBACK = "run it eagerly with capture='off' (--capture off on the command line)"


def capture_mode(trainer: Any) -> str:
    """The mode a fit of ``trainer`` runs its steps in: ``trainer.capture``, where that is
    ``"off"`` and the deprecated ``compile_step`` is true (the old spelling), ``"compile"``."""
    mode: str = trainer.capture
    return "compile" if mode == "off" and trainer.compile_step else mode


def graph_device_problem(mode: str, device: str | torch.device) -> str | None:
    """Why ``mode`` cannot run on ``device`` (the device as the message shows it: ``'cpu'``,
    ``'auto' on a machine without CUDA``), or None when it can: only ``"graph"`` needs CUDA."""
    if mode != "graph":
        return None
    if device == "auto":
        return None if torch.cuda.is_available() else "'auto' on a machine without CUDA"
    resolved = torch.device(device)
    return None if resolved.type == "cuda" else repr(str(resolved))


def check_capture_device(mode: str, device: str | torch.device, where: str) -> None:
    """Refuse ``capture="graph"`` on a device that is not CUDA.

    Args:
        mode: The capture mode.
        device: The device asked for (``"auto"`` resolves to CUDA only where it is available).
        where: What names the setting in the message (``"Trainer.capture"``).

    Raises:
        ValueError: ``mode`` is ``"graph"`` and ``device`` is not a CUDA device.
    """
    problem = graph_device_problem(mode, device)
    if problem is not None:
        raise ValueError(
            f"{where}='graph' records CUDA graphs and needs a CUDA device, got device {problem}; "
            "use capture='compile' (torch.compile on any device) or capture='off'"
        )


def capture_steps(
    mode: str,
    step: Callable[[Any], Any],
    val_step: Callable[[Any], Any],
) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """``step`` and ``val_step`` as a fit in ``mode`` runs them (as they are for ``"off"``)."""
    if mode == "off":
        return step, val_step
    if mode == "compile":
        compiled = torch.compile(step), torch.compile(val_step)
    else:
        compiled = (
            torch.compile(step, mode="reduce-overhead"),
            torch.compile(val_step, mode="reduce-overhead"),
        )
    return _guarded(mode, step, compiled[0]), _guarded(mode, val_step, compiled[1])


def _name(function: Callable[[Any], Any]) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


def _guarded(
    mode: str, original: Callable[[Any], Any], compiled: Callable[[Any], Any]
) -> Callable[[Any], Any]:
    """``compiled``, its capture failures raised as :class:`CaptureError`; under ``"graph"``
    each call begins a new CUDA-graph step, its tensors are copied out of the graph's memory
    (the next replay overwrites it, and listeners or the trainer may keep a loss), and a graph
    that inductor would not record warns once (it runs compiled, without CUDA graphs)."""
    graph, warned = mode == "graph", False

    @functools.wraps(original)
    def run(batch: Any) -> Any:
        nonlocal warned
        skips = _cudagraph_skips() if graph else 0
        try:
            if graph:
                torch.compiler.cudagraph_mark_step_begin()
            result = compiled(batch)
        except torch._dynamo.exc.TorchDynamoException as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CaptureError(
                f"capture={mode!r}: torch.compile could not capture the step "
                f"{_name(original)}: {type(exc).__name__}: {first}; {_FALLBACK}"
            ) from exc
        if not graph:
            return result
        if not warned and _cudagraph_skips() > skips:
            warned = True
            warnings.warn(
                f"capture='graph': inductor recorded no CUDA graph for a part of the step "
                f"{_name(original)} (it runs compiled, one launch per kernel; "
                "TORCH_LOGS=perf_hints names the reason); capture='compile' gives the same "
                "without graphs",
                RuntimeWarning,
                stacklevel=2,
            )
        return _copied(result)

    return run


def _cudagraph_skips() -> int:
    """How many compiled graphs inductor left without CUDA graphs so far (its own counter)."""
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


def _copied(value: Any) -> Any:
    """``value`` with every tensor (in mappings, lists and tuples) cloned; ``clone`` keeps the
    autograd graph, so the loss still back-propagates through the recorded graph."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, Mapping):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_copied(item) for item in value)
    return value
