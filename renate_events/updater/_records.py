"""What a state folder records of an update and of the configuration that wrote it, and the
comparison of a folder's configuration with an updater's."""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from torch import nn

from renate_events.config import ConfigFile
from renate_events.state_folder import FORMAT_NAME, FORMAT_VERSION, StateFolderError
from renate_events.updater._config_file import ConfigFunction, check_config_file, config_record
from renate_events.updater._listeners import BestWeights
from trainer import FitResult

__all__ = [
    "STRUCTURAL",
    "UpdateFunctions",
    "architecture_of",
    "check_compatible",
    "check_kept_settings",
    "configuration_differences",
    "describe",
    "kept_settings_differences",
    "manifest_now",
    "model_signature",
    "optimizer_record",
    "refuse_differences",
    "update_record",
    "updater_config",
    "with_update",
]

STRUCTURAL = ("memory_size", "feature_modules")  # learner_kwargs that shape the stored state


def describe(function: Any) -> str:
    """What a state folder records of a callable: where it is defined and its name."""
    if isinstance(function, functools.partial):
        return f"partial({describe(function.func)})"
    if isinstance(function, ConfigFunction):
        return f"{os.path.basename(function.config.path)}:{function.name}"
    module = getattr(function, "__module__", None) or "?"
    if module.startswith("_renate_events_config_"):  # defined in a config file
        module = "config"
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}"


def _source_sha256(function: Any) -> str | None:
    """The SHA-256 of a function's source (or of its bytecode), None for other callables."""
    target = function.func if isinstance(function, functools.partial) else function
    if isinstance(target, ConfigFunction):
        target = target.config.functions[target.name]
    try:
        text = inspect.getsource(target).encode("utf-8")
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        if code is None:
            return None
        text = code.co_code
    return hashlib.sha256(text).hexdigest()


def optimizer_record(optimizer: Mapping[str, Any] | Callable[..., Any]) -> dict[str, Any]:
    """The manifest's ``optimizer``: the options, or ``{"function": ...}`` for a factory."""
    if isinstance(optimizer, Mapping):
        return dict(optimizer)
    return {"function": describe(optimizer)}


@attrs.frozen
class UpdateFunctions:
    """The functions an update was given (None where not given), as its record names them."""

    loss_fn: Any
    learning_rate_scheduler: Any
    collate_fn: Any
    transforms: Mapping[str, Any]
    metrics: Mapping[str, Any]
    listeners: Sequence[Any]
    optimizer: Any

    @classmethod
    def of(cls, updater: Any) -> UpdateFunctions:
        """The functions of ``updater`` (a :class:`~renate_events.updater.ModelUpdater`), read
        from its attributes of the same names."""
        return cls(**{field.name: getattr(updater, field.name) for field in attrs.fields(cls)})

    def names(self) -> dict[str, Any]:
        """Where each function is defined, the metrics' names and the listeners' classes."""
        named = {
            "loss_fn": self.loss_fn,
            "learning_rate_scheduler": self.learning_rate_scheduler,
            "collate_fn": self.collate_fn,
        }
        functions: dict[str, Any] = {
            name: describe(function) for name, function in named.items() if function is not None
        }
        functions.update({name: describe(f) for name, f in self.transforms.items()})
        functions["metrics"] = sorted(self.metrics)
        functions["listeners"] = [type(listener).__name__ for listener in self.listeners]
        return functions

    def sha256s(self) -> dict[str, str]:
        """The SHA-256 of every function's source, by its argument's name."""
        given = {
            "loss_fn": self.loss_fn,
            "learning_rate_scheduler": self.learning_rate_scheduler,
            "collate_fn": self.collate_fn,
            **self.transforms,
            **{f"metrics.{name}": metric for name, metric in self.metrics.items()},
        }
        if not isinstance(self.optimizer, Mapping):
            given["optimizer"] = self.optimizer
        return {
            name: digest
            for name, function in given.items()
            if function is not None and (digest := _source_sha256(function)) is not None
        }


