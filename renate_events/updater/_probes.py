"""The data probes of an update: the user's data checked against the model, the loss, the
metrics and the samples of earlier updates before training, so that a mismatch is said at once,
with both shapes, instead of as an error deep inside training.

Every refusal is an :class:`~renate_events.updater.UpdateInputError`.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import attrs
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from renate_events.choices import MAPPED_TYPES
from renate_events.config import ConfigFile
from renate_events.inference import forward, model_device, takes_task_id
from renate_events.learners import (
    TRANSFORM_EXAMPLE,
    BaseExperienceReplayLearner,
    as_dataset,
    check_labels,
    check_splits,
)
from renate_events.updater._errors import UpdateInputError
from trainer.data import to_device

__all__ = [
    "InputProbe",
    "check_buffer_room",
    "check_metric",
    "check_splits_of_update",
    "dataset_tensors",
    "make_buffer_writable",
    "pair_as_dataset",
    "sample_signature",
]


def dataset_tensors(data: Dataset[Any], collate_fn: Any, what: str) -> tuple[torch.Tensor, ...]:
    """All of ``data`` as ``(inputs, targets)`` tensors, read batch by batch (``what`` names it
    in errors)."""
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 2:
        return tensors
    parts: list[Any] = []
    for batch in DataLoader(data, batch_size=512, shuffle=False, collate_fn=collate_fn):
        if not (
            isinstance(batch, (tuple, list))
            and len(batch) == 2
            and all(isinstance(part, torch.Tensor) for part in batch)
        ):
            raise UpdateInputError(
                f"{what}: the validation memory keeps (inputs, targets) tensor batches, got "
                f"{type(batch).__name__}; pass validation_memory=False "
                "(renate-events --no-validation-memory) for other data"
            )
        parts.append(batch)
    if not parts:
        raise UpdateInputError(f"{what} is empty; pass None for no validation data")
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def sample_signature(inputs: Any, targets: Any) -> dict[str, Any]:
    """The per-sample shape and dtype of a batch, as the manifest records them."""

    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return [list(value.shape[1:]), str(value.dtype).replace("torch.", "")]
        return type(value).__name__

    return {"inputs": one(inputs), "targets": one(targets)}


def pair_as_dataset(value: Any, name: str) -> Any:
    """An ``(inputs, targets)`` pair of tensors as a ``TensorDataset``, a list of ``(x, y)``
    samples as a map-style dataset; anything else as it is."""
    value = as_dataset(value)
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        return value
    if not all(isinstance(part, torch.Tensor) for part in value):
        return value
    if value[0].dim() == 0 or len(value[0]) != len(value[1]):
        raise UpdateInputError(
            f"ModelUpdater.update: {name} as (inputs, targets) needs one target per input, got "
            f"shapes {tuple(value[0].shape)} and {tuple(value[1].shape)}"
        )
    return TensorDataset(*value)


def check_splits_of_update(
    learner: BaseExperienceReplayLearner, train_dataset: Any, val_dataset: Any
) -> None:
    """The learner's checks of every split and transform (:func:`renate_events.learners.
    check_splits`: validation data like training data) before the update changes anything; a
    refusal is an :class:`UpdateInputError`."""
    try:
        check_splits(learner, train_dataset, val_dataset)
    except ValueError as exc:  # WrongTypeError is one too
        raise UpdateInputError(str(exc)) from None


def make_buffer_writable(learner: BaseExperienceReplayLearner) -> None:
    """A mapped buffer loaded lazily makes its working files now, with nothing changed if the
    disk refuses them (:class:`UpdateInputError`); other buffers have nothing to do."""
    buffer = getattr(learner, "buffer", None)
    if not isinstance(buffer, MAPPED_TYPES):
        return
    try:
        buffer.make_writable()
    except ValueError as exc:  # MappedFileError: the disk of its working files
        raise UpdateInputError(str(exc)) from exc


def check_buffer_room(learner: BaseExperienceReplayLearner, signature: Any) -> None:
    """A mapped buffer loaded lazily makes its working files now (a full or read-only disk
    refuses the update before training). One without storage yet (a first update) makes its
    files only once training has begun: refuse now a disk without room for ``max_size``
    samples of ``signature`` (their metadata, such as DER's logits, not counted: a lower
    bound)."""
    buffer = getattr(learner, "buffer", None)
    if not isinstance(buffer, MAPPED_TYPES):
        return
    make_buffer_writable(learner)
    if buffer.capacity > 0 or not signature:
        return
    pairs = [signature["inputs"], signature["targets"]]
    if not all(isinstance(pair, list) and hasattr(torch, pair[1]) for pair in pairs):
        return  # inputs that are not one tensor: their size is known at the first batch
    rows = [
        math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        for shape, dtype in pairs
    ]
    row = sum(rows)
    needed = row * cast(int, buffer.max_size)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]  # per file: the inputs' is the largest
    if limit != resource.RLIM_INFINITY and max(rows) * cast(int, buffer.max_size) > limit:
        raise UpdateInputError(
            f"the mapped buffer's inputs file needs {max(rows) * cast(int, buffer.max_size)} bytes "
            f"({buffer.max_size} samples of {max(rows)} bytes), but the process's file-size "
            f"limit is {limit} bytes; raise it (ulimit -f) or lower memory_size"
        )
    stats = os.statvfs(buffer.folder)
    free = stats.f_bavail * stats.f_frsize
    if free < needed:
        raise UpdateInputError(
            f"the mapped buffer needs at least {needed} bytes in {buffer.folder} ({buffer.max_size}"
            f" samples of {row} bytes), but its disk has {free} bytes free; free space there or "
            "pass buffer_folder on another disk"
        )


def check_metric(metric: str | None, metrics: Mapping[str, Any], validating: bool) -> None:
    """The best-model ``metric`` is reported by this update's validation."""
    if metric is None:
        return
    reported = ["val_loss", "val_accuracy", *(f"val_{name}" for name in metrics)]
    if not validating:
        raise UpdateInputError(
            f"the metric {metric!r} needs validation data: pass val_dataset "
            "(data_fn returning (train, validation)) or leave metric unset"
        )
    if metric not in reported:
        raise UpdateInputError(
            f"the metric {metric!r} is not reported by validation; it reports {reported}"
        )


@attrs.frozen
class InputProbe:
    """Checks one update's data with the functions the update was given.

    Attributes:
        collate_fn: The ``DataLoader`` collate function, or None.
        transforms: The batch transforms by Renate's names.
        metrics: ``{name: fn(outputs, targets)}``.
        config_file: Where the functions came from (its lines are shown in errors), or None.
    """

    collate_fn: Any
    transforms: Mapping[str, Any]
    metrics: Mapping[str, Any]
    config_file: ConfigFile | None

    def check(
        self,
        learner: BaseExperienceReplayLearner,
        data: Any,
        what: str,
        history: Callable[[], Sequence[Mapping[str, Any]]],
    ) -> dict[str, Any] | None:
        """One forward pass on a sample, and the sample shapes against the earlier updates' (the
        records of ``history()``); returns this data's signature (None for a loader)."""
        if not isinstance(data, Dataset):
            return None  # a loader or iterable: checked batch by batch by the trainer
        inputs, targets, task_ids = _first_batch(data, self.collate_fn, what)
        signature = sample_signature(inputs, targets)
        earlier = [r["data"] for r in history() if r.get("data")]
        if earlier and earlier[-1] != signature:
            raise UpdateInputError(
                f"{what}: its samples are {_shown(signature)}, but the state was trained on "
                f"samples of {_shown(earlier[-1])}; give data of the same shape and dtype"
            )
        if task_ids is not None or takes_task_id(learner.model):
            # Task ids (or their absence) first: the learner checks them against the model, the
            # heads (fit adds those of new ids) and the buffer, and the labels.
            _check_data(learner, data, what)
        if task_ids is None:
            self._probe(learner, inputs, targets, what, data)
        return signature

    def _probe(
        self, learner: BaseExperienceReplayLearner, inputs: Any, targets: Any, what: str, data: Any
    ) -> None:
        """The model on two samples, the labels against its outputs, then the loss and every
        metric on the outputs."""
        model = learner.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                outputs = self._forward_probe(model, inputs, what)
                _check_data(learner, data, what)
                targets = to_device(targets, outputs.device)
                if self.transforms.get("train_target_transform") is None:
                    try:  # any dataset's first labels, before the loss sees them
                        check_labels(targets, outputs, "training")
                    except ValueError as exc:
                        raise UpdateInputError(f"{what}: {exc}") from None
                target_transform = self.transforms.get("train_target_transform")
                if target_transform is not None:  # the loss sees the transformed labels
                    targets = target_transform(targets)
                self._call_probe("loss_fn", learner.loss_fn, outputs, targets, what, "the loss")
                for name, metric in self.metrics.items():
                    self._call_probe(name, metric, outputs, targets, what, f"the metric {name!r}")
        finally:
            model.train(was_training)

    def _transform_probe(self, batch: Any, what: str) -> Any:
        """``batch`` through ``train_transform``, its contract checked (a tensor of the batch's
        rows), so that a broken transform is named as such, not blamed on the model."""
        transform = self.transforms.get("train_transform")
        if transform is None:
            return batch
        shown = _tensor_text(batch)
        try:
            result = transform(batch)
        except Exception as exc:
            raise UpdateInputError(
                f"{what}: train_transform fails on its first samples ({shown}): "
                f"{type(exc).__name__}: {' '.join(str(exc).split())}{self._frame(exc)}"
            ) from None
        if not isinstance(batch, torch.Tensor):
            return result  # other inputs (a collate_fn's): the model's probe says the rest
        if not isinstance(result, torch.Tensor) or result.dim() == 0 or len(result) != len(batch):
            raise UpdateInputError(
                f"{what}: train_transform must return a tensor of the batch's {len(batch)} rows "
                f"(given {shown}), got {_tensor_text(result)}"
            )
        return result

    def _forward_probe(self, model: nn.Module, inputs: Any, what: str) -> torch.Tensor:
        transform = self.transforms.get("train_transform")
        batch = self._transform_probe(to_device(inputs, model_device(model)), what)
        try:
            return forward(model, batch)
        except Exception as exc:
            shape = _shown(sample_signature(inputs, None))
            floating = any(p.dtype.is_floating_point for p in model.parameters())
            raw = isinstance(inputs, torch.Tensor) and not inputs.dtype.is_floating_point
            if transform is None and floating and raw:  # uint8 images into a float model
                raise UpdateInputError(
                    f"{what}: the model fails on the raw {shape} samples ({type(exc).__name__}); "
                    "no train_transform is set to make them floats: define train_transform "
                    "(and buffer_transform, test_transform: the function of a config file, or "
                    f"ModelUpdater(transforms=...)), {TRANSFORM_EXAMPLE}"
                ) from None
            raise UpdateInputError(
                f"{what}: the model does not accept its samples ({shape}){_first_layer(model)}; "
                f"it raised {type(exc).__name__}: {' '.join(str(exc).split())}{self._frame(exc)}"
                ". Make model_fn's first layer fit the data (or reshape the data)"
            ) from None

    def _call_probe(
        self, name: str, function: Any, outputs: Any, targets: Any, what: str, role: str
    ) -> None:
        try:
            torch.as_tensor(function(outputs, targets)).float().mean()
        except Exception as exc:
            shapes = (
                f"outputs {_tensor_text(outputs)} and targets {_tensor_text(targets)} of two "
                "samples"
            )
            raise UpdateInputError(
                f"{what}: {role} ({name}) fails on the model's {shapes}: {type(exc).__name__}: "
                f"{' '.join(str(exc).split())}{self._frame(exc)}"
            ) from None

    def _frame(self, exc: BaseException) -> str:
        """`` (my_config.py, line 12: ...)`` where the error was raised inside the config file."""
        return "" if self.config_file is None else self.config_file.frame_of(exc)


def _check_data(learner: BaseExperienceReplayLearner, data: Any, what: str) -> None:
    try:
        learner.check_data(data)  # empty data, labels outside the outputs, task ids
    except ValueError as exc:
        raise UpdateInputError(f"{what}: {exc}") from None


def _first_batch(data: Dataset[Any], collate_fn: Any, what: str) -> tuple[Any, Any, Any]:
    """Two samples' inputs and targets, and their task ids for a ``TensorDataset`` of three
    tensors (task-incremental data; None otherwise)."""
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) in (2, 3):
        return tensors[0][:2], tensors[1][:2], (tensors[2][:2] if len(tensors) == 3 else None)
    try:
        batch = next(iter(DataLoader(data, batch_size=2, shuffle=False, collate_fn=collate_fn)))
    except StopIteration:
        raise UpdateInputError(f"{what} is empty; pass data for the update") from None
    except (RuntimeError, TypeError, ValueError) as exc:  # the collate function's refusal
        raise UpdateInputError(
            f"{what}: its first two samples cannot be made a batch ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())}); give (inputs, target) samples of one shape and "
            "kind, or a collate_fn"
        ) from None
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise UpdateInputError(
            f"{what}: batches must be (inputs, targets) pairs, got {type(batch).__name__}"
        )
    return batch[0], batch[1], None


def _tensor_text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')} {tuple(value.shape)}"
    return type(value).__name__


def _first_layer(model: nn.Module) -> str:
    """`` (its first layer is Linear(10 -> 4))`` for the first linear or convolution layer."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            return f" (its first layer is Linear({module.in_features} -> {module.out_features}))"
        if isinstance(module, nn.modules.conv._ConvNd):
            kind = type(module).__name__
            return f" (its first layer is {kind} with {module.in_channels} input channels)"
    return ""


def _shown(signature: Mapping[str, Any]) -> str:
    inputs = signature.get("inputs")
    if isinstance(inputs, list):
        return f"{inputs[1]} {tuple(inputs[0])}"
    return str(inputs)
