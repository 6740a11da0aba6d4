"""Replay benchmark: buffer cost against buffer size, and the ER step against fine-tuning.

Runs, single-threaded and in one process:

(a)+(b) ``benchmarks/replay_buffers.py``: reservoir ``update`` + ``sample`` per step for 200 to
        500 000 slots, against a baseline that builds a DataLoader iterator over the buffer every
        step (Renate's way);
(c)     the median step time of ``ExperienceReplayLearner`` over that of ``FineTuningLearner``
        (same model, batch 32 of new data, memory batch 32, memory 2 000 slots), and over a bare
        hand-written replay loop (sample a memory batch from tensors, forward both, one
        backward), all interleaved round by round.

Usage: python benchmarks/replay.py [--skip-buffers] [--rounds 9] [--steps 100]
"""

from __future__ import annotations

import argparse
import pathlib
import runpy
import statistics
import time

import torch
from torch.utils.data import TensorDataset

from renate_events.learners import ExperienceReplayLearner, FineTuningLearner
from trainer import Trainer

HERE = pathlib.Path(__file__).resolve().parent


def _mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(784, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


def learner_steps(rounds: int, steps: int) -> dict[str, float]:
    batch = 32
    data = TensorDataset(torch.randn(batch * steps, 784), torch.randint(0, 10, (batch * steps,)))
    warm = TensorDataset(torch.randn(2000, 784), torch.randint(0, 10, (2000,)))

    def make(cls, **kwargs):
        learner = cls(
            model=_mlp(), batch_size=batch, trainer=Trainer(max_epochs=1, device="cpu"), **kwargs
        )
        learner.fit(warm)  # fills the memory (and warms up)
        return lambda: learner.fit(data)

    fine_tuning = make(FineTuningLearner)
    replay = make(ExperienceReplayLearner, memory_size=2000, memory_batch_size=batch)

    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
    memory_x, memory_y = torch.randn(2000, 784), torch.randint(0, 10, (2000,))
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True)
    loss_fn = torch.nn.functional.cross_entropy

    def bare_replay():
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            idx = torch.randperm(2000)[:batch]
            loss = loss_fn(model(x), y) + loss_fn(model(memory_x[idx]), memory_y[idx])
            (loss / 2).backward()
            optimizer.step()

    variants = {"fine-tuning": fine_tuning, "ER": replay, "bare replay": bare_replay}
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / steps * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-buffers", action="store_true", help="only run part (c)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not args.skip_buffers:
        runpy.run_path(str(HERE / "replay_buffers.py"), run_name="__main__")
        print()
    medians = learner_steps(args.rounds, args.steps)
    base = medians["fine-tuning"]
    print(
        "(c) learner step, MLP 784-256-256-10, batch 32 + memory batch 32, 1 thread; "
        f"median of {args.rounds} rounds x {args.steps} steps"
    )
    for name, value in medians.items():
        print(
            f"  {name:12s} {value:8.1f} us/step  {value / base:5.2f}x fine-tuning  "
            f"{value / medians['bare replay']:5.2f}x bare replay"
        )


if __name__ == "__main__":
    main()
