"""The ``renate-events`` command: run a scenario, update a state folder, evaluate one.

Examples::

    renate-events run                                   # Split-Digits, DER++, buffer 200
    renate-events run --learner er --seeds 0 1 2 --output-dir runs/er
    renate-events run --config experiment.toml --epochs 5   # flags override the file
    renate-events update --input-state runs/er/state/seed-0 --data new.npz \\
        --output-state runs/er/next
    renate-events evaluate --state runs/er/next --scenario split-digits
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["main"]

_BUFFERS = ("reservoir", "sliding-window", "greedy-class-balancing")


class UsageError(Exception):
    """A bad argument or input file: reported in one line with exit code 2."""


# -- arguments ------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from renate_events.updater import LEARNERS

    parser = argparse.ArgumentParser(
        prog="renate-events",
        description="Continual learning with experience replay on the event-driven trainer.",
        epilog="examples:" + __doc__.split("Examples::", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from renate_events import __version__

    parser.add_argument("--version", action="version", version=f"renate-events {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,update,evaluate}")

    def training_options(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--learner",
            choices=sorted(LEARNERS),
            default="der",
            help="continual-learning method (default: der, i.e. DER++)",
        )
        p.add_argument(
            "--buffer",
            choices=_BUFFERS,
            default="reservoir",
            help="memory buffer type (default: reservoir)",
        )
        p.add_argument("--memory-size", type=int, default=200, help="buffer slots (default 200)")
        p.add_argument("--epochs", type=int, default=10, help="epochs per update (default 10)")
        p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
        p.add_argument("--batch-size", type=int, default=32, help="new-data batch (default 32)")
        p.add_argument(
            "--memory-batch-size", type=int, default=32, help="memory batch (default 32)"
        )
        p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda:0")
        p.add_argument(
            "--precision",
            choices=("32", "bf16-mixed", "16-mixed"),
            default="32",
            help="floating-point precision of training (default 32)",
        )
        p.add_argument("--no-progress", action="store_true", help="hide progress bars")

    run = sub.add_parser(
        "run",
        help="run a whole scenario, evaluating after each update",
        description="Run a scenario: one update per task, evaluation on every task after each.",
        epilog="examples:\n  renate-events run\n  renate-events run --learner er --seeds 0 1 2\n"
        "  renate-events run --config experiment.toml --epochs 5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--config", help="TOML file with any of these options (flags override it)")
    run.add_argument(
        "--scenario",
        default="split-digits",
        help="split-digits (default), permuted-digits or rotated-digits",
    )
    run.add_argument("--seeds", type=int, nargs="+", default=[0], help="one or several seeds")
    run.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[256],
        help="hidden layer sizes of the MLP (default 256)",
    )
    run.add_argument("--output-dir", default="runs/latest", help="where results are written")
    training_options(run)

    update = sub.add_parser(
        "update",
        help="one model update from a state folder and a data file",
        description="Load --input-state, train on --data, write --output-state.",
        epilog="example:\n  renate-events update --input-state runs/latest/state/seed-0 "
        "--data new.npz --output-state next-state",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    update.add_argument("--input-state", required=True, help="a state folder written by run/update")
    update.add_argument(
        "--data", required=True, help=".safetensors or .npz file with 'inputs' and 'targets'"
    )
    update.add_argument("--output-state", required=True, help="the state folder to write")
    update.add_argument("--task-id", default=None, help="a name for this update")
    update.add_argument("--epochs", type=int, default=None, help="override the folder's epochs")
    update.add_argument("--device", default=None, help="override the folder's device")
    update.add_argument("--no-progress", action="store_true", help="hide progress bars")

    evaluate = sub.add_parser(
        "evaluate",
        help="evaluate a state folder on a data file or a scenario",
        description="Print the accuracy of a state folder's model.",
        epilog="examples:\n  renate-events evaluate --state next-state --data test.npz\n"
        "  renate-events evaluate --state next-state --scenario split-digits",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("--state", required=True, help="a state folder")
    group = evaluate.add_mutually_exclusive_group(required=True)
    group.add_argument("--data", help=".safetensors or .npz file with 'inputs' and 'targets'")
    group.add_argument("--scenario", help="evaluate on every task's test set of this scenario")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of the scenario's split")
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "run" and args.config:
        config = _read_toml(args.config)
        run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
        known = {action.dest for action in run._actions}
        unknown = sorted(k for k in config if k.replace("-", "_") not in known)
        if unknown:
            raise UsageError(f"{args.config}: unknown options {unknown}; see renate-events run -h")
        run.set_defaults(**{k.replace("-", "_"): v for k, v in config.items()})
        args = parser.parse_args(argv)  # flags given on the command line win over the file
    return args


def _read_toml(path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError as exc:
            raise UsageError(
                "reading --config on Python 3.10 needs tomli: pip install tomli"
            ) from exc
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise UsageError(f"cannot read --config {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}") from exc


# -- shared pieces --------------------------------------------------------------------------------


def _mlp(inputs: int, hidden: Sequence[int], classes: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    width = inputs
    for size in hidden:
        layers += [torch.nn.Linear(width, size), torch.nn.ReLU()]
        width = size
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _progress(learner: Any, description: str, enabled: bool) -> None:
    """Show a progress bar for the learner's next update (tqdm is optional)."""
    if not enabled:
        return
    trainer = learner.trainer
    current = dict(trainer.listeners).get("progress")
    if current is None:
        try:
            from trainer.listeners import ProgressBar

            current = ProgressBar()
        except ImportError:
            return
        trainer.subscribe(current, name="progress")
    current.description = description


