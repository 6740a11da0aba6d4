"""The results of ``renate-events run``: the metrics of a seed, the printed table, the heatmap,
``metrics.csv`` and ``results.json``, and the output folder written all at once at the end."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from renate_events.anytime import plot_curves
from renate_events.cli._errors import UsageError, one_line
from renate_events.state_folder import (
    StagedStateFolder,
    StateFolderError,
    check_writable,
    state_token,
)
from renate_events.updater import ModelUpdater
from trainer import CheckpointError
from trainer.files import fsync_file, fsync_folder, temporary_sibling

__all__ = ["check_output_dir", "heatmap", "result_files", "seed_metrics", "table", "write_run"]

_RESULT_FILES = (  # results.json last
    "metrics.csv",
    "accuracy_matrix.png",
    "anytime_accuracy.png",
    "results.json",
)
_FLIPS = {
    "nfr": "negative_flip_rate",
    "nfi": "negative_flip_impact",
    "pfr": "positive_flip_rate",
    "pfi": "positive_flip_impact",
}


# -- the numbers ----------------------------------------------------------------------------------


def seed_metrics(
    seed: int,
    class_matrix: Any,
    task_matrix: Any,
    tasks: Sequence[Any],
    flips: Sequence[Mapping[str, float]],
) -> dict:
    """One seed's record in ``results.json``: the classes of each task (in the scenario's class
    order), both accuracy matrices, the regression (flips) between consecutive model versions and
    the summary metrics."""
    from renate_events import evaluation

    sizes = [len(task.test) for task in tasks]
    metrics = {
        "average_accuracy": evaluation.average_accuracy(class_matrix),
        "micro_average_accuracy": evaluation.micro_average_accuracy(class_matrix, sizes),
        "task_incremental_average_accuracy": evaluation.average_accuracy(task_matrix),
        "forgetting": evaluation.forgetting(class_matrix),
        "backward_transfer": evaluation.backward_transfer(class_matrix),
        "forward_transfer": evaluation.forward_transfer(class_matrix, class_matrix.baseline),
    }
    if flips:  # the mean over consecutive pairs of model versions
        for key, name in _FLIPS.items():
            metrics[name] = sum(flip[key] for flip in flips) / len(flips)
    return {
        "seed": seed,
        "class_groups": [list(task.classes) for task in tasks],
        "class_incremental": class_matrix.to_dict(),
        "task_incremental": task_matrix.to_dict(),
        "regression": [{"update": i + 1, **flip} for i, flip in enumerate(flips)],
        "metrics": metrics,
    }


def _title(options: Any) -> str:
    if options.config_file is not None:
        return f"{os.path.basename(options.config_file)} ({options.chunks} chunks)"
    return options.scenario


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def table(options: Any, runs: Sequence[dict], elapsed: float) -> str:
    """What ``run`` prints: the mean accuracy matrix and every metric as mean ± std."""
    matrices = [run["class_incremental"]["rows"] for run in runs]
    size = len(matrices[0])
    lines = [
        f"{options.learner} on {_title(options)}, {len(runs)} seed(s), {elapsed:.1f} s",
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
    lines.append(f"results in {options.output_dir}")
    return "\n".join(lines)


def result_files(options: Any, runs: Sequence[dict], elapsed: float) -> dict[str, bytes]:
    """The contents of ``results.json``, ``metrics.csv`` and (with matplotlib) the heatmap."""
    config = attrs.asdict(options)
    results = json.dumps({"config": config, "seconds": elapsed, "runs": list(runs)}, indent=2)
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    writer.writerow(["seed", "metric", "value"])
    for run in runs:
        for name, value in run["metrics"].items():
            writer.writerow([run["seed"], name, f"{value:.6f}"])
    files = {"results.json": results.encode(), "metrics.csv": rows.getvalue().encode()}
    image = heatmap(options, runs)
    if image is not None:
        files["accuracy_matrix.png"] = image
    curves = [run["anytime_accuracy"] for run in runs if "anytime_accuracy" in run]
    plot = (
        plot_curves(curves, f"{options.learner} on {_title(options)}, online") if curves else None
    )
    if plot is not None:
        files["anytime_accuracy.png"] = plot
    return files


def heatmap(options: Any, runs: Sequence[dict]) -> bytes | None:
    """The mean accuracy matrix as a PNG; None without matplotlib (imported only here)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None  # the heatmap is optional (pip install 'renate-events[plot]')
    rows = [run["class_incremental"]["rows"] for run in runs]
    mean = torch.tensor(rows, dtype=torch.float64).mean(dim=0)
    figure, axes = plt.subplots(figsize=(1.2 + 0.9 * mean.shape[1], 1 + 0.8 * mean.shape[0]))
    image = axes.imshow(mean.numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
    for row in range(mean.shape[0]):
        for column in range(mean.shape[1]):
            value = float(mean[row, column])
            color = "white" if value < 0.6 else "black"
            axes.text(
                column, row, f"{value:.2f}", ha="center", va="center", color=color, fontsize=8
            )
    axes.set_xlabel("evaluated on task")
    axes.set_ylabel("after update")
    axes.set_title(f"{options.learner} on {_title(options)}")
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    plt.close(figure)
    return buffer.getvalue()


# -- the output folder, written all at once at the end --------------------------------------------


def _state_folder(output_dir: str, seed: int) -> str:
    return os.path.join(output_dir, "state", f"seed-{seed}")


def check_output_dir(options: Any) -> dict[int, str | None]:
    """Check before training that the results can be written; what each state folder holds now.

    Returns:
        The :func:`~renate_events.updater.state_token` of every seed's state folder.
    """
    out = os.path.abspath(options.output_dir)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UsageError(f"--output-dir {options.output_dir}: {out} is not a folder")
    for name in (*_RESULT_FILES, "state"):
        path = os.path.join(out, name)
        if os.path.islink(path) or (
            os.path.exists(path) and os.path.isdir(path) != (name == "state")
        ):
            raise UsageError(
                f"--output-dir {options.output_dir}: {path} is in the way of the results"
            )
    _check_no_earlier_run(options, out)
    try:  # the deepest folder written; the folder above creates nothing, or a name is too long
        check_writable(_state_folder(out, max(options.seeds, key=lambda seed: len(str(seed)))))
    except StateFolderError as exc:
        raise UsageError(f"--output-dir {options.output_dir}: {one_line(exc)}") from None
    return {seed: state_token(_state_folder(out, seed)) for seed in options.seeds}


def _check_no_earlier_run(options: Any, out: str) -> None:
    """What this run would replace (results files, the state folders of its seeds) is replaced
    only with ``--overwrite``: a rerun never silently takes the place of another run."""
    found = [name for name in _RESULT_FILES if os.path.lexists(os.path.join(out, name))]
    found += [
        os.path.relpath(_state_folder(out, seed), out)
        for seed in options.seeds
        if os.path.lexists(_state_folder(out, seed))
    ]
    if found and not options.overwrite:
        raise UsageError(
            f"--output-dir {options.output_dir} holds an earlier run's {', '.join(found)}; give "
            "--overwrite to replace them, or another --output-dir"
        )


def _write_file(path: str, data: bytes) -> None:
    with open(path, "xb") as handle:
        handle.write(data)
    fsync_file(path)


def write_run(
    options: Any,
    files: Mapping[str, bytes],
    updaters: Mapping[int, ModelUpdater],
    tokens: Mapping[int, str | None],
) -> None:
    """Write the results and every seed's state folder (``updaters``: by seed): everything, or
    (on any failure) nothing."""
    out = os.path.abspath(options.output_dir)
    try:
        if not os.path.exists(out):
            _write_new_folder(out, lambda folder: _fill(folder, files, updaters))
        else:
            _replace_in_folder(out, files, updaters, tokens)
    except OSError as exc:
        raise CheckpointError(
            f"could not write the results to {out}: {one_line(exc)}; nothing was changed"
        ) from exc


def _fill(folder: str, files: Mapping[str, bytes], updaters: Mapping[int, ModelUpdater]) -> None:
    """Write results and state folders into a folder that nobody else knows of yet."""
    for name, data in files.items():
        _write_file(os.path.join(folder, name), data)
    _fill_states(os.path.join(folder, "state"), updaters)


def _fill_states(folder: str, updaters: Mapping[int, ModelUpdater]) -> None:
    os.makedirs(folder, exist_ok=True)
    for seed, updater in updaters.items():
        updater.stage_state(os.path.join(folder, f"seed-{seed}"), expected=None).commit()


def _write_new_folder(target: str, fill: Callable[[str], None]) -> None:
    """Create ``target`` whole: fill a folder beside it, then rename it into place.

    Folders created above ``target`` are removed again when anything fails.
    """
    created = []
    parent = os.path.dirname(target)
    while not os.path.exists(parent):
        created.append(parent)
        parent = os.path.dirname(parent)
    staging = temporary_sibling(target, "staging")
    try:
        for folder in reversed(created):
            os.mkdir(folder)
        os.mkdir(staging)
        fill(staging)
        fsync_folder(staging)
        os.rename(staging, target)  # refused if something appeared at target meanwhile
        fsync_folder(os.path.dirname(target))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:
            if os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)
        raise


