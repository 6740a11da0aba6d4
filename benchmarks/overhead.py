"""Per-step overhead of ``trainer.Trainer`` against a bare hand-written PyTorch loop.

Times, interleaved round by round in one process and single-threaded, the median microseconds per
training step of:

* ``bare``: ``for x, y in loader: zero_grad; loss = f(model(x), y); backward; step``;
* ``trainer+0``: ``Trainer.fit`` with the same step function and no listener;
* ``trainer+10``: the same with 10 no-op listeners subscribed to every event;
* ``fast+10``: the same with batches made by :class:`trainer.TensorLoader` (indexing the
  in-memory tensors) instead of the DataLoader;

on (a) a tiny model (linear 32 -> 4, batch 32), where loop overhead dominates, and (b) an MLP
784-256-256-10 at batch 128. Every variant reads batches from the same kind of DataLoader over an
in-memory TensorDataset. Ratios are against ``bare`` measured in the same run.

Usage: python benchmarks/overhead.py [--rounds 15] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer import EVENTS, TensorLoader, Trainer


def _noop_listener_class():
    def hook(self):
        return None

    methods = {f"on_{name}": hook for name in EVENTS if name != "exception"}
    return type("NoOp", (), methods)


NoOp = _noop_listener_class()


def make_case(name, model, features, classes, batch, steps):
    torch.manual_seed(0)
    data = TensorDataset(
        torch.randn(batch * steps, features), torch.randint(0, classes, (batch * steps,))
    )
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.functional.cross_entropy

    def step(batch):
        x, y = batch
        return loss_fn(model(x), y)

    def bare():
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()

    trainers = {}
    for listeners in (0, 10):
        trainer = Trainer(max_epochs=1, device="cpu")
        for _ in range(listeners):
            trainer.subscribe(NoOp())
        trainers[listeners] = trainer

    def with_trainer(listeners):
        def run():
            trainers[listeners].fit(model, optimizer, loader, step)

        return run

    fast = TensorLoader(data.tensors, batch_size=batch, shuffle=True)

    def fast_path():
        trainers[10].fit(model, optimizer, fast, step)

    variants = {
        "bare": bare,
        "trainer+0": with_trainer(0),
        "trainer+10": with_trainer(10),
        "fast+10": fast_path,
    }
    return name, variants, steps


def measure(variants, steps, rounds):
    for run in variants.values():  # warm-up
        run()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / steps * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(784, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    cases = [
        make_case("tiny (32->4, batch 32)", torch.nn.Linear(32, 4), 32, 4, 32, args.steps),
        make_case("MLP 784-256-256-10, batch 128", mlp, 784, 10, 128, args.steps),
    ]
    print(
        f"torch {torch.__version__}, 1 thread, {args.rounds} interleaved rounds of "
        f"{args.steps} steps; median us/step (ratio to bare)"
    )
    names = ("trainer+0", "trainer+10", "fast+10")
    print(f"{'case':32s} {'bare':>10s} " + " ".join(f"{n:>18s}" for n in names))
    for name, variants, steps in cases:
        medians = measure(variants, steps, args.rounds)
        base = medians["bare"]
        cells = [f"{medians['bare']:10.1f}"] + [
            f"{medians[v]:9.1f} ({medians[v] / base:4.2f}x)" for v in names
        ]
        print(f"{name:32s} " + " ".join(cells))


if __name__ == "__main__":
    main()
