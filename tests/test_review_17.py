"""Bugs found by a trial user of issue 17 (images, transforms, mapped buffers), one test each."""

from __future__ import annotations

import errno
import os
import resource

import pytest
import safetensors.torch
import torch
from torch.utils.data import TensorDataset

from renate_events import ExperienceReplayLearner
from renate_events.transforms import Normalize
from renate_events.updater import ModelUpdater, UpdateInputError
from tests.helpers import one_line_cli_error
from trainer import Trainer


def test_a_data_file_whose_inputs_and_targets_differ_in_length_is_one_line(tmp_path, capsys):
    data = tmp_path / "data.safetensors"
    inputs = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    safetensors.torch.save_file({"inputs": inputs, "targets": torch.arange(5)}, str(data))
    argv = ["evaluate", "--state", str(tmp_path / "state"), "--data", str(data)]
    one_line_cli_error(capsys, argv, "same length", "6 and 5")


def _learner(**transforms):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    return ExperienceReplayLearner(
        model=model,
        memory_size=8,
        memory_batch_size=4,
        batch_size=4,
        trainer=Trainer(max_epochs=1, device="cpu"),
        **transforms,
    )


def test_the_label_check_sees_the_target_transforms_labels():
    data = TensorDataset(torch.randn(8, 4), torch.arange(8) % 4 + 10)  # labels 10..13
    shift = {
        "train_target_transform": lambda t: t - 10,
        "buffer_target_transform": lambda t: t - 10,
    }
    assert _learner(**shift).fit(data).steps == 2  # remapped to the 4 outputs
    with pytest.raises(ValueError, match=r"training labels range over \[10, 13\]"):
        _learner(train_target_transform=shift["train_target_transform"]).fit(data)  # replay: raw
    data = TensorDataset(torch.randn(8, 4), torch.arange(8) % 4)
    for name in ("train_target_transform", "buffer_target_transform"):
        learner = _learner(**{name: lambda t: t + 10})
        before = {k: v.clone() for k, v in learner.model.state_dict().items()}
        with pytest.raises(ValueError, match=f"through {name} range over \\[10, 13\\]"):
            learner.fit(data)
        # refused before a forward pass: the batch-norm statistics are as they were
        assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())


@pytest.mark.parametrize("mean", [float("nan"), float("inf"), "a"])
def test_normalize_refuses_a_mean_that_is_not_a_finite_number(mean):
    with pytest.raises(ValueError, match=r"Normalize\.mean must be finite numbers"):
        Normalize([mean, 0.5, 0.5], [0.2, 0.2, 0.2])


def _mapped_updater(folder):
    torch.manual_seed(0)
    return ModelUpdater(
        torch.nn.Linear(4, 3),
        learner="er",
        learner_kwargs={"memory_size": 16, "memory_batch_size": 4, "batch_size": 8},
        trainer_kwargs={"device": "cpu", "max_epochs": 1},
        buffer_storage="mapped",
        output_state_folder=folder,
    )


def test_a_file_size_limit_below_the_mapped_buffer_is_refused_before_training(tmp_path):
    updater = _mapped_updater(tmp_path / "out")
    before = {k: v.clone() for k, v in updater.model.state_dict().items()}
    data = TensorDataset(torch.randn(16, 4), torch.arange(16) % 3)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200, hard))  # the inputs file: 16 x 16 bytes
    try:
        with pytest.raises(UpdateInputError, match="file-size limit is 200 bytes"):
            updater.update(data)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert all(torch.equal(before[k], v) for k, v in updater.model.state_dict().items())
    assert list(tmp_path.iterdir()) == []


CONFIG = """
import torch


def model_fn():
    return torch.nn.Linear(4, 3)


def data_fn(chunk_id, seed):
    return torch.utils.data.TensorDataset(torch.randn(16, 4), torch.arange(16) % 3)
"""


def test_a_mapped_buffer_file_failing_in_training_is_one_line_on_the_cli(
    tmp_path, capsys, monkeypatch
):
    config = tmp_path / "config.py"
    config.write_text(CONFIG)

    def too_large(*args):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(os, "posix_fallocate", too_large)  # the first buffer file, in training
    argv = ["update", "--config-file", str(config), "--output-state", str(tmp_path / "out")]
    argv += ["--buffer-storage", "mapped", "--epochs", "1", "--memory-size", "8"]
    argv += ["--batch-size", "8", "--memory-batch-size", "4", "--device", "cpu", "--no-progress"]
    one_line_cli_error(capsys, argv, "file-size limit")
    assert not (tmp_path / "out").exists()


def test_a_mapped_buffer_for_a_new_nested_output_works_beside_it_not_in_the_temp_folder(tmp_path):
    """The output's parent does not exist yet: its nearest existing ancestor, on its disk."""
    updater = _mapped_updater(tmp_path / "new" / "nested" / "out")
    assert str(updater.learner_instance.buffer.folder) == str(tmp_path)


def test_the_updaters_loss_probe_sees_the_train_target_transforms_labels():
    shift = lambda t: t - 10  # noqa: E731
    updater = ModelUpdater(
        torch.nn.Linear(4, 4),
        learner="er",
        learner_kwargs={"memory_size": 8, "memory_batch_size": 4, "batch_size": 4},
        trainer_kwargs={"device": "cpu", "max_epochs": 1},
        transforms={"train_target_transform": shift, "buffer_target_transform": shift},
    )
    assert updater.update(TensorDataset(torch.randn(8, 4), torch.arange(8) % 4 + 10)).steps == 2


def test_gdumb_checks_raw_uint8_images_through_the_train_transform():
    from renate_events.methods import GDumbLearner
    from renate_events.transforms import ToFloat

    images = torch.randint(0, 256, (6, 3, 2, 2), dtype=torch.uint8)
    data = TensorDataset(images, torch.arange(6) % 3)
    for classes in (3, 8):
        learner = GDumbLearner(
            model=torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, classes)),
            memory_size=6,
            trainer=Trainer(max_epochs=1, device="cpu"),
            train_transform=ToFloat(),
            buffer_transform=ToFloat(),
        )
        if classes == 3:
            learner.check_data(data)  # the probe took the uint8 images to the model before
        else:
            with pytest.raises(ValueError, match=r"at least the model's number of classes \(8\)"):
                learner.check_data(data)


def test_mapped_storage_without_a_mapped_herding_buffer_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"buffer_storage='mapped' has no 'herding' buffer"):
        ModelUpdater(
            torch.nn.Linear(4, 3),
            learner="icarl",
            buffer="herding",
            learner_kwargs={"memory_size": 6},
            trainer_kwargs={"device": "cpu", "max_epochs": 1},
            buffer_storage="mapped",
            output_state_folder=tmp_path / "out",
        )
    assert list(tmp_path.iterdir()) == []