def _replace_in_folder(
    out: str,
    files: Mapping[str, bytes],
    updaters: Mapping[int, ModelUpdater],
    tokens: Mapping[int, str | None],
) -> None:
    """Stage everything beside its destination first; then swap it all in, results.json last."""
    state_dir = os.path.join(out, "state")
    staged: list[StagedStateFolder] = []
    temporaries: dict[str, str] = {}
    try:
        if os.path.isdir(state_dir):
            for seed, updater in updaters.items():
                path = _state_folder(out, seed)
                staged.append(updater.stage_state(path, expected=tokens[seed]))
        for name, data in files.items():
            temporaries[name] = temporary_sibling(os.path.join(out, name), "tmp")
            _write_file(temporaries[name], data)
        if not os.path.isdir(state_dir):
            _write_new_folder(state_dir, lambda folder: _fill_states(folder, updaters))
    except BaseException:
        for staged_folder in staged:
            staged_folder.abort()
        for temporary in temporaries.values():
            if os.path.exists(temporary):
                os.unlink(temporary)
        raise
    for staged_folder in staged:
        staged_folder.commit()
    for name in _RESULT_FILES:
        path = os.path.join(out, name)
        if name in temporaries:
            os.replace(temporaries[name], path)
        elif os.path.isfile(path):  # an old heatmap must not pass for this run's
            os.unlink(path)
    fsync_folder(out)
