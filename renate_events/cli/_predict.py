"""``renate-events predict``: a state folder's predictions on new inputs, through its recorded
test transform and with its method's own classifier (the nearest mean of exemplars where the
method's spec names it), printed as a summary and written, when asked, as .npz or .csv."""

from __future__ import annotations

import os
from typing import Any

import numpy
import torch

from renate_events.cli._data_files import config_fitted, fitted_inputs, load_inputs_file
from renate_events.cli._errors import UsageError
from renate_events.cli._evaluate import (
    chunk_test_data,
    evaluated,
    for_evaluation,
    method_classifier,
    own_classifier,
    state_with_config,
)
from renate_events.cli._options import PredictOptions, check_options
from renate_events.cli._updaters import scratch_setting, updater_from_folder
from renate_events.inference import inference, outputs_in_batches
from trainer.data import resolve_device
from trainer.files import creation_problem, fsync_file, fsync_folder, temporary_sibling

__all__ = ["OUTPUT_SUFFIXES", "predict", "write_predictions"]

OUTPUT_SUFFIXES = (".npz", ".csv")
"""The file formats ``--output`` may name, by suffix."""


def predict(values: dict[str, Any], from_file: frozenset[str]) -> int:
    """``renate-events predict``: the labels (and class probabilities) a state folder's model
    gives to ``--data``'s inputs or to a config file's chunk."""
    options = check_options(PredictOptions, values)
    if options.data is None and options.config_file is None:
        raise UsageError(  # argparse's words: a group cannot say "one or both"
            "one of the arguments --data --config-file is required (see renate-events predict -h)"
        )
    if options.probabilities and options.output is None:  # it would be ignored
        raise UsageError("--probabilities needs --output P.npz or P.csv: the file they go to")
    _check_output(options.output)  # before anything is computed
    if options.chunk_id is not None and options.config_file is None:
        raise UsageError("--chunk-id needs --config-file")
    if options.config_file is not None:
        model, classifier, inputs = _config_inputs(options)
    else:
        inputs = load_inputs_file(options.data)
        updater, spec = updater_from_folder(options.state, **scratch_setting(options))
        inputs = fitted_inputs(f"--data {options.data}", inputs, spec)
        classifier = own_classifier(updater.learner_instance)
        model = evaluated(
            method_classifier(updater.learner_instance, classifier, options.state),
            updater.transforms,
        )
    outputs = _outputs(model.to(resolve_device(options.device)), inputs, options.state)
    labels = outputs.argmax(dim=1)
    probabilities = torch.softmax(outputs.float(), dim=1) if options.probabilities else None
    counts = torch.bincount(labels, minlength=outputs.shape[1]).tolist()
    shown = ", ".join(f"{label}: {count}" for label, count in enumerate(counts) if count)
    print(f"{len(labels)} samples, {classifier} classifier of {options.state}")
    print(f"predicted labels (label: samples): {shown}")
    if options.output is not None:
        write_predictions(options.output, labels, probabilities)
        print(f"written to {options.output}")
    return 0


def _config_inputs(options: Any) -> tuple[torch.nn.Module, str, Any]:
    """The model through the config file's test transform, the classifier's name and the
    inputs: ``--data``'s, or the test inputs of the chunk ``--chunk-id``."""
    if options.chunk_id is None and options.data is None:
        raise UsageError(
            "--config-file needs --chunk-id N (the chunk to predict on) or --data FILE (the "
            "inputs to predict on)"
        )
    if options.chunk_id is not None and options.data is not None:
        raise UsageError(
            f"--chunk-id {options.chunk_id} and --data {options.data}: predict on the chunk's "
            "test data or on the file's inputs, not both; leave one out"
        )
    data = None if options.data is None else load_inputs_file(options.data)
    config, _, updater = state_with_config(options)
    if data is not None:  # the file's inputs as stored, through the config's test_transform
        # check_split probes labelled data: labels of class 0 stand in for the unknown ones
        labelled = torch.utils.data.TensorDataset(data, torch.zeros(len(data), dtype=torch.int64))
        what = f"--data {options.data}"
        inputs = config_fitted(what, labelled, updater.learner_instance).tensors[0]
    else:
        inputs = _chunk_inputs(config, options.chunk_id, options.seed)
    classifier = own_classifier(updater.learner_instance)
    model = for_evaluation(
        method_classifier(updater.learner_instance, classifier, options.state), config
    )
    return model, classifier, inputs


