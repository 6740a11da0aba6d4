"""``renate-events run``: every seed prepared (data read, updater built and checked) before any
training, then one update per task with an evaluation on every task after each."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from renate_events.accuracy import resident_tests
from renate_events.anytime import AnytimeAccuracy
from renate_events.choices import default_buffer
from renate_events.cli._errors import UsageError
from renate_events.cli._evaluate import (
    ChunkTask,
    Transformed,
    chunk_test_data,
    evaluated,
    for_evaluation,
)
from renate_events.cli._options import (
    RunOptions,
    check_options,
    hyperparameter_values,
    learner_message,
    load_config_file,
)
from renate_events.cli._results import (
    check_output_dir,
    result_files,
    seed_metrics,
    table,
    write_run,
)
from renate_events.cli._tracking import log_accuracies, log_results, make_tracker, start_tracking
from renate_events.cli._updaters import (
    config_updater,
    feature_modules,
    optimizer_spec,
    progress,
    selection_settings,
    training_arguments,
    training_overrides,
)
from renate_events.cli._zoo import (
    MAX_PARAMETERS,
    SCENARIO_ARGS,
    mlp,
    parameter_count,
    pretrained_model,
    resolved_model,
    scenario_record,
    scenario_tasks,
    scenario_variants,
    spec_transforms,
    zoo_spec_for_run,
)
from renate_events.config import ConfigFile
from renate_events.methods import method, method_of
from renate_events.models import build_model
from renate_events.scenarios import IMAGE_SCENARIOS
from renate_events.settings import setting
from renate_events.updater import ModelUpdater
from trainer.listeners import ExperimentTracker
from trainer.run import place_model

__all__ = ["run"]


@attrs.define(eq=False)
class _Seed:
    """One seed of a run: its tasks and its updater, built (and so checked) before any training."""

    seed: int
    tasks: list[Any]
    updater: ModelUpdater
    rng_state: torch.Tensor
    evaluated: torch.nn.Module  # the model, with the config file's test transform if any
    anytime: AnytimeAccuracy | None = None  # with --online: the anytime-accuracy listener


def run(values: dict[str, Any], from_file: frozenset[str]) -> int:
    """``renate-events run``: train and evaluate every seed, then print and write the results."""
    options = _online(check_options(RunOptions, values, from_file))
    variants = scenario_variants(options)
    hyper = hyperparameter_values(values, options.learner, from_file, options.config)
    config = _run_config_file(options)
    if config is None:
        options = resolved_model(options)
    if config is None and method(options.learner).features == "hidden" and options.hidden == []:
        raise UsageError(f"--learner {options.learner} distils hidden layers: give --hidden sizes")
    # Under `torchrun --nproc_per_node=N`: data-parallel training over N processes; rank zero
    # prints and writes the results. State folders are not written (their staging folders are
    # per process), so `run` under torchrun keeps no state between invocations.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank_zero = int(os.environ.get("RANK", "0")) == 0
    tokens = None if distributed else check_output_dir(options)
    trackers = {  # each seed's run of --tracker (rank zero's), its package checked first
        seed: make_tracker(options, options.output_dir, f"-seed{seed}") if rank_zero else None
        for seed in options.seeds
    }
    seeds = [
        _prepare_seed(options, seed, distributed, hyper, variants)
        if config is None
        else _prepare_config_seed(options, config, seed, distributed, hyper)
        for seed in options.seeds
    ]
    started = time.perf_counter()
    try:
        runs = [_train_seed(options, plan, trackers[plan.seed]) for plan in seeds]
        elapsed = time.perf_counter() - started
        if rank_zero:
            files = result_files(options, runs, elapsed)
            if tokens is not None:
                write_run(options, files, {plan.seed: plan.updater for plan in seeds}, tokens)
            _log_results(options, trackers, runs, files if tokens is not None else {})
            print(table(options, runs, elapsed))
    finally:
        for tracker in trackers.values():
            if tracker is not None:
                tracker.finish(failed=True)  # a run still open here did not end well
    return 0


def _online(options: Any) -> Any:
    """The options of an online run (one epoch, ``--eval-every`` filled in), checked; others
    must not give ``--eval-every``."""
    if options.online and options.config_file is not None:
        raise UsageError(
            "--online is for a named --scenario; with --config-file, set max_epochs to 1 and "
            "subscribe renate_events.anytime.AnytimeAccuracy in your own code"
        )
    if not options.online:
        if options.eval_every is not None:
            raise UsageError(
                "--eval-every is the interval of --online's anytime accuracy: add --online"
            )
        return options
    if options.epochs not in (1, setting("epochs").default):
        raise UsageError(
            f"--online trains one pass over each task's data (one epoch); --epochs "
            f"{options.epochs} contradicts it: leave --epochs out"
        )
    every = options.eval_every or setting("eval_every").default
    return attrs.evolve(options, epochs=1, eval_every=every)


def _anytime(options: Any, tasks: Sequence[Any], evaluated: torch.nn.Module) -> list[Any]:
    """The listeners of a seed's updater: with ``--online``, the anytime accuracy on
    ``evaluated`` (the model with its test transform)."""
    if not options.online:
        return []
    return [AnytimeAccuracy(tasks, options.eval_every, model=evaluated)]


def _log_results(
    options: Any,
    trackers: Mapping[int, ExperimentTracker | None],
    runs: Sequence[Mapping[str, Any]],
    files: Mapping[str, bytes],
) -> None:
    """End each seed's tracker run with its summary metrics, the result files and (once
    written) its state folder."""
    out = os.path.abspath(options.output_dir)
    paths = [os.path.join(out, name) for name in files]
    for record in runs:
        tracker = trackers[record["seed"]]
        if tracker is not None:
            state = os.path.join(out, "state", f"seed-{record['seed']}") if files else None
            log_results(tracker, record["metrics"], paths, state)


def _run_config_file(options: Any) -> ConfigFile | None:
    """The ``--config-file`` of a run, with the options that only it allows checked."""
    if options.config_file is None:
        for flag, value in (
            ("--chunks", options.chunks),
            ("--metric", options.metric),
            ("--early-stopping", options.early_stopping),
        ):
            if value is not None:
                raise UsageError(f"{flag} needs --config-file")
        return None
    for flag, value in (
        ("--model", options.model),
        ("--model-args", options.model_args),
        ("--hidden", options.hidden),
        ("--data-dir", options.data_dir),
    ):
        if value is not None:
            raise UsageError(
                f"{flag}: with --config-file, its model_fn builds the model (it may call "
                "renate_events.models.build_model) and data_fn gives the data; leave it out"
            )
    if options.chunks is None:
        raise UsageError(
            "--config-file needs --chunks N: the number of updates, on data_fn's chunks 0..N-1"
        )
    return load_config_file(options.config_file)


def _check_run_length(updater: ModelUpdater, updates: int) -> None:
    """The learner built (its own checks) and, for a learner that can take only so many updates
    (a pool of one prompt per update), ``updates`` checked before the first one trains."""
    updater.learner_instance.check_updates(updates)


def _prepare_config_seed(
    options: Any,
    config: ConfigFile,
    seed: int,
    distributed: bool,
    hyper: Mapping[str, Any],
) -> _Seed:
    """One seed of a run over a config file's chunks: all data read and checked first."""
    torch.manual_seed(seed)  # model_fn's initial weights, then data_fn, as in `update`
    overrides = {**training_overrides(options), "seed": seed, "distributed": distributed}
    updater = config_updater(config, overrides, hyper, None, **selection_settings(options))
    try:
        _check_run_length(updater, options.chunks or 0)
    except ValueError as exc:
        raise UsageError(learner_message(exc)) from None
    tasks = []
    for chunk in range(options.chunks or 0):
        train, val = config.data(chunk, seed)
        test = chunk_test_data(config, chunk, seed, val, updater.learner_instance)
        classes = tuple(sorted(set(test.tensors[1].tolist())))
        tasks.append(ChunkTask(chunk, train, val, test, classes))
    return _Seed(seed, tasks, updater, torch.get_rng_state(), for_evaluation(updater.model, config))


