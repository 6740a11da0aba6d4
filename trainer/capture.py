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

In both captured modes the optimizer step is compiled too (:class:`CompiledOptimizerStep`:
eager at a fit's first step, the learning rate as a tensor); gradient clipping, a GradScaler,
the non-finite-loss check and the listeners run eagerly between the steps, exactly as without
capture: no event fires between a step's forward and its optimizer step, so no listener has to
be refused (one that reads the loss on the host is one sync a step, as without capture).

A captured step is traced with graph breaks refused: Python state written by the step and
other host work go in functions marked :func:`eager` (each call one allowed graph break);
any other graph break (a ``.item()``, a shape that depends on the data, a ``print``) raises
:class:`CaptureError` while the step is traced, before that part runs and before the step's
optimizer step. ``TORCH_LOGS=graph_breaks`` lists the allowed ones.

Shapes: a graph is specialised to the shapes it saw. A batch of another shape (the last partial
batch of an epoch, a memory batch while the buffer holds fewer samples than ``memory_batch_size``)
compiles (``"graph"``: records) one more graph for it the first time it comes and reuses it
after; a parameter added to the model fails torch.compile's guards and recompiles too. Nothing
is silently reused for a shape it was not made for. ``torch._dynamo.config.recompile_limit`` (8
by default) bounds the variants per function of a step; a captured step that reaches it is
refused (:class:`CaptureError` naming the guard that failed at every call, and where).

An error of ``torch.compile`` while it captures the step is raised as :class:`CaptureError`,
naming the step and the eager fallback.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

import attr
import torch

from trainer.exceptions import CaptureError

__all__ = [
    "CAPTURE_MODES",
    "CompiledOptimizerStep",
    "capture_mode",
    "capture_steps",
    "check_capture_device",
    "eager",
    "graph_device_problem",
    "keep_gradients",
    "keep_in_step",
    "optimizer_stepper",
]

CAPTURE_MODES = ("off", "compile", "graph")
"""The values of ``Trainer.capture``."""

_F = TypeVar("_F", bound=Callable[..., Any])

# What eager functions call under dynamo, made when a capture is first set up (so that a
# process that never captures does not import torch._dynamo, about a second): per function, a
# one-item list holding it behind torch.compiler.disable and the switch that allows its graph
# break (torch.compile's per-region "error on graph break", torch 2.9 and later).
_EAGER: list[tuple[Callable[..., Any], list[Callable[..., Any]]]] = []
_PREPARED = False


def eager(function: _F) -> _F:
    """Run ``function`` eagerly when a compiled step calls it.

    For the parts of a step that a captured step keeps out of its graph: writes to attrs
    objects (their validating ``__setattr__`` sends ``torch.compile`` into endless recursion,
    ``InternalTorchDynamoError: RecursionError``), draws from CPU generators and random
    transforms (a compiled graph would draw other numbers than the eager step), pinned copies
    and the checks of an update's first step. Under ``torch.compile`` each call is a graph break
    (``torch.compiler.disable``), the one kind a captured step allows (any other is refused,
    see :func:`capture_steps`). Outside compilation it is a plain call after one check of
    ``torch.compiler.is_compiling()``, and importing a module that uses it does not import
    ``torch._dynamo``.
    """
    holder: list[Callable[..., Any]] = []
    _EAGER.append((function, holder))
    if _PREPARED:
        holder.append(_allowed_break(function))

    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return function(*args, **kwargs)
        # traced by dynamo: the allowed graph break (none made when the step was compiled
        # by a torch.compile of the caller's own, not by a capture: then it is traced inline)
        return (holder[0] if holder else function)(*args, **kwargs)

    return cast(_F, functools.wraps(function)(_own_code(call, function)))


def _own_code(wrapper: _F, function: Callable[..., Any]) -> _F:
    """``wrapper`` (a closure around ``function``) with a code object of its own.

    Dynamo resumes a graph break inside a wrapper by compiling the wrapper's frame, and keeps
    the compiled variants on its code object, guarded on the arguments. One code object shared
    by the wrappers of every eager function (or torch's own ``error_on_graph_break`` wrapper,
    shared by all) gathered the variants of all of them: X-DER's step reached the recompile
    limit at its second update. A code object per wrapped function keeps them apart.
    """
    name = f"{wrapper.__name__}_{getattr(function, '__name__', 'function')}"
    # one per wrapped function, not per wrapper: the fits of a learner wrap its bound step
    # anew each time and find their compiled frames (a new code object traced them again)
    key = (wrapper.__code__, getattr(getattr(function, "__func__", function), "__code__", name))
    code = wrapper.__code__.replace(co_name=name)
    if sys.version_info >= (3, 11):  # no co_qualname before
        code = code.replace(co_qualname=name)
    code = _CODES.setdefault(key, code)
    closure, defaults = wrapper.__closure__, wrapper.__defaults__
    return cast(_F, types.FunctionType(code, wrapper.__globals__, name, defaults, closure))


_CODES: dict[tuple[Any, Any], Any] = {}  # the code objects of _own_code's wrappers


def _under(
    manager: Any, function: Callable[..., Any], of: Callable[..., Any]
) -> Callable[..., Any]:
    """``function`` called inside the context ``manager`` (an ``error_on_graph_break``
    switch), through a wrapper with a code object of its own for ``of``, the function that
    ``function`` is or wraps (see :func:`_own_code`)."""

    def switched(*args: Any, **kwargs: Any) -> Any:
        with manager:
            return function(*args, **kwargs)

    return _own_code(switched, of)


def _allowed_break(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` behind ``torch.compiler.disable``, its graph break allowed."""
    disabled = torch.compiler.disable(function)
    allow = getattr(torch._dynamo, "error_on_graph_break", None)
    if allow is None:  # a torch without the switch: every graph break is allowed
        return disabled
    return _under(allow(False), disabled, function)  # `disabled` has torch's shared code


def _prepare_eager() -> None:
    """Make what every :func:`eager` function calls under dynamo (once, before a capture)."""
    global _PREPARED
    if not _PREPARED:
        for function, holder in _EAGER:
            holder.append(_allowed_break(function))
        _PREPARED = True


def keep_in_step(instance: Any, name: str, value: Any) -> None:
    """Set the attribute ``name`` of ``instance`` (an attrs object) to ``value`` in a way a
    captured step can trace: past attrs' validating ``__setattr__`` (which sends dynamo into
    endless recursion). For an attribute without a validator or converter, where that is the
    same as a plain assignment, written in a part of the step that cannot be :func:`eager`
    (an eager call inside a loop makes dynamo give up the whole step: "graph break in loop").
    """
    object.__setattr__(instance, name, value)


def keep_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Copy the gradients of ``optimizer``'s parameters out of CUDA-graph memory.

    Under ``capture="graph"`` the backward pass is replayed from a CUDA graph and the gradients
    it leaves in ``.grad`` live in the graph's memory pool, which the next step's replay
    reuses: gradients summed over several steps (``accumulate_grad_batches > 1``) would be read
    after being overwritten (torch refuses: "accessing tensor output of CUDAGraphs that has
    been overwritten by a subsequent run", pytorch issue 169545). The trainer calls this after
    each backward pass of an accumulation window that no optimizer step follows: one copy of
    the gradients per such step, only in that mode.
    """
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter.grad is not None:
                parameter.grad = parameter.grad.clone()


_FALLBACK = "run it eagerly with capture='off'"  # the command line shows it as its flag


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
    """``step`` and ``val_step`` as a fit in ``mode`` runs them (as they are for ``"off"``).

    A captured step is traced with graph breaks refused, except in the library's own
    :func:`eager` parts: a graph break anywhere else (an output shape that depends on the
    data, a host read such as ``.item()`` or ``.tolist()``, a ``print``, a call dynamo cannot
    trace) raises :class:`CaptureError` while the step is traced, before that part runs.
    """
    if mode == "off":
        return step, val_step
    # Dynamo logs a warning for the graph break of `.item()` before the strict trace turns it
    # into an error: the CaptureError says it all (and a command line prints one line).
    logging.getLogger("torch._dynamo.variables.tensor").setLevel(logging.ERROR)
    frames = logging.getLogger("torch._dynamo.convert_frame")
    if not any(isinstance(f, _NoRefusedRecompileNote) for f in frames.filters):
        frames.addFilter(_NoRefusedRecompileNote())
    _prepare_eager()
    options: dict[str, Any] = {} if mode == "compile" else {"mode": "reduce-overhead"}
    compiled = [torch.compile(_strict(function), **options) for function in (step, val_step)]
    return _guarded(mode, step, compiled[0]), _guarded(mode, val_step, compiled[1])


def _strict(function: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``function`` traced with graph breaks refused (where torch has the switch)."""
    refuse = getattr(torch._dynamo, "error_on_graph_break", None)
    return (
        function
        if refuse is None
        else functools.wraps(function)(_under(refuse(True), function, function))
    )


def _refusing_breaks() -> contextlib.AbstractContextManager[Any]:
    """Graph breaks (and the recompile limit) refused while dynamo compiles a frame."""
    refuse = getattr(torch._dynamo, "error_on_graph_break", None)
    return contextlib.nullcontext() if refuse is None else refuse(True)


def optimizer_stepper(mode: str, optimizer: torch.optim.Optimizer) -> Callable[..., None]:
    """What a fit in ``mode`` calls as ``stepper(first=...)`` for an optimizer step (``first``:
    the fit's first): ``optimizer.step()`` for ``"off"``, else a :class:`CompiledOptimizerStep`."""
    if mode != "off":
        for kept in _STEPPERS:
            if kept._optimizer() is optimizer:  # an earlier fit's optimizer: its compiled step
                kept.new_fit()
                return kept
        live = [kept for kept in _STEPPERS if kept._optimizer() is not None]
        # a compiled step keeps its optimizer's state alive: one of a dead optimizer is dropped
        reset = not live or len(live) < len(_STEPPERS) or len(live) >= _KEPT_STEPPERS
        if reset:  # every compiled step is dropped: the live optimizers' compile theirs again
            _STEPPERS[:] = live[-(_KEPT_STEPPERS - 1) :]  # with the new one: at most four
        stepper = CompiledOptimizerStep(optimizer, reset=reset)
        _STEPPERS.append(stepper)
        return stepper

    def step(first: bool) -> None:
        optimizer.step()

    return step


# The steppers made since the compiled optimizer steps were last dropped (each holds its
# optimizer weakly): a fit that steps one of their optimizers again (a Trainer fitted epoch by
# epoch, a benchmark's interleaved rounds) reuses its compiled step instead of tracing and
# compiling optimizer.step() anew (seconds a fit). A new optimizer drops every compiled step
# (the steppers of live optimizers are kept and compile again) when one of the kept ones is
# gone (its compiled step holds the optimizer's state) or past the first few, so that the
# variants of the step's frames (one per optimizer) stay well below dynamo's recompile limit
# (8) and no dead optimizer's state stays in memory in a run of many updates.
_STEPPERS: list[CompiledOptimizerStep] = []
_KEPT_STEPPERS = 4


def _optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """The function a :class:`CompiledOptimizerStep` compiles (one code object, whose cache a
    new instance clears)."""
    optimizer.step()


class CompiledOptimizerStep:
    """``optimizer.step()`` under ``torch.compile`` (default mode, also for ``"graph"``): the
    update of every parameter as a few fused kernels instead of a loop of small ones.

    * The first optimizer step of a fit runs eagerly (the caller says which one it is, so that
      a resumed fit steps as the uninterrupted one did): it makes the optimizer's state
      (momentum buffers, Adam's moments), which the compiled step then finds in place.
    * The learning rate goes into the compiled step as a tensor (a 0-dimensional CPU tensor per
      parameter group, filled with the group's ``lr`` before each call and the float put back
      after): a scheduler changing it causes no recompilation, and the optimizer's
      ``param_groups`` and ``state_dict`` keep their floats.
    * Any other hyperparameter (momentum, betas, weight decay, the groups and their sizes) is
      compiled in as a constant: when one changes during the fit (a ``OneCycleLR`` cycling
      momentum, a group added), the step warns once and runs eagerly for the rest of the fit.
    * A new instance drops the compiled steps of earlier optimizers (unless ``reset=False``),
      so that the fits of a long run do not pile up towards dynamo's recompile limit.
      :func:`optimizer_stepper` keeps the instances of the last few optimizers: a fit whose
      optimizer an earlier captured fit stepped reuses that fit's instance, compiled step
      included; :meth:`new_fit` starts its per-fit bookkeeping afresh.
    * The optimizer is held weakly: the instance kept for the next fit keeps no optimizer (and
      no optimizer state on a GPU) alive.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, reset: bool = True) -> None:
        self._optimizer = weakref.ref(optimizer)
        self.settings: list[tuple[Any, ...]] | None = None  # what the compiled step assumes
        self.eager = False
        self.traced = False  # the compiled step has been traced once
        self.lrs = [torch.zeros((), dtype=torch.float32) for _ in optimizer.param_groups]
        reset_code = getattr(torch._dynamo, "reset_code", None)
        if reset and reset_code is not None:  # every frame of the step: ours and the optimizer's
            for code in _step_codes(optimizer):
                reset_code(code)
        self.compiled = torch.compile(_optimizer_step)
        _prepare_eager()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer this instance steps."""
        optimizer = self._optimizer()
        if optimizer is None:  # pragma: no cover - a fit holds its optimizer while it steps
            raise ReferenceError("the optimizer of this CompiledOptimizerStep no longer exists")
        return optimizer

    def new_fit(self) -> None:
        """Start a fit with this instance: the hyperparameters are taken afresh at its first
        compiled step, and a step made eager by an earlier fit's change is compiled again."""
        self.settings, self.eager = None, False
        groups = len(self.optimizer.param_groups)
        if len(self.lrs) != groups:  # a group added since: a learning rate tensor for each
            self.lrs = [torch.zeros((), dtype=torch.float32) for _ in range(groups)]

    def __call__(self, first: bool) -> None:
        """One optimizer step; ``first``: the fit's first (run eagerly)."""
        optimizer = self.optimizer
        if first:
            optimizer.step()
            return
        settings = _settings(optimizer)
        if self.settings is None:
            self.settings = settings
        elif not self.eager and settings != self.settings:
            self.eager = True
            warnings.warn(
                f"capture: a hyperparameter of {type(optimizer).__name__} other than the "
                "learning rate changed during the fit (a scheduler cycling momentum, a "
                "parameter group added?); its step runs eagerly from here on",
                RuntimeWarning,
                stacklevel=3,
            )
        if self.eager:
            optimizer.step()
        else:
            self._compiled_step(optimizer)

    def _compiled_step(self, optimizer: torch.optim.Optimizer) -> None:
        groups = optimizer.param_groups
        floats = [group["lr"] for group in groups]
        for group, holder, lr in zip(groups, self.lrs, floats):
            if not isinstance(lr, torch.Tensor):  # an optimizer made with a tensor lr keeps it
                holder.fill_(lr)
                group["lr"] = holder
        try:
            if self.traced:
                self.compiled(optimizer)
            else:  # the call that traces optimizer.step()
                with _quiet_profiler_note():
                    self.compiled(optimizer)
                self.traced = True
        except torch._dynamo.exc.TorchDynamoException as exc:
            raise CaptureError(_capture_failure("compile", _optimizer_step, exc)) from exc
        finally:
            for group, lr in zip(groups, floats):
                group["lr"] = lr


class _NoRefusedRecompileNote(logging.Filter):
    """Drops dynamo's many-line warning that a frame hit the recompile limit where graph breaks
    are refused: a :class:`CaptureError` saying the same follows (the command line's one line).
    Elsewhere (the user's own ``torch.compile``) the frame then runs eagerly and it stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        refusing = getattr(torch._dynamo.utils, "_get_error_on_graph_break", lambda: False)
        return not (str(record.msg).startswith("torch._dynamo hit config.") and refusing())


class _NoProfilerNote(logging.Filter):
    """Drops dynamo's note that it ignores a ``record_function`` block."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Profiler record function")


@contextlib.contextmanager
def _quiet_profiler_note() -> Iterator[None]:
    """Without dynamo's warning about the profiler block inside every ``optimizer.step()``
    (torch's own ``record_function``, which a compiled step leaves out): a line on stderr of
    every captured fit, about nothing the user wrote. Dynamo warns once per process, so the
    first trace of the optimizer step is the only one to quieten."""
    logger = logging.getLogger("torch._dynamo.variables.ctx_manager")
    note = _NoProfilerNote()
    logger.addFilter(note)
    try:
        yield
    finally:
        logger.removeFilter(note)


def _step_codes(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The code objects dynamo compiles for a :class:`CompiledOptimizerStep`: its own function
    and each layer of ``optimizer.step`` (torch's profiling ``wrapper`` around ``_use_grad``
    around the class's ``step``: the wrapper is a frame of its own, and its variants, one per
    optimizer object, reached the recompile limit after 8 fits in one process)."""
    codes, function = [_optimizer_step.__code__], cast(Any, type(optimizer).step)
    while function is not None:
        code = getattr(function, "__code__", None)
        if code is not None:
            codes.append(code)
        function = getattr(function, "__wrapped__", None)
    return codes


def _settings(optimizer: torch.optim.Optimizer) -> list[tuple[Any, ...]]:
    """Per parameter group, its size and every hyperparameter but the learning rate (tensor
    values left out: the compiled step reads those, it does not assume them)."""
    return [
        (
            len(group["params"]),
            *(
                (key, value)
                for key, value in group.items()
                if key not in ("params", "lr") and not isinstance(value, torch.Tensor)
            ),
        )
        for group in optimizer.param_groups
    ]


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
    refusing = _refusing_breaks()  # one switch for every call (it keeps a stack: reentrant)

    @functools.wraps(original)
    def run(batch: Any) -> Any:
        nonlocal warned
        skips = _cudagraph_skips() if graph else 0
        try:
            if graph:
                torch.compiler.cudagraph_mark_step_begin()
            # strict from the step's own first frame: where its guards fail at every call, the
            # recompile limit is a refusal there too (else dynamo runs that frame eagerly)
            with refusing:
                result = compiled(batch)
        except torch._dynamo.exc.TorchDynamoException as exc:
            raise CaptureError(_capture_failure(mode, original, exc)) from exc
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


def _capture_failure(
    mode: str, original: Callable[[Any], Any], exc: torch._dynamo.exc.TorchDynamoException
) -> str:
    """The message of a step that ``torch.compile`` could not capture: what broke the capture,
    where (the innermost frame of the user's code dynamo names) and the eager fallback."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    what = getattr(exc, "gb_type", None)  # a refused graph break: its kind and explanation
    if what is None:
        frame, writes_attrs = _where(lines)
        where = "" if frame is None else f" at {frame}"
        if writes_attrs and isinstance(exc.__context__, RecursionError):
            return (
                f"capture={mode!r}: torch.compile could not capture the step {_name(original)}: "
                f"it writes a field of an attrs object{where} (attrs' validating __setattr__ sends "
                "torch.compile into endless recursion); mark the method that writes it "
                f"@trainer.capture.eager, or {_FALLBACK}"
            )
        return (
            f"capture={mode!r}: torch.compile could not capture the step {_name(original)}: "
            f"{type(exc).__name__}: {lines[0] if lines else ''}{where}; {_FALLBACK}"
        )
    if what == "Dynamo recompile limit exceeded":
        return _recompiled_at_every_call(mode, original)
    explanation = next(
        (line.removeprefix("Explanation: ") for line in lines if line.startswith("Explanation:")),
        "",
    )
    frame = getattr(exc, "innermost_user_frame_summary", None)
    where = "" if frame is None else f" at {frame.filename}:{frame.lineno} in {frame.name}"
    return (
        f"capture={mode!r}: the step {_name(original)} cannot be captured: {what}"
        f"{' (' + explanation + ')' if explanation else ''}{where}; a captured step must not "
        "read values back to the host (.item(), .tolist(), print, Python control flow on a "
        "tensor) or make shapes that depend on the data: move that out of the step, or "
        f"{_FALLBACK}"
    )


def _recompiled_at_every_call(mode: str, original: Callable[[Any], Any]) -> str:
    """The message of a step refused at dynamo's recompile limit: the guard that failed at the
    last compilation (dynamo's own record of them), where, and what usually causes it."""
    recorded: dict[Any, list[Any]] = getattr(torch._dynamo.utils, "guard_failures", {})
    failures = max(recorded.values(), key=len, default=[])
    # the failure of the newest compiled variant ("<frame>/<variant>: <guard>  # ...")
    newest = max(map(str, failures), key=_variant, default="")
    lines = [line.strip() for line in newest.splitlines()]
    guard = _GUARD.match(lines[0]) if lines else None
    frame, _ = _where(lines)
    return (
        f"capture={mode!r}: the step {_name(original)} cannot be captured: torch.compile "
        f"compiled it again at every call up to torch._dynamo.config.recompile_limit "
        f"({torch._dynamo.config.recompile_limit})"
        f"{', the guard ' + repr(guard['guard']) + ' failing each time' if guard else ''}"
        f"{' at ' + frame if frame else ''}: Python state that the step changes at every call "
        "(a counter, an int attribute of a module, a list it appends to); keep it in a tensor "
        f"or write it in a method marked @trainer.capture.eager, or {_FALLBACK}"
    )


# a line of dynamo's guard failures: "12/0: net.calls == 3   # source  # file:line (HINT ...)"
_GUARD = re.compile(r"\d+/(?P<variant>\d+): (?P<guard>.+?)\s*(?:#|\(HINT|$)", re.M)


def _variant(failure: str) -> int:
    match = _GUARD.match(failure)
    return int(match["variant"]) if match else -1


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


def _library(module: Any) -> str:
    return os.path.dirname(module.__file__) + os.sep


def _where(lines: list[str]) -> tuple[str | None, bool]:
    """From the lines of a dynamo error's message: ``file:line in name`` of the innermost frame
    of its "from user code" stack outside torch and attrs (the user's line that broke the
    capture; None if it names none), and whether that line called attrs' ``__setattr__``."""
    found, in_attrs = None, False
    for line in lines:
        match = _FRAME.match(line)
        if match is None:
            continue
        file = match["file"]
        if file.startswith(_library(attr)):
            in_attrs = in_attrs or match["name"] == "__setattr__"
        elif not file.startswith(_library(torch)):
            found, in_attrs = f"{file}:{match['line']} in {match['name']}", False
    return found, in_attrs


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