def _load_data_file(path: str) -> torch.utils.data.TensorDataset:
    if not os.path.isfile(path):
        raise UsageError(f"--data {path}: no such file")
    if path.endswith(".safetensors"):
        import safetensors.torch

        try:
            tensors = safetensors.torch.load_file(path)
        except Exception as exc:
            raise UsageError(f"--data {path} is not a readable safetensors file: {exc}") from exc
    elif path.endswith(".npz"):
        try:
            import numpy
        except ImportError as exc:
            raise UsageError(".npz files need numpy: pip install numpy") from exc
        try:
            with numpy.load(path, allow_pickle=False) as archive:
                tensors = {k: torch.from_numpy(archive[k]) for k in archive.files}
        except (OSError, ValueError) as exc:
            raise UsageError(f"--data {path} is not a readable .npz file: {exc}") from exc
    else:
        raise UsageError(f"--data {path}: expected a .safetensors or .npz file")
    missing = {"inputs", "targets"} - set(tensors)
    if missing:
        raise UsageError(f"--data {path} lacks {sorted(missing)}; it holds {sorted(tensors)}")
    inputs, targets = tensors["inputs"].float(), tensors["targets"].long()
    if len(inputs) != len(targets) or len(inputs) == 0:
        raise UsageError(
            f"--data {path}: inputs and targets must have the same non-zero length, got "
            f"{len(inputs)} and {len(targets)}"
        )
    return torch.utils.data.TensorDataset(inputs, targets)


def _updater_from_folder(folder: str, **overrides: Any) -> Any:
    from renate_events.updater import ModelUpdater, read_manifest

    manifest = read_manifest(folder)
    spec = manifest.get("metadata", {}).get("model")
    if not spec or spec.get("kind") != "mlp":
        raise UsageError(
            f"{folder} was not written by renate-events run/update (its manifest has no model "
            "description); load it from Python with ModelUpdater and your own model"
        )
    model = _mlp(spec["inputs"], spec["hidden"], spec["classes"])
    trainer_kwargs = dict(manifest["trainer"])
    trainer_kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return ModelUpdater(
        model,
        learner=manifest["learner"],
        learner_kwargs=manifest["learner_kwargs"],
        optimizer=manifest["optimizer"],
        buffer=manifest.get("buffer", "reservoir"),
        trainer_kwargs=trainer_kwargs,
        metadata=manifest.get("metadata", {}),
        input_state_folder=folder,
    )