def _run_model(
    options: Any, tasks: Sequence[Any], seed: int
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The seed's fresh model and what the manifest records of it: the command line's MLP on
    the digits scenarios (as before zoo models existed), a zoo model on the image ones."""
    classes = 1 + max(max(task.classes) for task in tasks)
    if options.scenario in IMAGE_SCENARIOS and options.pretrained is not None:
        torch.manual_seed(seed)  # the new head's
        return pretrained_model(options, tasks, classes)
    if options.scenario in IMAGE_SCENARIOS:
        spec = zoo_spec_for_run(options, tasks, classes)
        torch.manual_seed(seed)
        return build_model(spec["name"], **spec["args"]), spec
    hidden = options.hidden or []
    inputs = tasks[0].train.tensors[0].shape[1]
    count = parameter_count(inputs, hidden, classes)
    if count > MAX_PARAMETERS:
        raise UsageError(
            f"--hidden {hidden} makes an MLP of {count} parameters; the command line "
            f"builds MLPs of at most {MAX_PARAMETERS}"
        )
    torch.manual_seed(seed)
    spec = {"kind": "mlp", "inputs": inputs, "hidden": hidden, "classes": classes}
    return mlp(inputs, hidden, classes), spec


def _learner_kwargs(
    options: Any, seed: int, spec: Mapping[str, Any], hyper: Mapping[str, Any]
) -> dict[str, Any]:
    """The learner's arguments of one seed on a scenario: the buffer (only for a method with a
    memory, unless ``--memory-size`` is given), the batches, the seed, the features to distil
    from the command line's MLP, and the hyperparameters given."""
    memory_size = options.memory_size
    kwargs: dict[str, Any] = {
        "memory_size": setting("memory_size").default if memory_size is None else memory_size,
        "memory_batch_size": options.memory_batch_size,
        "batch_size": options.batch_size,
        "seed": seed,
    }
    method_spec = method(options.learner)
    if not method_spec.uses_memory and memory_size is None:
        kwargs.pop("memory_size")
    if method_spec.features == "hidden" and spec["kind"] == "mlp":  # the hidden layers' outputs
        kwargs["feature_modules"] = [str(2 * i + 1) for i in range(len(spec["hidden"]))]
    if method_spec.features == "last-hidden" and spec["kind"] == "mlp" and spec["hidden"]:
        # an embedding: the last hidden layer (a zoo model's: its backbone)
        kwargs["feature_modules"] = [str(2 * len(spec["hidden"]) - 1)]
    kwargs.update(hyper)
    return kwargs


