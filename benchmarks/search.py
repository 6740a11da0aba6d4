"""Hyperparameter search per update on Split-Digits, through the command line, against the
command line's defaults.

Three ways to run the five updates of Split-Digits (DER++, reservoir of 200, 10 epochs; a
fifth of every task's training data is its validation data, kept across updates in the
validation memory):

* ``defaults``: ``renate-events update`` with the defaults (``alpha = beta = 1``, Adam 1e-3);
* ``search, median pruner``: ``update --search N`` per update over ``alpha``, ``beta`` (0.05 to
  1, log) and ``lr`` (1e-4 to 1e-2, log), selecting by ``val_accuracy``;
* ``search, no pruner``: the same with ``--search-pruner none``.

After the last update, the class-incremental average accuracy on the five test sets
(``renate-events evaluate``), and the training steps of all trials of all updates. Reported as
mean ± standard deviation over ``--seeds``.

Run: ``python benchmarks/search.py`` (a few minutes single-threaded; ``--trials`` and
``--seeds`` to change it). It prints the table and writes it to ``docs/benchmarks/search.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import pathlib
import re
import statistics
import tempfile
import time

import torch
from _report import command_line, page_header, write_page

from renate_events.cli import main as cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASKS = 5

CONFIG = '''
"""Split-Digits as a config file: chunk t is task t, a fifth of its training data validates."""
import functools

import torch
from torch.utils.data import TensorDataset

from renate_events.scenarios import split_digits


@functools.cache
def _tasks(seed):
    return list(split_digits(seed=seed).tasks())


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def data_fn(chunk_id, seed):
    inputs, targets = _tasks(seed)[chunk_id].train.tensors
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(seed + chunk_id))
    held = order[: len(order) // 5]
    kept = order[len(order) // 5 :]
    return TensorDataset(inputs[kept], targets[kept]), TensorDataset(inputs[held], targets[held])


def test_data_fn(chunk_id, seed):
    return _tasks(seed)[chunk_id].test
'''

SPACE = """
alpha = {low = 0.05, high = 1.0, log = true}
beta = {low = 0.05, high = 1.0, log = true}
lr = {low = 1e-4, high = 1e-2, log = true}
"""


def _quiet(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli(args)
    if status != 0:
        raise RuntimeError(f"renate-events {' '.join(args)} exited with {status}")
    return out.getvalue()


def _run(folder: pathlib.Path, seed: int, trials: int | None, pruner: str) -> tuple[float, int]:
    """Five updates; the final average accuracy and the training steps of every trial."""
    config, space = folder / "split_digits.py", folder / "space.toml"
    config.write_text(CONFIG)
    space.write_text(SPACE)
    steps, state = 0, None
    for chunk in range(TASKS):
        out = folder / f"state-{chunk}"
        args = ["update", "--config-file", str(config), "--output-state", str(out)]
        args += ["--chunk-id", str(chunk), "--seed", str(seed), "--no-progress", "--device", "cpu"]
        if state is not None:
            args += ["--input-state", str(state)]
        if trials is not None:
            args += ["--config", str(space), "--search", str(trials), "--metric", "val_accuracy"]
            args += ["--search-pruner", pruner]
        printed = _quiet(args)
        if trials is None:
            steps += int(re.search(r"trained (\d+) steps", printed).group(1))
        else:
            rows = csv.DictReader(io.StringIO((out / "search.csv").read_text()))
            steps += sum(int(row["steps"] or 0) for row in rows)
        state = out
    args = ["evaluate", "--config-file", str(config), "--state", str(state), "--seed", str(seed)]
    args += ["--chunk-ids", *map(str, range(TASKS))]
    accuracy = float(re.search(r"average accuracy ([0-9.]+)", _quiet(args)).group(1))
    return accuracy, steps


def _mean_std(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--markdown", type=pathlib.Path, default=ROOT / "docs" / "benchmarks" / "search.md"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    arms = {
        "defaults": (None, "median"),
        f"search, {args.trials} trials, median pruner": (args.trials, "median"),
        f"search, {args.trials} trials, no pruner": (args.trials, "none"),
    }
    lines = [
        "| run | average accuracy after 5 updates | training steps (all trials) | seconds |",
        "|---|---|---|---|",
    ]
    for name, (trials, pruner) in arms.items():
        accuracies, steps, seconds = [], [], []
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as folder:
                started = time.perf_counter()
                accuracy, count = _run(pathlib.Path(folder), seed, trials, pruner)
                seconds.append(time.perf_counter() - started)
            accuracies.append(accuracy)
            steps.append(float(count))
        lines.append(
            f"| {name} | {_mean_std(accuracies)} | {statistics.mean(steps):.0f} | "
            f"{statistics.mean(seconds):.1f} |"
        )
        print(lines[-1], flush=True)
    setting = (
        f"Split-Digits, DER++ (reservoir 200, 10 epochs, batch 32), seeds {args.seeds}, one CPU "
        "thread; accuracy is class-incremental on the five test sets"
    )
    page = [
        "# Hyperparameter search per update",
        "",
        *page_header(command_line("search.py"), setting),
    ]
    write_page(args.markdown, [*page, *lines, ""])


if __name__ == "__main__":
    main()
