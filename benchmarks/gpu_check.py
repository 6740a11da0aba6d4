"""GPU check: step time against bare loops, and whether steady-state steps synchronise.

On one CUDA device, in under five minutes, prints:

1. the median time per training step of ``Trainer.fit`` against a bare hand-written loop, for an
   MLP 784-256-256-10 at batch 128 in fp32 and in bf16-mixed, with the data set resident on the
   GPU (``TensorLoader(device="cuda")``) and with a ``DataLoader`` from pinned memory (the bare
   loop copies with ``non_blocking=True``, the trainer's batch mover does the same). The trainer
   is timed with ``nonfinite_loss="off"`` and with the default ``"raise"``, whose check reads one
   bool from the GPU per step;
2. the step of ``ExperienceReplayLearner`` (buffer on the GPU:
   ``ReservoirBuffer(..., device="cuda")`` passed as ``buffer=``) against a bare replay loop
   (random memory batch from GPU tensors, concatenated with the new batch, one forward and
   backward) and the same loop with a sync-free reservoir update written on the GPU;
3. the sync check: steady-state steps (after warm-up, from the second batch of a fit to its last)
   run under ``torch.cuda.set_sync_debug_mode("error")`` with ``Trainer(nonfinite_loss="off")``;
   the verdict names the operation that synchronised, if any (the ``RuntimeError`` is caught and
   printed with the frames of this project). Then the same steps, and a whole fit, under
   ``"warn"``, to list every synchronising line with its count. The scenarios: the trainer
   alone, ER and DER++ on the MLP, the image workload of (4), and a canary that must
   synchronise;
4. the image workload of ``benchmarks/replay_step_resnet.py`` on the GPU: the DER++ step of the
   reduced ResNet-18 (``resnet18(num_classes=10, nf=20)`` and ``nf=64``, new batch 32 + memory
   batch 32, a ``ReservoirBuffer`` of 500 ``uint8`` slots on the GPU, the CIFAR preset of
   :func:`~renate_events.transforms.cifar_train_transform` as train and buffer transform) of
   ``DarkExperienceReplayLearner`` against a bare loop doing the same work on GPU tensors (two
   forward passes, the preset on both batches, CE + beta CE + alpha MSE, SGD, a reservoir
   update with a spare row), in fp32 and bf16-mixed; beside the learner's eager step its
   compiled step (``Trainer(capture="compile")``) and its captured one (``capture="graph"``,
   CUDA graphs; "skipped: no CUDA" in the dry run), each with its ratio to the bare eager loop
   and the issue's targets (library eager <= 1.05x; captured >= 4x faster). Compiling takes
   the first runs (not timed), and each timed run leaves out its first two steps, the bare
   loop's too (a fit's first step runs eagerly, and under capture its second compiles the
   fit's optimizer step: the targets are about the steady step); ``--no-capture`` leaves the
   two out.

5. precision rows (``gpu_precision.py``): that DER++ step with ``Trainer(tf32=...)`` and
   ``Trainer(channels_last=...)`` on and off, fp32 and bf16-mixed, against the bare fp32 loop;
6. run timing (``gpu_run_timing.py``): ``renate-events run --scenario seq-cifar10 --epochs 1`` on
   generated CIFAR-10 files in a fresh process, with the shares of steps, evaluation and start-up.

Every time is measured with ``torch.cuda.synchronize()`` before and after a run of steps. Without
CUDA the script prints "no CUDA device; nothing to check" and exits 0; ``--cpu-dry-run`` runs the
same code on the CPU with small sizes (the sync checks then check nothing, and say so) to try
the script out.

Usage: python benchmarks/gpu_check.py [--steps 200] [--rounds 5] [--sections 1,2,3,4,5,6]
       [--widths 20,64] [--no-capture] [--cpu-dry-run]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import gpu_precision
import gpu_run_timing
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from renate_events.memory import ReservoirBuffer
from renate_events.methods import DarkExperienceReplayLearner, ExperienceReplayLearner
from renate_events.models import resnet18
from renate_events.transforms import cifar_train_transform
from trainer import TensorLoader, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT_DIRS = tuple(os.path.join(ROOT, d) + os.sep for d in ("trainer", "renate_events"))
SYNC_MESSAGE = "synchronizing CUDA operation"
PRECISIONS = ("32", "bf16-mixed")
FEATURES, CLASSES, BATCH, MEMORY = 784, 10, 128, 2_000
IMAGE_BATCH, IMAGE_MEMORY, IMAGE_WIDTHS = 32, 500, (20, 64)
"""The image workload: new and memory batch, ``uint8`` slots, ResNet-18 widths ``nf``."""
ALPHA, BETA = 0.2, 0.5
"""DER++'s weights of the logit MSE and the cross-entropy on memory (as replay_step_resnet.py)."""

