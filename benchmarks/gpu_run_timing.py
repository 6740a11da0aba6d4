"""GPU check, run timing: where the time of ``renate-events run`` goes.

Writes random images in the CIFAR-10 binary format (what :func:`renate_events.datasets.
load_cifar10` reads: ``data_batch_1..5.bin`` and ``test_batch.bin``, records of one label byte
and 3 072 image bytes) to a temporary folder, then runs, in a fresh Python process so that
start-up counts::

    renate-events run --scenario seq-cifar10 --data-dir DIR --epochs 1 --device cuda
        --output-dir TMP --no-progress [--tf32 --channels-last ... (--run-args)]

The child process times its phases (``Trainer.fit`` and its validation, ``evaluate`` of the
untrained model and ``evaluate_row`` after each update, the heatmap) with
``torch.cuda.synchronize()`` at each boundary and the parent prints the shares of the whole wall
time: interpreter start, imports of ``renate_events.cli``, building (the options, the data, the
scenario, model and updater, and the first update's checks, until the first fit or evaluation
starts), training steps, validation, evaluation, the heatmap (matplotlib, whose first use in a fresh
environment builds its font cache) and the rest (the later updates' checks and undo snapshots, the
state folders, the result files). Target on a GPU: evaluation and start-up (interpreter, imports,
building) under 15% of the run.

``--cpu-dry-run`` runs a tiny data set (8 training and 2 test images per class, a ResNet-18 of
width 4) on the CPU, in one thread, in well under a minute; its shares mean nothing.

``gpu_check.py`` calls :func:`section`; run alone:
``python benchmarks/gpu_run_timing.py [--per-class 5000] [--test-per-class 1000]
[--run-args "--tf32"] [--cpu-dry-run]`` (a CPU run with ``--per-class 100 --test-per-class 200``
gives shares worth comparing between two versions of the library on one machine).
This module imports nothing heavy at its top: the child starts its clock before it imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

TARGET = 0.15
"""Evaluation and start-up together, as a share of the run's wall time, on a GPU."""
DRY_RUN = {"per_class": 8, "test_per_class": 2, "run_args": ["--model-args", "{nf = 4}"]}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the data -------------------------------------------------------------------------------------


def write_cifar10(folder: str, per_class: int, test_per_class: int) -> str:
    """Random CIFAR-10 binary files under ``folder/cifar-10-batches-bin``; returns ``folder``."""
    import numpy as np

    target = os.path.join(folder, "cifar-10-batches-bin")
    os.makedirs(target, exist_ok=True)
    generator = np.random.default_rng(0)
    parts = [(f"data_batch_{i}.bin", per_class * 2) for i in range(1, 6)]  # 10 classes / 5 files
    for name, count in [*parts, ("test_batch.bin", test_per_class * 10)]:
        records = generator.integers(0, 256, size=(count, 3073), dtype=np.uint8)
        records[:, 0] = np.arange(count) % 10  # the label byte, every class alike
        with open(os.path.join(target, name), "wb") as handle:
            handle.write(records.tobytes())
    return folder


# -- the child: one run, timed from the inside ----------------------------------------------------