def update_record(
    task_id: Any,
    result: FitResult,
    seconds: float,
    *,
    signature: dict[str, Any] | None,
    best: BestWeights | None,
    samples: int | None = None,
    functions: UpdateFunctions,
    learner_kwargs: Mapping[str, Any],
    config_sha256: str | None,
) -> dict[str, Any]:
    """One update's record in the manifest's ``history``."""
    metrics = {
        name: float(value)
        for name, value in result.metrics.items()
        if isinstance(value, (int, float)) and value == value and abs(value) != float("inf")
    }
    return {
        "task_id": task_id,
        "steps": int(result.steps),
        "epochs": int(result.epochs),
        "stopped_early": bool(result.stopped_early),
        "seconds": round(seconds, 3),
        "metrics": metrics,
        "learner_kwargs": dict(learner_kwargs),
        "optimizer": optimizer_record(functions.optimizer),
        "functions": functions.names(),
        "functions_sha256": functions.sha256s(),
        "data": signature,
        "samples": samples,
        "best": None
        if best is None or best.best is None
        else {"metric": best.metric, "mode": best.mode, "value": best.best, "epoch": best.epoch},
        "config_sha256": config_sha256,
    }


def dataset_size(data: Any) -> int | None:
    """The number of samples of an update's data (None for data without ``len``): the manifest
    records it, so that a buffer read back cannot claim to have seen more."""
    try:
        return len(data)
    except TypeError:
        return None


