"""Data files of the command line: ``inputs`` and ``targets`` in .safetensors or .npz files,
numbers only (no object arrays), every tensor checked, and fitted to a state folder's model."""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from renate_events.cli._errors import UsageError, one_line
from renate_events.learners import ModelRefusedError, check_split

__all__ = [
    "config_fitted",
    "fitted",
    "fitted_inputs",
    "load_data_file",
    "load_inputs_file",
    "shift_inputs",
]


def load_data_file(path: str) -> torch.utils.data.TensorDataset:
    """``inputs`` (N, ...) and integer ``targets`` (N,) from a .safetensors or .npz file; the
    inputs keep their dtype until :func:`fitted` converts them for the state's model."""
    tensors = _read_tensors("--data", path)
    missing = {"inputs", "targets"} - set(tensors)
    if missing:
        raise UsageError(f"--data {path} lacks {sorted(missing)}; it holds {sorted(tensors)}")
    inputs, targets = _inputs(path, tensors["inputs"]), _targets(path, tensors["targets"])
    if len(inputs) != len(targets):
        raise UsageError(
            f"--data {path}: 'inputs' and 'targets' must have the same length, got {len(inputs)} "
            f"and {len(targets)}"
        )
    return torch.utils.data.TensorDataset(inputs, targets)


def load_inputs_file(path: str) -> torch.Tensor:
    """The ``inputs`` (N, ...) of a .safetensors or .npz file (``targets``, if any, unused): what
    ``predict`` predicts on."""
    tensors = _read_tensors("--data", path)
    if "inputs" not in tensors:
        raise UsageError(f"--data {path} lacks 'inputs'; it holds {sorted(tensors)}")
    return _inputs(path, tensors["inputs"])


def shift_inputs(flag: str, path: str) -> torch.utils.data.TensorDataset:
    """The ``inputs`` of a ``shift`` data file (``flag``: ``--reference`` or ``--query``), as
    float32 rows."""
    tensors = _read_tensors(flag, path)
    if "inputs" not in tensors:
        raise UsageError(f"{flag} {path} lacks 'inputs'; it holds {sorted(tensors)}")
    inputs = tensors["inputs"]
    if inputs.dim() == 0 or inputs.dtype.is_complex or inputs.dtype == torch.bool:
        raise UsageError(f"{flag} {path}: 'inputs' must be real numbers, one row per sample")
    if inputs.dtype.is_floating_point and not bool(torch.isfinite(inputs).all()):
        raise UsageError(f"{flag} {path}: 'inputs' holds NaN or infinite values")
    return torch.utils.data.TensorDataset(inputs.float())


def _read_tensors(flag: str, path: str) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors or .npz file (``flag`` names the option in errors)."""
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path}: no such file")
    if path.endswith(".safetensors"):
        return _read_safetensors(flag, path)
    if path.endswith(".npz"):
        return _read_npz(flag, path)
    raise UsageError(f"{flag} {path}: expected a .safetensors or .npz file")


def _read_safetensors(flag: str, path: str) -> dict[str, torch.Tensor]:
    import safetensors.torch

    try:
        return safetensors.torch.load_file(path)
    except (safetensors.SafetensorError, OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path} is not a readable safetensors file: {exc}") from exc


def _read_npz(flag: str, path: str) -> dict[str, torch.Tensor]:
    try:
        import numpy
    except ImportError as exc:
        raise UsageError(".npz files need numpy: pip install numpy") from exc
    if not zipfile.is_zipfile(path):
        raise UsageError(f"{flag} {path} is not a readable .npz file (not a zip archive)")
    arrays = {}
    try:
        with numpy.load(path, allow_pickle=False) as archive:
            for key in archive.files:
                array = archive[key]
                if array.dtype.kind not in "biuf":
                    raise UsageError(
                        f"{flag} {path}: {key!r} holds {array.dtype} values; it must hold numbers"
                    )
                arrays[key] = torch.from_numpy(_as_torch_dtype(numpy, array))
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise UsageError(f"{flag} {path} is not a readable .npz file: {exc}") from exc
    return arrays


_STORED = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8")
"""The numpy dtypes an array keeps (torch has each); others widen to float64 or int64."""


def _as_torch_dtype(numpy: Any, array: Any) -> Any:
    """``array`` in its stored dtype (so that messages name it), in native byte order; a dtype
    torch lacks (bool, uint16, float128, ...) as float64 or int64."""
    name = array.dtype.name if array.dtype.name in _STORED else None
    if name is None:
        name = "float64" if array.dtype.kind == "f" else "int64"
    return array.astype(numpy.dtype(name), copy=False)


def _inputs(path: str, inputs: torch.Tensor) -> torch.Tensor:
    if inputs.dim() < 2 or len(inputs) == 0:
        raise UsageError(
            f"--data {path}: 'inputs' must have the shape (samples, features) or (samples, "
            f"channels, height, width) with at least one sample, got {tuple(inputs.shape)}"
        )
    if inputs.dtype.is_complex or not (inputs.dtype.is_floating_point or _is_integer(inputs)):
        raise UsageError(f"--data {path}: 'inputs' holds {inputs.dtype} values, not real numbers")
    if inputs.dtype.is_floating_point and not bool(torch.isfinite(inputs).all()):
        raise UsageError(f"--data {path}: 'inputs' holds NaN or infinite values")
    return inputs


def _is_integer(tensor: torch.Tensor) -> bool:
    return not tensor.dtype.is_floating_point and not tensor.dtype.is_complex


def _targets(path: str, targets: torch.Tensor) -> torch.Tensor:
    if targets.dim() != 1:
        raise UsageError(
            f"--data {path}: 'targets' must be one class index per sample, got the shape "
            f"{tuple(targets.shape)}"
        )
    if targets.dtype == torch.bool or targets.dtype.is_complex:
        raise UsageError(
            f"--data {path}: 'targets' holds {targets.dtype} values, not class indices"
        )
    if targets.dtype.is_floating_point and not bool((targets == targets.round()).all()):
        raise UsageError(f"--data {path}: 'targets' holds non-integer values, not class indices")
    return targets.long()


def fitted(
    what: str, data: torch.utils.data.TensorDataset, spec: Mapping[str, Any]
) -> torch.utils.data.TensorDataset:
    """The data (``what``: where it comes from) as the model takes it: float feature vectors for
    the command line's MLP, raw ``uint8`` images for a zoo model on images; labels checked."""
    inputs, targets = data.tensors
    if len(inputs) != len(targets):
        raise UsageError(
            f"{what}: 'inputs' and 'targets' must have the same length, got {len(inputs)} "
            f"and {len(targets)}"
        )
    inputs = fitted_inputs(what, inputs, spec)
    low, high = int(targets.min()), int(targets.max())
    if low < 0 or high >= spec["classes"]:
        raise UsageError(
            f"{what}: the labels range over [{low}, {high}]; the state folder's model has "
            f"{spec['classes']} classes (labels 0..{spec['classes'] - 1})"
        )
    return torch.utils.data.TensorDataset(inputs, targets)


