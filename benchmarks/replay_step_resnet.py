"""One DER++ replay step of the reduced ResNet-18 on augmented CIFAR-shaped data, library vs bare.

The workload is the Seq-CIFAR-10 setting of Buzzega et al., "Dark Experience for General
Continual Learning: a Strong, Simple Baseline", NeurIPS 2020, with a buffer of 500 (the values
of the authors' code for it: SGD with learning rate 0.03, new batch 32 + memory batch 32,
``alpha = 0.2``, ``beta = 0.5``), on the reduced ResNet-18 of GEM (``resnet18(num_classes=10,
nf=20)``, 1.1M parameters) and random ``uint8`` images of 3x32x32 (no data set is downloaded).
Two variants are timed, interleaved round by round in one process, single-threaded:

* ``DarkExperienceReplayLearner + Trainer``: the library's DER++ learner driven by
  :class:`trainer.Trainer`, its :class:`~renate_events.memory.ReservoirBuffer` of 500 ``uint8``
  slots full (with stored logits) before timing, ``train_transform`` and ``buffer_transform`` the
  CIFAR preset of :func:`renate_events.transforms.cifar_train_transform`;
* ``bare DER++ loop``: a hand-written loop doing the same work without the learner, the buffer or
  the trainer: the new batch by indexing the training tensors with a shuffled order, the preset on
  it, the memory batch by indexing preallocated ``uint8`` tensors at ``randperm(500)[:32]``, the
  preset on that, two forward passes (the model has batch normalisation, so the learner does not
  concatenate them either), ``(CE_new + beta * CE_memory + alpha * MSE(logits_memory, stored)) /
  (1 + beta + alpha)``, backward, SGD step, then a vectorised reservoir update of the memory
  (inputs, targets, logits; where two samples of a batch pick one slot the later wins).

Before timing, both start from the same model, the same memory and the same random state, and
take a few steps: their losses must agree (the script stops if they do not), so the two do the
same arithmetic. The cost of the transforms alone (the preset on one batch of 32 ``uint8``
images) is timed the same way, on the CPU, and on a CUDA device when there is one.

How a step is timed (as in ``compare.py``, whose timing code this uses): both variants step the
same SGD subclass, which notes this thread's CPU time (``--clock wall``: wall time) at the start
of every ``step()``; consecutive marks are one full step apart. A run's step time is the median
of its spans after the first two (``--quantile``), a variant's the median over the rounds, and
the ratio the median over the rounds of the ratio within a round. What a ``fit`` costs once
(seeding, the learner's check of the data and the first batch) is reported apart, as
"ms once per fit".

A third variant, ``DarkExperienceReplayLearner + Trainer(capture='compile')``, is the library's
step compiled with ``torch.compile`` (inductor on the CPU; see docs/capture.rst): its losses are
checked against the eager step's (relative tolerance ``COMPILED_TOLERANCE``), its compilation
happens in the warm-up run (not timed), and its ratio to the bare loop and its gain over the eager
step are reported. ``--no-compile`` leaves it out.

Usage: python benchmarks/replay_step_resnet.py [--quick] [--rounds 5] [--steps 6] [--nf 20]
       [--markdown docs/benchmarks/replay_step_resnet.md] [--no-compile]
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import compare
import torch
import torch.nn.functional as F
from _report import command_line, page_header, write_page

from renate_events.memory import ReservoirBuffer
from renate_events.methods import DarkExperienceReplayLearner
from renate_events.models import resnet18
from renate_events.transforms import cifar_train_transform
from trainer import TensorLoader, Trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MARKDOWN = ROOT / "docs" / "benchmarks" / "replay_step_resnet.md"

CLASSES = 10
IMAGE = (3, 32, 32)
MEMORY_SIZE = 500
BATCH = 32
MEMORY_BATCH = 32
LEARNING_RATE = 0.03
ALPHA = 0.2
"""DER++'s weight of the logit MSE on the memory batch (the DER code's Seq-CIFAR-10, 500)."""
BETA = 0.5
"""DER++'s weight of the cross-entropy on the memory batch."""
SEED = 0
RAND_HIGH = 2**62
"""The reservoir's raw draws are integers in ``[0, RAND_HIGH)``, one per sample (as the
library's ``ReservoirBuffer`` documents)."""
TARGET = 1.10
"""The most the library's step may take, as a multiple of the bare loop's (issue 17)."""
LIBRARY = "DarkExperienceReplayLearner + Trainer"
COMPILED = "DarkExperienceReplayLearner + Trainer(capture='compile')"
BARE = "bare DER++ loop"
COMPILED_TOLERANCE = 1e-4
"""How far a compiled step's loss may be from the eager one's, relative (inductor reorders
floating-point sums)."""

