"""Step time of ``trainer.Trainer`` and the ER learner against bare loops and other frameworks.

Measures, interleaved round by round in one process and single-threaded, the median time of one
steady-state training step (µs) of:

* ``bare loop``: ``for x, y in DataLoader: zero_grad; loss = f(model(x), y); backward; step``,
  the reference every ratio is taken against, and the same loop over a :class:`TensorLoader`;
* ``Trainer``: ``Trainer.fit`` with the same step function, over the same DataLoader and over a
  :class:`trainer.TensorLoader` (the fast path: batches by indexing the in-memory tensors), each
  with 0, 1, 10 and 100 no-op listeners subscribed to every loop event, and once without the
  default non-finite loss check (``nonfinite_loss="off"``);
* PyTorch Lightning (defaults less logger, checkpointing, progress bar and model summary; and
  ``barebones=True``) and Ignite (``create_supervised_trainer``), when importable;

on (a) a tiny model (linear 32 -> 4, batch 32), where loop overhead dominates, and (b) an MLP
784-256-256-10 at batch 128. Before those, the cost of one event alone:
``trainer.events.batch_end.send(...)`` with 0 to 100 listeners, timed with ``timeit``.

For replay, on the same two models with a memory batch as large as the new-data batch and 2 000
memory slots: ``ExperienceReplayLearner``'s step against a bare hand-written replay loop (draw a
random memory batch from tensors, concatenate it with the new batch, one forward and backward),
the same loop plus a hand-written reservoir update of the memory (what the ER step also does every
step), and Avalanche's ``Replay`` when importable.

How a step is timed: every variant uses the same SGD subclass, which notes the time (this
thread's CPU time by default, ``--clock wall`` for wall time) whenever its ``step()`` starts.
Consecutive marks are one full training step apart whatever the framework does around it
(prefetching, callbacks, closures); a run's time per step is the 10th percentile of those spans
after the first two (``--quantile``; see :data:`QUANTILE` for why not the median), and a
variant's is the median over the rounds. Ratios are the median over the rounds
of the ratio within a round, so that runs which were close in time are compared. What a ``fit``
costs once (building a Lightning trainer, starting an epoch, Avalanche's end-of-experience memory
update) is not part of it; it is reported separately as "once per fit": the call's duration less
its steps.

Usage: python benchmarks/compare.py [--quick] [--rounds 11] [--steps 150] [--replay-steps 80]
       [--markdown docs/benchmarks/compare.md]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import itertools
import logging
import pathlib
import platform
import statistics
import time
import timeit
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from _report import command_line, page_header, write_page
from torch.utils.data import DataLoader, TensorDataset

from renate_events.methods import ExperienceReplayLearner
from trainer import EVENTS, TensorLoader, Trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MARKDOWN = ROOT / "docs" / "benchmarks" / "compare.md"

LOOP_EVENTS = tuple(
    name for name in EVENTS if name not in ("save_checkpoint", "load_checkpoint", "exception")
)
"""The events of the training loop itself (the no-op listeners subscribe to each)."""
LISTENER_COUNTS = (0, 1, 10, 100)
SKIP = 2
"""Steps at the start of every run left out of the per-step time (warm caches after setup)."""
MEMORY_SIZE = 2_000
LEARNING_RATE = 1e-3

Run = Callable[[], Any]


# -- timing --------------------------------------------------------------------------------------


CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]
"""What the marks read: this thread's CPU time by default (``--clock wall``: wall time).

Every variant here runs in the calling thread (DataLoaders without workers), so its CPU time is
its whole cost; wall time on a shared virtual machine also counts the time the host gives to other
guests, which moved identical loops by 15% between rounds when this script was written.
"""


class TimedSGD(torch.optim.SGD):
    """Plain SGD that notes the time (:data:`clock`) at the start of every ``step()``."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float) -> None:
        super().__init__(params, lr=lr)
        self.marks: list[float] = []

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        _mark(self.marks)
        return super().step(closure)


@torch.compiler.disable  # a host clock: under a compiled optimizer step it runs eagerly, by name
def _mark(marks: list[float]) -> None:
    marks.append(clock())


