"""``renate-events evaluate``, and the model as evaluation sees it (through the test transform;
with the method's own classifier), which ``run`` evaluates too."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from renate_events.cli._data_files import config_fitted, fitted, load_data_file
from renate_events.cli._errors import UsageError, one_line
from renate_events.cli._options import EvaluateOptions, check_options, load_config_file
from renate_events.cli._updaters import config_updater, scratch_setting, updater_from_folder
from renate_events.cli._zoo import (
    check_data_dir,
    evaluation_tasks,
    scenario_variants,
)
from renate_events.config import ConfigFile
from renate_events.inference import EVAL_BATCH_SIZE, forward, inference, model_device, pinned
from renate_events.learners import check_split
from renate_events.methods import METHODS, method_of
from renate_events.settings import setting
from renate_events.state_folder import read_manifest
from renate_events.updater import dataset_tensors
from trainer.data import resolve_device

__all__ = [
    "ChunkTask",
    "Transformed",
    "chunk_test_data",
    "evaluate",
    "evaluated",
    "for_evaluation",
    "method_classifier",
    "own_classifier",
    "state_with_config",
]


class Transformed(torch.nn.Module):
    """``model(transform(x))``: a test transform in evaluation."""

    def __init__(self, model: torch.nn.Module, transform: Callable[[Any], Any]) -> None:
        super().__init__()
        self.model = model
        self.transform = transform

    def forward(self, inputs: Any) -> Any:
        return self.model(self.transform(inputs))


def evaluated(model: torch.nn.Module, transforms: Mapping[str, Any]) -> torch.nn.Module:
    """The model as evaluation sees it: through the test transform of ``transforms``, if any."""
    test = transforms.get("test_transform")
    return model if test is None else Transformed(model, test)


def for_evaluation(model: torch.nn.Module, config: ConfigFile | None) -> torch.nn.Module:
    """The model through the config file's test transform, if it defines one."""
    transform = None if config is None else config.transform("test_transform")
    return model if transform is None else Transformed(model, transform)


@attrs.frozen
class ChunkTask:
    """A config file's chunk as :func:`renate_events.evaluation.evaluate` takes a task."""

    task_id: int
    train: Any
    val: Any
    test: torch.utils.data.TensorDataset
    classes: tuple[int, ...]


def chunk_test_data(
    config: ConfigFile, chunk_id: int, seed: int, val: Any, learner: Any = None
) -> Any:
    """The test data of a chunk as tensors: ``test_data_fn``'s, else the validation data; with
    a ``learner``, checked against its model before anything trains or is evaluated (labels
    within the outputs, finite inputs, the test transform's contract: ``check_split``)."""
    test = config.test_data(chunk_id, seed)
    if test is None:
        test = val
    if test is None:
        raise UsageError(
            f"{config.path} defines no test_data_fn and data_fn gives no validation data for "
            f"chunk {chunk_id}: the command has nothing to evaluate on"
        )
    inputs, targets = dataset_tensors(test, config.collate(), f"the test data of chunk {chunk_id}")
    data = torch.utils.data.TensorDataset(inputs, targets)
    if learner is not None:
        try:
            check_split(learner, data, "test")
        except ValueError as exc:
            raise UsageError(f"chunk {chunk_id}: {one_line(exc)}") from None
    return data


def _metric_means(
    model: torch.nn.Module, data: torch.utils.data.TensorDataset, metrics: Mapping[str, Any]
) -> dict[str, float]:
    """The mean of each ``metrics_fn`` metric over ``data`` (one synchronisation per metric)."""
    if not metrics:
        return {}
    device = model_device(model)
    inputs, targets = (pinned(tensor, device) for tensor in data.tensors)
    sums = {name: torch.zeros((), dtype=torch.float64, device=device) for name in metrics}
    with inference(model, outputs_leave_autograd=True):
        for start in range(0, len(targets), EVAL_BATCH_SIZE):
            stop = start + EVAL_BATCH_SIZE
            batch = targets[start:stop].to(device, non_blocking=True)
            outputs = forward(model, inputs[start:stop].to(device, non_blocking=True))
            for name, metric in metrics.items():
                value = torch.as_tensor(metric(outputs, batch), device=device)
                sums[name] += value.double().mean() * len(batch)
    return {name: float(total) / len(targets) for name, total in sums.items()}


def own_classifier(learner: Any) -> str:
    """The method's own classifier: ``nme`` where its spec says so, else ``logits``."""
    spec = method_of(learner)
    return "logits" if spec is None else spec.classifier


def chosen_classifier(learner: Any, classifier: str | None, state: str) -> torch.nn.Module:
    """``--classifier`` (None: the method's own), said on the first line of the output."""
    name = classifier or own_classifier(learner)
    print(f"classifier {name}" + ("" if classifier else " (the method's own)"))
    return method_classifier(learner, name, state)


def method_classifier(learner: Any, classifier: str, state: str) -> torch.nn.Module:
    """The learner's model (``logits``) or its nearest-mean-of-exemplars classifier (``nme``,
    for the methods whose spec names that classifier)."""
    if classifier == "logits":
        return learner.model
    spec = method_of(learner)
    if spec is None or spec.classifier != "nme":
        names = sorted(name for name, other in METHODS.items() if other.classifier == "nme")
        raise UsageError(
            f"--classifier nme needs a state folder of --learner {' or '.join(names)}; {state} "
            f"holds a {type(learner).__name__}"
        )
    try:
        return learner.nme_classifier()
    except ValueError as exc:
        raise UsageError(f"--classifier nme: {exc}") from None