def with_update(manifest: dict[str, Any], task_id: Any, record: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` (from :func:`manifest_now`) with one more update, of ``record``."""
    manifest["updates"] += 1
    manifest["task_ids"].append(task_id)
    manifest["history"].append(record)
    return manifest


def manifest_now(
    previous: Mapping[str, Any] | None,
    config: Mapping[str, Any],
    *,
    trainer: Mapping[str, Any],
    metadata: Mapping[str, Any],
    architecture: str,
    validation_memory: bool,
    config_file: ConfigFile | None,
    buffer_storage: str,
) -> dict[str, Any]:
    """The manifest of the state now (without ``files``): the ``previous`` one's progress (None
    before the first update) with an updater's configuration (``config``: learner, its keyword
    arguments, optimizer record, buffer and model signature) and settings."""
    manifest = dict(previous) if previous is not None else {}
    manifest.update(
        format=FORMAT_NAME,
        format_version=FORMAT_VERSION,
        trainer=trainer,
        metadata=metadata,
        architecture=architecture,
        validation_memory=validation_memory,
        **config,
    )
    if config_file is not None or "config" not in manifest:
        manifest["config"] = config_record(config_file)
    manifest.pop("buffer_storage", None)
    if buffer_storage != "memory":  # absent: in memory (as in every earlier folder)
        manifest["buffer_storage"] = buffer_storage
    manifest.setdefault("updates", 0)
    manifest["task_ids"] = list(manifest.get("task_ids", []))
    manifest["history"] = list(manifest.get("history", []))
    return manifest


def architecture_of(model: nn.Module) -> str:
    """The model's ``architecture`` attribute, or its class name."""
    name = getattr(model, "architecture", None)
    return name if isinstance(name, str) and name else type(model).__name__


def model_signature(model: nn.Module) -> dict[str, list[Any]]:
    """``{parameter: [shape, dtype]}`` of the model's state dict, as the manifest records it."""
    return {
        name: [list(tensor.shape), str(tensor.dtype).replace("torch.", "")]
        for name, tensor in model.state_dict().items()
    }


def kept_settings_differences(
    manifest: Mapping[str, Any], learner: str, buffer: str, learner_kwargs: Mapping[str, Any]
) -> list[str]:
    """What differs between a folder's learner, buffer and the learner arguments that shape the
    stored state (:data:`STRUCTURAL`) and an update's: a later update keeps them; a message for
    each."""
    mine = {"learner": learner, "buffer": buffer}
    differences = [
        f"{key}: the folder has {manifest[key]!r}, this updater {mine[key]!r}"
        for key in ("learner", "buffer")
        if manifest[key] != mine[key]
    ]
    for key in STRUCTURAL:
        saved = manifest["learner_kwargs"].get(key)
        live = learner_kwargs.get(key)
        if saved != live:
            differences.append(
                f"learner_kwargs[{key!r}]: the folder has {saved!r}, this updater {live!r}"
            )
    return differences


def configuration_differences(
    manifest: Mapping[str, Any],
    mine: Mapping[str, Any],
    learner_kwargs: Mapping[str, Any],
    buffer_storage: str,
) -> list[str]:
    """What differs between a folder's configuration (its ``manifest``) and an updater's
    (``mine``: learner, buffer, optimizer record and model signature) that the folder's state
    cannot follow; a message for each."""
    differences = kept_settings_differences(
        manifest, mine["learner"], mine["buffer"], learner_kwargs
    )
    saved_optimizer, live_optimizer = manifest["optimizer"], mine["optimizer"]
    if saved_optimizer.get("name", "adam") != live_optimizer.get("name", "adam") and not (
        "function" in saved_optimizer or "function" in live_optimizer
    ):  # the checkpoint's optimizer state is checked against one of the same class
        differences.append(
            f"optimizer: the folder has {saved_optimizer.get('name', 'adam')!r}, this "
            f"updater {live_optimizer.get('name', 'adam')!r} (its options may change)"
        )
    saved_storage = manifest.get("buffer_storage", "memory")
    if saved_storage != buffer_storage:
        differences.append(
            f"buffer_storage: the folder has {saved_storage!r}, this updater "
            f"{buffer_storage!r} (renate-events update --buffer-storage {saved_storage})"
        )
    return differences + _model_differences(manifest["model"], mine["model"])


def _model_differences(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    differences = []
    for name in sorted(set(saved) | set(live)):
        if name not in live:
            differences.append(f"model: the folder has parameter {name!r}, the model does not")
        elif name not in saved:
            differences.append(f"model: the model has parameter {name!r}, the folder does not")
        elif saved[name] != live[name]:
            differences.append(
                f"model: {name!r} is {saved[name][1]} {tuple(saved[name][0])} in the folder, "
                f"{live[name][1]} {tuple(live[name][0])} in the model"
            )
    return differences


def updater_config(updater: Any) -> dict[str, Any]:
    """What a ``ModelUpdater`` records of its configuration in the manifest (and checks a later
    update against): the learner, its arguments, the optimizer, the buffer, the model's shape."""
    return {
        "learner": updater.learner,
        "learner_kwargs": updater.learner_kwargs,
        "optimizer": optimizer_record(updater.optimizer),
        "buffer": updater.buffer,
        "model": model_signature(updater.model),
    }


def refuse_differences(folder: Any, differences: list[str]) -> None:
    """A :class:`~renate_events.state_folder.StateFolderError` listing ``differences`` between
    ``folder``'s configuration and an update's, if there are any."""
    if differences:
        raise StateFolderError(
            f"the state folder {folder} was written by a different configuration: "
            + "; ".join(differences)
        )


def check_kept_settings(
    folder: Any,
    manifest: Mapping[str, Any],
    learner: str,
    buffer: str,
    learner_kwargs: Mapping[str, Any],
) -> None:
    """A later update of ``folder`` keeps its learner, buffer and memory size (they shape the
    stored state): checked before the learner is built, so that a change is said as such rather
    than as the new learner refusing the old buffer or memory size."""
    refuse_differences(folder, kept_settings_differences(manifest, learner, buffer, learner_kwargs))


def check_compatible(updater: Any, manifest: Mapping[str, Any]) -> None:
    """The input folder's ``manifest`` was written by ``updater``'s configuration (a
    :class:`~renate_events.updater.ModelUpdater`) and config file (unless it accepts a change);
    else a :class:`~renate_events.state_folder.StateFolderError`."""
    differences = configuration_differences(
        manifest, updater_config(updater), updater.learner_kwargs, updater.buffer_storage
    )
    refuse_differences(updater.input_state_folder, differences)
    if updater.config_file is not None and not updater.accept_config_change:
        check_config_file(updater.input_state_folder, manifest["config"], updater.config_file)