def _chunk_inputs(config: Any, chunk: int, seed: int) -> torch.Tensor:
    """The test inputs of a config file's chunk (``test_data_fn``'s, else the validation data)."""
    val = None if config.has("test_data_fn") else config.data(chunk, seed)[1]
    inputs = chunk_test_data(config, chunk, seed, val).tensors[0]
    if inputs.dtype.is_floating_point and not bool(torch.isfinite(inputs).all()):
        raise UsageError(
            f"chunk {chunk}: the test inputs hold NaN or infinite values; clean or drop those "
            "samples (predict's labels for them would mean nothing)"
        )
    return inputs


def _outputs(model: torch.nn.Module, inputs: Any, state: str) -> torch.Tensor:
    """The classifier's outputs on every input, one (N, classes) tensor on the CPU."""
    with inference(model, outputs_leave_autograd=True):
        outputs = torch.cat([chunk.cpu() for chunk in outputs_in_batches(model, inputs)])
    if outputs.dim() != 2 or len(outputs) != len(inputs):
        raise UsageError(
            f"{state}: the model gives outputs of the shape {tuple(outputs.shape)} for "
            f"{len(inputs)} samples; predict needs one row of class scores per sample"
        )
    return outputs


def _check_output(path: str | None) -> None:
    """Refuse an ``--output`` that is not new, not .npz or .csv, or not in a writable folder."""
    if path is None:
        return
    if not path.endswith(OUTPUT_SUFFIXES):
        raise UsageError(f"--output {path}: expected a .npz or .csv file")
    if os.path.lexists(path):
        raise UsageError(f"--output {path} exists; predict never writes over a file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--output {path}: no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--output {path}: the folder {folder} may not be written")
    problem = creation_problem(path)  # what permission bits do not tell: /proc, a long name
    if problem is not None:
        raise UsageError(f"--output {path} cannot be written: {problem}; choose another file")


def write_predictions(
    path: str, labels: torch.Tensor, probabilities: torch.Tensor | None = None
) -> None:
    """Write ``labels`` (and ``probabilities``, one column per class) to ``path``, a new .npz
    (arrays ``labels``, ``probabilities``) or .csv file (a header row, then one row per sample:
    the label, then each class's probability): complete or not at all, never over a file.

    Raises:
        UsageError: ``path`` exists (also when it appeared meanwhile) or cannot be written.
    """
    _check_output(path)
    temporary = temporary_sibling(path, "tmp")
    try:
        with open(temporary, "wb") as handle:
            _write(handle, path, labels.numpy(), probabilities)
        fsync_file(temporary)
        _publish(temporary, path)
    except OSError as exc:
        raise UsageError(f"--output {path}: cannot write it: {exc.strerror or exc}") from None
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)
    fsync_folder(os.path.dirname(os.path.abspath(path)))


def _write(handle: Any, path: str, labels: Any, probabilities: torch.Tensor | None) -> None:
    if path.endswith(".npz"):
        arrays = {"labels": labels}
        if probabilities is not None:
            arrays["probabilities"] = probabilities.numpy()
        numpy.savez(handle, **arrays)
        return
    header = ["label"]
    table = labels.reshape(-1, 1).astype(numpy.float64)
    formats = ["%d"]
    if probabilities is not None:
        header += [f"p{k}" for k in range(probabilities.shape[1])]
        table = numpy.hstack([table, probabilities.double().numpy()])
        formats += ["%.6g"] * probabilities.shape[1]
    numpy.savetxt(handle, table, fmt=formats, delimiter=",", header=",".join(header), comments="")


def _publish(temporary: str, path: str) -> None:
    """Give the written file its name, unless a file appeared there meanwhile (a hard link
    never replaces one; where links are not supported, a rename after a last check)."""
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise UsageError(f"--output {path} exists; predict never writes over a file") from None
    except OSError:  # a file system without hard links
        if os.path.lexists(path):
            raise UsageError(f"--output {path} exists; predict never writes over a file") from None
        os.replace(temporary, path)