@dataclass
class Timing:
    """Per-step and once-per-fit times of one variant, one value per round."""

    per_step_us: list[float] = field(default_factory=list)
    per_fit_ms: list[float] = field(default_factory=list)

    @property
    def step(self) -> float:
        return statistics.median(self.per_step_us)

    @property
    def fit(self) -> float:
        return statistics.median(self.per_fit_ms)

    def ratio(self, reference: Timing) -> float:
        """Median over the rounds of this variant's step time over ``reference``'s in the same
        round: pairing runs that were close in time cancels the machine's slow drifts."""
        return statistics.median(
            mine / theirs for mine, theirs in zip(self.per_step_us, reference.per_step_us)
        )


QUANTILE = 0.1
"""Which step of a run stands for the run: the 10th percentile of its step times by default.

Identical steps of one loop spread from 1x to 2.7x their fastest on the shared two-core VM this
was written on, in CPU time too (the host's other guests share caches and cores); the spread
hides differences of a few percent in a median. Work a variant does every step is in every one of
its steps, fast ones included, so a low quantile keeps it and drops most of the interference.
``--quantile 0.5`` reports medians.
"""


def measure(
    variants: dict[str, Run], optimizer: TimedSGD, rounds: int, quantile: float = QUANTILE
) -> dict[str, Timing]:
    """Run every variant once to warm up, then ``rounds`` interleaved rounds.

    The order of the variants rotates from round to round, so that no variant always runs first in
    a round (right after the garbage collection and the previous round's last variant).
    """
    names = list(variants)
    for name in names:
        variants[name]()
    timings = {name: Timing() for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            optimizer.marks.clear()
            start = clock()
            variants[name]()
            duration = clock() - start
            marks = optimizer.marks
            if len(marks) < SKIP + 2:
                raise RuntimeError(f"{name}: only {len(marks)} optimizer steps; raise --steps")
            # A low quantile of the step-to-step spans (see QUANTILE); the mean over the run is
            # kept for "per fit".
            spans = sorted(b - a for a, b in itertools.pairwise(marks[SKIP:]))
            mean_step = (marks[-1] - marks[SKIP]) / len(spans)
            timings[name].per_step_us.append(spans[int(quantile * (len(spans) - 1))] * 1e6)
            timings[name].per_fit_ms.append(max(0.0, duration - mean_step * len(marks)) * 1e3)
    return timings


# -- peers ---------------------------------------------------------------------------------------


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def import_lightning() -> tuple[Any, str]:
    """``(lightning.pytorch module or None, version or reason it is skipped)``."""
    errors = []
    for module, distribution in (
        ("lightning.pytorch", "lightning"),
        ("pytorch_lightning", "pytorch-lightning"),
    ):
        try:
            pl = importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken install raising anything else
            errors.append(f"{module}: {type(exc).__name__}: {exc}")
            continue
        for name in (
            "lightning.pytorch",
            "pytorch_lightning",
            "lightning.fabric",
            "lightning_fabric",
        ):
            logging.getLogger(name).setLevel(logging.ERROR)
        return pl, f"{distribution} {_version(distribution)}"
    return None, "not importable (" + "; ".join(errors) + "); pip install pytorch-lightning"


def import_ignite() -> tuple[Any, str]:
    try:
        engine = importlib.import_module("ignite.engine")
    except Exception as exc:
        return None, f"not importable ({type(exc).__name__}: {exc}); pip install pytorch-ignite"
    return engine, f"pytorch-ignite {_version('pytorch-ignite')}"


def import_avalanche() -> tuple[Any, str]:
    try:
        modules = {
            "benchmarks": importlib.import_module("avalanche.benchmarks"),
            "strategies": importlib.import_module("avalanche.training.supervised"),
            "plugins": importlib.import_module("avalanche.training.plugins"),
        }
    except Exception as exc:
        why = (
            "avalanche-lib is not installed"
            if isinstance(exc, ModuleNotFoundError) and exc.name == "avalanche"
            else f"avalanche-lib does not import ({type(exc).__name__}: {exc})"
        )
        return None, (
            f"{why}. It needs torchvision, whose wheels are built against a matching torch and do "
            "not work beside the CPU build torch 2.13.0; benchmarks/README.md shows a separate "
            "environment for it"
        )
    return modules, f"avalanche-lib {_version('avalanche-lib')}"


# -- cases ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    features: int
    classes: int
    batch: int
    hidden: tuple[int, ...] = ()

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        sizes = (self.features, *self.hidden, self.classes)
        layers: list[torch.nn.Module] = []
        for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
            if i:
                layers.append(torch.nn.ReLU())
            layers.append(torch.nn.Linear(n_in, n_out))
        return layers[0] if len(layers) == 1 else torch.nn.Sequential(*layers)

    def data(self, samples: int, seed: int) -> TensorDataset:
        generator = torch.Generator().manual_seed(seed)
        return TensorDataset(
            torch.randn(samples, self.features, generator=generator),
            torch.randint(0, self.classes, (samples,), generator=generator),
        )


CASES = (
    Case("tiny: linear 32->4, batch 32", 32, 4, 32),
    Case("MLP 784-256-256-10, batch 128", 784, 10, 128, (256, 256)),
)


def _noop_listener_class() -> type:
    def hook(self: Any) -> None:
        return None

    return type("NoOp", (), {f"on_{event}": hook for event in LOOP_EVENTS})


NoOp = _noop_listener_class()


class Reader:
    """A listener that takes two keywords of ``batch_end`` and does nothing with them."""

    def on_batch_end(self, state: Any, loss: Any) -> None:
        return None


def dispatch_costs(number: int = 2_000, repeat: int = 7) -> tuple[list[list[str]], list[str]]:
    """µs per ``batch_end.send`` with 0, 1, 10 and 100 listeners (best of ``repeat``), alone."""
    kinds = {"no-op, no keywords": NoOp, "no-op taking (state, loss)": Reader}
    per_send: dict[str, list[float]] = {kind: [] for kind in kinds}
    for kind, listener in kinds.items():
        for count in LISTENER_COUNTS:
            trainer = Trainer(device="cpu")
            for _ in range(count):
                trainer.subscribe(listener())
            signal = trainer.events.batch_end
            payload = {
                "sender": trainer,
                "trainer": trainer,
                "model": None,
                "optimizer": None,
                "state": trainer.state,
                "batch": None,
                "outputs": None,
                "loss": None,
            }
            timer = timeit.Timer(
                lambda signal=signal, trainer=trainer, payload=payload: signal.send(
                    trainer, **payload
                )
            )
            per_send[kind].append(min(timer.repeat(repeat=repeat, number=number)) / number * 1e6)
    rows = [
        [f"{count} listeners", *(f"{per_send[kind][i]:.2f}" for kind in kinds)]
        for i, count in enumerate(LISTENER_COUNTS)
    ]
    notes = [
        f"each listener ({kind}) adds {_slope(LISTENER_COUNTS, values):.3f} µs per event sent"
        for kind, values in per_send.items()
    ]
    notes.append("with no listener connected the loop does not call send() at all")
    return [["listeners", *(f"µs per send, {kind}" for kind in kinds)], *rows], notes


def loop_variants(case: Case, steps: int, peers: dict[str, Any]) -> tuple[dict[str, Run], Any]:
    model = case.model()
    optimizer = TimedSGD(model.parameters(), lr=LEARNING_RATE)
    data = case.data(case.batch * steps, seed=1)
    loaders = {
        "DataLoader": DataLoader(data, batch_size=case.batch, shuffle=True),
        "TensorLoader": TensorLoader(data.tensors, batch_size=case.batch, shuffle=True),
    }

    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def bare(loader: Iterable[Any]) -> Run:
        def run() -> None:
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()

        return run

    def fit(trainer: Trainer, loader: Iterable[Any]) -> Run:
        return lambda: trainer.fit(model, optimizer, loader, step)

    variants: dict[str, Run] = {
        "bare loop, DataLoader": bare(loaders["DataLoader"]),
        "bare loop, TensorLoader": bare(loaders["TensorLoader"]),
    }
    for kind, loader in loaders.items():
        for count in LISTENER_COUNTS:
            trainer = Trainer(max_epochs=1, device="cpu")
            for _ in range(count):
                trainer.subscribe(NoOp())
            variants[f"Trainer, {kind}, {count} listeners"] = fit(trainer, loader)
    # The default loss check reads one bool per step; how much of the overhead is it?
    unchecked = Trainer(max_epochs=1, device="cpu", nonfinite_loss="off")
    variants["Trainer, TensorLoader, 0 listeners, nonfinite_loss='off'"] = fit(
        unchecked, loaders["TensorLoader"]
    )
    if peers["lightning"] is not None:
        variants.update(_lightning_variants(peers["lightning"], model, optimizer, loaders))
    if peers["ignite"] is not None:
        engine = peers["ignite"].create_supervised_trainer(
            model, optimizer, F.cross_entropy, device="cpu"
        )
        loader = loaders["DataLoader"]
        variants["Ignite, DataLoader"] = lambda: engine.run(loader, max_epochs=1)
    return variants, optimizer


def _lightning_variants(
    pl: Any, model: torch.nn.Module, optimizer: TimedSGD, loaders: dict[str, Any]
) -> dict[str, Run]:
    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer

    module = Module()
    common = {"max_epochs": 1, "accelerator": "cpu", "devices": 1, "num_sanity_val_steps": 0}
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }

    def run(**options: Any) -> Run:
        def fit() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "does not have many workers", and the like
                trainer = pl.Trainer(**common, **options)
                trainer.fit(module, train_dataloaders=loaders["DataLoader"])

        return fit

    return {
        "Lightning, DataLoader": run(**quiet),
        "Lightning barebones, DataLoader": run(barebones=True),
    }


