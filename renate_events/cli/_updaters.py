"""The :class:`~renate_events.updater.ModelUpdater` of a command: its learner, buffer, optimizer
and trainer from the options given, the input state's manifest and the settings' defaults, built
and loaded so that every check runs before anything trains."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch.optim import Optimizer

from renate_events.choices import default_buffer
from renate_events.cli._errors import UsageError
from renate_events.cli._options import learner_message
from renate_events.cli._zoo import mlp, model_spec, spec_transforms
from renate_events.config import ConfigError, ConfigFile
from renate_events.methods import method
from renate_events.models import build_model
from renate_events.settings import COMMANDS, check_device, setting
from renate_events.state_folder import StateFolderError, read_manifest
from renate_events.state_folder.manifest import CHECKPOINT
from renate_events.updater import ModelUpdater, UpdateInputError, check_kept_settings
from trainer.capture import graph_device_problem
from trainer.checkpoint import read_checkpoint
from trainer.files import creation_problem

__all__ = [
    "config_updater",
    "feature_modules",
    "learner_settings",
    "optimizer_setting",
    "optimizer_spec",
    "progress",
    "resume_settings",
    "scratch_setting",
    "selection_settings",
    "trainer_setting",
    "training_arguments",
    "training_overrides",
    "updater_from_folder",
]

_LEARNER_OPTIONS = ("memory_size", "batch_size", "memory_batch_size")
"""Settings that are learner arguments (``learner_kwargs``) with a default of the command line."""
_OPTIMIZER_OPTIONS = ("optimizer", "lr", "momentum", "weight_decay")
_TRAINER_OPTIONS = (("epochs", "max_epochs"), ("device", "device"), ("precision", "precision"))
"""Settings that are :class:`trainer.Trainer` arguments, with the argument's name."""
_SPARSE_TRAINER_OPTIONS = ("nonfinite_loss", "capture", "tf32", "channels_last")
"""Settings that are :class:`trainer.Trainer` arguments of the same name, recorded in the state
only when given with another value than the Trainer's default or recorded already (so that the
manifest of a state trained with the defaults stays as it was)."""


def training_overrides(options: Any) -> dict[str, Any]:
    """The training options given (None: keep the input state's value, or the default)."""
    names = [name for name in COMMANDS["update"] if setting(name).later]
    return {name: getattr(options, name, None) for name in names}


def learner_settings(
    overrides: Mapping[str, Any], hyper: Mapping[str, Any], manifest: Mapping[str, Any] | None
) -> tuple[str, str, dict[str, Any]]:
    """The learner's name, the buffer and ``learner_kwargs``: the input state's (or the first
    update's defaults), then the options given."""
    if manifest is not None:
        learner = overrides.get("learner") or manifest["learner"]
        buffer = overrides.get("buffer") or manifest["buffer"]
        kwargs = dict(manifest["learner_kwargs"])
    else:
        learner = overrides.get("learner") or setting("learner").default
        buffer = overrides.get("buffer") or default_buffer(learner)
        kwargs = {name: setting(name).default for name in _LEARNER_OPTIONS}
        kwargs["seed"] = overrides.get("seed", setting("seed").default)
        if not method(learner).uses_memory:
            kwargs.pop("memory_size")
    for name in _LEARNER_OPTIONS:
        if overrides.get(name) is not None:
            kwargs[name] = overrides[name]
    kwargs.update(hyper)
    return learner, buffer, kwargs


def _buffer_storage(overrides: Mapping[str, Any], manifest: Mapping[str, Any] | None) -> str:
    """``--buffer-storage``, else the input state's (absent from its manifest: in memory)."""
    first = setting("buffer_storage").default
    saved = first if manifest is None else manifest.get("buffer_storage", first)
    return overrides.get("buffer_storage") or saved


def feature_modules(learner: str, kwargs: dict[str, Any], model: torch.nn.Module) -> None:
    """A method that distils hidden features, on a zoo model, distils its feature modules
    unless told otherwise."""
    if method(learner).features != "hidden" or "feature_modules" in kwargs:
        return
    names = getattr(model, "feature_module_names", None)
    if not names:
        raise UsageError(
            f"--learner {learner} distils intermediate features: give --feature-modules "
            '["name", ...] with names of the model\'s submodules'
        )
    kwargs["feature_modules"] = list(names)