Run = Callable[[], Any]


def images(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random CIFAR-shaped ``uint8`` images and labels."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (samples, *IMAGE), dtype=torch.uint8, generator=generator)
    return x, torch.randint(0, CLASSES, (samples,), generator=generator)


def full_buffer(model: torch.nn.Module) -> ReservoirBuffer:
    """A reservoir of :data:`MEMORY_SIZE` ``uint8`` slots, filled with the model's logits."""
    x, y = images(MEMORY_SIZE, seed=1)
    with torch.no_grad():
        model.eval()
        logits = model(cifar_train_transform()(x))
        model.train()
    buffer = ReservoirBuffer(MEMORY_SIZE, seed=SEED)
    buffer.update(x, y, {"logits": logits})
    return buffer


class BareDERpp:
    """The hand-written DER++ loop, on its own copy of a buffer's contents and random state."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        buffer: ReservoirBuffer,
        data: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        self.model, self.optimizer, self.data = model, optimizer, data
        state = buffer.state_dict()  # the random state before the sample below draws
        (x, y), metadata = buffer.sample(MEMORY_SIZE)  # setup only: copy the contents out
        order = metadata["idx"].argsort()
        self.memory_x, self.memory_y = x[order].clone(), y[order].clone()
        self.memory_logits = metadata["logits"][order].clone()
        self.seen = buffer.num_seen
        self.update_generator = torch.Generator()
        self.update_generator.set_state(state["generator_state"])
        self.sample_generator = torch.Generator()
        self.sample_generator.set_state(state["sample_generator_state"])
        self.train_transform = cifar_train_transform()
        self.buffer_transform = cifar_train_transform()
        self.losses: list[float] = []

    def run(self, steps: int | None = None, seed: int | None = None, record: bool = False) -> None:
        """One epoch over the data (the first ``steps`` batches), as ``fit`` runs one."""
        if seed is not None:
            torch.manual_seed(seed)  # what the trainer does at the start of a fit
        x_all, y_all = self.data
        order = torch.randperm(len(y_all))
        for start in range(0, len(y_all) if steps is None else steps * BATCH, BATCH):
            index = order[start : start + BATCH]
            loss = self.step(x_all.index_select(0, index), y_all.index_select(0, index))
            if record:
                self.losses.append(loss.item())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.model
        outputs = model(self.train_transform(x))
        idx = torch.randperm(MEMORY_SIZE, generator=self.sample_generator)[:MEMORY_BATCH]
        memory_x = self.buffer_transform(self.memory_x.index_select(0, idx))
        memory_y = self.memory_y.index_select(0, idx)
        stored = self.memory_logits.index_select(0, idx)
        outputs_memory = model(memory_x)
        loss = F.cross_entropy(outputs, y)
        loss = loss + BETA * F.cross_entropy(outputs_memory, memory_y)
        loss = loss + ALPHA * F.mse_loss(outputs_memory, stored)
        loss = loss / (1.0 + BETA + ALPHA)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.reservoir_update(x, y, outputs.detach())
        return loss.detach()

    def reservoir_update(self, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> None:
        """Algorithm R, vectorised: sample ``n`` takes slot ``r % (n + 1)`` if below the size."""
        n, size = self.seen, MEMORY_SIZE
        raw = torch.randint(0, RAND_HIGH, (len(y),), generator=self.update_generator)
        slots = raw % torch.arange(n + 1, n + len(y) + 1)
        positions = torch.nonzero(slots < size).squeeze(1)
        slots = slots.index_select(0, positions)
        # Several samples on one slot: the latest wins (its position is the largest).
        latest = torch.full((size,), -1).scatter_reduce_(0, slots, positions, "amax")
        won = latest.index_select(0, slots) == positions
        slots, positions = slots[won], positions[won]
        self.memory_x.index_copy_(0, slots, x.index_select(0, positions))
        self.memory_y.index_copy_(0, slots, y.index_select(0, positions))
        self.memory_logits.index_copy_(0, slots, logits.index_select(0, positions))
        self.seen = n + len(y)


class _Losses:
    """A listener noting the loss of every step (only while the two variants are compared)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_batch_end(self, loss: torch.Tensor) -> None:
        self.values.append(loss.item())


def learner_for(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    buffer: ReservoirBuffer,
    capture: str = "off",
) -> DarkExperienceReplayLearner:
    return DarkExperienceReplayLearner(
        model=model,
        optimizer=optimizer,
        buffer=buffer,
        memory_size=MEMORY_SIZE,
        memory_batch_size=MEMORY_BATCH,
        batch_size=BATCH,
        alpha=ALPHA,
        beta=BETA,
        seed=SEED,
        train_transform=cifar_train_transform(),
        buffer_transform=cifar_train_transform(),
        trainer=Trainer(max_epochs=1, device="cpu", capture=capture),
    )


def _library_losses(
    model: torch.nn.Module, buffer: ReservoirBuffer, data: Any, capture: str
) -> list[float]:
    learner = learner_for(
        model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE), buffer, capture
    )
    losses = _Losses()
    learner.trainer.subscribe(losses)
    learner.fit(TensorLoader(data, batch_size=BATCH, shuffle=True))
    return losses.values