def config_fitted(
    what: str, data: torch.utils.data.TensorDataset, learner: Any
) -> torch.utils.data.TensorDataset:
    """A data file (``what``: where it comes from) for a config file's model: kept as stored (the
    config file's ``test_transform`` converts it, as it does the config's own test data), its
    first inputs tried on the model through that transform and its labels checked against the
    outputs (:func:`~renate_events.learners.check_split`), so that data the model cannot take
    is one line naming the file."""
    try:
        check_split(learner, data, "test")
    except ModelRefusedError as exc:  # the model failed on the inputs: say what to do
        fix = _refused_fix(exc.batch, learner)
        raise UsageError(f"{what}: {one_line(exc)}" + (f"; {fix}" if fix else "")) from None
    except ValueError as exc:
        raise UsageError(f"{what}: {one_line(exc)}") from None
    return data


def _refused_fix(sample: torch.Tensor, learner: Any) -> str:
    """What to do when a config file's model fails on a data file's inputs (``sample``: as its
    ``test_transform`` made them): another floating dtype than the model's is saved as the
    model's, else the shape is the model's to match; empty for integer inputs to a floating
    model (the refusal names the transform to define)."""
    weights = [p.dtype for p in learner.model.parameters() if p.dtype.is_floating_point]
    if weights and not sample.dtype.is_floating_point:
        return ""
    if weights and sample.dtype != weights[0]:
        wanted = str(weights[0]).removeprefix("torch.")
        return f"save the inputs as {wanted} or convert them in test_transform"
    return (
        f"the model rejected samples of the shape {tuple(sample.shape[1:])}: give inputs of the "
        "shape it takes (as the config file's data_fn gives them), or reshape them in "
        "test_transform"
    )


def fitted_inputs(what: str, inputs: torch.Tensor, spec: Mapping[str, Any]) -> torch.Tensor:
    """The inputs as the model of ``spec`` takes them (see :func:`fitted`)."""
    if spec["kind"] == "mlp":
        return _mlp_inputs(what, inputs, spec)
    return _images(what, inputs, spec)


def _mlp_inputs(what: str, inputs: torch.Tensor, spec: Mapping[str, Any]) -> torch.Tensor:
    if inputs.dim() != 2:
        raise UsageError(
            f"{what}: 'inputs' must have the shape (samples, features), got "
            f"{tuple(inputs.shape)}; the state folder's model is an MLP: flatten images first"
        )
    if inputs.shape[1] != spec["inputs"]:
        raise UsageError(
            f"{what}: the samples have {inputs.shape[1]} features; the state folder's model "
            f"takes {spec['inputs']}"
        )
    inputs = inputs.float()
    if not bool(torch.isfinite(inputs).all()):
        raise UsageError(f"{what}: 'inputs' holds values too large for float32")
    return inputs


def _images(what: str, inputs: torch.Tensor, spec: Mapping[str, Any]) -> torch.Tensor:
    """Raw images of the spec's shape, as ``uint8`` (the state's transforms make the floats)."""
    shape = tuple(spec["inputs"])
    if tuple(inputs.shape[1:]) != shape:
        raise UsageError(
            f"{what}: the samples have the shape {tuple(inputs.shape[1:])}; the state folder's "
            f"model takes {shape}"
        )
    if inputs.dtype.is_floating_point or int(inputs.min()) < 0 or int(inputs.max()) > 255:
        raise UsageError(
            f"{what}: 'inputs' must be raw images, integers 0..255 (uint8), got {inputs.dtype} "
            f"values in [{float(inputs.min()):g}, {float(inputs.max()):g}]; the state folder's "
            f"{spec['transforms']} transforms convert them to floats per batch"
        )
    return inputs.to(torch.uint8)
