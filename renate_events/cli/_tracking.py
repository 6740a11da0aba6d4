"""The experiment tracker of ``run`` and ``update`` (``--tracker mlflow|wandb|tensorboard``): made
from the options before anything trains, subscribed to an updater's trainer (which logs the
training and validation scalars, :class:`trainer.listeners.ExperimentTracker`), and what the
command line logs beyond them: the hyperparameters, the accuracy matrix after each update of a
run, the results files and the state folders."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from renate_events.choices import TRACKERS
from renate_events.cli._errors import UsageError, one_line
from renate_events.updater import ModelUpdater
from trainer import MissingPackageError
from trainer.files import creation_problem
from trainer.listeners import ExperimentTracker

__all__ = [
    "default_tracker_dir",
    "log_accuracies",
    "log_results",
    "make_tracker",
    "start_tracking",
    "tracked",
]

_TRACKER_OPTIONS = ("tracker_dir", "tracking_uri", "tracker_project", "tracker_run_name")


def default_tracker_dir(output: str) -> str:
    """``tracking/`` beside the command's output (``--output-dir`` or ``--output-state``)."""
    return os.path.join(os.path.dirname(os.path.abspath(output)), "tracking")


def _check_tracker_options(options: Any) -> None:
    if options.tracker is None:
        for name in _TRACKER_OPTIONS:
            if getattr(options, name) != attrs.fields_dict(type(options))[name].default:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} needs --tracker mlflow, wandb or tensorboard")
    elif options.tracking_uri is not None and options.tracker != "mlflow":
        raise UsageError(
            f"--tracking-uri is MLflow's tracking URI: with --tracker {options.tracker}, give "
            "--tracker-dir (or leave both out)"
        )


_FIRST_ENTRY = {"mlflow": "mlflow.db", "wandb": "wandb"}  # else: the run's folder
"""What each tracker first creates in its folder."""


def _check_tracker_folder(options: Any, folder: str, name: str) -> None:
    """Refuse, before anything trains, a tracker folder in which nothing can be created."""
    problem = creation_problem(os.path.join(folder, _FIRST_ENTRY.get(options.tracker, name)))
    if problem is not None:
        flag = "--tracker-dir" if options.tracker_dir else "the tracker's folder (--tracker-dir)"
        raise UsageError(
            f"{flag} {folder} cannot be written: {problem}; nothing was written: choose "
            "another --tracker-dir"
        )


def make_tracker(options: Any, output: str, suffix: str = "") -> ExperimentTracker | None:
    """The tracker of ``--tracker`` (None without it), its run not open yet; a package that is
    missing is one line here, before anything trains.

    Its run is called ``--tracker-run-name`` (default: the name of ``output``) with ``suffix``;
    it stays open over the updates (the command ends it). Its folder is ``--tracker-dir``
    (default: :func:`default_tracker_dir`): MLflow's SQLite store and artifacts (unless
    ``--tracking-uri``), W&B's ``wandb/`` folder, TensorBoard's event files (a folder per run).
    """
    _check_tracker_options(options)
    if options.tracker is None:
        return None
    folder = options.tracker_dir or default_tracker_dir(output)
    name = (options.tracker_run_name or os.path.basename(os.path.normpath(output))) + suffix
    if options.tracking_uri is None:
        _check_tracker_folder(options, folder, name)
    try:
        kind = TRACKERS[options.tracker]
        if options.tracker == "mlflow":
            uri, store = options.tracking_uri, None if options.tracking_uri else folder
            return kind(
                experiment=options.tracker_project,
                run_name=name,
                tracking_uri=uri,
                folder=store,
                keep_open=True,
            )
        if options.tracker == "wandb":
            project = options.tracker_project
            return kind(project=project, name=name, dir=folder, keep_open=True)
        return kind(os.path.join(folder, name), keep_open=True)
    except MissingPackageError as exc:
        raise UsageError(f"--tracker {options.tracker}: {one_line(exc)}") from None


def _options_params(options: Any) -> dict[str, Any]:
    """The options given (those not None), without the tracker's own."""
    return {
        name: value
        for name, value in attrs.asdict(options).items()
        if value is not None and name not in ("tracker", *_TRACKER_OPTIONS)
    }