def check_same_losses(nf: int, steps: int, compiled: bool) -> list[tuple[float, ...]]:
    """Both variants (and the compiled step, with ``compiled``) from the same model, memory and
    seed for ``steps`` steps: the same losses.

    Raises:
        AssertionError: When a loss differs by more than float32 rounding (the compiled step's:
            by more than :data:`COMPILED_TOLERANCE`).
    """
    torch.manual_seed(SEED)
    model = resnet18(num_classes=CLASSES, nf=nf)
    buffer = full_buffer(model)
    bare_model, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
    compiled_buffer = copy.deepcopy(buffer)
    data = images(steps * BATCH, seed=2)
    bare = BareDERpp(
        bare_model,
        torch.optim.SGD(bare_model.parameters(), lr=LEARNING_RATE),
        copy.deepcopy(buffer),
        data,
    )
    ours = _library_losses(model, buffer, data, "off")
    bare.run(seed=SEED, record=True)
    pairs = list(zip(ours, bare.losses, strict=True))
    for step, (a, b) in enumerate(pairs):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (
            f"step {step}: the library's loss {a!r} and the bare loop's {b!r} differ: the "
            "two variants no longer do the same work"
        )
    if not compiled:
        return pairs
    theirs = _library_losses(compiled_model, compiled_buffer, data, "compile")
    for step, (a, c) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - c) <= COMPILED_TOLERANCE * max(1.0, abs(a)), (
            f"step {step}: the compiled step's loss {c!r} and the eager step's {a!r} differ"
        )
    return [(*pair, c) for pair, c in zip(pairs, theirs)]


def variants(nf: int, steps: int, compiled: bool) -> tuple[dict[str, Run], compare.TimedSGD]:
    """The timed variants, on one model and one optimizer, each with its own full memory."""
    torch.manual_seed(SEED)
    model = resnet18(num_classes=CLASSES, nf=nf)
    optimizer = compare.TimedSGD(model.parameters(), lr=LEARNING_RATE)
    buffer = full_buffer(model)
    data = images(steps * BATCH, seed=3)
    bare = BareDERpp(model, optimizer, copy.deepcopy(buffer), data)
    learners = {LIBRARY: learner_for(model, optimizer, copy.deepcopy(buffer))}
    if compiled:  # compiled in measure's warm-up run, not timed
        learners[COMPILED] = learner_for(model, optimizer, buffer, capture="compile")
    loader = TensorLoader(data, batch_size=BATCH, shuffle=True)
    timed: dict[str, Run] = {BARE: lambda: bare.run(seed=SEED)}
    for name, learner in learners.items():
        timed[name] = lambda learner=learner: learner.fit(loader)
    return timed, optimizer