def _prepare_seed(
    options: Any,
    seed: int,
    distributed: bool,
    hyper: Mapping[str, Any],
    variants: Mapping[str, Any],
) -> _Seed:
    """One seed of a run on a named scenario: its tasks, its model and its updater, checked."""
    tasks = scenario_tasks(options.scenario, options.data_dir, seed, variants)
    model, spec = _run_model(options, tasks, seed)
    transforms = spec_transforms(spec)
    evaluated_model = evaluated(model, transforms)
    listeners = _anytime(options, tasks, evaluated_model)
    learner_kwargs = _learner_kwargs(options, seed, spec, hyper)
    feature_modules(options.learner, learner_kwargs, model)  # a zoo model's feature modules
    first_optimizer = {"name": setting("optimizer").default, "lr": setting("lr").default}
    overrides = training_overrides(options)
    try:
        updater = ModelUpdater(
            model,
            learner=options.learner,
            learner_kwargs=learner_kwargs,
            optimizer=optimizer_spec(first_optimizer, overrides),
            buffer=options.buffer or default_buffer(options.learner),
            **training_arguments({**overrides, "distributed": distributed}, None, None),
            metadata={
                "model": spec,
                "scenario": options.scenario,
                SCENARIO_ARGS: scenario_record(seed, variants),
            },
            transforms=transforms,
            listeners=listeners,
        )
        _check_run_length(updater, len(tasks))  # and the learner's own checks
    except ValueError as exc:  # the learner's checks of a combination of options
        raise UsageError(learner_message(exc)) from None
    return _Seed(seed, tasks, updater, torch.get_rng_state(), evaluated_model, *listeners)


