"""The checks of every split of an update (training, validation) and of every transform on a
real batch of it, before any parameter or buffer slot changes: labels within the model's outputs,
finite inputs, and each transform's contract (a tensor of the batch's rows that the model takes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from renate_events.inference import inference, model_device
from renate_events.learners.checks import ModelRefusedError, model_refused, output_classes
from renate_events.learners.seeding import rng_kept
from renate_events.memory import BufferDataset
from renate_events.models import MultiHeadClassificationModel
from trainer.capture import capture_mode
from trainer.data import to_device
from trainer.exceptions import CaptureError

__all__ = [
    "SampleList",
    "as_dataset",
    "check_labels",
    "check_split",
    "check_splits",
]


_SPLIT_TRANSFORMS = {"training": "train_transform", "validation": "test_transform"}


class SampleList(Dataset[Any]):
    """A list (or tuple) of ``(inputs, target)`` samples as a map-style dataset."""

    def __init__(self, samples: Sequence[Any]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        return self.samples[index]


def as_dataset(data: Any) -> Any:
    """A list or tuple of samples (items ``(inputs, target)`` with a scalar target, or triples
    with a task id) as a :class:`SampleList`; a list of batches, a dataset or a loader as it is.
    """
    if isinstance(data, Dataset) or not isinstance(data, (list, tuple)) or not data:
        return data
    first = data[0]
    if not (isinstance(first, (tuple, list)) and len(first) in (2, 3)):
        return data
    target = first[1]
    if isinstance(target, (int, float)) or (isinstance(target, torch.Tensor) and target.dim() == 0):
        return SampleList(data)  # one target per item: samples, not batches
    return data


def check_splits(learner: Any, train_data: Any, val_data: Any) -> None:
    """The learner's :meth:`check_data` on the training data, then :func:`check_split` on the
    training and the validation data. Raises ``ValueError`` naming the split (and the
    transform)."""
    learner.check_data(train_data)
    check_split(learner, train_data, "training")
    if val_data is not None:
        check_split(learner, val_data, "validation")


def check_capturable_heads(learner: Any) -> None:
    """Refuse a captured step (``Trainer(capture=...)``) for a multi-head model trained on data
    with task ids: which heads a batch needs depends on the data (the model's per-sample call
    picks them with ``torch.unique``), so the step cannot be one graph; raised before training.

    Raises:
        CaptureError: The trainer captures its steps and the model is a
            :class:`~renate_events.models.MultiHeadClassificationModel`.
    """
    mode = capture_mode(learner.trainer)
    if mode != "off" and isinstance(learner.model, MultiHeadClassificationModel):
        raise CaptureError(
            f"capture={mode!r} cannot capture the steps of a MultiHeadClassificationModel "
            "trained on data with task ids: the heads a batch needs depend on its task ids "
            "(data-dependent, picked with torch.unique); train it with capture='off'"
        )


def check_split(learner: Any, data: Any, split: str) -> None:
    """One split against the model: its first sample through the split's transform
    (``train_transform`` or ``test_transform``) and, for training data replayed from a buffer,
    through ``buffer_transform`` (the buffer stores the raw dtype), each tried on the model in
    eval mode without gradients and with the RNG put back; for validation data, then the labels
    within the model's outputs and the inputs finite (all of a ``TensorDataset``'s tensors, the
    first batch of another dataset). An iterable that is not a dataset is checked batch by batch
    in training; a buffer's own samples (Joint, GDumb) were checked when they were stored.

    NaN in the training data is left to the trainer's ``nonfinite_loss`` (``"skip"`` trains on
    past such batches).
    """
    if isinstance(data, BufferDataset):
        return
    batch = _first_batch(learner, as_dataset(data), split)
    if batch is None:
        return
    inputs, targets, task_ids = batch
    if task_ids is not None:
        check_capturable_heads(learner)
    if split == "training":
        # check_data has run the model on a train_transform'ed sample of a TensorDataset of
        # class labels: the buffer transform's output needs a forward only if it differs.
        run = None if _labels_probed(data) else ()
        accepted, outputs = _try_transform(learner, "train_transform", inputs, task_ids, split, run)
        if outputs is not None and learner.train_target_transform is None:
            check_labels(targets, outputs, split)  # the first labels of any other dataset
        if _replays(learner):
            _try_transform(learner, "buffer_transform", inputs, task_ids, split, accepted)
        return
    _, outputs = _try_transform(learner, "test_transform", inputs, task_ids, split, ())
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) in (2, 3):
        inputs, targets = tensors[:2]
    _check_finite(inputs, split)
    if outputs is not None:
        check_labels(targets, outputs, split)


def _labels_probed(data: Any) -> bool:
    """Whether :meth:`DataChecks.check_data` ran the model on a sample of ``data``."""
    tensors = getattr(data, "tensors", None)
    if not (isinstance(tensors, tuple) and len(tensors) in (2, 3)):
        return False
    return not tensors[1].dtype.is_floating_point and tensors[1].dim() == 1


def _replays(learner: Any) -> bool:
    """Whether memory batches go through the model (a buffer and a component that uses it)."""
    components = getattr(learner, "components", {})
    return learner.buffer is not None and any(c.weight > 0 for c in components.values())


def _first_batch(learner: Any, data: Any, split: str) -> tuple[Any, Any, Any] | None:
    """Two samples of ``data`` as ``(inputs, targets, task_ids)``, or None where ``data`` is
    not a dataset (a loader: its batches are checked as they come)."""
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) in (2, 3):
        if len(tensors[0]) == 0:
            raise ValueError(f"the {split} data is empty; pass data, or None for no {split}")
        return tensors[0][:2], tensors[1][:2], (tensors[2][:2] if len(tensors) == 3 else None)
    if not isinstance(data, Dataset):
        return None
    loader = DataLoader(data, batch_size=2, shuffle=False, collate_fn=learner.collate_fn)
    try:
        batch = next(iter(loader))
    except StopIteration:
        raise ValueError(f"the {split} data is empty; pass data, or None for no {split}") from None
    except (RuntimeError, TypeError) as exc:  # the collate function's refusal
        raise ValueError(
            f"the {split} data: its first two samples cannot be made a batch "
            f"({type(exc).__name__}: {' '.join(str(exc).split())}); give (inputs, target) "
            "samples of one shape and kind, or a collate_fn"
        ) from None
    if not (isinstance(batch, (tuple, list)) and len(batch) in (2, 3)):
        raise ValueError(
            f"the {split} data: batches must be (inputs, targets) or (inputs, targets, task_ids), "
            f"got {type(batch).__name__}; give a dataset of (inputs, target) samples"
        )
    return batch[0], batch[1], (batch[2] if len(batch) == 3 else None)


def _try_transform(
    learner: Any, name: str, inputs: Any, task_ids: Any, split: str, accepted: Any
) -> tuple[Any, torch.Tensor | None]:
    """The first sample of ``inputs`` through the transform ``name`` (its contract checked on
    one sample and on two),
    then the model unless ``accepted`` is None or the signature the model already took:
    ``(signature, the model's outputs)`` (None for what was not run)."""
    if not isinstance(inputs, torch.Tensor):
        return None, None
    model = learner.model
    device = model_device(model)
    # The buffer transform is tried on one sample: its rows are checked on every memory batch
    # (tests pin that it never sees more than one sample outside replay).
    batch = to_device(inputs[: 1 if name == "buffer_transform" else 2], device)
    ids = None if task_ids is None else to_device(task_ids[:1], device)
    with inference(model), rng_kept(batch):
        try:
            batch = learner.probe_transform(name, batch)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"the {split} data: {exc}") from None
        signature = (batch.dtype, tuple(batch.shape[1:]))
        if accepted is None or signature == accepted:
            return signature, None
        if ids is not None and not _has_heads(model, ids):
            return signature, None  # heads still to add: check_data checks these ids
        try:
            outputs = learner._forward(batch, ids)
        except Exception as exc:
            message = model_refused(learner, name, batch, split, exc)
            raise ModelRefusedError(message, batch) from None
    return signature, outputs


