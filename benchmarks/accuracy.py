"""Final accuracy and forgetting of every method on Split-Digits, mean ± std over seeds.

Runs fine-tuning, ER, DER, DER++, POD-ER, CLS-ER, Super-ER, EWC (Renate's lambda and a larger
one, separate and online), LwF, Offline-ER, DER++ filling a class-balanced buffer at the end of
each update (with the terms averaged, and summed as Avalanche's DER does), X-DER (its own
class-balanced buffer), repeated distillation, GDumb, iCaRL (evaluated with its
nearest-mean-of-exemplars classifier on the hidden layer's features) and Joint with the command
line's defaults (MLP 64-256-10, Adam 1e-3, 10 epochs per task, batch 32, memory batch 32,
reservoir of 200; EWC and LwF keep no memory) on Split-Digits (class-incremental, five two-class
tasks) and prints average accuracy (class- and task-incremental), forgetting and wall time per
run. Every method of the registry (``renate_events.methods.METHODS``) has a row: those above
under their names, any other under its registry name with its defaults, its memory, features and
classifier as its spec declares them (but those whose spec needs a Vision Transformer, measured
by ``benchmarks/prompt_step.py``).

Usage: python benchmarks/accuracy.py [--seeds 0 1 2 3 4] [--epochs 10] [--methods EWC LwF ...]

``--online``: the online-stream rows instead (:data:`ONLINE`): ER and ER-ACE in a single pass
(each sample seen once), batches of 10 new and 10 memory samples, SGD 0.1, reservoir of 200, on
Split-Digits with sharp and with blurry (Blurry-10) boundaries; final class-IL accuracy,
forgetting and the anytime accuracy (the mean of the accuracy on the tasks seen so far, every 10
steps).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from renate_events import evaluation
from renate_events.choices import BUFFERS
from renate_events.cli._zoo import mlp
from renate_events.methods import LEARNERS
from renate_events.methods import METHODS as SPECS
from renate_events.scenarios import split_digits
from trainer import Trainer

METHODS = {
    "fine-tuning": ("fine-tuning", {}),
    "ER": ("er", {}),
    "DER": ("der", {"beta": 0.0}),
    "DER++": ("der", {}),
    "POD-ER": ("pod-er", {"feature_modules": ["1"]}),
    "CLS-ER": ("cls-er", {}),
    "Super-ER": ("super-er", {"feature_modules": ["1"]}),
    "EWC": ("ewc", {}),
    "EWC (lambda=1000)": ("ewc", {"ewc_lambda": 1000.0}),
    "online EWC": ("ewc", {"ewc_mode": "online", "decay_factor": 0.9, "ewc_lambda": 1000.0}),
    "LwF": ("lwf", {}),
    "Offline-ER": ("offline-er", {}),
    "DER++ (end, balanced)": (
        "der",
        {"buffer_filling": "end", "buffer": "greedy-class-balancing"},
    ),
    "DER++ (end, balanced, summed)": (
        "der",
        {"buffer_filling": "end", "buffer": "greedy-class-balancing", "loss_normalization": False},
    ),
    "X-DER": ("xder", {}),
    "Repeated distillation": ("repeated-distill", {}),
    "GDumb": ("gdumb", {}),
    "iCaRL": ("icarl", {"feature_modules": ["1"]}),
    "Joint": ("joint", {}),
}
# A row for every other registered method that trains any model (a new method module shows up
# here unchanged); those that prompt a ViT are measured by benchmarks/prompt_step.py.
_COVERED = {name for name, _ in METHODS.values()}
METHODS.update(
    {name: (name, {}) for name in LEARNERS if name not in _COVERED and SPECS[name].model == "any"}
)


def run(method: str, seed: int, epochs: int) -> dict[str, float]:
    name, extra = METHODS[method]
    tasks = split_digits(seed=seed).tasks()
    torch.manual_seed(seed)
    model = mlp(64, [256], 10)
    spec = SPECS[name]
    kwargs = {"memory_batch_size": 32, "batch_size": 32, "seed": seed, **extra}
    if spec.uses_memory:
        kwargs["memory_size"] = 200
    if spec.features != "none":
        kwargs.setdefault("feature_modules", ["1"])  # the hidden layer's output
    if "buffer" in kwargs:  # a buffer by its command-line name, of the memory's size
        kwargs["buffer"] = BUFFERS[kwargs["buffer"]](max_size=200, seed=seed)
    learner = LEARNERS[name](
        model=model,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        trainer=Trainer(max_epochs=epochs, device="cpu"),
        **kwargs,
    )
    class_matrix, task_matrix = evaluation.AccuracyMatrix(), evaluation.AccuracyMatrix()
    start = time.perf_counter()
    for task in tasks:
        learner.fit(task.train)
        evaluated = learner.nme_classifier() if spec.classifier == "nme" else model
        class_matrix.append(evaluation.evaluate(evaluated, tasks, mode="class-incremental"))
        task_matrix.append(evaluation.evaluate(evaluated, tasks, mode="task-incremental"))
    return {
        "class-IL accuracy": evaluation.average_accuracy(class_matrix),
        "task-IL accuracy": evaluation.average_accuracy(task_matrix),
        "forgetting": evaluation.forgetting(class_matrix),
        "seconds": time.perf_counter() - start,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--online", action="store_true", help="the online-stream rows instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.online:
        return main_online(args.seeds)
    print(
        f"Split-Digits, class-incremental, {len(args.seeds)} seeds, {args.epochs} epochs/task, "
        "1 thread; mean ± std"
    )
    width = max(18, *map(len, args.methods))
    header = f"{'method':{width}s} {'class-IL acc':>15s} {'task-IL acc':>15s} {'forgetting':>15s} "
    print(header + f"{'s/run':>7s}")
    for method in args.methods:
        results = [run(method, seed, args.epochs) for seed in args.seeds]
        cells = []
        for key in ("class-IL accuracy", "task-IL accuracy", "forgetting"):
            values = [r[key] for r in results]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1))
            cells.append(f"{mean:7.3f} ± {std:.3f}")
        seconds = sum(r["seconds"] for r in results) / len(results)
        print(f"{method:{width}s} " + " ".join(f"{c:>15s}" for c in cells) + f" {seconds:7.1f}")


# -- online streams (issue 27): a single pass, anytime accuracy ----------------------------------

ONLINE = {  # row: (method, blurry fraction)
    "online ER": ("er", 0.0),
    "online ER-ACE": ("er-ace", 0.0),
    "online ER, Blurry-10": ("er", 0.1),
    "online ER-ACE, Blurry-10": ("er-ace", 0.1),
}


def run_online(row: str, seed: int) -> dict[str, float]:
    from renate_events.anytime import AnytimeAccuracy

    name, blurry = ONLINE[row]
    tasks = split_digits(seed=seed, blurry=blurry).tasks()
    torch.manual_seed(seed)
    model = mlp(64, [256], 10)
    learner = LEARNERS[name](
        model=model,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        trainer=Trainer(max_epochs=1, device="cpu"),
        memory_size=200,
        memory_batch_size=10,
        batch_size=10,
        seed=seed,
    )
    anytime = AnytimeAccuracy(tasks, every=10)
    learner.trainer.subscribe(anytime)
    matrix = evaluation.AccuracyMatrix()
    start = time.perf_counter()
    for index, task in enumerate(tasks):
        anytime.reach(index)
        learner.fit(task.train)
        matrix.append(evaluation.evaluate(model, tasks, mode="class-incremental"))
    anytime.finish(model)
    return {
        "class-IL accuracy": evaluation.average_accuracy(matrix),
        "forgetting": evaluation.forgetting(matrix),
        "anytime accuracy": anytime.area(),
        "seconds": time.perf_counter() - start,
    }


def main_online(seeds) -> None:
    print(f"Split-Digits online (one pass, batch 10), {len(seeds)} seeds, 1 thread; mean ± std")
    width = max(map(len, ONLINE))
    keys = ("class-IL accuracy", "forgetting", "anytime accuracy")
    print(f"{'row':{width}s} " + " ".join(f"{k:>17s}" for k in keys) + f" {'s/run':>7s}")
    for row in ONLINE:
        results = [run_online(row, seed) for seed in seeds]
        cells = []
        for key in keys:
            values = [r[key] for r in results]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1))
            cells.append(f"{mean:7.3f} ± {std:.3f}")
        seconds = sum(r["seconds"] for r in results) / len(results)
        print(f"{row:{width}s} " + " ".join(f"{c:>17s}" for c in cells) + f" {seconds:7.1f}")


if __name__ == "__main__":
    main()