def optimizer_setting(
    overrides: Mapping[str, Any],
    manifest: Mapping[str, Any] | None,
    config: ConfigFile | None,
    trains: bool = True,
    folder: str | None = None,
) -> dict[str, Any]:
    """``{"optimizer": ...}`` for :class:`ModelUpdater`, or nothing when ``optimizer_fn`` makes
    it. An updater that only reads the state ``folder`` (``trains`` false: ``evaluate``,
    ``predict``) needs no ``optimizer_fn``: its optimizer, of the class the checkpoint names,
    only takes the checkpoint's optimizer state and never steps."""
    if config is not None and config.has("optimizer_fn"):
        for option in _OPTIMIZER_OPTIONS:
            if overrides.get(option) is not None:
                flag = "--" + option.replace("_", "-")
                raise UsageError(
                    f"{flag}: {config.path} defines optimizer_fn, which sets the learning rate "
                    f"and the other optimizer options; change it there or leave {flag} out"
                )
        return {}
    saved = None if manifest is None else manifest["optimizer"]
    if saved is not None and "function" in saved and not trains and folder is not None:
        return {"optimizer": _SavedOptimizerClass(os.path.join(folder, CHECKPOINT))}
    if saved is not None and "function" in saved:
        raise UsageError(
            f"the state folder's optimizer came from a config file's optimizer_fn "
            f"({saved['function']}); pass that --config-file"
        )
    return {"optimizer": optimizer_spec(saved or _default_optimizer(), overrides)}


@attrs.frozen
class _SavedOptimizerClass:
    """``f(params)``: an optimizer of the class a checkpoint was written with (read once it is
    called), for an updater that reads a state and never trains it."""

    path: str

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        name = read_checkpoint(self.path)["trainer"]["optimizer_class"]
        optimizer_class = getattr(torch.optim, str(name), None)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise UsageError(
                f"{self.path}: the optimizer {name!r} came from the state's optimizer_fn and is "
                "not one of torch.optim; pass the --config-file that defines it"
            )
        return optimizer_class(params)


def _default_optimizer() -> dict[str, Any]:
    return {"name": setting("optimizer").default, "lr": setting("lr").default}