def _train_seed(options: Any, plan: _Seed, tracker: ExperimentTracker | None) -> dict[str, Any]:
    from renate_events import evaluation

    if tracker is not None:  # its run opens now, before this seed trains
        start_tracking(tracker, plan.updater, options, seed=plan.seed)
    torch.set_rng_state(plan.rng_state)  # as if this seed's model had just been built
    model, tasks = plan.evaluated, _on_training_device(plan)
    class_matrix, task_matrix = evaluation.AccuracyMatrix(), evaluation.AccuracyMatrix()
    class_matrix.baseline = evaluation.evaluate(model, tasks, mode="class-incremental")
    targets = torch.cat([task.test.tensors[-1] for task in tasks])
    previous, flips = None, []
    for index, task in enumerate(tasks):
        description = f"seed {plan.seed} task {task.task_id}"
        progress(plan.updater.learner_instance, description, not options.no_progress)
        if plan.anytime is not None:
            plan.anytime.reach(index)
        plan.updater.update(task.train, getattr(task, "val", None), task_id=task.task_id)
        model = _run_classifier(plan)
        # both rows and the predictions of the flip rates from one pass over the test sets
        row = evaluation.evaluate_row(model, tasks, predictions=True)
        class_matrix.append(row.accuracies["class-incremental"])
        task_matrix.append(row.accuracies["task-incremental"])
        if tracker is not None:
            log_accuracies(tracker, class_matrix.rows, task_matrix.rows)
        current = row.predictions
        if previous is not None:  # flips between consecutive model versions, on all test sets
            flips.append(evaluation.regression_metrics(previous, current, targets))
        previous = current
    record = seed_metrics(plan.seed, class_matrix, task_matrix, tasks, flips)
    if plan.anytime is not None:
        plan.anytime.finish()
        record["anytime_accuracy"] = plan.anytime.to_dict()
        record["metrics"]["anytime_accuracy"] = plan.anytime.area()
    return record


def _on_training_device(plan: _Seed) -> list[Any]:
    """The seed's model on the device it trains on (from the start: the untrained model's
    accuracy is taken there, as every later one) and its tasks with their test sets kept where
    they are evaluated, on that GPU or pinned, for the whole run (the anytime accuracy's too)."""
    learner = plan.updater.learner_instance
    device = place_model(learner.trainer, learner.model)
    tasks = resident_tests(plan.tasks, device)
    if plan.anytime is not None:
        plan.anytime.tasks = tasks
    return tasks


def _run_classifier(plan: _Seed) -> torch.nn.Module:
    """What ``run`` evaluates after an update: the method's own classifier (the nearest mean of
    exemplars for an ``nme`` method once it has class means, with the config file's test
    transform, if any), else the model."""
    learner = plan.updater.learner_instance
    spec = method_of(learner)
    if spec is None or spec.classifier != "nme":
        return plan.evaluated
    try:
        nme = learner.nme_classifier()
    except ValueError:  # no class means yet: nothing was trained
        return plan.evaluated
    evaluated_model = plan.evaluated
    if isinstance(evaluated_model, Transformed):
        return Transformed(nme, evaluated_model.transform)
    return nme