def replay_variants(
    case: Case, steps: int, avalanche: Any
) -> tuple[dict[str, Run], TimedSGD, str | None]:
    """ER learner, bare replay, bare replay + reservoir update and Avalanche's Replay."""
    model = case.model()
    optimizer = TimedSGD(model.parameters(), lr=LEARNING_RATE)
    batch = case.batch
    warm = case.data(MEMORY_SIZE + batch, seed=2)
    data = case.data(batch * steps, seed=3)
    loader = TensorLoader(data.tensors, batch_size=batch, shuffle=True)

    learner = ExperienceReplayLearner(
        model=model,
        optimizer=optimizer,
        memory_size=MEMORY_SIZE,
        memory_batch_size=batch,
        batch_size=batch,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    learner.fit(warm)  # fills the memory

    memory_x = warm.tensors[0][:MEMORY_SIZE].clone()
    memory_y = warm.tensors[1][:MEMORY_SIZE].clone()
    memory_logits = torch.zeros(MEMORY_SIZE, case.classes)
    seen = [MEMORY_SIZE]

    def bare_replay(update_memory: bool) -> Run:
        def run() -> None:
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                idx = torch.randint(0, MEMORY_SIZE, (batch,))
                outputs = model(torch.cat([x, memory_x[idx]]))
                loss = F.cross_entropy(outputs, torch.cat([y, memory_y[idx]]))
                loss.backward()
                optimizer.step()
                if update_memory:  # reservoir sampling, vectorised, with the new batch's logits
                    n = seen[0]
                    slots = torch.randint(0, 2**62, (batch,)) % torch.arange(n + 1, n + batch + 1)
                    keep = slots < MEMORY_SIZE
                    kept = slots[keep]
                    memory_x[kept] = x[keep]
                    memory_y[kept] = y[keep]
                    memory_logits[kept] = outputs[:batch].detach()[keep]
                    seen[0] = n + batch

        return run

    variants: dict[str, Run] = {
        "bare replay": bare_replay(False),
        "bare replay + reservoir update": bare_replay(True),
        "ExperienceReplayLearner, TensorLoader": lambda: learner.fit(loader),
    }
    skipped = None
    if avalanche is not None:
        try:
            variants["Avalanche Replay"] = _avalanche_replay(
                avalanche, model, optimizer, warm, data, batch
            )
        except Exception as exc:  # an API this script does not know: report, keep the rest
            skipped = f"set-up failed ({type(exc).__name__}: {exc})"
    return variants, optimizer, skipped


def _avalanche_replay(
    avalanche: Any,
    model: torch.nn.Module,
    optimizer: TimedSGD,
    warm: TensorDataset,
    data: TensorDataset,
    batch: int,
) -> Run:
    """Avalanche's ``Replay`` strategy (memory batch = ``train_mb_size``, one concatenated
    forward), trained once on ``warm`` to fill its memory; each run trains on ``data``."""
    benchmark = avalanche["benchmarks"].tensors_benchmark(
        train_tensors=[list(warm.tensors), list(data.tensors)],
        test_tensors=[[t[:batch] for t in data.tensors]],
        task_labels=[0, 0],
        complete_test_set_only=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "No loggers specified, metrics will not be logged"
        evaluator = avalanche["plugins"].EvaluationPlugin(loggers=[])
    strategy = avalanche["strategies"].Replay(
        model=model,
        optimizer=optimizer,
        criterion=torch.nn.CrossEntropyLoss(),
        mem_size=MEMORY_SIZE,
        train_mb_size=batch,
        train_epochs=1,
        device="cpu",
        evaluator=evaluator,
        eval_every=-1,
    )
    stream = benchmark.train_stream
    strategy.train(stream[0], eval_streams=[])  # fills the memory
    new_data = stream[1]
    return lambda: strategy.train(new_data, eval_streams=[])


# -- reporting -----------------------------------------------------------------------------------


def _slope(counts: tuple[int, ...], values: list[float]) -> float:
    """Least-squares slope of ``values`` against ``counts``."""
    mean_x, mean_y = statistics.fmean(counts), statistics.fmean(values)
    num = sum((x - mean_x) * (y - mean_y) for x, y in zip(counts, values))
    return num / sum((x - mean_x) ** 2 for x in counts)


def _same_loader_reference(name: str) -> str | None:
    if "TensorLoader" in name and name.startswith("Trainer"):
        return "bare loop, TensorLoader"
    if "DataLoader" in name and not name.startswith("bare"):
        return "bare loop, DataLoader"
    return None


def loop_table(timings: dict[str, Timing]) -> tuple[list[list[str]], list[str]]:
    base = timings["bare loop, DataLoader"]
    rows = []
    for name, timing in timings.items():
        reference = _same_loader_reference(name)
        same = f"{timing.ratio(timings[reference]):.2f}x" if reference else ""
        rows.append(
            [name, f"{timing.step:.1f}", f"{timing.ratio(base):.2f}x", same, f"{timing.fit:.2f}"]
        )
    notes = []
    for kind in ("DataLoader", "TensorLoader"):
        values = [timings[f"Trainer, {kind}, {n} listeners"].step for n in LISTENER_COUNTS]
        slope = _slope(LISTENER_COUNTS, values)
        notes.append(
            f"Trainer with a {kind}: {values[0]:.1f} µs/step with no listener, "
            f"{values[-1]:.1f} with 100; each no-op listener adds {slope:.2f} µs per step "
            f"(least-squares over 0, 1, 10, 100; two events fire per step: batch_start and "
            f"batch_end)"
        )
    return rows, notes


def replay_table(timings: dict[str, Timing]) -> list[list[str]]:
    base = timings["bare replay"]
    with_update = timings["bare replay + reservoir update"]
    return [
        [
            name,
            f"{timing.step:.1f}",
            f"{timing.ratio(base):.2f}x",
            f"{timing.ratio(with_update):.2f}x",
            f"{timing.fit:.2f}",
        ]
        for name, timing in timings.items()
    ]


LOOP_HEADER = [
    "variant",
    "µs/step",
    "x bare DataLoader loop",
    "x bare loop, same loader",
    "ms once per fit",
]
REPLAY_HEADER = ["variant", "µs/step", "x bare replay", "x bare replay + update", "ms once per fit"]


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    line = "  ".join(
        f"{cell:<{w}}" if i == 0 else f"{cell:>{w}}"
        for i, (cell, w) in enumerate(zip(header, widths))
    )
    print(line)
    print("-" * len(line))
    for row in rows:
        print(
            "  ".join(
                f"{cell:<{w}}" if i == 0 else f"{cell:>{w}}"
                for i, (cell, w) in enumerate(zip(row, widths))
            )
        )


def _section(
    title: str, subtitle: str, header: list[str], rows: list[list[str]], notes: list[str]
) -> list[str]:
    """Print a titled table and its notes; return them as markdown lines."""
    print(f"\n{title}{subtitle}")
    _print_table(header, rows)
    for note in notes:
        print(note)
    lines = [f"**{title}**", "", *_markdown_table(header, rows), ""]
    return lines + ([*[f"- {note}" for note in notes], ""] if notes else [])


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join([" --- "] + [" ---: "] * (len(header) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about a minute: fewer rounds/steps")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 11; quick 5)")
    parser.add_argument("--steps", type=int, help="steps per loop run (default 150; quick 60)")
    parser.add_argument(
        "--replay-steps", type=int, help="steps per replay run (default 80; quick 40)"
    )
    parser.add_argument(
        "--markdown",
        type=pathlib.Path,
        default=DEFAULT_MARKDOWN,
        help="where to write the markdown table (default: docs/benchmarks/compare.md)",
    )
    parser.add_argument(
        "--quantile",
        type=float,
        default=QUANTILE,
        help="the step of a run that stands for it, as a quantile of its step times (default "
        "0.1; 0.5: the median)",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="what a step's time is: this thread's CPU time (default) or wall time",
    )
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    rounds = args.rounds or (5 if args.quick else 11)
    steps = args.steps or (60 if args.quick else 150)
    replay_steps = args.replay_steps or (40 if args.quick else 80)
    if not 0 <= args.quantile <= 1:
        parser.error(f"--quantile must be in [0, 1], got {args.quantile}")
    if min(rounds, steps, replay_steps) < 1 or min(steps, replay_steps) < SKIP + 2:
        parser.error(f"--rounds must be >= 1 and the step counts >= {SKIP + 2}")
    command = command_line("compare.py", argv)
    torch.set_num_threads(1)
    started = time.perf_counter()

    lightning, lightning_note = import_lightning()
    ignite, ignite_note = import_ignite()
    avalanche, avalanche_note = import_avalanche()
    peers = {"lightning": lightning, "ignite": ignite}
    peer_lines = [
        f"PyTorch Lightning: {'measured, ' if lightning else 'skipped: '}{lightning_note}",
        f"Ignite: {'measured, ' if ignite else 'skipped: '}{ignite_note}",
        f"Avalanche: {'measured, ' if avalanche else 'skipped: '}{avalanche_note}",
    ]
    setting = (
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.system()} "
        f"{platform.machine()}, {_cpu_name()}, 1 thread, {args.clock} time; a run's step time is "
        f"the {args.quantile:.0%} quantile of its step times, a variant's the median over "
        f"{rounds} interleaved rounds (ratios: median of the ratios within a round), "
        f"{steps} steps per loop run and {replay_steps} per replay run (the first {SKIP} of each "
        f"run left out)"
    )
    print(setting)
    for line in peer_lines:
        print(line)

    markdown = [
        *page_header(command, setting),
        *[f"- {line}" for line in peer_lines],
        "",
    ]
    if lightning or ignite or avalanche:
        markdown += [
            "The measured peer frameworks were importable in the environment of this run, a "
            'separate virtual environment beside the same torch (see "Peer frameworks" in '
            "`benchmarks/README.md`); where they are not installed, their rows are skipped.",
            "",
        ]
    (header, *rows), notes = dispatch_costs()
    title = "event dispatch alone: trainer.events.batch_end.send(...), best of 7 x 2000 sends"
    markdown += _section(title, "", header, rows, notes)

    for label, case in zip("ab", CASES):
        variants, optimizer = loop_variants(case, steps, peers)
        timings = measure(variants, optimizer, rounds, args.quantile)
        rows, notes = loop_table(timings)
        title = f"({label}) training loop, {case.name}"
        subtitle = ": µs per step (ratios against the bare loops of this run)"
        markdown += _section(title, subtitle, LOOP_HEADER, rows, notes)

    for label, case in zip("cd", CASES):
        variants, optimizer, failed = replay_variants(case, replay_steps, avalanche)
        timings = measure(variants, optimizer, rounds, args.quantile)
        rows = replay_table(timings)
        title = (
            f"({label}) replay step, {case.name} + memory batch {case.batch}, "
            f"{MEMORY_SIZE} memory slots"
        )
        print(f"\n{title}: µs per step")
        _print_table(REPLAY_HEADER, rows)
        if failed:
            print(f"Avalanche Replay: {failed}")
        markdown += [f"**{title}**", "", *_markdown_table(REPLAY_HEADER, rows), ""]
        if failed:
            markdown += [f"Avalanche Replay: {failed}.", ""]

    elapsed = time.perf_counter() - started
    print(f"\ntotal {elapsed:.0f} s")
    markdown += [
        "Every variant steps the same SGD subclass, which notes the time at the start of each "
        "`step()`; a step's time is the span between those marks, so once-per-fit work (building "
        "a Lightning trainer, starting an epoch, Avalanche's end-of-experience memory update) is "
        'left out of it and shown as "ms once per fit". Times are this thread\'s CPU time unless '
        "the setting above says wall time; a run's step time is a low quantile of its steps' "
        "times (identical steps spread up to 2.7x on this shared machine; work done every step "
        "is in the fast steps too), a variant's the median over the rounds, and a ratio the "
        "median over the rounds of the ratio within a round. The ER learner runs one forward "
        "pass over the new and the memory batch "
        'concatenated (`memory_forward="auto"`), one cross-entropy over both (weighted as '
        "Renate's normalised sum of the new-data and memory losses; with ER's defaults the plain "
        "mean), draws its memory batch without replacement and updates its reservoir (with the "
        "logits) every step; the bare replay loop runs one cross-entropy over both batches, "
        "draws with replacement and, in its second form, does a hand-written reservoir update. "
        "See `benchmarks/README.md`.",
        "",
    ]
    write_page(args.markdown, markdown)


if __name__ == "__main__":
    main()
