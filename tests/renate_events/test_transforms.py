"""Batch transforms (renate_events.transforms) and the learners' transform fields."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from renate_events.methods import (
    ElasticWeightConsolidationLearner,
    ExperienceReplayLearner,
    GDumbLearner,
    ICaRLLearner,
)
from renate_events.transforms import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    ToFloat,
    cifar_test_transform,
    cifar_train_transform,
)
from tests.helpers import (
    SCALED_TRANSFORMS,
    SaveThenCrash,
    assert_same_tensors,
    assert_same_tree,
    model_and_listeners,
    parameters_of,
    small_mlp,
    uint8_task,
)
from trainer import Trainer, validators


def _images(n=16, size=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator)


def test_random_crop_takes_a_window_of_the_zero_padded_image():
    images = _images(12)
    out = RandomCrop(8, padding=2, generator=torch.Generator().manual_seed(3))(images)
    assert out.shape == images.shape and out.dtype == torch.uint8
    padded = F.pad(images, (2, 2, 2, 2))
    offsets = set()
    for i in range(len(images)):
        hits = [
            (r, c)
            for r in range(5)
            for c in range(5)
            if torch.equal(out[i], padded[i, :, r : r + 8, c : c + 8])
        ]
        assert hits, f"sample {i} is no window of its padded image"
        offsets.add(hits[0])
    assert len(offsets) > 3  # one offset per image, not one per batch


def test_random_crop_builds_its_constants_once_per_device_and_size(monkeypatch):
    """A tensor built from a Python list on a GPU synchronises with the host: RandomCrop makes
    its offset limits once per device and image size, not at every call (it runs twice per
    replay step)."""
    crop = RandomCrop(8, padding=2, generator=torch.Generator().manual_seed(3))
    wide = torch.randint(0, 256, (4, 3, 6, 10), dtype=torch.uint8)
    crop(_images(4)), crop(wide)  # the first call for each size makes its constants
    built = []
    real = torch.tensor

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        built.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    for _ in range(3):
        crop(_images(4))
        out = crop(wide)
    assert built == []
    padded = F.pad(wide, (2, 2, 2, 2))  # a non-square image keeps its own limits: 4 rows, 8 cols
    assert out.shape == (4, 3, 8, 8)
    for i in range(4):
        assert any(
            torch.equal(out[i], padded[i, :, r : r + 8, c : c + 8])
            for r in range(3)
            for c in range(7)
        )


def test_random_crop_without_padding_at_full_size_is_the_identity():
    images = _images(4)
    assert torch.equal(RandomCrop(8, padding=0)(images), images)


def test_flip_probabilities_and_generator_reproducibility():
    images = _images(64).float()
    assert torch.equal(RandomHorizontalFlip(0.0)(images), images)
    assert torch.equal(RandomHorizontalFlip(1.0)(images), images.flip(-1))
    a = RandomHorizontalFlip(generator=torch.Generator().manual_seed(5))(images)
    b = RandomHorizontalFlip(generator=torch.Generator().manual_seed(5))(images)
    assert torch.equal(a, b)
    flipped = [torch.equal(a[i], images[i].flip(-1)) for i in range(64)]
    assert 10 < sum(flipped) < 54


def test_to_float_and_normalize_values():
    images = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 1, 1, 3).expand(1, 3, 1, 3)
    out = cifar_test_transform()(images.contiguous())
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    expected = (torch.tensor([0.0, 0.2, 1.0]).view(1, 1, 1, 3) - mean) / std
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="expects uint8 images"):
        ToFloat()(torch.zeros(1, 3, 2, 2))
    assert ToFloat(accept_float=True)(torch.ones(1, 3, 2, 2)).dtype == torch.float32
    with pytest.raises(ValueError, match="3 channels"):
        Normalize(CIFAR10_MEAN, CIFAR10_STD)(torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match="positive"):
        Normalize((0.5,), (0.0,))
    with pytest.raises(validators.WrongTypeError, match=r"Compose\.transforms"):
        Compose([1])


def test_cifar_preset_seeded_by_generator_or_global_rng():
    images = _images(8, size=32)
    a = cifar_train_transform("cifar100", generator=torch.Generator().manual_seed(1))(images)
    b = cifar_train_transform("cifar100", generator=torch.Generator().manual_seed(1))(images)
    assert a.dtype == torch.float32 and a.shape == (8, 3, 32, 32) and torch.equal(a, b)
    torch.manual_seed(2)
    c = cifar_train_transform()(images)
    torch.manual_seed(2)
    assert torch.equal(c, cifar_train_transform()(images))
    with pytest.raises(ValueError, match="dataset must be one of"):
        cifar_train_transform("svhn")
    with pytest.raises(ValueError, match="cannot crop"):
        RandomCrop(40, padding=2)(images)


# -- learners -----------------------------------------------------------------------------------


def _model(seed=0, size=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * size * size, 4))


def _task(seed, n=32, size=8):
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(_images(n, size, seed), torch.randint(0, 4, (n,), generator=generator))


def _augment():
    return Compose([RandomCrop(8, padding=2), RandomHorizontalFlip(), ToFloat()])


class Counting:
    """A transform that counts its calls and the dtypes it was given."""

    def __init__(self, inner):
        self.inner, self.dtypes = inner, []

    def __call__(self, inputs):
        self.dtypes.append(inputs.dtype)
        return self.inner(inputs)


def _learner(trainer=None, **kwargs):
    options = {
        "train_transform": _augment(),
        "buffer_transform": _augment(),
        "test_transform": ToFloat(),
    }
    options.update(kwargs)
    return ExperienceReplayLearner(
        model=_model(),
        memory_size=24,
        memory_batch_size=8,
        batch_size=8,
        seed=3,
        trainer=trainer or Trainer(max_epochs=2, device="cpu"),
        **options,
    )


def test_uint8_images_stay_raw_in_the_buffer_and_each_replay_is_augmented_afresh():
    buffer_transform = Counting(_augment())
    learner = _learner(buffer_transform=buffer_transform)
    learner.fit(_task(0), _task(9, n=8))
    (inputs, _), _ = learner.buffer.sample(4)
    assert inputs.dtype == torch.uint8
    stored = set(map(bytes, learner.buffer.sample(24)[0][0].numpy()))
    raw = set(map(bytes, _task(0).tensors[0].numpy()))
    assert stored <= raw  # the untransformed samples
    # 8 steps; a probe on the first raw batch, then one sample per step once memory is full.
    assert buffer_transform.dtypes and set(buffer_transform.dtypes) == {torch.uint8}
    assert len(buffer_transform.dtypes) >= 1 + 6


def test_target_transforms_apply_to_new_and_memory_targets():
    calls = {"train": 0, "buffer": 0}

    def train_targets(targets):
        calls["train"] += 1
        return targets

    def buffer_targets(targets):
        calls["buffer"] += 1
        return (targets + 1) % 4

    learner = _learner(train_target_transform=train_targets, buffer_target_transform=buffer_targets)
    learner.fit(_task(0))
    # 8 steps and one probe of all the labels by check_data (their range, before training)
    assert calls["train"] == 8 + 1 and calls["buffer"] > 6


@pytest.mark.all_or_nothing
@pytest.mark.parametrize(
    ("field", "transform", "error", "match"),
    [
        ("train_transform", lambda x: x[:-1], ValueError, "must keep the batch size"),
        ("train_transform", lambda x: x.float().tolist(), validators.WrongTypeError, "tensor"),
        ("test_transform", lambda x: "no", validators.WrongTypeError, "must return a tensor"),
        ("buffer_transform", cifar_test_transform(), ValueError, "expects uint8 images"),
    ],
)
def test_bad_transforms_fail_before_anything_changes(field, transform, error, match):
    learner = _learner(train_transform=ToFloat(accept_float=True), buffer_transform=None)
    float_task = TensorDataset(_task(0).tensors[0].float() / 255, _task(0).tensors[1])
    learner.fit(float_task)
    before = parameters_of(learner.model)
    buffer_before = learner.buffer.state_dict()
    setattr(learner, field, transform)
    with pytest.raises(error, match=match):
        learner.fit(float_task, float_task if field == "test_transform" else None)
    if field != "test_transform":  # validation runs after training: only the step is all-or-nothing
        assert_same_tensors(before, parameters_of(learner.model))
        after = learner.buffer.state_dict()
        assert torch.equal(after["sample_generator_state"], buffer_before["sample_generator_state"])
        assert after["num_seen"] == buffer_before["num_seen"]


def test_images_of_another_shape_than_the_buffers_are_refused_before_training():
    learner = _learner()
    learner.fit(_task(0))
    before = parameters_of(learner.model)
    seen = learner.buffer.num_seen
    bigger = _task(1, size=10)
    learner.train_transform = Compose([RandomCrop(8, padding=0), ToFloat()])
    with pytest.raises(ValueError, match="per-sample shape"):
        learner.fit(bigger)
    assert_same_tensors(before, parameters_of(learner.model))
    assert learner.buffer.num_seen == seen


def test_resumed_update_repeats_the_same_augmentations(tmp_path):
    tasks = [_task(0), _task(1)]
    reference = _learner()
    for task in tasks:
        reference.fit(task)
    expected = model_and_listeners(reference, tmp_path / "reference.safetensors")

    trainer = Trainer(max_epochs=2, device="cpu")
    crash = SaveThenCrash(tmp_path / "mid.safetensors", 5)
    trainer.subscribe(crash, priority=10, name="crash")
    learner = _learner(trainer)
    learner.fit(tasks[0])
    crash.armed = True
    with pytest.raises(KeyboardInterrupt):
        learner.fit(tasks[1])
    resumed = _learner()
    resumed.fit(tasks[1], resume_from=tmp_path / "mid.safetensors")
    assert_same_tree(expected, model_and_listeners(resumed, tmp_path / "resumed.safetensors"))

    # Without the transforms' draws in the checkpointed RNG the runs would differ: a run whose
    # augmentations differ ends elsewhere.
    other = _learner(train_transform=Compose([RandomCrop(8, padding=3), ToFloat()]))
    for task in tasks:
        other.fit(task)
    ours, theirs = parameters_of(reference.model), parameters_of(other.model)
    assert not all(torch.equal(ours[k], theirs[k]) for k in ours)


def _bn_learner(**transforms):
    """An ER learner on a model with batch-norm statistics, which any training forward pass
    changes."""
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


@pytest.mark.all_or_nothing
def test_the_label_check_sees_the_target_transforms_labels():
    data = TensorDataset(torch.randn(8, 4), torch.arange(8) % 4 + 10)  # labels 10..13
    shift = {
        "train_target_transform": lambda t: t - 10,
        "buffer_target_transform": lambda t: t - 10,
    }
    assert _bn_learner(**shift).fit(data).steps == 2  # remapped to the 4 outputs
    with pytest.raises(ValueError, match=r"training labels range over \[10, 13\]"):
        _bn_learner(train_target_transform=shift["train_target_transform"]).fit(data)  # replay: raw
    data = TensorDataset(torch.randn(8, 4), torch.arange(8) % 4)
    for name in ("train_target_transform", "buffer_target_transform"):
        learner = _bn_learner(**{name: lambda t: t + 10})
        before = {k: v.clone() for k, v in learner.model.state_dict().items()}
        with pytest.raises(ValueError, match=f"through {name} range over \\[10, 13\\]"):
            learner.fit(data)
        # refused before a forward pass: the batch-norm statistics are as they were
        assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())


@pytest.mark.parametrize("mean", [float("nan"), float("inf"), "a"])
def test_normalize_refuses_a_mean_that_is_not_a_finite_number(mean):
    with pytest.raises(ValueError, match=r"Normalize\.mean must be finite numbers"):
        Normalize([mean, 0.5, 0.5], [0.2, 0.2, 0.2])


@pytest.mark.parametrize(
    ("cls", "kwargs", "steps"),
    [
        (ElasticWeightConsolidationLearner, {}, 2),
        (ICaRLLearner, {"feature_modules": ["1"], "memory_size": 8, "memory_batch_size": 4}, 2),
        (GDumbLearner, {"memory_size": 8, "memory_batch_size": 4}, 1),  # the 8 buffered
    ],
    ids=["ewc-fisher", "icarl-means", "gdumb-class-probe"],
)
def test_learners_call_the_model_on_transformed_inputs_only(
    cls: Any, kwargs: Any, steps: int
) -> None:
    # EWC's Fisher pass, iCaRL's class count after herding and GDumb's class probe ran the
    # model on the raw inputs, which fails for data that needs the learner's transform.
    learner = cls(
        model=small_mlp(),
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
        **SCALED_TRANSFORMS,
        **kwargs,
    )
    for task in range(2):
        assert learner.fit(uint8_task(task)).steps == steps


def test_the_tinyimagenet_preset_crops_64_and_normalises_with_its_statistics():
    from renate_events.transforms import TINYIMAGENET_MEAN, TINYIMAGENET_STD

    images = torch.full((2, 3, 64, 64), 128, dtype=torch.uint8)
    train = cifar_train_transform("tinyimagenet")(images)
    assert train.shape == (2, 3, 64, 64) and train.dtype == torch.float32
    test = cifar_test_transform("tinyimagenet")(images)
    expected = (128 / 255 - torch.tensor(TINYIMAGENET_MEAN)) / torch.tensor(TINYIMAGENET_STD)
    assert torch.allclose(test[0, :, 0, 0], expected)


def test_the_command_lines_preset_crops_images_of_their_own_size():
    """A Tiny-ImageNet folder of 32x32 (or 8x8) images: the training transform crops at the
    images' size; its fixed crop of 64 refused every batch, in a message about model_fn."""
    from renate_events.cli._zoo import spec_transforms

    for side in (8, 32, 64):
        spec = {"kind": "zoo", "transforms": "tinyimagenet", "augment": True}
        spec["inputs"] = [3, side, side]
        images = torch.randint(0, 256, (2, 3, side, side), dtype=torch.uint8)
        transforms = spec_transforms(spec)
        for name in ("train_transform", "buffer_transform", "test_transform"):
            assert transforms[name](images).shape == (2, 3, side, side), (side, name)