def _timed(spans: dict[str, float], name: str, function: Callable[..., Any], sync: Any) -> Any:
    """``function``, adding its wall time (between two device syncs) to ``spans[name]``; a call
    made while a fit runs (``--online``'s anytime evaluations) is also added to
    ``spans[name + " in fit"]``, so that the fit's share can leave it out."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sync()
        start = time.perf_counter()
        spans.setdefault("first " + name, start)
        inside = spans.get("fitting", 0.0) > 0
        if name == "fit":
            spans["fitting"] = 1.0
        try:
            return function(*args, **kwargs)
        finally:
            sync()
            took = time.perf_counter() - start
            spans[name] = spans.get(name, 0.0) + took
            if name == "fit":
                spans["fitting"] = 0.0
            elif inside:
                spans[name + " in fit"] = spans.get(name + " in fit", 0.0) + took

    return wrapper


def child(out: str, cli_args: list[str]) -> int:
    """Run the command line in this process with its phases timed; write them to ``out``."""
    started = time.perf_counter()
    import renate_events.cli as cli  # torch and the library: the imports

    imported = time.perf_counter()
    import torch

    from renate_events import evaluation
    from renate_events.cli import _results
    from trainer import Trainer

    def sync() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    spans: dict[str, float] = {}
    Trainer.fit = _timed(spans, "fit", Trainer.fit, sync)  # type: ignore[method-assign]
    Trainer._validate = _timed(spans, "validation", Trainer._validate, sync)  # type: ignore
    evaluation.evaluate = _timed(spans, "evaluation", evaluation.evaluate, sync)
    evaluation.evaluate_row = _timed(spans, "evaluation", evaluation.evaluate_row, sync)
    _results.heatmap = _timed(spans, "heatmap", _results.heatmap, sync)
    code = cli.main(cli_args)
    ended = time.perf_counter()
    record = {
        "code": code,
        "child": ended - started,
        "imports": imported - started,
        # until the first fit or evaluation (run evaluates the untrained model first)
        "building": min(spans.get("first fit", ended), spans.get("first evaluation", ended))
        - imported,
        "fit": spans.get("fit", 0.0),
        "validation": spans.get("validation", 0.0),
        "evaluation in fit": spans.get("evaluation in fit", 0.0),  # --online's anytime ones
        "evaluation": spans.get("evaluation", 0.0),
        "heatmap": spans.get("heatmap", 0.0),
    }
    with open(out, "w") as handle:
        json.dump(record, handle)
    return code


# -- the parent: the data, the process, the table -------------------------------------------------


def shares(record: dict[str, float], wall: float) -> dict[str, float]:
    """Seconds of each phase of a run whose process took ``wall`` seconds."""
    phases = {
        "interpreter start": wall - record["child"],
        "imports (renate_events.cli)": record["imports"],
        "building (until the first fit or evaluation)": record["building"],
        "training steps (Trainer.fit)": record["fit"]
        - record["validation"]
        - record.get("evaluation in fit", 0.0),
        "validation (in fit)": record["validation"],
        "evaluation (evaluate, evaluate_row)": record["evaluation"],
        "heatmap (matplotlib)": record["heatmap"],
    }
    phases["rest (checks, snapshots, state folders, files)"] = wall - sum(phases.values())
    return phases


def time_run(data_dir: str, device: str, run_args: list[str]) -> tuple[float, dict[str, float]]:
    """One ``renate-events run`` in a fresh process: its wall time and the child's record."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "timing.json")
        argv = ["run", "--scenario", "seq-cifar10", "--data-dir", data_dir, "--epochs", "1"]
        argv += ["--device", device, "--output-dir", os.path.join(scratch, "run")]
        argv += ["--no-progress", *run_args]
        command = [sys.executable, os.path.abspath(__file__), "--child", out, "--", *argv]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
        }
        if device == "cpu":  # a dry run: one thread, as a shared CPU runs tiny convolutions best
            env["OMP_NUM_THREADS"] = "1"
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        wall = time.perf_counter() - started
        if result.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"the timed run failed ({result.returncode}): {shlex.join(argv)}\n"
                f"{result.stdout[-2000:]}{result.stderr[-3000:]}"
            )
        with open(out) as handle:
            return wall, json.load(handle)


def print_shares(title: str, wall: float, phases: dict[str, float], gpu: bool) -> None:
    print(f"\n{title}\n  total wall time {wall:.1f} s")
    width = max(len(name) for name in phases)
    for name, seconds in phases.items():
        print(f"  {name:{width}s}  {seconds:7.1f} s  {seconds / wall:6.1%}")
    start = sum(v for k, v in phases.items() if k.startswith(("interpreter", "imports", "build")))
    overhead = (start + phases["evaluation (evaluate, evaluate_row)"]) / wall
    verdict = ("meets" if overhead < TARGET else "MISSES") if gpu else "not a GPU: no verdict"
    print(
        f"  evaluation + start-up: {overhead:.1%} of the run (target on a GPU: < {TARGET:.0%}; "
        f"{verdict})"
    )


def section(
    device: Any,
    per_class: int | None = None,
    run_args: list[str] | None = None,
    test_per_class: int | None = None,
) -> None:
    """Generate the data, time one run on ``device`` (a ``torch.device`` or a name), print."""
    kind = getattr(device, "type", str(device))
    dry = kind != "cuda"
    per_class = per_class or (DRY_RUN["per_class"] if dry else 5000)
    test_per_class = test_per_class or (DRY_RUN["test_per_class"] if dry else 1000)
    run_args = list(run_args or (DRY_RUN["run_args"] if dry else []))
    with tempfile.TemporaryDirectory() as folder:
        write_cifar10(folder, per_class, test_per_class)
        wall, record = time_run(folder, kind, run_args)
    title = (
        f"(6) run timing: renate-events run --scenario seq-cifar10 --epochs 1 --device {kind} "
        f"{shlex.join(run_args)} on generated CIFAR-10 files ({per_class * 10} training, "
        f"{test_per_class * 10} test images), in a fresh process"
    )
    print_shares(title, wall, shares(record, wall), gpu=not dry)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # the timed process: --child OUT -- <command line>
        return child(argv[1], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-class", type=int, help="training images per class (5000)")
    parser.add_argument("--test-per-class", type=int, help="test images per class (1000)")
    parser.add_argument("--run-args", default="", help="more options of run, e.g. '--tf32'")
    parser.add_argument("--cpu-dry-run", action="store_true", help="without CUDA: tiny, on CPU")
    args = parser.parse_args(argv)
    import torch

    if torch.cuda.is_available():
        device = "cuda"
    elif args.cpu_dry_run:
        device = "cpu"
    else:
        print("no CUDA device; nothing to check")
        return 0
    run_args = shlex.split(args.run_args) or None
    if device == "cpu" and run_args is not None:
        run_args = [*DRY_RUN["run_args"], *run_args]
    section(device, args.per_class, run_args, args.test_per_class)
    return 0


if __name__ == "__main__":
    sys.exit(main())