# -- run ------------------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    from renate_events import evaluation
    from renate_events.scenarios import SCENARIOS
    from renate_events.updater import ModelUpdater

    _check_positive(
        epochs=args.epochs, memory_batch_size=args.memory_batch_size, batch_size=args.batch_size
    )
    if args.memory_size < 0:
        raise UsageError(f"--memory-size must be >= 0, got {args.memory_size}")
    if args.scenario not in SCENARIOS:
        raise UsageError(f"unknown --scenario {args.scenario!r}; choose from {sorted(SCENARIOS)}")
    # Under `torchrun --nproc_per_node=N`: data-parallel training over N processes; rank zero
    # prints and writes the results. State folders are not written (their staging folders are
    # per process), so `run` under torchrun keeps no state between invocations.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank_zero = int(os.environ.get("RANK", "0")) == 0
    os.makedirs(args.output_dir, exist_ok=True)
    runs = []
    started = time.perf_counter()
    for seed in args.seeds:
        tasks = list(SCENARIOS[args.scenario](seed=seed).tasks())
        inputs = tasks[0].train.tensors[0].shape[1]
        classes = 1 + max(max(task.classes) for task in tasks)
        torch.manual_seed(seed)
        model = _mlp(inputs, args.hidden, classes)
        learner_kwargs = {
            "memory_size": args.memory_size,
            "memory_batch_size": args.memory_batch_size,
            "batch_size": args.batch_size,
            "seed": seed,
        }
        if args.learner in ("fine-tuning", "joint"):
            learner_kwargs.pop("memory_size")
        if args.learner in ("pod-er", "super-er"):  # distil the outputs of the hidden layers
            learner_kwargs["feature_modules"] = [str(2 * i + 1) for i in range(len(args.hidden))]
        updater = ModelUpdater(
            model,
            learner=args.learner,
            learner_kwargs=learner_kwargs,
            optimizer={"name": "adam", "lr": args.lr},
            buffer=args.buffer,
            trainer_kwargs={
                "max_epochs": args.epochs,
                "device": args.device,
                "precision": args.precision,
                **({"distributed": "init"} if distributed else {}),
            },
            metadata={
                "model": {
                    "kind": "mlp",
                    "inputs": inputs,
                    "hidden": list(args.hidden),
                    "classes": classes,
                },
                "scenario": args.scenario,
            },
            output_state_folder=None
            if distributed
            else os.path.join(args.output_dir, "state", f"seed-{seed}"),
        )
        before = evaluation.evaluate(model, tasks, mode="class-incremental")
        class_matrix, task_matrix = evaluation.AccuracyMatrix(), evaluation.AccuracyMatrix()
        class_matrix.baseline = before
        for task in tasks:
            _progress(
                updater.learner_instance, f"seed {seed} task {task.task_id}", not args.no_progress
            )
            updater.update(task.train, task_id=task.task_id)
            class_matrix.append(evaluation.evaluate(model, tasks, mode="class-incremental"))
            task_matrix.append(evaluation.evaluate(model, tasks, mode="task-incremental"))
        runs.append(_metrics(seed, class_matrix, task_matrix, tasks))
    elapsed = time.perf_counter() - started
    if rank_zero:
        _write_results(args, runs, elapsed)
        print(_table(args, runs, elapsed))
    return 0


def _metrics(seed: int, class_matrix: Any, task_matrix: Any, tasks: Sequence[Any]) -> dict:
    from renate_events import evaluation

    sizes = [len(task.test) for task in tasks]
    return {
        "seed": seed,
        "class_incremental": class_matrix.to_dict(),
        "task_incremental": task_matrix.to_dict(),
        "metrics": {
            "average_accuracy": evaluation.average_accuracy(class_matrix),
            "micro_average_accuracy": evaluation.micro_average_accuracy(class_matrix, sizes),
            "task_incremental_average_accuracy": evaluation.average_accuracy(task_matrix),
            "forgetting": evaluation.forgetting(class_matrix),
            "backward_transfer": evaluation.backward_transfer(class_matrix),
            "forward_transfer": evaluation.forward_transfer(class_matrix, class_matrix.baseline),
        },
    }


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _table(args: argparse.Namespace, runs: Sequence[dict], elapsed: float) -> str:
    matrices = [run["class_incremental"]["rows"] for run in runs]
    size = len(matrices[0])
    lines = [
        f"{args.learner} on {args.scenario}, {len(runs)} seed(s), {elapsed:.1f} s",
        "accuracy matrix (class-incremental; row i: after update i, column j: task j; "
        "mean over seeds)",
        "          " + " ".join(f"{'task ' + str(j):>8s}" for j in range(size)),
    ]
    for i in range(size):
        cells = [sum(m[i][j] for m in matrices) / len(matrices) for j in range(size)]
        lines.append(f"update {i:<2d} " + " ".join(f"{c:8.3f}" for c in cells))
    lines.append("metric                              mean ± std")
    for name in runs[0]["metrics"]:
        mean, std = _mean_std([run["metrics"][name] for run in runs])
        lines.append(f"{name:34s} {mean:6.3f} ± {std:.3f}")
    lines.append(f"results in {args.output_dir}")
    return "\n".join(lines)