Run = Callable[[], Any]


def mlp(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, CLASSES),
    ).to(device)


def make_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(samples, FEATURES, generator=generator),
        torch.randint(0, CLASSES, (samples,), generator=generator),
    )


def autocast(precision: str, device: torch.device) -> Any:
    if precision == "32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_sync_mode(device: torch.device, mode: str | int) -> None:
    """``torch.cuda.set_sync_debug_mode`` on CUDA; nothing on the CPU (dry run)."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode(mode)


# -- timing --------------------------------------------------------------------------------------


def measure(variants: dict[str, Run], steps: int, rounds: int, device: torch.device) -> dict:
    """Median µs per step of each variant: one warm-up run, then ``rounds`` interleaved rounds.
    A run that returns a number has timed its ``steps`` steps itself: the seconds it returns."""
    for run in variants.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            synchronize(device)
            start = time.perf_counter()
            seconds = run()
            synchronize(device)
            if not isinstance(seconds, float):
                seconds = time.perf_counter() - start
            times[name].append(seconds / steps * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


SETTLE = 2
"""Steps at the start of each run that section 4 leaves out of its times. A fit's first step runs
eagerly (its checks of the batch), and under capture its second compiles the fit's optimizer
step (every fit traces its own optimizer's step again: about a second, which over a hundred
timed steps would hide what capture saves). The issue's targets are about the steady step."""


class SteadyClock:
    """A listener timing a fit's steps after its first :data:`SETTLE`, the device synchronised
    at both ends (outside the timed steps): ``seconds`` of the last fit."""

    def __init__(self, device: torch.device, batches: int) -> None:
        self.device, self.batches = device, batches
        self.steps, self.start, self.seconds = 0, 0.0, 0.0

    def on_train_start(self) -> None:
        self.steps = 0

    def on_batch_end(self) -> None:
        self.steps += 1
        if self.steps in (SETTLE, self.batches):
            synchronize(self.device)
            now = time.perf_counter()
            if self.steps == SETTLE:
                self.start = now
            else:
                self.seconds = now - self.start

    def fit(self, learner: Any, loader: Iterable[Any]) -> float:
        """``learner.fit(loader)``; the seconds of its steady steps."""
        learner.fit(loader)
        return self.seconds


def print_times(
    title: str, medians: dict[str, float], reference: str, skipped: dict[str, str] | None = None
) -> None:
    base = medians[reference]
    print(f"\n{title} (median µs per step; ratio against {reference!r})")
    width = max(len(name) for name in [*medians, *(skipped or {})])
    for name, value in medians.items():
        print(f"  {name:{width}s}  {value:9.1f}  {value / base:5.2f}x")
    for name, reason in (skipped or {}).items():
        print(f"  {name:{width}s}  {reason}")


