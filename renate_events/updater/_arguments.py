"""The checks of :class:`~renate_events.updater.ModelUpdater`'s arguments, each alone (attrs
validators and converters) and together (:func:`check_early_stopping`, :func:`check_buffer`)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import attrs

from renate_events.choices import (
    MAPPED_BUFFERS,
    TRANSFORMS,
    check_known_keys,
    check_optimizer,
    trainer_arguments,
)
from renate_events.methods import LEARNERS, learner_arguments, method
from renate_events.state_folder import StateFolderError, check_writable, folder_key
from trainer import validators as checks
from trainer.capture import check_capture_device

__all__ = [
    "check_buffer",
    "check_early_stopping",
    "check_folder",
    "check_json_object",
    "check_learner_kwargs",
    "check_listeners",
    "check_optimizer_config",
    "check_output_folder",
    "check_task_id",
    "check_trainer_kwargs",
    "check_transforms",
    "max_epochs_of",
    "metrics_mapping",
    "optional_callable",
]


def check_json_object(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A dict with string keys, storable in JSON without loss (no NaN or infinities)."""
    name = checks.field_name(instance, attribute)
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise checks.WrongTypeError(f"{name} must be a dict with string keys, got {value!r}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise checks.WrongTypeError(
            f"{name} must be JSON-able (it is stored in the state folder's manifest to check later "
            f"updates against it): {exc}"
        ) from None


