"""Calibration, power and cost of the shift detectors in ``renate_events.shift``.

* Calibration: over ``--trials`` pairs of samples from one distribution (standard normal, 8
  features, 100 samples a side), the fraction the test rejects at level 0.05, with the 99%
  binomial interval around 0.05 it should fall in.
* Power: the rejection rate against the size of a shift, for a mean shift of every feature and
  for a class-proportion shift (a two-component mixture whose second component's weight moves
  from 0.5), both tests, 100 samples a side.
* Cost: seconds per test against the sample size, the baseline being one KS test on 100 samples
  measured in the same run (MMD's cost grows quadratically; ``max_samples`` caps it).

Run: ``python benchmarks/shift_detection.py`` (about a minute single-threaded; ``--trials`` to
change it). It prints the tables and writes them to ``docs/benchmarks/shift_detection.md``, and
with matplotlib the power curves to ``docs/benchmarks/shift_power.png``.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import time

import torch
from _report import command_line, page_header, write_page

from renate_events.shift import ks_test, mmd_test

ROOT = pathlib.Path(__file__).resolve().parents[1]
FEATURES, SAMPLES, LEVEL = 8, 100, 0.05


def _normal(n: int, generator: torch.Generator, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(n, FEATURES, generator=generator) + shift


def _mixture(n: int, generator: torch.Generator, weight: float) -> torch.Tensor:
    """Two classes, at -1 and +1 on every feature; ``weight`` of the samples are of the second."""
    second = torch.rand(n, generator=generator) < weight
    centres = torch.where(second, 1.0, -1.0).unsqueeze(1)
    return torch.randn(n, FEATURES, generator=generator) + centres


def _tests(permutations: int) -> dict:
    return {
        "ks": lambda x, y, seed: ks_test(x, y, level=LEVEL),
        "mmd": lambda x, y, seed: mmd_test(
            x, y, num_permutations=permutations, seed=seed, level=LEVEL
        ),
    }


def _rate(test, make_pair, trials: int) -> float:
    rejected = 0
    for trial in range(trials):
        x, y = make_pair(trial)
        rejected += test(x, y, trial).shift
    return rejected / trials


def calibration(trials: int, permutations: int) -> list[str]:
    spread = 2.58 * math.sqrt(LEVEL * (1 - LEVEL) / trials)
    lines = [
        f"| test | rejection rate under no shift ({trials} trials) | 99% interval around 0.05 |",
        "|---|---|---|",
    ]
    for name, test in _tests(permutations).items():

        def pair(trial: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(trial)
            return _normal(SAMPLES, g), _normal(SAMPLES, g)

        rate = _rate(test, pair, trials)
        lines.append(f"| {name} | {rate:.3f} | [{LEVEL - spread:.3f}, {LEVEL + spread:.3f}] |")
    return lines


def _shifted_pair(kind: str, size: float, trial: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + trial)
    if kind == "mean shift":
        return _normal(SAMPLES, g), _normal(SAMPLES, g, size)
    return _mixture(SAMPLES, g, 0.5), _mixture(SAMPLES, g, size)


def power(trials: int, permutations: int) -> tuple[list[str], dict]:
    curves: dict = {}
    settings = {
        "mean shift": [0.0, 0.1, 0.2, 0.3, 0.5],
        "class-proportion shift": [0.5, 0.6, 0.7, 0.8, 0.9],
    }
    lines = ["| shift | size | ks | mmd |", "|---|---|---|---|"]
    for kind, sizes in settings.items():
        for size in sizes:
            row = []
            for name, test in _tests(permutations).items():
                rate = _rate(test, functools.partial(_shifted_pair, kind, size), trials)
                curves.setdefault((kind, name), []).append((size, rate))
                row.append(f"{rate:.2f}")
            lines.append(f"| {kind} | {size} | " + " | ".join(row) + " |")
    return lines, curves


def cost(permutations: int, largest: int) -> list[str]:
    def seconds(test, n: int) -> float:
        g = torch.Generator().manual_seed(n)
        x, y = _normal(n, g), _normal(n, g, 0.1)
        best = math.inf
        for _ in range(3):
            started = time.perf_counter()
            test(x, y, 0)
            best = min(best, time.perf_counter() - started)
        return best

    tests = _tests(permutations)
    baseline = seconds(tests["ks"], 100)
    lines = [
        f"| samples a side | ks (s) | mmd, {permutations} permutations (s) | "
        "mmd / baseline (KS on 100) |",
        "|---|---|---|---|",
    ]
    for n in (size for size in (100, 250, 500, 1000, 2000) if size <= largest):
        ks_s, mmd_s = seconds(tests["ks"], n), seconds(tests["mmd"], n)
        lines.append(f"| {n} | {ks_s:.4f} | {mmd_s:.3f} | {mmd_s / baseline:.0f}x |")
    return lines


def _plot(curves: dict, path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for axis, kind, label in zip(
        axes,
        ("mean shift", "class-proportion shift"),
        ("shift of every feature's mean", "weight of the second class"),
    ):
        for name in ("ks", "mmd"):
            sizes, rates = zip(*curves[(kind, name)])
            axis.plot(sizes, rates, marker="o", label=name)
        axis.axhline(LEVEL, color="grey", linestyle=":", label="level 0.05")
        axis.set_xlabel(label)
        axis.set_ylabel("rejection rate")
        axis.set_title(kind)
        axis.set_ylim(0, 1.02)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--permutations", type=int, default=200)
    parser.add_argument(
        "--largest", type=int, default=2000, help="the largest sample size of the cost table"
    )
    parser.add_argument(
        "--markdown", type=pathlib.Path, default=ROOT / "docs" / "benchmarks" / "shift_detection.md"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    calibration_lines = calibration(args.trials, args.permutations)
    power_lines, curves = power(max(20, args.trials // 2), args.permutations)
    cost_lines = cost(args.permutations, args.largest)
    picture = args.markdown.parent / "shift_power.png"
    plotted = _plot(curves, picture)
    setting = (
        f"{FEATURES} features, {SAMPLES} samples a side, level {LEVEL}, {args.permutations} MMD "
        "permutations, one CPU thread"
    )
    lines = ["# Shift detection", "", *page_header(command_line("shift_detection.py"), setting)]
    lines += ["## Calibration", "", *calibration_lines, "", "## Power", "", *power_lines, ""]
    if plotted:
        lines += [f"The power curves are drawn in `{picture.name}` beside this page.", ""]
    lines += ["## Cost", "", *cost_lines, ""]
    print("\n".join(lines))
    write_page(args.markdown, lines)


if __name__ == "__main__":
    main()