def loop_section(device: torch.device, steps: int, rounds: int) -> None:
    x, y = make_data(BATCH * steps, seed=1)
    resident = TensorLoader((x, y), batch_size=BATCH, shuffle=True, device=device)
    pinned = DataLoader(
        TensorDataset(x, y), batch_size=BATCH, shuffle=True, pin_memory=device.type == "cuda"
    )
    for precision in PRECISIONS:
        model = mlp(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(batch: Any, model: torch.nn.Module = model) -> torch.Tensor:
            inputs, targets = batch
            return F.cross_entropy(model(inputs), targets)

        def bare(
            loader: Iterable[Any],
            model: torch.nn.Module = model,
            optimizer: torch.optim.Optimizer = optimizer,
            precision: str = precision,
        ) -> Run:
            def run() -> None:
                for inputs, targets in loader:
                    inputs = inputs.to(device, non_blocking=True)
                    targets = targets.to(device, non_blocking=True)
                    optimizer.zero_grad(set_to_none=True)
                    with autocast(precision, device):
                        loss = F.cross_entropy(model(inputs), targets)
                    loss.backward()
                    optimizer.step()

            return run

        def fit(
            loader: Iterable[Any],
            nonfinite: str,
            model: torch.nn.Module = model,
            optimizer: torch.optim.Optimizer = optimizer,
            step: Callable[[Any], torch.Tensor] = step,
            precision: str = precision,
        ) -> Run:
            trainer = Trainer(
                max_epochs=1, device=device, precision=precision, nonfinite_loss=nonfinite
            )
            return lambda: trainer.fit(model, optimizer, loader, step)

        variants = {
            "bare loop, GPU-resident TensorLoader": bare(resident),
            "Trainer, GPU-resident, nonfinite_loss='off'": fit(resident, "off"),
            "Trainer, GPU-resident, nonfinite_loss='raise'": fit(resident, "raise"),
            "bare loop, pinned DataLoader": bare(pinned),
            "Trainer, pinned DataLoader, nonfinite_loss='off'": fit(pinned, "off"),
        }
        medians = measure(variants, steps, rounds, device)
        print_times(
            f"(1) training loop, MLP 784-256-256-10, batch {BATCH}, precision {precision}",
            medians,
            "bare loop, GPU-resident TensorLoader",
        )


def make_learner(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str, device: torch.device
) -> ExperienceReplayLearner:
    return ExperienceReplayLearner(
        model=model,
        optimizer=optimizer,
        memory_size=MEMORY,
        memory_batch_size=BATCH,
        batch_size=BATCH,
        buffer=ReservoirBuffer(MEMORY, seed=0, device=device),
        trainer=Trainer(max_epochs=1, device=device, precision=precision, nonfinite_loss="off"),
    )


def replay_section(device: torch.device, steps: int, rounds: int) -> None:
    x, y = make_data(BATCH * steps, seed=3)
    warm_x, warm_y = make_data(MEMORY + BATCH, seed=2)
    loader = TensorLoader((x, y), batch_size=BATCH, shuffle=True, device=device)
    warm = TensorLoader((warm_x, warm_y), batch_size=BATCH, shuffle=True, device=device)
    for precision in PRECISIONS:
        model = mlp(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        learner = make_learner(model, optimizer, precision, device)
        learner.fit(warm)  # fills the memory
        # One spare row (index MEMORY) takes the samples the reservoir rejects, so the update
        # needs no boolean mask (which would synchronise).
        memory_x = torch.cat([warm_x[:MEMORY], warm_x[:1]]).to(device)
        memory_y = torch.cat([warm_y[:MEMORY], warm_y[:1]]).to(device)
        memory_logits = torch.zeros(MEMORY + 1, CLASSES, device=device)
        seen = [MEMORY]

        def bare_replay(
            update_memory: bool,
            model: torch.nn.Module = model,
            optimizer: torch.optim.Optimizer = optimizer,
            precision: str = precision,
            memory: tuple[torch.Tensor, ...] = (memory_x, memory_y, memory_logits),
            seen: list[int] = seen,
        ) -> Run:
            memory_x, memory_y, memory_logits = memory

            def run() -> None:
                for inputs, targets in loader:
                    optimizer.zero_grad(set_to_none=True)
                    idx = torch.randint(0, MEMORY, (BATCH,), device=device)
                    with autocast(precision, device):
                        outputs = model(torch.cat([inputs, memory_x[idx]]))
                        loss = F.cross_entropy(outputs, torch.cat([targets, memory_y[idx]]))
                    loss.backward()
                    optimizer.step()
                    if update_memory:
                        n = seen[0]
                        raw = torch.randint(0, 2**62, (BATCH,), device=device)
                        slots = raw % torch.arange(n + 1, n + BATCH + 1, device=device)
                        slots = torch.where(slots < MEMORY, slots, MEMORY)
                        memory_x.index_copy_(0, slots, inputs)
                        memory_y.index_copy_(0, slots, targets)
                        memory_logits.index_copy_(0, slots, outputs[:BATCH].detach().float())
                        seen[0] = n + BATCH

            return run

        variants = {
            "bare replay": bare_replay(False),
            "bare replay + reservoir update": bare_replay(True),
            "ExperienceReplayLearner, GPU buffer": lambda learner=learner: learner.fit(loader),
        }
        medians = measure(variants, steps, rounds, device)
        print_times(
            f"(2) replay step, MLP, batch {BATCH} + memory batch {BATCH}, {MEMORY} slots on the "
            f"GPU, precision {precision}",
            medians,
            "bare replay",
        )


def make_images(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random CIFAR-shaped ``uint8`` images and labels."""
    generator = torch.Generator().manual_seed(seed)
    shape = (samples, 3, 32, 32)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    return images, torch.randint(0, CLASSES, (samples,), generator=generator)


def make_image_learner(
    nf: int, precision: str, device: torch.device, nonfinite: str = "off", capture: str = "off"
) -> DarkExperienceReplayLearner:
    """DER++ on the reduced ResNet-18, ``uint8`` buffer on ``device``, the CIFAR preset, its
    steps run as ``capture`` says (``Trainer(capture=...)``). One optimizer for all its fits (not
    a factory): a captured fit then reuses the previous fit's compiled optimizer step, so the
    timed fits do not compile it again (seconds a fit; a new optimizer per update compiles it
    once per update)."""
    torch.manual_seed(0)
    model = resnet18(num_classes=CLASSES, nf=nf).to(device)
    return DarkExperienceReplayLearner(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.03),
        memory_size=IMAGE_MEMORY,
        memory_batch_size=IMAGE_BATCH,
        batch_size=IMAGE_BATCH,
        alpha=ALPHA,
        beta=BETA,
        buffer=ReservoirBuffer(IMAGE_MEMORY, seed=0, device=device),
        train_transform=cifar_train_transform(),
        buffer_transform=cifar_train_transform(),
        trainer=Trainer(
            max_epochs=1,
            device=device,
            precision=precision,
            nonfinite_loss=nonfinite,
            capture=capture,
        ),
    )


class BareImageDERpp:
    """The DER++ image step by hand on GPU tensors: the work of the learner, without it."""

    def __init__(
        self, model: torch.nn.Module, loader: Iterable[Any], precision: str, device: torch.device
    ) -> None:
        self.model, self.loader, self.precision, self.device = model, loader, precision, device
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.03)
        x, y = make_images(IMAGE_MEMORY + 1, seed=5)  # one spare row takes rejected samples
        self.memory_x, self.memory_y = x.to(device), y.to(device)
        self.memory_logits = torch.zeros(IMAGE_MEMORY + 1, CLASSES, device=device)
        self.transform, self.buffer_transform = cifar_train_transform(), cifar_train_transform()
        self.seen = IMAGE_MEMORY

    def run(self) -> float:
        """One pass over the loader; the seconds of its steps after the first :data:`SETTLE`."""
        model, optimizer, device, m = self.model, self.optimizer, self.device, IMAGE_MEMORY
        start = 0.0
        for step, (inputs, targets) in enumerate(self.loader):
            if step == SETTLE:
                synchronize(device)
                start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            idx = torch.randint(0, m, (IMAGE_BATCH,), device=device)
            with autocast(self.precision, device):
                outputs = model(self.transform(inputs))
                memory = model(self.buffer_transform(self.memory_x[idx]))
                loss = (
                    F.cross_entropy(outputs, targets)
                    + BETA * F.cross_entropy(memory, self.memory_y[idx])
                    + ALPHA * F.mse_loss(memory, self.memory_logits[idx].to(memory.dtype))
                ) / (1 + ALPHA + BETA)
            loss.backward()
            optimizer.step()
            n, batch = self.seen, len(targets)
            raw = torch.randint(0, 2**62, (batch,), device=device)
            slots = raw % torch.arange(n + 1, n + batch + 1, device=device)
            slots = torch.where(slots < m, slots, m)
            self.memory_x.index_copy_(0, slots, inputs)
            self.memory_y.index_copy_(0, slots, targets)
            self.memory_logits.index_copy_(0, slots, outputs.detach().float())
            self.seen = n + batch
        synchronize(device)
        return time.perf_counter() - start


CAPTURED = {"library compiled": "compile", "library captured": "graph"}
"""The captured variants of the image step and their ``Trainer(capture=...)``."""
EAGER_TARGET, CAPTURED_TARGET = 1.05, 4.0
"""Targets (issue 28): library eager <= 1.05x bare eager; captured >= 4x faster than it."""


def image_variants(
    nf: int,
    precision: str,
    device: torch.device,
    loaders: tuple[Iterable[Any], Iterable[Any]],
    capture: bool,
) -> tuple[dict[str, Run], dict[str, str]]:
    """The timed variants of the DER++ image step (each learner's memory full) and the skipped
    ones with the reason."""
    loader, warm = loaders
    torch.manual_seed(0)
    bare = BareImageDERpp(resnet18(num_classes=CLASSES, nf=nf).to(device), loader,
                          precision, device)  # fmt: skip
    variants: dict[str, Run] = {"bare eager": bare.run}
    skipped: dict[str, str] = {}
    for label, mode in {"library eager": "off", **CAPTURED}.items():
        if mode != "off" and not capture:
            skipped[label] = "skipped: --no-capture, or a dry run's second precision"
            continue
        if mode == "graph" and device.type != "cuda":
            skipped[label] = "skipped: no CUDA"
            continue
        learner = make_image_learner(nf, precision, device, capture=mode)
        learner.fit(warm)  # fills the memory (and compiles a captured step)
        clock = SteadyClock(device, len(loader))  # type: ignore[arg-type]
        learner.trainer.subscribe(clock)
        variants[label] = lambda learner=learner, clock=clock: clock.fit(learner, loader)
    return variants, skipped


def image_section(device: torch.device, steps: int, rounds: int, capture: bool = True) -> None:
    x, y = make_images(IMAGE_BATCH * steps, seed=6)
    warm_x, warm_y = make_images(IMAGE_MEMORY + IMAGE_BATCH, seed=7)
    loader = TensorLoader((x, y), batch_size=IMAGE_BATCH, shuffle=True, device=device)
    warm = TensorLoader((warm_x, warm_y), batch_size=IMAGE_BATCH, shuffle=True, device=device)
    for nf in IMAGE_WIDTHS:
        for precision in PRECISIONS:
            torch._dynamo.reset()  # each width and precision compiles afresh
            # The dry run compiles once (tracing a ResNet takes ~10 s of CPU): at fp32 only.
            compiled = capture and (device.type == "cuda" or precision == PRECISIONS[0])
            variants, skipped = image_variants(nf, precision, device, (loader, warm), compiled)
            medians = measure(variants, steps - SETTLE, rounds, device)
            print_times(
                f"(4) DER++ image step, resnet18(nf={nf}), batch {IMAGE_BATCH} + memory batch "
                f"{IMAGE_BATCH}, {IMAGE_MEMORY} uint8 slots on the GPU, CIFAR preset on both, "
                f"precision {precision}, the steady steps of each run (its first {SETTLE} left "
                "out)",
                medians,
                "bare eager",
                skipped,
            )
            print(image_verdict(medians))


def image_verdict(medians: dict[str, float]) -> str:
    """The issue's targets against the bare eager loop, met or not."""
    base = medians["bare eager"]
    eager = medians["library eager"] / base
    parts = [
        f"library eager {eager:.2f}x bare eager (target <= {EAGER_TARGET:.2f}x: "
        f"{'met' if eager <= EAGER_TARGET else 'NOT met'})"
    ]
    for label in CAPTURED:
        if label in medians:
            faster = base / medians[label]
            parts.append(f"{label} {faster:.2f}x as fast")
            if label == "library captured":
                met = "met" if faster >= CAPTURED_TARGET else "NOT met"
                parts[-1] += f" (target >= {CAPTURED_TARGET:.0f}x: {met})"
    return "  " + "; ".join(parts)


# -- sync check ----------------------------------------------------------------------------------


@contextmanager
def sync_window(trainer: Trainer, device: torch.device, mode: str, last: int) -> Iterator[None]:
    """Sync debugging from ``batch_start`` of the second batch to ``batch_end`` of batch ``last``.

    The switch-on runs before every other ``batch_start`` receiver, the switch-off after every
    other ``batch_end`` receiver (the learner's buffer update included), so that everything in
    between is checked: the step, backward, optimizer step, listeners, and for later batches the
    loader and the batch move.
    """

    def sync_on(state: Any) -> None:
        if state.batch_idx == 1:
            set_sync_mode(device, mode)

    def sync_off(state: Any) -> None:
        if state.batch_idx == last:
            set_sync_mode(device, 0)

    trainer.connect("batch_start", sync_on, priority=10**9)
    trainer.connect("batch_end", sync_off, priority=-(10**9))
    try:
        yield
    finally:
        set_sync_mode(device, 0)
        trainer.unsubscribe(sync_on)
        trainer.unsubscribe(sync_off)


def _ours(frames: Iterable[traceback.FrameSummary]) -> list[str]:
    return [
        f"{os.path.relpath(f.filename, ROOT)}:{f.lineno}: {(f.line or '').strip()}"
        for f in frames
        if f.filename.startswith(PROJECT_DIRS)
    ]


def describe(exc: BaseException) -> str:
    """The synchronising operation behind ``exc`` (searched along its cause chain)."""
    seen: BaseException | None = exc
    while seen is not None:
        if SYNC_MESSAGE in str(seen):
            frames = traceback.extract_tb(seen.__traceback__)
            lines = _ours(frames) or [f"{f.filename}:{f.lineno}" for f in frames[-1:]]
            innermost = frames[-1]
            where = "\n      ".join(lines[-4:])
            return (
                f"SYNCHRONISED: {type(seen).__name__}: {seen}\n"
                f"    innermost call: {innermost.filename}:{innermost.lineno}: "
                f"{(innermost.line or '').strip()}\n"
                f"    project frames (outermost first):\n      {where}"
            )
        seen = seen.__cause__ or seen.__context__
    return f"FAILED for another reason: {type(exc).__name__}: {exc}"


@contextmanager
def sync_warnings() -> Iterator[collections.Counter[str]]:
    """Count "synchronizing CUDA operation" warnings by the innermost project frame."""
    sites: collections.Counter[str] = collections.Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        previous = warnings.showwarning

        def record(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
            if SYNC_MESSAGE not in str(message):
                previous(message, category, filename, lineno, *args)
                return
            ours = _ours(traceback.extract_stack()[:-1])
            sites[ours[-1] if ours else f"{filename}:{lineno}"] += 1

        warnings.showwarning = record
        yield sites


def _trainer_fit(
    device: torch.device, loader: Iterable[Any], precision: str = "32", nonfinite: str = "off"
) -> tuple[Trainer, Run]:
    model = mlp(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    trainer = Trainer(max_epochs=1, device=device, precision=precision, nonfinite_loss=nonfinite)

    def step(batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)

    return trainer, lambda: trainer.fit(model, optimizer, loader, step)


def _learner_fit(
    device: torch.device, loader: Iterable[Any], precision: str
) -> tuple[Trainer, Run]:
    model = mlp(device)
    learner = make_learner(model, torch.optim.Adam(model.parameters(), lr=1e-3), precision, device)
    return learner.trainer, lambda: learner.fit(loader)


def _derpp_fit(device: torch.device, loader: Iterable[Any], precision: str) -> tuple[Trainer, Run]:
    model = mlp(device)
    learner = DarkExperienceReplayLearner(
        model=model,
        memory_size=MEMORY,
        memory_batch_size=BATCH,
        batch_size=BATCH,
        alpha=ALPHA,
        beta=BETA,
        buffer=ReservoirBuffer(MEMORY, seed=0, device=device),
        trainer=Trainer(max_epochs=1, device=device, precision=precision, nonfinite_loss="off"),
    )
    return learner.trainer, lambda: learner.fit(loader)


def _image_fit(device: torch.device, batches: int, precision: str) -> tuple[Trainer, Run]:
    learner = make_image_learner(IMAGE_WIDTHS[0], precision, device)
    warm_x, warm_y = make_images(IMAGE_MEMORY, seed=8)
    learner.fit(TensorLoader((warm_x, warm_y), batch_size=IMAGE_BATCH, device=device))  # full
    x, y = make_images(IMAGE_BATCH * batches, seed=9)
    loader = TensorLoader((x, y), batch_size=IMAGE_BATCH, shuffle=True, device=device)
    return learner.trainer, lambda: learner.fit(loader)


def sync_scenarios(device: torch.device, batches: int) -> dict[str, tuple[Trainer, Run]]:
    """Each scenario: the trainer to watch and a fit over ``batches`` batches."""
    x, y = make_data(BATCH * batches, seed=4)
    resident = TensorLoader((x, y), batch_size=BATCH, device=device)
    pinned = DataLoader(TensorDataset(x, y), batch_size=BATCH, pin_memory=device.type == "cuda")
    scenarios: dict[str, tuple[Trainer, Run]] = {}
    for precision in PRECISIONS:
        scenarios[f"Trainer, GPU-resident TensorLoader, {precision}"] = _trainer_fit(
            device, resident, precision
        )
        scenarios[f"ExperienceReplayLearner, GPU buffer, {precision}"] = _learner_fit(
            device, resident, precision
        )
        scenarios[f"DarkExperienceReplayLearner, GPU buffer, {precision}"] = _derpp_fit(
            device, resident, precision
        )
        scenarios[
            f"DER++ image step, resnet18(nf={IMAGE_WIDTHS[0]}), uint8 GPU buffer, CIFAR preset, "
            f"{precision}"
        ] = _image_fit(device, batches, precision)
    scenarios["Trainer, pinned DataLoader, 32"] = _trainer_fit(device, pinned)
    # The default loss check reads one bool per step: this one must be reported.
    scenarios["canary: Trainer with the default nonfinite_loss='raise'"] = _trainer_fit(
        device, resident, nonfinite="raise"
    )
    return scenarios


def sync_section(device: torch.device, batches: int) -> None:
    print(
        f"\n(3) sync check: steady-state steps (batches 2..{batches} of a fit, after a warm-up "
        "fit) under torch.cuda.set_sync_debug_mode('error'), nonfinite_loss='off' (the canary "
        "keeps the default 'raise' and must synchronise)"
    )
    dry = device.type != "cuda"
    if dry:
        print(
            "  CPU dry run: the sync census is skipped (torch.cuda.set_sync_debug_mode needs "
            "CUDA); each scenario below only runs its fits"
        )
    for name, (trainer, run) in sync_scenarios(device, batches).items():
        run()  # warm-up: optimizer state, memory filled, kernels and handles created
        if dry:
            run()
            print(f"  {name}: ran {batches} steps, not checked (no CUDA)")
            continue
        try:
            with sync_window(trainer, device, "error", last=batches - 1):
                run()
        except Exception as exc:
            verdict = describe(exc)
        else:
            verdict = f"no synchronising operation in {batches - 1} steady-state steps"
        print(f"  {name}: {verdict}")
        with sync_warnings() as steady, sync_window(trainer, device, "warn", last=batches - 1):
            run()
        with sync_warnings() as whole:
            set_sync_mode(device, "warn")
            try:
                run()
            finally:
                set_sync_mode(device, 0)
        for label, sites in (("steady state", steady), (f"whole fit of {batches} steps", whole)):
            if sites:
                print(f"    'warn' census, {label}:")
                for site, count in sites.most_common():
                    print(f"      {count:4d}x {site}")
            else:
                print(f"    'warn' census, {label}: none")


def main(argv: list[str] | None = None) -> int:
    global BATCH, MEMORY, IMAGE_BATCH, IMAGE_MEMORY, IMAGE_WIDTHS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="steps per timed run (default 200)")
    parser.add_argument("--rounds", type=int, help="interleaved timed rounds (default 5)")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="without CUDA: run everything on the CPU, small"
    )
    parser.add_argument(
        "--no-capture",
        action="store_true",
        help="leave out the compiled and captured image steps (their compilation takes minutes)",
    )
    parser.add_argument(
        "--widths",
        help="the ResNet widths (nf) of sections 3 to 5, comma-separated (default: 20,64)",
    )
    parser.add_argument(
        "--sections",
        default="1,2,3,4,5,6",
        help="the sections to run, comma-separated, in the order given (default: all six)",
    )
    args = parser.parse_args(argv)
    try:
        sections = [int(part) for part in args.sections.split(",")]
    except ValueError:
        sections = []
    if not sections or not set(sections) <= {1, 2, 3, 4, 5, 6}:
        parser.error(f"--sections takes numbers 1 to 6, comma-separated; got {args.sections!r}")
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.cpu_dry_run:
        device = torch.device("cpu")
    else:
        print("no CUDA device; nothing to check")
        return 0
    dry = device.type == "cpu"
    if dry:  # the code paths only: small batches keep the CPU's bf16 emulation short
        torch.set_num_threads(1)  # tiny kernels on a shared CPU: threads only wait for each other
        BATCH, MEMORY = 16, 200
        IMAGE_BATCH, IMAGE_MEMORY, IMAGE_WIDTHS = 8, 32, (4,)
        # The code paths only: inductor's code generation for a ResNet takes minutes on a CPU,
        # so the compiled step of the dry run traces and runs with the aot_eager backend.
        compile_ = torch.compile
        torch.compile = lambda function, **kwargs: compile_(  # type: ignore[assignment]
            function, **(kwargs or {"backend": "aot_eager"})
        )
    if args.widths is not None:
        try:
            IMAGE_WIDTHS = tuple(int(part) for part in args.widths.split(","))
        except ValueError:
            parser.error(f"--widths takes numbers, comma-separated; got {args.widths!r}")
    steps = args.steps or (8 if dry else 200)
    rounds = args.rounds or (1 if dry else 5)
    if steps < 3 or rounds < 1:
        parser.error("--steps must be >= 3 and --rounds >= 1")
    name = torch.cuda.get_device_name(device) if not dry else "CPU (dry run)"
    print(f"torch {torch.__version__} on {name}; {steps} steps per timed run, {rounds} rounds")
    started = time.perf_counter()
    torch._dynamo.config.recompile_limit = 64  # a learner per width and precision
    run = {
        1: lambda: loop_section(device, steps, rounds),
        2: lambda: replay_section(device, steps, rounds),
        3: lambda: sync_section(device, batches=max(3, min(steps, 20))),
        4: lambda: image_section(device, min(steps, 100), rounds, capture=not args.no_capture),
        5: lambda: gpu_precision.section(sys.modules[__name__], device, steps, rounds),
        6: lambda: gpu_run_timing.section(device),  # run: steps, evaluation, start-up shares
    }
    for number in sections:
        run[number]()
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