def optimizer_spec(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (``{"name": ..., "lr": ..., ...}``) with ``--optimizer``, ``--lr``,
    ``--momentum`` and ``--weight-decay`` applied; another optimizer keeps only the learning
    rate of ``base`` (its other options may not apply)."""
    optimizer = dict(base)
    first = _default_optimizer()
    current = optimizer.get("name", first["name"])
    name = overrides.get("optimizer")
    if name is not None and name != current:
        optimizer = {"name": name, "lr": optimizer.get("lr", first["lr"])}
        current = name
    for option in _OPTIMIZER_OPTIONS[1:]:
        if overrides.get(option) is not None:
            optimizer[option] = overrides[option]
    if "momentum" in optimizer and current != "sgd":
        raise UsageError(
            f"--momentum is an option of sgd, not of {current}: give --optimizer sgd or leave "
            "--momentum out"
        )
    return optimizer


def trainer_setting(
    overrides: Mapping[str, Any], manifest: Mapping[str, Any] | None, folder: str | None
) -> dict[str, Any]:
    """``trainer_kwargs``: the input state's (or the settings' defaults), then the options
    given; a saved device this machine lacks is refused unless ``--device`` replaces it."""
    if manifest is not None:
        trainer_kwargs = dict(manifest["trainer"])
    else:
        trainer_kwargs = {name: setting(option).default for option, name in _TRAINER_OPTIONS}
    for option, name in _TRAINER_OPTIONS:
        if overrides.get(option) is not None:
            trainer_kwargs[name] = overrides[option]
    for name in _SPARSE_TRAINER_OPTIONS:
        value = overrides.get(name)
        if value is not None and (value != setting(name).default or name in trainer_kwargs):
            trainer_kwargs[name] = value
    if overrides.get("distributed"):
        trainer_kwargs["distributed"] = "init"
    if "device" in trainer_kwargs and overrides.get("device") is None and folder is not None:
        check_device(
            f"{folder}: the trainer device (override it with --device)", trainer_kwargs["device"]
        )
    device = trainer_kwargs.get("device", "auto")
    problem = graph_device_problem(trainer_kwargs.get("capture", "off"), device)
    if problem is not None:
        raise UsageError(
            f"--capture graph records CUDA graphs and needs a CUDA device, got --device {problem}; "
            "use --capture compile (torch.compile on any device) or --capture off"
        )
    return trainer_kwargs


def training_arguments(
    overrides: Mapping[str, Any], manifest: Mapping[str, Any] | None, folder: str | None
) -> dict[str, Any]:
    """``max_epochs`` and ``trainer_kwargs`` for :class:`ModelUpdater`: the trainer's arguments of
    :func:`trainer_setting`, the epochs taken out (they are the updater's own argument)."""
    trainer_kwargs = trainer_setting(overrides, manifest, folder)
    # Absent from an input state's manifest: written from Python before ModelUpdater recorded
    # max_epochs, its updates trained one epoch each (None), which a later update keeps.
    return {"max_epochs": trainer_kwargs.pop("max_epochs", None), "trainer_kwargs": trainer_kwargs}


def selection_settings(options: Any) -> dict[str, Any]:
    """Best-model selection, early stopping and the validation memory from the options."""
    metric = options.metric
    mode = options.mode
    if mode is None:  # an accuracy is better when higher; anything else (a loss) when lower
        mode = "max" if metric is not None and metric.endswith("accuracy") else "min"
    if options.early_stopping is not None and metric is None:
        raise UsageError("--early-stopping watches --metric: give --metric val_loss (or another)")
    patience = attrs.fields(ModelUpdater).early_stopping_patience.default
    return {
        "metric": metric,
        "mode": mode,
        "early_stopping_enabled": options.early_stopping is not None,
        "early_stopping_patience": options.early_stopping or patience,
        "validation_memory": not options.no_validation_memory,
    }


def resume_settings(options: Any, manifest: Mapping[str, Any] | None) -> dict[str, Any]:
    """``checkpoint_every`` and ``restart`` for :class:`ModelUpdater`: mid-update checkpoints
    and whether an interrupted update's is discarded."""
    storage = _buffer_storage({"buffer_storage": options.buffer_storage}, manifest)
    if options.checkpoint_every is not None and storage != "memory":
        raise UsageError(
            f"--checkpoint-every with a {storage} buffer (--buffer-storage {storage}) is not "
            "supported: its working files do not outlive the process; use --buffer-storage "
            "memory or leave out --checkpoint-every"
        )
    return {"checkpoint_every": options.checkpoint_every, "restart": options.restart}


def scratch_setting(options: Any) -> dict[str, Any]:
    """``{"buffer_folder": --scratch-dir}`` for :class:`ModelUpdater` (nothing when not given),
    the folder checked first so that a bad one is said as the option."""
    folder = getattr(options, "scratch_dir", None)
    if folder is None:
        return {}
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--scratch-dir {folder} must be an existing folder that may be written")
    problem = creation_problem(os.path.join(folder, "buffer"))  # what access() hides from root
    if problem is not None:
        raise UsageError(
            f"--scratch-dir {folder} must be an existing folder that may be written: {problem}"
        )
    return {"buffer_folder": folder}


def config_updater(
    config: ConfigFile,
    overrides: Mapping[str, Any],
    hyper: Mapping[str, Any],
    manifest: Mapping[str, Any] | None,
    trains: bool = True,
    **kwargs: Any,
) -> ModelUpdater:
    """A :class:`ModelUpdater` from a config file and the options, built and loaded (so that
    every check runs before training); ``trains`` false for one that only reads the state."""
    model = config.model()
    learner, buffer, learner_kwargs = learner_settings(overrides, hyper, manifest)
    folder = kwargs.get("input_state_folder")
    if manifest is None:
        feature_modules(learner, learner_kwargs, model)
    else:
        check_kept_settings(folder, manifest, learner, buffer, learner_kwargs)
    try:
        updater = ModelUpdater.from_config(
            config,
            model=model,
            learner=learner,
            learner_kwargs=learner_kwargs,
            buffer=buffer,
            buffer_storage=_buffer_storage(overrides, manifest),
            **training_arguments(overrides, manifest, folder),
            metadata={} if manifest is None else manifest["metadata"],
            **optimizer_setting(overrides, manifest, config, trains, folder),
            **kwargs,
        )
        updater.learner_instance  # noqa: B018 - builds and loads, so that errors come now
    except (StateFolderError, UpdateInputError, ConfigError):
        raise
    except ValueError as exc:  # the learner's or the trainer's checks of the settings
        raise UsageError(learner_message(exc)) from None
    return updater


def updater_from_folder(
    folder: str,
    lock_timeout: float | None = None,
    overrides: Mapping[str, Any] | None = None,
    hyper: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """A :class:`ModelUpdater` with the folder's model (the command line's MLP or a zoo model),
    loaded, and the model's description; everything checked first. ``kwargs`` are more
    arguments of the updater (the output folder, ``buffer_folder``)."""
    if lock_timeout is None:
        lock_timeout = setting("lock_timeout").default
    manifest = read_manifest(folder, timeout=lock_timeout)
    if manifest.get("config") is not None:
        raise UsageError(
            f"{folder} was written from the config file {manifest['config']['file']}; pass it "
            "as --config-file"
        )
    spec = model_spec(folder, manifest)
    overrides = overrides or {}
    learner, buffer, learner_kwargs = learner_settings(overrides, hyper or {}, manifest)
    check_kept_settings(folder, manifest, learner, buffer, learner_kwargs)
    if spec["kind"] == "mlp":
        model = mlp(spec["inputs"], spec["hidden"], spec["classes"])
    else:
        model = build_model(spec["name"], **spec["args"])
    try:
        updater = ModelUpdater(
            model,
            transforms=spec_transforms(spec),
            learner=learner,
            learner_kwargs=learner_kwargs,
            buffer=buffer,
            buffer_storage=_buffer_storage(overrides, manifest),
            **training_arguments(overrides, manifest, folder),
            metadata=manifest["metadata"],
            input_state_folder=folder,
            lock_timeout=lock_timeout,
            validation_memory=manifest.get("validation_memory", False),
            **optimizer_setting(overrides, manifest, None),
            **kwargs,
        )
        updater.learner_instance  # noqa: B018 - builds and loads, so that errors come now
    except StateFolderError:
        raise
    except ValueError as exc:  # the learner's or the trainer's checks of the folder's values
        raise StateFolderError(f"{folder}: its manifest is refused: {exc}") from None
    return updater, spec


def progress(learner: Any, description: str, enabled: bool) -> None:
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