def check_learner_kwargs(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """JSON-able keyword arguments that the learner takes."""
    check_json_object(instance, attribute, value)
    if instance.learner in LEARNERS:
        known = learner_arguments(LEARNERS[instance.learner])
        check_known_keys(checks.field_name(instance, attribute), value, known)


def check_trainer_kwargs(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """JSON-able keyword arguments that :class:`trainer.Trainer` takes."""
    check_json_object(instance, attribute, value)
    name = checks.field_name(instance, attribute)
    check_known_keys(name, value, trainer_arguments())
    if value.get("capture") == "graph":  # refused here, not when the update builds its trainer
        check_capture_device("graph", value.get("device", "auto"), f"{name}['capture']")


def max_epochs_of(updater: Any) -> tuple[int | None, dict[str, Any]]:
    """A :class:`~renate_events.updater.ModelUpdater`'s epochs per update and its
    ``trainer_kwargs`` without ``max_epochs``.

    ``trainer_kwargs['max_epochs']``, the earlier way to set the epochs, still sets them (with a
    :class:`DeprecationWarning` naming ``max_epochs``); given both ways with two values (and
    ``max_epochs`` not left at its default), a :class:`ValueError`, as for a value there that is
    not a positive int or None (checked first). The caller's dict is not changed.
    """
    max_epochs, trainer_kwargs = updater.max_epochs, updater.trainer_kwargs
    default = attrs.fields(type(updater)).max_epochs.default
    if "max_epochs" not in trainer_kwargs:
        return max_epochs, trainer_kwargs
    given = trainer_kwargs["max_epochs"]
    if given is not None and not (checks.is_int(given) and given >= 1):  # before comparing
        error = ValueError if checks.is_int(given) else checks.WrongTypeError
        raise error(
            "ModelUpdater: trainer_kwargs['max_epochs'] must be a positive int or None, got "
            f"{given!r}"
        )
    if max_epochs != default and given != max_epochs:
        raise ValueError(
            f"ModelUpdater: max_epochs={max_epochs!r} and trainer_kwargs['max_epochs']={given!r} "
            "disagree; give the epochs once, as max_epochs (trainer_kwargs['max_epochs'] is "
            "deprecated)"
        )
    # max_epochs at its default cannot be told from max_epochs left out: say what happens
    if given == max_epochs:
        what = f"max_epochs is {given!r} too: give the epochs once"
    else:
        what = (
            f"the {given!r} given there is used, as max_epochs is at its default {default} "
            "(the command line's --epochs)"
        )
    warnings.warn(
        f"ModelUpdater: trainer_kwargs['max_epochs'] is deprecated; pass max_epochs={given!r} "
        f"instead ({what})",
        DeprecationWarning,
        stacklevel=_outside_level(),
    )
    rest = {name: value for name, value in trainer_kwargs.items() if name != "max_epochs"}
    return given, rest


def _outside_level() -> int:
    """The ``stacklevel`` of a warning raised by this function's caller that names the user's
    line: the first frame outside this package and attrs' generated ``__init__`` (a
    ``ModelUpdater(...)`` or a ``ModelUpdater.from_config(...)`` in the user's code)."""
    here = os.path.dirname(__file__)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith((here, "<attrs generated"))
    ):
        frame, level = frame.f_back, level + 1
    return level


def check_folder(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A path or None."""
    if value is not None and not (isinstance(value, (str, os.PathLike)) and os.fspath(value)):
        raise checks.WrongTypeError(
            f"{checks.field_name(instance, attribute)} must be a path or None, got {value!r}"
        )


def check_task_id(task_id: Any) -> None:
    """A task id of :meth:`ModelUpdater.update`: a str, an int or None."""
    if not (task_id is None or isinstance(task_id, str) or checks.is_int(task_id)):
        raise checks.WrongTypeError(
            f"ModelUpdater.update: task_id must be a str, an int or None, got {task_id!r}"
        )


def check_optimizer_config(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """``{"name": ..., **kwargs}`` that the optimizer accepts, or a factory ``f(params)``."""
    if callable(value) and not isinstance(value, Mapping):
        return  # a factory f(params), recorded by name
    check_json_object(instance, attribute, value)
    check_optimizer(checks.field_name(instance, attribute), value)


def optional_callable(signature: str) -> Any:
    """A validator of None or a callable (``signature`` is shown in the error)."""
    return attrs.validators.optional(checks.is_callable(signature))


def metrics_mapping(value: Any) -> dict[str, Any]:
    """The converter of ``metrics``: a mapping as a dict."""
    if not isinstance(value, Mapping):
        raise checks.WrongTypeError(
            f"ModelUpdater.metrics must be a mapping {{name: fn(outputs, targets)}}, got {value!r}"
        )
    return dict(value)


def check_listeners(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Listener objects (not names or numbers)."""
    for listener in value:
        if listener is None or isinstance(listener, (str, bytes, int, float)):
            raise checks.WrongTypeError(
                f"{checks.field_name(instance, attribute)} must be listener objects, got "
                f"{listener!r}"
            )


def check_transforms(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Callables under the names of :data:`TRANSFORMS`."""
    name = checks.field_name(instance, attribute)
    for key, function in value.items():
        if key not in TRANSFORMS:
            raise ValueError(f"{name} has the unknown key {key!r}; known are {list(TRANSFORMS)}")
        if not callable(function):
            raise checks.WrongTypeError(f"{name}[{key!r}] must be a callable, got {function!r}")


def check_early_stopping(enabled: bool, metric: str | None) -> None:
    """Early stopping has a metric to watch."""
    if enabled and metric is None:
        raise ValueError(
            "ModelUpdater.early_stopping_enabled needs a metric to watch: pass metric="
            "'val_loss' (and mode='min') or another validation metric"
        )


def check_buffer(learner: str, buffer: str, buffer_storage: str) -> None:
    """The learner takes the buffer, and the buffer's storage has it."""
    spec = method(learner)
    if buffer not in spec.buffers:
        raise ValueError(
            f"ModelUpdater: learner={learner!r} cannot use buffer={buffer!r}: its "
            f"buffers are {list(spec.buffers)}; use ModelUpdater: buffer="
            f"{spec.default_buffer!r} (its default: leave buffer unset; on the command line: "
            f"--buffer {spec.default_buffer})"
        )
    if buffer_storage == "mapped" and buffer not in MAPPED_BUFFERS:
        raise ValueError(
            f"ModelUpdater: buffer_storage='mapped' has no {buffer!r} buffer; mapped "
            f"buffers are {sorted(MAPPED_BUFFERS)}: pick one of them or buffer_storage="
            "'memory' (renate-events: --buffer-storage memory)"
        )


def check_output_folder(
    output: str, input_state_folder: str | os.PathLike[str] | None, in_place: bool, probe: bool
) -> None:
    """The output folder (a :func:`~renate_events.state_folder.folder_key`) is not the input
    (unless ``in_place``) nor inside it, and, with ``probe`` (once, before an update trains),
    can be written (:func:`~renate_events.state_folder.check_writable`)."""
    source = None if input_state_folder is None else folder_key(input_state_folder)
    if output == source and not in_place:
        raise StateFolderError(
            f"output_state_folder {output} is the input_state_folder; pass in_place=True "
            "(renate-events update --in-place) to replace the input, or choose another folder"
        )
    if source is not None and output.startswith(source + os.sep):
        raise StateFolderError(
            f"output_state_folder {output} is inside the input_state_folder {source}"
        )
    if probe:
        check_writable(output)
