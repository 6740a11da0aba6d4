"""Issue 25.1: every split (training, validation) and every transform (train, buffer, test) is
checked on a real batch before any parameter or buffer slot changes; a list of samples works."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.methods import ExperienceReplayLearner
from renate_events.updater import ModelUpdater, UpdateInputError
from tests.helpers import assert_same_tensors, one_line_cli_error, parameters_of, scaled
from trainer import Trainer

pytestmark = pytest.mark.all_or_nothing


def _images(n: int = 32, seed: int = 0) -> TensorDataset:
    """uint8 'images' of 8 features in 4 classes."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 255, (n, 8), dtype=torch.uint8, generator=g)
    return TensorDataset(inputs, torch.randint(0, 4, (n,), generator=g))


def _floats(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def _learner(**kwargs) -> ExperienceReplayLearner:
    torch.manual_seed(0)
    return ExperienceReplayLearner(
        model=torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
        memory_size=16,
        memory_batch_size=4,
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
        **kwargs,
    )


def _refused(learner, train, val, *words: str) -> None:
    """``fit`` refuses before anything changes: the model, the buffer and the RNG as they were."""
    learner.fit(_floats(16, 5) if train is None else train)  # a buffer with samples in it
    weights, seen = parameters_of(learner.model), learner.buffer.num_seen
    stored = learner.buffer.state_dict()
    rng = torch.get_rng_state()
    with pytest.raises(ValueError) as info:
        learner.fit(train if train is not None else _floats(16, 6), val)
    for word in words:
        assert word in str(info.value), info.value
    assert len(str(info.value).splitlines()) == 1
    assert_same_tensors(parameters_of(learner.model), weights)
    assert learner.buffer.num_seen == seen
    after = learner.buffer.state_dict()
    assert after.keys() == stored.keys()
    for key, value in stored.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(after[key], value), key
    assert torch.equal(torch.get_rng_state(), rng)


def test_uint8_images_without_buffer_transform_name_it_before_training():
    learner = _learner(train_transform=scaled, test_transform=scaled)
    with pytest.raises(ValueError) as info:
        learner.fit(_images())
    text = str(info.value)
    assert "training data as the buffer replays it" in text and "define buffer_transform" in text
    assert "docs/images.rst" in text and "uint8" in text
    assert learner.buffer.num_seen == 0 and learner.trainer.state.global_step == 0


def test_uint8_images_without_test_transform_refused_at_once():
    learner = _learner(train_transform=scaled, buffer_transform=scaled)
    learner.fit(_images(16, 3))
    weights, seen = parameters_of(learner.model), learner.buffer.num_seen
    with pytest.raises(ValueError, match=r"the validation data.*define test_transform"):
        learner.fit(_images(), _images(8, 1))
    assert_same_tensors(parameters_of(learner.model), weights)
    assert learner.buffer.num_seen == seen


def test_a_test_transform_returning_other_rows_is_refused_before_training():
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([scaled(x), scaled(x)])

    learner = _learner(train_transform=scaled, buffer_transform=scaled, test_transform=doubled)
    with pytest.raises(ValueError, match=r"the validation data: .*test_transform.*batch size 1"):
        learner.fit(_images(), _images(8, 1))
    assert learner.buffer.num_seen == 0


@pytest.mark.parametrize("label", [9, -1])
def test_a_label_out_of_range_only_in_validation(label):
    val = _floats(8, 1)
    val.tensors[1][3] = label
    _refused(_learner(), None, val, "the validation labels", f"{label}", "4 outputs")


def test_nan_only_in_validation():
    val = _floats(8, 1)
    val.tensors[0][5, 2] = float("nan")
    _refused(_learner(), None, val, "the validation inputs", "NaN", "index 5")


def test_a_list_of_samples_trains_like_its_dataset():
    data = _floats(24)
    samples = [(data.tensors[0][i], data.tensors[1][i]) for i in range(24)]
    learner = _learner()
    assert learner.fit(samples, samples[:8]).steps == 3
    assert learner.buffer.num_seen == 24


def _updater(**kwargs) -> ModelUpdater:
    torch.manual_seed(0)
    return ModelUpdater(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
        learner="er",
        learner_kwargs={"memory_size": 16, "memory_batch_size": 4, "batch_size": 8, "seed": 0},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        **kwargs,
    )


def test_model_updater_takes_a_list_of_samples():
    data = _floats(100)
    x, y = data.tensors
    updater = _updater()
    result = updater.update([(x[i], y[i]) for i in range(100)])
    assert result.steps == 13


def test_model_updater_refuses_validation_labels_out_of_range_before_anything_changes():
    updater = _updater()
    val = _floats(8, 1)
    val.tensors[1][0] = 9
    weights = parameters_of(updater.learner_instance.model)
    with pytest.raises(UpdateInputError, match="the validation labels range over"):
        updater.update(_floats(), val)
    assert_same_tensors(parameters_of(updater.learner_instance.model), weights)
    assert updater.learner_instance.buffer.num_seen == 0


CONFIG = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def data_fn(chunk_id, seed):
    generator = torch.Generator().manual_seed(100 * chunk_id + seed)
    inputs = torch.randn(64, 8, generator=generator)
    targets = (inputs[:, 0] > 0).long() + 2 * (inputs[:, 1] > 0).long()
    val_targets = targets[:16].clone()
    val_targets[3] = 9
    return TensorDataset(inputs, targets), TensorDataset(inputs[:16], val_targets)
"""


def test_cli_update_with_a_validation_label_out_of_range(tmp_path, capsys):
    config = tmp_path / "my_config.py"
    config.write_text(CONFIG)
    out = tmp_path / "state"
    argv = ["update", "--config-file", str(config), "--epochs", "1", "--device", "cpu"]
    one_line_cli_error(
        capsys, [*argv, "--no-progress", "--output-state", str(out)], "validation labels", "[0, 9]"
    )
    assert not out.exists()


def test_model_updater_names_the_missing_test_transform_of_uint8_images():
    updater = _updater(transforms={"train_transform": scaled, "buffer_transform": scaled})
    weights = parameters_of(updater.learner_instance.model)
    with pytest.raises(UpdateInputError, match=r"the validation data: .*define test_transform"):
        updater.update(_images(), _images(8, 1))
    assert_same_tensors(parameters_of(updater.learner_instance.model), weights)
    assert updater.learner_instance.buffer.num_seen == 0


def _first_row(x: torch.Tensor) -> torch.Tensor:
    """A broken transform: one row whatever the batch (it keeps a batch of one sample)."""
    return scaled(x)[:1]


@pytest.mark.parametrize("name", ["train_transform", "test_transform"])
def test_a_transform_returning_one_row_of_any_batch_is_refused_before_training(name):
    transforms = {"train_transform": scaled, "buffer_transform": scaled, "test_transform": scaled}
    transforms[name] = _first_row
    learner = _learner(**transforms)
    with pytest.raises(ValueError, match=rf"{name}.*batch size 2"):
        learner.fit(_images(), _images(8, 1))
    assert learner.buffer.num_seen == 0 and learner.trainer.state.global_step == 0


@pytest.mark.parametrize(
    ("transform", "words"),
    [
        (lambda x: x.float().numpy(), ("train_transform", "must return a tensor", "ndarray")),
        (lambda x: None, ("train_transform", "must return a tensor", "NoneType")),
        (lambda x: scaled(x)[:1], ("train_transform", "2 rows", "(1, 8)")),
        (lambda x: x.no_such_method(), ("train_transform fails", "AttributeError")),
    ],
)
def test_model_updater_blames_a_broken_train_transform_not_the_model(transform, words):
    updater = _updater(
        transforms={
            "train_transform": transform,
            "buffer_transform": scaled,
            "test_transform": scaled,
        }
    )
    weights = parameters_of(updater.learner_instance.model)
    with pytest.raises(UpdateInputError) as info:
        updater.update(_images(), _images(8, 1))
    text = str(info.value)
    assert "first layer" not in text and "model does not accept" not in text, text
    for word in words:
        assert word in text, text
    assert len(text.splitlines()) == 1
    assert_same_tensors(parameters_of(updater.learner_instance.model), weights)
    assert updater.learner_instance.buffer.num_seen == 0


BROKEN_LATER = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def data_fn(chunk_id, seed):
    generator = torch.Generator().manual_seed(100 * chunk_id + seed)
    inputs = torch.randint(0, 255, (40, 8), dtype=torch.uint8, generator=generator)
    return TensorDataset(inputs, torch.randint(0, 4, (40,), generator=generator))


def _scaled(x):
    return x.float() / 255


def train_transform():
    return _scaled


def test_transform():
    return _scaled


def buffer_transform():
    # right on the probe's single sample, wrong on a memory batch
    return lambda x: _scaled(x)[:1]
"""


def test_cli_a_transform_broken_on_a_later_batch_is_one_line_and_writes_nothing(tmp_path, capsys):
    config = tmp_path / "my_config.py"
    config.write_text(BROKEN_LATER)
    out = tmp_path / "state"
    argv = ["update", "--config-file", str(config), "--epochs", "1", "--device", "cpu"]
    argv += ["--no-progress", "--output-state", str(out), "--learner", "er"]
    argv += ["--batch-size", "8", "--memory-batch-size", "4", "--memory-size", "16"]
    one_line_cli_error(capsys, argv, "buffer_transform", "batch size 4", "(1, 8)")
    assert not out.exists()
