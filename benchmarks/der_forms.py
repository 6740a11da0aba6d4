"""Which difference between this library's DER++ and Avalanche's DER matters, on Split-Digits.

Avalanche's ``DER`` strategy (``avalanche/training/supervised/der.py``) fills a class-balanced
memory at the end of each experience with the final model's logits, draws one memory batch per
step from a shuffled, cycled loader over the memory, forwards ``[memory; new]`` in one pass and
*sums* ``CE(new) + alpha * MSE(memory logits) + beta * CE(memory)``. This script runs a bare
hand-written loop doing exactly that, its variants (random memory batches, a second memory draw
for the cross-entropy as in the DER paper's code), and :class:`DarkExperienceReplayLearner` with
the same recipe (``buffer_filling="end"``, a ``GreedyClassBalancingBuffer``), its loss averaged
(``loss_normalization=True``, the default, as Renate) and summed, with one or two memory draws
and with one or two forward passes. The recipe is the issue's: MLP 64-256-10, SGD, batches of 10
new and 10 memory samples, 200 slots, 5 epochs per task, ``alpha = 0.1``, ``beta = 0.5``
(Avalanche's defaults). Prints the final class-incremental average accuracy, mean ± std over
seeds.

Usage: python benchmarks/der_forms.py [--seeds 0 1 ... 19] [--epochs 5] [--lr 0.05]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from renate_events import evaluation
from renate_events.cli._zoo import mlp
from renate_events.components import WeightedMeanSquaredErrorLossComponent
from renate_events.memory import GreedyClassBalancingBuffer
from renate_events.methods import DarkExperienceReplayLearner
from renate_events.scenarios import split_digits
from trainer import Trainer

ALPHA, BETA, BATCH, SLOTS = 0.1, 0.5, 10, 200


def library(seed: int, epochs: int, lr: float, **options) -> float:
    """DER++ of this library with the recipe and ``options``; the final average accuracy."""
    tasks = split_digits(seed=seed).tasks()
    torch.manual_seed(seed)
    model = mlp(64, [256], 10)
    learner = DarkExperienceReplayLearner(
        model=model,
        optimizer=lambda p: torch.optim.SGD(p, lr=lr),
        trainer=Trainer(max_epochs=epochs, device="cpu"),
        memory_size=SLOTS,
        memory_batch_size=BATCH,
        batch_size=BATCH,
        seed=seed,
        alpha=ALPHA,
        beta=BETA,
        buffer_filling="end",
        buffer=GreedyClassBalancingBuffer(max_size=SLOTS, seed=seed),
        **options,
    )
    matrix = evaluation.AccuracyMatrix()
    for task in tasks:
        learner.fit(task.train)
        matrix.append(evaluation.evaluate(model, tasks, mode="class-incremental"))
    return evaluation.average_accuracy(matrix)


def _memory_batches(slots: int, cycled: bool, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Slots of memory batches: a shuffled loader cycled over the memory (drop_last, as
    Avalanche's), or a fresh random batch each time."""
    while True:
        if cycled:
            order = torch.randperm(slots, generator=generator)
            for start in range(0, slots - BATCH + 1, BATCH):
                yield order[start : start + BATCH]
        else:
            yield torch.randperm(slots, generator=generator)[:BATCH]


def _balanced(targets: torch.Tensor, old: int, generator: torch.Generator) -> torch.Tensor:
    """Rows kept by a class-balanced memory of ``SLOTS``: ``SLOTS // classes`` per class, the
    first of the ``old`` rows already kept, a random choice among a new class's rows."""
    classes = targets.unique()
    per_class = SLOTS // len(classes)
    kept = []
    for label in classes:
        rows = (targets == label).nonzero().flatten()
        if not bool((rows < old).any()):
            rows = rows[torch.randperm(len(rows), generator=generator)]
        kept.append(rows[:per_class])
    return torch.cat(kept)


def bare(seed: int, epochs: int, lr: float, cycled: bool = True, two_draws: bool = False) -> float:
    """Avalanche's DER written out (see the module docstring); the final average accuracy."""
    tasks = split_digits(seed=seed).tasks()
    torch.manual_seed(seed)
    model = mlp(64, [256], 10)
    generator = torch.Generator().manual_seed(seed)
    memory: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    matrix = evaluation.AccuracyMatrix()
    for task in tasks:
        inputs, targets = task.train.tensors[:2]
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        draws = None if memory is None else _memory_batches(len(memory[1]), cycled, generator)
        for _ in range(epochs):
            order = torch.randperm(len(targets))
            for start in range(0, len(targets), BATCH):
                rows = order[start : start + BATCH]
                x, y = inputs[rows], targets[rows]
                if draws is None or memory is None:
                    loss = F.cross_entropy(model(x), y)
                else:
                    slots = next(draws)
                    mx, my, ml = (t[slots] for t in memory)
                    out = model(torch.cat([mx, x]))
                    if two_draws:
                        slots = next(draws)
                        replayed = F.cross_entropy(model(memory[0][slots]), memory[1][slots])
                    else:
                        replayed = F.cross_entropy(out[:BATCH], my)
                    loss = F.cross_entropy(out[BATCH:], y)
                    loss = loss + ALPHA * F.mse_loss(out[:BATCH], ml) + BETA * replayed
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        model.eval()
        with torch.no_grad():
            logits = model(inputs)
        model.train()
        stored = (inputs, targets, logits)
        if memory is not None:
            stored = tuple(torch.cat([m, s]) for m, s in zip(memory, stored))
        kept = _balanced(stored[1], 0 if memory is None else len(memory[1]), generator)
        memory = tuple(t[kept] for t in stored)
        matrix.append(evaluation.evaluate(model, tasks, mode="class-incremental"))
    return evaluation.average_accuracy(matrix)


def _two_draws() -> dict[str, WeightedMeanSquaredErrorLossComponent]:
    return {"mse_loss": WeightedMeanSquaredErrorLossComponent(ALPHA, sample_new_memory_batch=True)}


VARIANTS: dict[str, Callable[[int, int, float], float]] = {
    "Avalanche's DER, bare": lambda s, e, lr: bare(s, e, lr),
    "bare, random memory batches": lambda s, e, lr: bare(s, e, lr, cycled=False),
    "bare, random, two draws": lambda s, e, lr: bare(s, e, lr, cycled=False, two_draws=True),
    "DER++ here, averaged (default)": lambda s, e, lr: library(s, e, lr),
    "DER++ here, summed": lambda s, e, lr: library(s, e, lr, loss_normalization=False),
    "DER++ here, summed, two draws": lambda s, e, lr: library(
        s, e, lr, loss_normalization=False, components=_two_draws()
    ),
    "DER++ here, summed, two passes": lambda s, e, lr: library(
        s, e, lr, loss_normalization=False, memory_forward="separate"
    ),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(20)))
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"Split-Digits, class-IL, {len(args.seeds)} seeds, {args.epochs} epochs/task, SGD lr "
        f"{args.lr}, batch {BATCH} + memory {BATCH}, {SLOTS} slots; mean ± std"
    )
    for name in args.variants:
        start = time.perf_counter()
        results = [VARIANTS[name](seed, args.epochs, args.lr) for seed in args.seeds]
        mean = sum(results) / len(results)
        std = math.sqrt(sum((r - mean) ** 2 for r in results) / max(len(results) - 1, 1))
        seconds = (time.perf_counter() - start) / len(results)
        print(f"{name:32s} {mean:.3f} ± {std:.3f}  {seconds:5.1f} s/run", flush=True)


if __name__ == "__main__":
    main()