def _updater_params(updater: ModelUpdater) -> dict[str, Any]:
    """What the updater trains with: the method, the buffer, the learner's arguments, the
    optimizer (a config file's ``optimizer_fn`` by its name) and the trainer's arguments."""
    optimizer = updater.optimizer
    if not isinstance(optimizer, Mapping):
        optimizer = {"function": getattr(optimizer, "__qualname__", repr(optimizer))}
    return {
        "learner": updater.learner,
        "buffer": updater.buffer,
        "buffer_storage": updater.buffer_storage,
        "learner_kwargs": dict(updater.learner_kwargs),
        "optimizer": dict(optimizer),
        "max_epochs": updater.max_epochs,
        "trainer_kwargs": dict(updater.trainer_kwargs),
    }


def start_tracking(
    tracker: ExperimentTracker, updater: ModelUpdater, options: Any, **more: Any
) -> None:
    """Subscribe ``tracker`` to the updater's trainer and open its run with the hyperparameters:
    the options given (``options.*``), what the updater trains with, and ``more``. A run that
    cannot be opened (a server out of reach, a folder that may not be written) is one line."""
    trainer = updater.learner_instance.trainer
    if tracker not in dict(trainer.listeners).values():
        trainer.subscribe(tracker, name="tracker")
    params = {"options": _options_params(options), **_updater_params(updater), **more}
    try:
        tracker.log_params(params)
    except Exception as exc:  # the tracker's own errors (its store, server, folder): any type
        tracker.finish(failed=True)
        raise UsageError(
            f"--tracker: could not open a run ({type(exc).__name__}: {one_line(exc)})"
        ) from None


def log_accuracies(
    tracker: ExperimentTracker,
    class_il: Sequence[Sequence[float]],
    task_il: Sequence[Sequence[float]],
) -> None:
    """Log the last rows of the accuracy matrices (class- and task-incremental; one row per
    update so far) at the run's step: the update's number (``update``, from 1), the accuracy on
    each task (``accuracy_task_<j>``, class-incremental; ``task_il_accuracy_task_<j>``) and their
    means over the tasks seen so far (``average_accuracy``, ``task_il_average_accuracy``)."""
    update, class_row, task_row = len(class_il), class_il[-1], task_il[-1]
    seen = min(update, len(class_row))
    values: dict[str, float] = {"update": update}
    for j, (class_value, task_value) in enumerate(zip(class_row, task_row)):
        values[f"accuracy_task_{j}"] = class_value
        values[f"task_il_accuracy_task_{j}"] = task_value
    values["average_accuracy"] = sum(class_row[:seen]) / seen
    values["task_il_average_accuracy"] = sum(task_row[:seen]) / seen
    tracker.log_metrics(values)


def log_results(
    tracker: ExperimentTracker,
    metrics: Mapping[str, float],
    files: Sequence[str],
    state_folder: str | None,
) -> None:
    """Log a run's summary ``metrics`` (``final_<name>``), its result ``files`` and its
    ``state_folder`` (as the artifact ``state``), then end the run."""
    tracker.log_metrics({f"final_{name}": value for name, value in metrics.items()})
    for path in files:
        if os.path.isfile(path):
            tracker.log_artifact(path)
    if state_folder is not None and os.path.isdir(state_folder):
        tracker.log_artifact(state_folder, name="state")
    tracker.finish()


@contextlib.contextmanager
def tracked(
    tracker: ExperimentTracker | None, updater: ModelUpdater, options: Any, **more: Any
) -> Iterator[None]:
    """One update of ``update`` logged to ``tracker`` (nothing when None): its run opens before
    the update with the hyperparameters (``more`` added), and ends after it with the output
    state folder as the artifact ``state`` (or as failed when the update raised)."""
    if tracker is None:
        yield
        return
    start_tracking(tracker, updater, options, **more)
    try:
        yield
    except BaseException:
        tracker.finish(failed=True)
        raise
    log_results(tracker, {}, [], os.fspath(updater.output_state_folder or options.output_state))
