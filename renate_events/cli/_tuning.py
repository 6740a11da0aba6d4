"""``renate-events update --search N``: N trials of one update from the same input state (Optuna),
every searched value checked before the first trial; the best trial's state is the output."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from renate_events.choices import default_buffer
from renate_events.cli._errors import UsageError, one_line
from renate_events.cli._updaters import (
    config_updater,
    learner_settings,
    optimizer_setting,
    scratch_setting,
    selection_settings,
    trainer_setting,
)
from renate_events.config import ConfigFile
from renate_events.hyperparameters import HyperparameterError, check_value, hyperparameters
from renate_events.settings import setting
from renate_events.updater import ModelUpdater
from trainer import validators as checks

__all__ = ["search_update"]


def search_update(
    options: Any,
    config: ConfigFile,
    manifest: Mapping[str, Any] | None,
    overrides: Mapping[str, Any],
    hyper: Mapping[str, Any],
    chunk: int,
) -> int:
    """``update --search N``: N trials of this update from the same input state; the best
    trial's state, with the trials table ``search.csv``, is the output."""
    from renate_events import search

    space = search.parse_space(options.search_space, options.config or "--config")
    if options.search is None or not space:
        raise UsageError(
            "--search TRIALS and a search space go together: give --search and, in the --config "
            "TOML file, tables such as alpha = {low = 0.05, high = 1.0, log = true}"
        )
    try:
        optuna = search.require_optuna()
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    learner = overrides.get("learner") or (
        manifest["learner"] if manifest else setting("learner").default
    )
    _check_space(space, learner, manifest)
    _check_not_given(space, overrides, hyper, options.config)
    if "lr" in space and config.has("optimizer_fn"):
        raise UsageError(
            f"--search: lr: {config.path} defines optimizer_fn, which sets the learning rate; "
            "search it there (e.g. from an environment variable) or leave lr out of the space"
        )
    selection = selection_settings(options)
    if selection["metric"] is None:
        selection.update(metric="val_loss", mode=options.mode or "min")
    task_id = options.task_id if options.task_id is not None else chunk
    runner = _TrialRunner(options, config, manifest, overrides, hyper, chunk, selection, task_id)
    current = _current_params(space, learner, manifest, overrides, hyper, config)
    _try_every_value(runner, space, current)
    runner.check_validation()
    study = _study(optuna, options, selection["mode"])
    search.fail_dead_trials(optuna, study)  # a killed worker's trials: FAIL, not RUNNING
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    finished = [t for t in study.trials if t.state in done]
    new_study = not study.trials  # asked before anything is enqueued (which adds a trial)
    if current is not None and all(t.params != current for t in finished):
        study.enqueue_trial(current)  # the settings the update would have used without a search
    if new_study:
        _warm_start(study, options, manifest, space, selection["mode"], current)
    study.optimize(
        lambda trial: runner.trial(trial, search.suggest(trial, space), optuna),
        n_trials=max(0, options.search - len(finished)),
    )
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        raise UsageError(f"--search: none of the {len(study.trials)} trials completed")
    best = study.best_trial
    updater = runner.best_updater(best)
    updater.write_output({search.SEARCH_FILE: search.trials_table(study)})
    steps = sum(int(t.user_attrs.get("steps", 0)) for t in study.trials)
    pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials)
    print(
        f"searched {len(study.trials)} trials ({pruned} pruned, {steps} steps in all); best "
        f"trial {best.number}: {selection['metric']} {best.value:.4f} with {best.params}; "
        f"state in {options.output_state}"
    )
    return 0


def _check_space(space: Mapping[str, Any], learner: str, manifest: Any) -> None:
    """Every name in the space is an option or a hyperparameter, every value of the right kind."""
    from renate_events import search

    learners = (
        list(space["learner"].choices)
        if isinstance(space.get("learner"), search.Choice)
        else [learner]
    )
    _check_option_ranges(space)
    for name in sorted(space):
        if manifest is not None and name in ("learner", "buffer", "memory_size"):
            raise UsageError(
                f"--search: {name} shapes the stored state and cannot change on a later update; "
                "search it on the first update"
            )
        if name in search.OPTIONS:
            continue
        for candidate in learners:
            parameter = space[name]
            values = (
                parameter.choices
                if isinstance(parameter, search.Choice)
                else (parameter.low, parameter.high)
            )
            for value in values:
                try:
                    check_value(candidate, name, value)
                except HyperparameterError as exc:
                    raise UsageError(f"--search: {exc}") from None


