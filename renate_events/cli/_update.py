"""``renate-events update``: one update of a state folder, on a data file or on a config file's
chunk (with ``--search``, the best of several trials: ``_tuning``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from renate_events.cli._data_files import fitted, load_data_file
from renate_events.cli._errors import UsageError
from renate_events.cli._options import (
    UpdateOptions,
    check_options,
    hyperparameter_values,
    load_config_file,
)
from renate_events.cli._tracking import make_tracker, tracked
from renate_events.cli._tuning import search_update
from renate_events.cli._updaters import (
    config_updater,
    progress,
    resume_settings,
    scratch_setting,
    selection_settings,
    training_overrides,
    updater_from_folder,
)
from renate_events.cli._zoo import check_same_model
from renate_events.settings import setting
from renate_events.state_folder import check_writable, read_manifest
from renate_events.updater import check_config_file

__all__ = ["update"]


def update(values: dict[str, Any], from_file: frozenset[str]) -> int:
    """``renate-events update``: train the input state on new data, write the output state."""
    options = check_options(UpdateOptions, values, from_file)
    check_writable(options.output_state)  # before anything is read or trained (also --search)
    if options.config_file is not None:
        return _update_from_config(options, values, from_file)
    if options.data is None or options.input_state is None:
        raise UsageError(
            "update needs --input-state and --data, or --config-file (its data_fn gives the "
            "data; see renate-events update -h)"
        )
    for name in ("chunk_id", "metric", "early_stopping", "search"):
        if getattr(options, name) is not None:
            raise UsageError(f"--{name.replace('_', '-')} needs --config-file")
    tracker = make_tracker(options, options.output_state)  # a missing package: before reading
    data = load_data_file(options.data)
    manifest = read_manifest(options.input_state, timeout=options.lock_timeout)
    learner = options.learner or manifest["learner"]
    hyper = hyperparameter_values(values, learner, from_file, options.config)
    updater, spec = updater_from_folder(
        options.input_state,
        options.lock_timeout,
        training_overrides(options),
        hyper,
        output_state_folder=options.output_state,  # the mapped buffer's working files go beside it
        in_place=options.in_place,
        overwrite=options.overwrite,
        **resume_settings(options, manifest),
        **scratch_setting(options),
    )
    check_same_model(options, spec, options.input_state)
    data = fitted(f"--data {options.data}", data, spec)
    progress(updater.learner_instance, "update", not options.no_progress)
    with tracked(tracker, updater, options):
        result = updater.update(data, task_id=options.task_id)
    loss = result.metrics.get("train_loss", math.nan)
    print(f"trained {result.steps} steps; train_loss {loss:.4f}; state in {options.output_state}")
    return 0


def _update_from_config(options: Any, values: dict[str, Any], from_file: frozenset[str]) -> int:
    if options.data is not None:
        raise UsageError(
            "--data and --config-file: choose one; with a config file, data_fn gives the data "
            "of --chunk-id"
        )
    if options.model is not None or options.model_args is not None:
        raise UsageError(
            f"--model{'-args' if options.model is None else ''}: with --config-file, its model_fn "
            "builds the model (it may call renate_events.models.build_model); leave it out"
        )
    tracker = make_tracker(options, options.output_state)  # a missing package: before reading
    if tracker is not None and (options.search is not None or options.search_space):
        raise UsageError(
            "--tracker with --search: not supported yet; each trial's updater is its own "
            "(log the search with Optuna's storage, --search-storage)"
        )
    config = load_config_file(options.config_file)
    manifest = None
    if options.input_state is not None:
        manifest = read_manifest(options.input_state, timeout=options.lock_timeout)
        if not options.accept_config_change:
            check_config_file(options.input_state, manifest.get("config"), config)
    learner = options.learner or (manifest["learner"] if manifest else setting("learner").default)
    hyper = hyperparameter_values(values, learner, from_file, options.config)
    chunk = options.chunk_id if options.chunk_id is not None else (manifest or {}).get("updates", 0)
    overrides = {**training_overrides(options), "seed": options.seed}
    if options.search is not None or options.search_space:
        if options.checkpoint_every is not None or options.restart:
            raise UsageError(
                "--search cannot be resumed: its trials are not checkpointed; leave out "
                f"--{'restart' if options.restart else 'checkpoint-every'}"
            )
        return search_update(options, config, manifest, overrides, hyper, chunk)
    torch.manual_seed(options.seed)  # model_fn's initial weights, then data_fn, as in `run`
    updater = config_updater(
        config,
        overrides,
        hyper,
        manifest,
        input_state_folder=options.input_state,
        output_state_folder=options.output_state,
        in_place=options.in_place,
        overwrite=options.overwrite,
        lock_timeout=options.lock_timeout,
        accept_config_change=options.accept_config_change,
        **resume_settings(options, manifest),
        **selection_settings(options),
        **scratch_setting(options),
    )
    train, val = config.data(chunk, options.seed)
    progress(updater.learner_instance, f"chunk {chunk}", not options.no_progress)
    task_id = options.task_id if options.task_id is not None else chunk
    with tracked(tracker, updater, options, chunk=chunk):
        result = updater.update(train, val, task_id=task_id)
    shown = "; ".join(
        f"{name} {value:.4f}" for name, value in sorted(result.metrics.items()) if name != "epoch"
    )
    print(
        f"trained {result.steps} steps on chunk {chunk}; {shown}; state in {options.output_state}"
    )
    return 0