def _has_heads(model: Any, task_ids: torch.Tensor) -> bool:
    heads = getattr(model, "heads", None)
    return heads is None or all(str(t) in heads for t in task_ids.tolist())


def _check_finite(inputs: Any, split: str) -> None:
    if not (isinstance(inputs, torch.Tensor) and inputs.dtype.is_floating_point):
        return
    if not bool(torch.isfinite(inputs).all()):  # one synchronisation per split and update
        rows = (~torch.isfinite(inputs.reshape(len(inputs), -1))).any(1).nonzero()
        raise ValueError(
            f"the {split} inputs hold NaN or infinite values ({len(rows)} samples, the first "
            f"at index {int(rows[0])}); clean or drop those samples"
        )


def check_labels(targets: Any, outputs: torch.Tensor, split: str) -> None:
    """Class labels (integers, one per sample) of ``split`` within the model's ``outputs``
    (other targets are left to the loss). Raises ``ValueError`` naming the split."""
    if not isinstance(targets, torch.Tensor) or targets.dim() != 1:
        return
    if targets.dtype.is_floating_point or targets.dtype.is_complex or len(targets) == 0:
        return
    try:
        classes = output_classes(outputs)
    except ValueError as exc:
        raise ValueError(f"the {split} data: {exc}") from None
    low, high = int(targets.min()), int(targets.max())
    if low < 0 or high >= classes:
        raise ValueError(
            f"the {split} labels range over [{low}, {high}], but the model has {classes} outputs "
            f"(labels 0..{classes - 1}); remap the labels or widen the model's last layer"
        )