def _check_not_given(
    space: Mapping[str, Any], overrides: Mapping[str, Any], hyper: Mapping[str, Any], where: Any
) -> None:
    """A searched name is not also given a value (``--epochs 3`` beside a searched ``epochs``):
    the search would set it in every trial, so the value given would be silently ignored."""
    for name in sorted(space):
        value = hyper.get(name, overrides.get(name))
        if value is not None:
            flag = "--" + name.replace("_", "-")
            raise UsageError(
                f"--search: {name} is searched (in {where}) and given as {flag} {value}; leave "
                f"{flag} out, or take {name} out of the search space"
            )


def _try_every_value(runner: Any, space: Mapping[str, Any], current: Any) -> None:
    """Build (not train) an updater with every choice and both ends of every range, so that a
    value the learner refuses is an error before the first trial."""
    from renate_events import search

    for name, parameter in space.items():
        if isinstance(parameter, search.Choice):
            values: tuple[Any, ...] = parameter.choices
        else:
            values = (parameter.low, parameter.high)
        for value in values:
            try:
                runner.updater({**(current or {}), name: value})
            except UsageError as exc:
                raise UsageError(f"--search: {name} = {value!r} is refused: {exc}") from None


def _check_option_ranges(space: Mapping[str, Any]) -> None:
    """The searched options' values are ones the command line accepts (the settings' choices
    and lowest values)."""
    from renate_events import search

    options = [setting(name) for name in search.OPTIONS if name in space]
    for entry in (entry for entry in options if entry.choices is not None):
        allowed = sorted(entry.choices)
        bad = [c for c in getattr(space[entry.name], "choices", (None,)) if c not in allowed]
        if bad:
            raise UsageError(f"--search: {entry.name} choice {bad[0]!r} is not one of {allowed}")
    for entry in (entry for entry in options if entry.choices is None):
        parameter = space[entry.name]
        values = getattr(parameter, "choices", None) or (getattr(parameter, "low", None),)
        if any(not checks.is_real(v) or v < entry.low for v in values):
            raise UsageError(
                f"--search: {entry.name} must be a number >= {entry.low} in every trial"
            )
        if isinstance(parameter, search.FloatRange) and entry.kind == "int":
            raise UsageError(f"--search: {entry.name} is an int: give int low and high")


def _study(optuna: Any, options: Any, mode: str) -> Any:
    from renate_events import search

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our errors are one line
    try:
        return search.create_study(
            optuna,
            mode=mode,
            seed=options.seed,
            storage=options.search_storage,
            name=options.search_study,
            pruner=options.search_pruner,
        )
    except Exception as exc:  # Optuna raises many kinds for a storage it cannot open
        raise UsageError(
            f"--search-storage {options.search_storage}: cannot open it ({type(exc).__name__}: "
            f"{one_line(exc)})"
        ) from None


def _current_params(
    space: Mapping[str, Any],
    learner: str,
    manifest: Any,
    overrides: Mapping[str, Any],
    hyper: Mapping[str, Any],
    config: ConfigFile,
) -> dict[str, Any] | None:
    """What the update would use without a search, for every searched name; None when any of
    them lies outside the space (then the search need not try it)."""
    from renate_events import search

    _, _, kwargs = learner_settings(overrides, hyper, manifest)
    trainer = trainer_setting(overrides, manifest, None)
    optimizer = optimizer_setting(overrides, manifest, config).get("optimizer", {})
    known = {
        **{name: entry.default for name, entry in hyperparameters(learner).items()},
        **kwargs,
        "lr": optimizer.get("lr", setting("lr").default),
        "epochs": trainer.get("max_epochs"),
        "learner": learner,
        "buffer": overrides.get("buffer")
        or (manifest["buffer"] if manifest else default_buffer(learner)),
    }
    current = {name: known.get(name) for name in space}
    inside = all(
        value in parameter.choices
        if isinstance(parameter, search.Choice)
        else checks.is_real(value) and parameter.low <= value <= parameter.high
        for value, parameter in ((current[name], space[name]) for name in space)
    )
    return current if inside else None