def evaluate(values: dict[str, Any], from_file: frozenset[str]) -> int:
    """``renate-events evaluate``: the accuracy of a state folder's model on every task."""
    from renate_events import evaluation
    from renate_events.scenarios import Task

    options = check_options(EvaluateOptions, values)
    _check_sources(options)
    if options.scenario is not None or options.data_dir is not None:
        check_data_dir(options.scenario, options.data_dir)
    if options.class_order is not None and options.scenario is None:
        raise UsageError(
            "--class-order orders the tasks of a --scenario; give one, or leave it out"
        )
    if options.config_file is not None:
        return _evaluate_from_config(options)
    if options.chunk_ids is not None:
        raise UsageError("--chunk-ids needs --config-file")
    if options.data is not None:
        data = load_data_file(options.data)
        note = None
    else:
        scenario_variants(options)  # --class-order checked before the state is read
    updater, spec = updater_from_folder(options.state, **scratch_setting(options))
    if options.data is not None:
        data = fitted(f"--data {options.data}", data, spec)
        classes = tuple(sorted(set(data.tensors[1].tolist())))
        tasks = [Task(task_id=0, train=data, test=data, classes=classes)]
    else:  # the tasks the state's run trained on, as its manifest records them
        tasks, note = evaluation_tasks(options.state, updater.metadata, options)
        for task in tasks:  # every task's labels: a later task may exceed the model's classes
            fitted(f"--scenario {options.scenario}", task.test, spec)
    # the data checked first: the classifier's line is printed only for an evaluation that runs
    classifier = chosen_classifier(updater.learner_instance, options.classifier, options.state)
    model = evaluated(classifier, updater.transforms).to(resolve_device(options.device))
    accuracies = evaluation.evaluate(model, tasks, mode="class-incremental")
    for task, accuracy in zip(tasks, accuracies):
        print(f"task {task.task_id}: accuracy {accuracy:.4f} ({len(task.test)} samples)")
    print(f"average accuracy {sum(accuracies) / len(accuracies):.4f}")
    if note is not None:  # after the evaluation: a refusal before it stays one line
        print(note, file=sys.stderr)
    return 0


def _check_sources(options: Any) -> None:
    """What to evaluate on: ``--data``, ``--scenario`` or ``--config-file`` (its chunks, or with
    ``--data`` that file), in argparse's words where it would have refused."""
    given = [
        flag
        for flag, value in (
            ("--data", options.data),
            ("--scenario", options.scenario),
            ("--config-file", options.config_file),
        )
        if value is not None
    ]
    if not given:
        raise UsageError(
            "one of the arguments --data --scenario --config-file is required (see "
            "renate-events evaluate -h)"
        )
    if options.scenario is not None and len(given) > 1:
        other = next(flag for flag in given if flag != "--scenario")
        raise UsageError(
            f"--scenario and {other}: evaluate on a scenario's tasks, a data file (--data) or a "
            "config file's chunks (--config-file); only --data goes with --config-file"
        )


def state_with_config(options: Any) -> tuple[Any, dict[str, Any], Any]:
    """The config file of ``--config-file``, the manifest of ``--state`` and an updater reading
    that state with the config file's functions (``evaluate`` and ``predict`` on chunks)."""
    config = load_config_file(options.config_file)
    manifest = read_manifest(options.state)
    updater = config_updater(
        config,
        {},
        {},
        manifest,
        input_state_folder=options.state,
        validation_memory=manifest.get("validation_memory", False),
        accept_config_change=options.accept_config_change,
        trains=False,
        **scratch_setting(options),
    )
    return config, manifest, updater


def _evaluate_from_config(options: Any) -> int:
    from renate_events import evaluation

    if options.data is not None and options.chunk_ids is not None:
        raise UsageError(
            "--chunk-ids and --data: evaluate on the config file's chunks or on the file, not both"
        )
    data = None if options.data is None else load_data_file(options.data)
    config, manifest, updater = state_with_config(options)
    if data is None:
        tasks = _chunk_tasks(options, config, manifest, updater.learner_instance)
        name = "chunk"
    else:  # the file as stored, for the config file's test_transform
        test = config_fitted(f"--data {options.data}", data, updater.learner_instance)
        tasks = [ChunkTask(0, None, None, test, tuple(sorted(set(test.tensors[1].tolist()))))]
        name = "task"
    model = for_evaluation(
        chosen_classifier(updater.learner_instance, options.classifier, options.state), config
    ).to(resolve_device(options.device))
    accuracies = evaluation.evaluate(model, tasks, mode="class-incremental")
    metrics = config.metrics()
    for task, accuracy in zip(tasks, accuracies):
        extra = _metric_means(model, task.test, metrics)
        shown = "".join(f"; {name} {value:.4f}" for name, value in extra.items())
        print(f"{name} {task.task_id}: accuracy {accuracy:.4f}{shown} ({len(task.test)} samples)")
    print(f"average accuracy {sum(accuracies) / len(accuracies):.4f}")
    return 0


def _chunk_tasks(
    options: Any, config: ConfigFile, manifest: Mapping[str, Any], learner: Any
) -> list[ChunkTask]:
    """The test data of the chunks ``--chunk-ids`` (default: those the state was trained on),
    every chunk read and checked before anything is printed."""
    chunks = options.chunk_ids or list(range(manifest["updates"]))
    seed = setting("seed").default if options.seed is None else options.seed
    tasks = []
    for chunk in chunks:
        val = None if config.has("test_data_fn") else config.data(chunk, seed)[1]
        test = chunk_test_data(config, chunk, seed, val, learner)
        classes = tuple(sorted(set(test.tensors[1].tolist())))
        tasks.append(ChunkTask(chunk, None, None, test, classes))
    return tasks
