"""Blurry task boundaries, seeded class orders and the hue-shift scenario."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.scenarios import (
    ClassIncrementalScenario,
    HueShiftScenario,
    blurry_assignment,
    dominant_hues,
    resolve_class_order,
    shuffled_classes,
)


def _data(n: int = 400, classes: int = 4) -> TensorDataset:
    inputs = torch.arange(n, dtype=torch.float32).unsqueeze(1)  # feature 0 traces the sample
    return TensorDataset(inputs, torch.arange(n) % classes)


def _counts(task) -> list[int]:
    return torch.bincount(task.train.tensors[1], minlength=4).tolist()


# -- blurry boundaries ---------------------------------------------------------------------------


def test_zero_blurry_is_the_disjoint_split():
    sharp = ClassIncrementalScenario(_data(), num_tasks=2).tasks()
    blurry = ClassIncrementalScenario(_data(), num_tasks=2, blurry=0.0).tasks()
    for a, b in zip(sharp, blurry):
        assert torch.equal(a.train.tensors[0], b.train.tensors[0])


def test_blurry_moves_the_given_share_of_each_task_to_the_others():
    tasks = ClassIncrementalScenario(_data(), num_tasks=2, blurry=0.2, seed=3).tasks()
    # 150 training samples per task (75 per class); round(0.2 * 150) = 30 leave each task.
    assert sum(_counts(tasks[0])[:2]) == 120 and sum(_counts(tasks[0])[2:]) == 30
    assert sum(_counts(tasks[1])[2:]) == 120 and sum(_counts(tasks[1])[:2]) == 30
    every = torch.cat([task.train.tensors[0] for task in tasks]).flatten()
    assert len(every) == len(torch.unique(every)) == 300  # each sample once, none lost
    assert [task.classes for task in tasks] == [(0, 1), (2, 3)]
    assert set(tasks[0].test.tensors[1].tolist()) == {0, 1}  # test sets stay the major classes


def test_blurry_is_reproducible_and_seeded():
    a = ClassIncrementalScenario(_data(), num_tasks=2, blurry=0.5, seed=1).tasks()
    b = ClassIncrementalScenario(_data(), num_tasks=2, blurry=0.5, seed=1).tasks()
    c = ClassIncrementalScenario(_data(), num_tasks=2, blurry=0.5, seed=2).tasks()
    assert torch.equal(a[0].train.tensors[0], b[0].train.tensors[0])
    assert not torch.equal(a[0].train.tensors[0], c[0].train.tensors[0])


def test_blurry_assignment_moves_to_other_tasks_and_keeps_left_out_samples():
    task_of = torch.tensor([-1] * 10 + [0] * 100 + [1] * 50 + [2] * 40)
    new = blurry_assignment(task_of, 3, 0.5, torch.Generator().manual_seed(0))
    assert torch.equal(new[:10], task_of[:10])
    moved = new != task_of
    assert [int(moved[task_of == t].sum()) for t in range(3)] == [50, 25, 20]
    assert bool((new[task_of >= 0] >= 0).all())
    full = blurry_assignment(task_of, 3, 1.0, torch.Generator().manual_seed(0))
    assert bool((full[task_of >= 0] != task_of[task_of >= 0]).all())
    assert torch.equal(blurry_assignment(task_of, 1, 0.5, torch.Generator()), task_of)


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_blurry_outside_the_unit_interval_is_refused(value):
    with pytest.raises(
        ValueError, match=r"ClassIncrementalScenario.blurry must be a number in \[0, 1\]"
    ):
        ClassIncrementalScenario(_data(), num_tasks=2, blurry=value)


# -- class orders --------------------------------------------------------------------------------


def test_seeded_class_order_is_a_reproducible_permutation():
    order = shuffled_classes(range(10), seed=5)
    assert sorted(order) == list(range(10)) and order == shuffled_classes(range(10), seed=5)
    assert order != shuffled_classes(range(10), seed=6)
    assert resolve_class_order("seed:5", range(10)) == order
    assert resolve_class_order(None, range(10)) is None


def test_class_order_makes_the_groups():
    scenario = ClassIncrementalScenario(_data(), num_tasks=2, class_order=[3, 0, 2, 1])
    assert scenario.groups() == ((3, 0), (2, 1))
    assert [task.classes for task in scenario.tasks()] == [(0, 3), (1, 2)]
    as_tensor = ClassIncrementalScenario(
        _data(), num_tasks=2, class_order=torch.tensor([3, 0, 2, 1])
    )
    assert as_tensor.groups() == ((3, 0), (2, 1))
    seeded = ClassIncrementalScenario(_data(), num_tasks=4, class_order="seed:9")
    assert [g[0] for g in seeded.groups()] == list(shuffled_classes(range(4), 9))


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([0, 1, 2], "exactly once"),
        ([0, 1, 1, 2], "exactly once"),
        ("seed:x", "seed:N"),
        ("random", "seed:N"),
    ],
)
def test_a_bad_class_order_is_refused(value, words):
    with pytest.raises(ValueError, match=words):
        ClassIncrementalScenario(_data(), num_tasks=2, class_order=value)


def test_class_order_with_class_groups_is_refused():
    with pytest.raises(ValueError, match="class_groups already orders"):
        ClassIncrementalScenario(_data(), class_groups=[[0, 1], [2, 3]], class_order=[0, 1, 2, 3])


# -- hue shift -----------------------------------------------------------------------------------


def _coloured(hues: list[float]) -> torch.Tensor:
    """One 4x4 image per hue: pure colours on the HSV circle (saturation and value 1)."""
    images = []
    for hue in hues:
        k = (torch.tensor([5.0, 3.0, 1.0]) + hue * 6) % 6
        rgb = 1 - torch.clamp(torch.minimum(k, 4 - k), 0, 1)
        images.append(rgb.view(3, 1, 1).expand(3, 4, 4))
    return torch.stack(images)


def test_dominant_hue_matches_the_hsv_model_for_any_scale():
    hues = [0.0, 0.1, 0.25, 0.5, 0.7, 0.9]
    scores = dominant_hues(_coloured(hues))
    assert scores.tolist() == pytest.approx(hues, abs=0.011)
    as_bytes = (_coloured(hues) * 255).round().to(torch.uint8)
    assert torch.equal(dominant_hues(as_bytes), dominant_hues(as_bytes.float() / 255))
    grey = torch.full((1, 3, 4, 4), 0.5)
    assert dominant_hues(grey).tolist() == [0.0]


def test_dominant_hue_is_the_majority_colour():
    image = _coloured([0.5])[0].clone()
    image[:, 0, :] = _coloured([0.0])[0][:, 0, :]  # one row of red, three of cyan
    assert dominant_hues(image.unsqueeze(0)).tolist() == [0.5]


def test_hue_shift_sorts_tasks_by_hue():
    hues = torch.linspace(0, 0.95, 40)
    images = _coloured(
        hues[torch.randperm(40, generator=torch.Generator().manual_seed(0))].tolist()
    )
    data = TensorDataset(images, torch.arange(40) % 2)
    tasks = HueShiftScenario(data, 4, seed=0).tasks()
    assert sum(len(task.train) for task in tasks) == 30 and sum(len(t.test) for t in tasks) == 10
    ranges = [dominant_hues(task.train.tensors[0]) for task in tasks]
    for before, after in itertools.pairwise(ranges):
        assert before.max() <= after.min()
    again = HueShiftScenario(data, 4, seed=0).tasks()
    assert torch.equal(again[2].train.tensors[0], tasks[2].train.tensors[0])
    soft = HueShiftScenario(data, 4, randomness=1.0, seed=0).tasks()
    assert not all(torch.equal(a.train.tensors[0], b.train.tensors[0]) for a, b in zip(tasks, soft))


@pytest.mark.parametrize("shape", [(10, 8, 8), (10, 1, 8, 8), (10, 4, 8, 8), (10, 8, 8, 3)])
def test_hue_shift_needs_rgb_images(shape):
    data = TensorDataset(torch.rand(shape), torch.arange(10) % 2)
    with pytest.raises(ValueError, match=r"must hold RGB images \(N, 3, H, W\)"):
        HueShiftScenario(data, 2)


def test_hue_shift_on_grayscale_says_why():
    data = TensorDataset(torch.rand(10, 1, 8, 8), torch.arange(10) % 2)
    with pytest.raises(ValueError, match="grayscale images have no hue"):
        HueShiftScenario(data, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dominant_hue_on_cuda_equals_the_cpus():
    images = torch.randint(0, 256, (2100, 3, 8, 8), dtype=torch.uint8)  # three chunks
    assert torch.equal(dominant_hues(images.cuda()), dominant_hues(images))


# -- rotation and permutation of any image tensor --------------------------------------------------


def test_byte_images_rotate_as_uint8():
    from renate_events.scenarios import RotationScenario

    images = torch.randint(0, 256, (12, 3, 5, 5), dtype=torch.uint8)
    data = TensorDataset(images, torch.arange(12) % 2)
    tasks = RotationScenario(data, (0, 90), byte_images=True, seed=0).tasks()
    rotated = tasks[1].test.tensors[0]
    assert rotated.dtype == torch.uint8 and rotated.shape == (4, 3, 5, 5)
    original = tasks[0].test.tensors[0]
    expected = torch.rot90(original, 1, dims=(2, 3))  # counter-clockwise
    assert (rotated.int() - expected.int()).abs().max() <= 1
    with pytest.raises(TypeError, match="byte_images=True takes uint8 inputs"):
        RotationScenario(
            TensorDataset(images.float(), torch.arange(12) % 2), (0, 90), byte_images=True
        )


@pytest.mark.parametrize("shape", [(12, 5, 5), (12, 3, 5, 5)])
def test_permutation_and_rotation_take_any_image_tensor(shape):
    from renate_events.scenarios import PermutationScenario, RotationScenario

    data = TensorDataset(torch.rand(shape), torch.arange(12) % 2)
    permuted = PermutationScenario(data, 2, seed=0).tasks()
    assert permuted[1].test.tensors[0].shape[1:] == shape[1:]
    assert torch.equal(
        permuted[1].test.tensors[0].flatten(1).sort(dim=1).values,
        permuted[0].test.tensors[0].flatten(1).sort(dim=1).values,
    )
    rotated = RotationScenario(data, (0, 180)).tasks()
    assert rotated[1].test.tensors[0].shape[1:] == shape[1:]