def _warm_start(
    study: Any, options: Any, manifest: Any, space: Mapping[str, Any], mode: str, current: Any
) -> None:
    """Try the input state's best earlier configurations first (once per study), after the
    ``current`` settings (often the earlier best itself, which is not tried twice)."""
    from renate_events import search

    if manifest is None or search.SEARCH_FILE not in manifest["files"]:
        return
    path = os.path.join(options.input_state or "", search.SEARCH_FILE)
    with open(path, encoding="utf-8") as handle:
        for params in search.earlier_best(handle.read(), space, mode):
            if params != current:
                study.enqueue_trial(params)


@attrs.define(eq=False)
class _TrialRunner:
    """Builds and trains one trial's updater; keeps the best one's in memory."""

    options: Any
    config: ConfigFile
    manifest: Any
    overrides: Mapping[str, Any]
    hyper: Mapping[str, Any]
    chunk: int
    selection: dict[str, Any]
    task_id: Any
    kept: dict[int, ModelUpdater] = attrs.field(factory=dict)

    def check_validation(self) -> None:
        """The metric needs validation data that reports it: said before any trial."""
        _, val = self.config.data(self.chunk, self.options.seed)
        kept = self.manifest is not None and self.manifest.get("validation_memory", False)
        metric = self.selection["metric"]
        if val is None and not (kept and self.selection["validation_memory"]):
            raise UsageError(
                f"--search compares trials by {metric}, a validation metric: make data_fn return "
                "(train, validation)"
            )
        reported = ["val_loss", "val_accuracy", *(f"val_{m}" for m in self.config.metrics())]
        if metric not in reported:
            raise UsageError(
                f"--metric {metric!r} is not reported by validation; it reports {reported}"
            )

    def trial(self, trial: Any, params: Mapping[str, Any], optuna: Any) -> float:
        """Train one trial's updater (pruned by the pruner); its best validation value."""
        from renate_events import search

        trial.set_user_attr(search.WORKER, search.worker_id())  # see search.fail_dead_trials
        updater = self.updater(params)
        pruner = search.TrialPruner(trial, self.selection["metric"])
        trainer = updater.learner_instance.trainer
        with trainer.subscribed(pruner, name="_trial_pruner"):
            train, val = self.config.data(self.chunk, self.options.seed)
            result = updater.update(train, val, task_id=self.task_id, write=False)
        trial.set_user_attr("steps", int(result.steps))
        if pruner.pruned:
            raise optuna.TrialPruned()
        value = float(updater.history[-1]["best"]["value"])
        best = min if self.selection["mode"] == "min" else max
        if not self.kept or best(value, self._kept_value()) == value:
            self.kept = {trial.number: updater}
        trial.set_user_attr("value", value)
        return value

    def _kept_value(self) -> float:
        (updater,) = self.kept.values()
        return float(updater.history[-1]["best"]["value"])

    def best_updater(self, best: Any) -> ModelUpdater:
        """The best trial's updater: kept, or trained again from its parameters when another
        process ran it (an interrupted search, or another worker on the same storage)."""
        if best.number in self.kept:
            return self.kept[best.number]
        updater = self.updater(best.params)
        train, val = self.config.data(self.chunk, self.options.seed)
        updater.update(train, val, task_id=self.task_id, write=False)
        return updater

    def updater(self, params: Mapping[str, Any]) -> ModelUpdater:
        """The updater of one trial's parameters (options and hyperparameters), built."""
        from renate_events import search

        overrides, hyper = dict(self.overrides), dict(self.hyper)
        for name, value in params.items():
            (overrides if name in search.OPTIONS else hyper)[name] = value
        torch.manual_seed(self.options.seed)  # every trial starts from the same weights
        return config_updater(
            self.config,
            overrides,
            hyper,
            self.manifest,
            input_state_folder=self.options.input_state,
            output_state_folder=self.options.output_state,
            in_place=self.options.in_place,
            overwrite=self.options.overwrite,
            lock_timeout=self.options.lock_timeout,
            accept_config_change=self.options.accept_config_change,
            **self.selection,
            **scratch_setting(self.options),
        )