def _write_results(args: argparse.Namespace, runs: Sequence[dict], elapsed: float) -> None:
    config = {k: v for k, v in vars(args).items() if k not in ("command",)}
    with open(os.path.join(args.output_dir, "results.json"), "w", encoding="utf-8") as handle:
        json.dump({"config": config, "seconds": elapsed, "runs": list(runs)}, handle, indent=2)
    with open(os.path.join(args.output_dir, "metrics.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["seed", "metric", "value"])
        for run in runs:
            for name, value in run["metrics"].items():
                writer.writerow([run["seed"], name, f"{value:.6f}"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return  # the heatmap is optional (pip install 'renate-events[plot]')
    rows = [run["class_incremental"]["rows"] for run in runs]
    mean = torch.tensor(rows, dtype=torch.float64).mean(dim=0)
    figure, axes = plt.subplots(figsize=(1.2 + 0.9 * mean.shape[1], 1 + 0.8 * mean.shape[0]))
    image = axes.imshow(mean.numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
    for row in range(mean.shape[0]):
        for column in range(mean.shape[1]):
            value = float(mean[row, column])
            axes.text(
                column,
                row,
                f"{value:.2f}",
                ha="center",
                va="center",
                color="white" if value < 0.6 else "black",
                fontsize=8,
            )
    axes.set_xlabel("evaluated on task")
    axes.set_ylabel("after update")
    axes.set_title(f"{args.learner} on {args.scenario}")
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    figure.savefig(os.path.join(args.output_dir, "accuracy_matrix.png"), dpi=120)
    plt.close(figure)


# -- update and evaluate --------------------------------------------------------------------------


def _update(args: argparse.Namespace) -> int:
    _check_positive(epochs=args.epochs)
    data = _load_data_file(args.data)
    overrides = {"max_epochs": args.epochs, "device": args.device}
    updater = _updater_from_folder(args.input_state, **overrides)
    updater.output_state_folder = args.output_state
    _progress(updater.learner_instance, "update", not args.no_progress)
    result = updater.update(data, task_id=args.task_id)
    loss = result.metrics.get("train_loss", math.nan)
    print(f"trained {result.steps} steps; train_loss {loss:.4f}; state in {args.output_state}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from renate_events import evaluation
    from renate_events.scenarios import SCENARIOS, Task

    updater = _updater_from_folder(args.state)
    model = updater.learner_instance.model
    if args.data:
        data = _load_data_file(args.data)
        classes = tuple(sorted(set(data.tensors[1].tolist())))
        tasks = [Task(task_id=0, train=data, test=data, classes=classes)]
    else:
        if args.scenario not in SCENARIOS:
            raise UsageError(
                f"unknown --scenario {args.scenario!r}; choose from {sorted(SCENARIOS)}"
            )
        tasks = list(SCENARIOS[args.scenario](seed=args.seed).tasks())
    accuracies = evaluation.evaluate(model, tasks, mode="class-incremental")
    for task, accuracy in zip(tasks, accuracies):
        print(f"task {task.task_id}: accuracy {accuracy:.4f} ({len(task.test)} samples)")
    print(f"average accuracy {sum(accuracies) / len(accuracies):.4f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``renate-events`` console script."""
    from renate_events.updater import StateFolderError
    from trainer import TrainerError

    try:
        args = _parse(argv)
        command = {"run": _run, "update": _update, "evaluate": _evaluate}[args.command]
        return command(args)
    except (UsageError, StateFolderError, TrainerError, FileNotFoundError) as exc:
        print(f"renate-events: error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"renate-events: error: {exc}".splitlines()[0], file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