def transform_costs(repeats: int) -> list[list[str]]:
    """ms per batch of 32 of the CIFAR preset (crop, flip, to float, normalise), per device."""
    x, _ = images(BATCH, seed=4)
    preset = cifar_train_transform()
    rows = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        batch = x.to(device)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        clock = time.perf_counter if device == "cuda" else compare.clock
        for _ in range(3):
            preset(batch)
        times = []
        for _ in range(repeats):
            sync()
            start = clock()
            preset(batch)
            sync()
            times.append(clock() - start)
        rows.append([device, f"{statistics.median(times) * 1e3:.3f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 4 steps")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 5; quick 1)")
    parser.add_argument("--steps", type=int, help="steps per run (default 6; quick 4)")
    parser.add_argument("--check-steps", type=int, default=3, help="steps of the loss check")
    parser.add_argument("--nf", type=int, default=20, help="ResNet-18 width (64: DER's own)")
    parser.add_argument("--quantile", type=float, default=0.5, help="a run's step (0.5: median)")
    parser.add_argument("--clock", choices=sorted(compare.CLOCKS), default="cpu")
    parser.add_argument("--markdown", type=pathlib.Path, default=DEFAULT_MARKDOWN)
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="leave out the compiled step (Trainer(capture='compile'); compiling takes minutes)",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    steps = args.steps or (4 if args.quick else 6)
    if rounds < 1 or steps < compare.SKIP + 2 or args.check_steps < 1:
        parser.error(f"--rounds and --check-steps must be >= 1, --steps >= {compare.SKIP + 2}")
    if not 0 <= args.quantile <= 1:
        parser.error(f"--quantile must be in [0, 1], got {args.quantile}")
    compare.clock = compare.CLOCKS[args.clock]
    command = command_line("replay_step_resnet.py", argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    setting = (
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.system()} "
        f"{platform.machine()}, {compare._cpu_name()}, 1 thread, {args.clock} time; "
        f"resnet18(num_classes={CLASSES}, nf={args.nf}), DER++ (alpha {ALPHA}, beta {BETA}, SGD "
        f"lr {LEARNING_RATE}), new batch {BATCH} + memory batch {MEMORY_BATCH}, {MEMORY_SIZE} "
        f"uint8 slots full, CIFAR-10 preset as train and buffer transform; a run's step time is "
        f"the {args.quantile:.0%} quantile of its {steps - compare.SKIP - 1} step spans (the "
        f"first {compare.SKIP} steps left out), a variant's the median over {rounds} "
        "interleaved rounds (ratio: median of the ratios within a round)"
    )
    print(setting)

    compiled = not args.no_compile
    pairs = check_same_losses(args.nf, args.check_steps, compiled)
    worst = max(abs(p[0] - p[1]) for p in pairs)
    agree = (
        f"losses agree over {len(pairs)} steps from the same model, memory and seed: "
        + ", ".join(f"{p[0]:.6f}" for p in pairs)
        + f" (largest difference {worst:.1e})"
    )
    if compiled:
        worst_compiled = max(abs(p[0] - p[2]) for p in pairs)
        agree += f"; the compiled step's within {worst_compiled:.1e} of the eager step's"
    print(agree)

    timed, optimizer = variants(args.nf, steps, compiled)
    timings = compare.measure(timed, optimizer, rounds, args.quantile)
    base = timings[BARE]
    header = ["variant", "ms/step", "x bare DER++ loop", "ms once per fit"]
    rows = [
        [
            name,
            f"{timing.step / 1e3:.1f}",
            f"{timing.ratio(base):.3f}x",
            f"{timing.fit:.1f}",
        ]
        for name, timing in timings.items()
    ]
    title = "one DER++ replay step: ms per step"
    print(f"\n{title}")
    compare._print_table(header, rows)
    ratio = timings[LIBRARY].ratio(base)
    met = "met" if ratio <= TARGET else "NOT met"
    verdict = f"library / bare: {ratio:.3f}x (target <= {TARGET:.2f}x: {met})"
    if compiled:
        gain = timings[LIBRARY].step / timings[COMPILED].step
        verdict += (
            f"; compiled: {timings[COMPILED].ratio(base):.3f}x bare, {gain:.2f}x as fast as eager"
        )
    print(verdict)

    cost_header = ["device", "ms per batch of 32"]
    costs = transform_costs(repeats=5 if args.quick else 50)
    cost_title = "the CIFAR preset alone (crop 32 pad 4, flip, to float, normalise), uint8 3x32x32"
    print(f"\n{cost_title}")
    compare._print_table(cost_header, costs)
    share = 2 * float(costs[0][1]) / (timings[LIBRARY].step / 1e3)
    share_note = (
        f"two batches per step (new and memory): {share:.1%} of the library's step on the CPU"
    )
    if not torch.cuda.is_available():
        share_note += "; no CUDA device here, so no GPU row"
    print(share_note)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")

    markdown = [
        *page_header(command, setting),
        f"- {agree}",
        f"- {verdict}",
        "",
        f"**{title}**",
        "",
        *compare._markdown_table(header, rows),
        "",
        f"**{cost_title}**",
        "",
        *compare._markdown_table(cost_header, costs),
        "",
        f"- {share_note}",
        "",
    ]
    write_page(args.markdown, markdown)


if __name__ == "__main__":
    main()
