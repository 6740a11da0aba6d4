"""Tests for renate_events.scenarios: splits, transformations, reproducibility and errors."""

from __future__ import annotations

import doctest
import inspect
import itertools
import math

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from renate_events import scenarios
from renate_events.scenarios import (
    SCENARIOS,
    ClassIncrementalScenario,
    DataIncrementalScenario,
    FeatureSortingScenario,
    IIDScenario,
    PermutationScenario,
    RotationScenario,
    Task,
    permuted_digits,
    rotate_images,
    rotated_digits,
    split_digits,
)


def _data(n: int = 60, classes: int = 4, features: int = 5, seed: int = 0) -> TensorDataset:
    """Inputs whose feature 0 is the sample's index (to trace samples), targets cycle classes."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.rand(n, features, generator=generator)
    inputs[:, 0] = torch.arange(n, dtype=torch.float32)
    return TensorDataset(inputs, torch.arange(n) % classes)


def _ids(dataset: TensorDataset) -> list[int]:
    return dataset.tensors[0][:, 0].long().tolist()


def _images(n: int = 24, size: int = 6, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 1, size, size, generator=generator), torch.arange(n) % 3)


FACTORIES = {
    "class-incremental": lambda data, seed: ClassIncrementalScenario(data, num_tasks=2, seed=seed),
    "permutation": lambda data, seed: PermutationScenario(data, 3, seed=seed),
    "rotation": lambda data, seed: RotationScenario(
        data, (0, 30, 90), image_shape=(1, 1, 5), seed=seed
    ),
    "iid": lambda data, seed: IIDScenario(data, 3, seed=seed),
    "data-incremental": lambda data, seed: DataIncrementalScenario(
        data, torch.arange(len(data)) % 3, data_ids=(2, 0, 1), seed=seed
    ),
    "feature-sorting": lambda data, seed: FeatureSortingScenario(
        data, 3, feature_idx=2, randomness=0.3, seed=seed
    ),
}


def _tensors(tasks: list[Task]) -> list[torch.Tensor]:
    return [t for task in tasks for t in (*task.train.tensors, *task.test.tensors)]


# ---------------------------------------------------------------------------- reproducibility


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_same_seed_same_tensors_other_seed_other_tensors(kind: str) -> None:
    make = FACTORIES[kind]
    first, again = make(_data(), 3).tasks(), make(_data(), 3).tasks()
    other = make(_data(), 4).tasks()
    assert len(first) == len(again) == make(_data(), 3).num_tasks
    for a, b in zip(_tensors(first), _tensors(again)):
        assert torch.equal(a, b)
    assert [t.classes for t in first] == [t.classes for t in again]
    assert any(
        a.shape != b.shape or not torch.equal(a, b)
        for a, b in zip(_tensors(first), _tensors(other))
    )


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_iteration_length_and_task_ids(kind: str) -> None:
    scenario = FACTORIES[kind](_data(), 0)
    tasks = list(scenario)
    assert len(scenario) == scenario.num_tasks == len(tasks)
    assert [task.task_id for task in tasks] == list(range(len(tasks)))
    for task in tasks:
        assert len(task.train) > 0 and len(task.test) > 0
        assert task.train.tensors[1].dtype == torch.int64


def test_any_map_style_dataset_is_read_once_into_tensors() -> None:
    data = _data()

    class Pairs(Dataset):
        def __len__(self) -> int:
            return len(data)

        def __getitem__(self, index: int):
            x, y = data[index]
            return x, int(y)

    from_pairs = IIDScenario(Pairs(), 2, seed=1).tasks()
    from_tensors = IIDScenario(data, 2, seed=1).tasks()
    for a, b in zip(_tensors(from_pairs), _tensors(from_tensors)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_cuda_data_gives_the_same_tasks_as_cpu_data(kind: str) -> None:
    data = _data()
    on_gpu = TensorDataset(*(t.cuda() for t in data.tensors))
    cpu_tasks, gpu_tasks = FACTORIES[kind](data, 5).tasks(), FACTORIES[kind](on_gpu, 5).tasks()
    for a, b in zip(_tensors(cpu_tasks), _tensors(gpu_tasks)):
        assert b.is_cuda
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=0)
    assert [t.classes for t in cpu_tasks] == [t.classes for t in gpu_tasks]


# ------------------------------------------------------------------------------- train / test


@pytest.mark.parametrize("fraction", [None, 0.1, 0.5])
def test_split_is_stratified_and_disjoint(fraction: float | None) -> None:
    data = _data(n=80, classes=4)
    tasks = ClassIncrementalScenario(data, num_tasks=1, test_fraction=fraction).tasks()
    train, test = _ids(tasks[0].train), _ids(tasks[0].test)
    assert not set(train) & set(test)
    assert sorted(train + test) == list(range(80))
    expected = math.floor(20 * (0.25 if fraction is None else fraction) + 0.5)
    assert torch.bincount(tasks[0].test.tensors[1]).tolist() == [expected] * 4


def test_split_keeps_a_training_sample_of_every_class() -> None:
    data = TensorDataset(torch.arange(5.0).unsqueeze(1), torch.tensor([0, 0, 1, 1, 2]))
    task = ClassIncrementalScenario(data, class_groups=[[0, 1, 2]], test_fraction=0.9).tasks()[0]
    assert sorted(task.train.tensors[1].tolist()) == [0, 1, 2]  # class 2 has a single sample
    assert sorted(task.test.tensors[1].tolist()) == [0, 1]


def test_explicit_test_dataset_is_used_as_given() -> None:
    data, test = _data(n=40), _data(n=12, seed=5)
    tasks = ClassIncrementalScenario(data, [[0, 1], [2, 3]], test_dataset=test).tasks()
    assert sorted(_ids(tasks[0].train) + _ids(tasks[1].train)) == list(range(40))
    assert sorted(_ids(tasks[0].test) + _ids(tasks[1].test)) == list(range(12))
    iid = IIDScenario(data, 2, test_dataset=test).tasks()
    assert all(torch.equal(task.test.tensors[0], test.tensors[0]) for task in iid)


# ---------------------------------------------------------------------------- class-incremental


def test_class_incremental_groups_are_disjoint_and_cover_all_classes() -> None:
    data = _data(n=100, classes=10)
    tasks = ClassIncrementalScenario(data, num_tasks=3, seed=2).tasks()
    assert [task.classes for task in tasks] == [(0, 1, 2, 3), (4, 5, 6), (7, 8, 9)]
    seen: set[int] = set()
    for task in tasks:
        for split in (task.train, task.test):
            assert set(split.tensors[1].tolist()) == set(task.classes)
        assert not seen & set(task.classes)
        seen |= set(task.classes)
    assert seen == set(range(10))
    train_ids = [i for task in tasks for i in _ids(task.train)]
    test_ids = [i for task in tasks for i in _ids(task.test)]
    assert sorted(train_ids + test_ids) == list(range(100))


def test_class_incremental_explicit_groups_keep_their_order() -> None:
    tasks = ClassIncrementalScenario(_data(), [[3], [0, 2]]).tasks()
    assert [task.classes for task in tasks] == [(3,), (0, 2)]
    assert set(tasks[1].train.tensors[1].tolist()) == {0, 2}  # class 1 left out


# ------------------------------------------------------------------------------- permutation


def test_permutations_are_bijections_and_task_zero_is_the_identity() -> None:
    data = _data(n=40, features=6)
    scenario = PermutationScenario(data, 4, seed=3)
    permutations = scenario.permutations()
    assert torch.equal(permutations[0], torch.arange(6))
    for permutation in permutations:
        assert torch.equal(torch.sort(permutation).values, torch.arange(6))
    assert len({tuple(p.tolist()) for p in permutations}) == 4
    tasks = scenario.tasks()
    # test sets: the same test pool, each under its permutation
    pool = tasks[0].test.tensors[0]
    for task, permutation in zip(tasks, permutations):
        assert torch.equal(task.test.tensors[0], pool[:, permutation])
        assert torch.equal(task.test.tensors[1], tasks[0].test.tensors[1])
    # training chunks: disjoint samples of the training pool, permuted
    originals = data.tensors[0]
    chunks = []
    for task, permutation in zip(tasks, permutations):
        inverse = torch.argsort(permutation)
        restored = task.train.tensors[0][:, inverse]
        ids = restored[:, 0].long()
        assert torch.equal(restored, originals[ids])
        chunks.append(ids.tolist())
    sizes = [len(c) for c in chunks]
    assert max(sizes) - min(sizes) <= 1
    assert sorted(i for chunk in chunks for i in chunk) == sorted(
        set(range(40)) - set(_ids(tasks[0].test))
    )


def test_permutation_of_images_keeps_their_shape() -> None:
    tasks = PermutationScenario(_images(), 2).tasks()
    assert tasks[1].train.tensors[0].shape[1:] == (1, 6, 6)
    flat = tasks[0].test.tensors[0].flatten(1)
    assert torch.equal(torch.sort(tasks[1].test.tensors[0].flatten(1)).values, flat.sort().values)


# ---------------------------------------------------------------------------------- rotation


def test_rotation_by_zero_is_the_identity_and_by_90_matches_rot90() -> None:
    data = _images(n=24, size=6)
    tasks = RotationScenario(data, degrees=(0, 90, 360)).tasks()
    pool = tasks[0].test.tensors[0]
    assert torch.equal(tasks[2].test.tensors[0], pool)  # exact, no interpolation
    expected = torch.rot90(pool, k=1, dims=(-2, -1))
    torch.testing.assert_close(tasks[1].test.tensors[0], expected, atol=1e-5, rtol=0)


def test_rotation_of_flat_inputs_with_image_shape() -> None:
    data = TensorDataset(torch.rand(12, 2 * 5 * 5), torch.arange(12) % 2)
    tasks = RotationScenario(data, (0, 180, -90), image_shape=(2, 5, 5)).tasks()
    assert all(task.train.tensors[0].shape[1:] == (50,) for task in tasks)
    pool = tasks[0].test.tensors[0].reshape(-1, 2, 5, 5)
    for task, k in zip(tasks[1:], (2, -1)):
        turned = task.test.tensors[0].reshape(-1, 2, 5, 5)
        torch.testing.assert_close(turned, torch.rot90(pool, k, (-2, -1)), atol=1e-5, rtol=0)


def test_rotate_images_matches_rot90_and_is_rigid_on_non_square_images() -> None:
    generator = torch.Generator().manual_seed(0)
    square = torch.rand(3, 2, 7, 7, generator=generator)
    for k in (1, 2, 3, -1):
        torch.testing.assert_close(
            rotate_images(square, 90 * k), torch.rot90(square, k, (-2, -1)), atol=1e-5, rtol=0
        )
    # a 4x4 block in the middle of a 4x6 frame turns in place; the side columns leave the frame
    wide = torch.zeros(1, 1, 4, 6)
    block = torch.rand(4, 4, generator=generator)
    wide[0, 0, :, 1:5] = block
    turned = rotate_images(wide, 90)
    torch.testing.assert_close(turned[0, 0, :, 1:5], torch.rot90(block), atol=1e-5, rtol=0)
    assert turned[0, 0, :, [0, 5]].abs().max() < 1e-6


def test_rotation_by_45_keeps_the_centre_and_zeroes_the_corners() -> None:
    image = torch.ones(1, 1, 9, 9)
    turned = rotate_images(image, 45)
    assert turned[0, 0, 4, 4].item() == pytest.approx(1.0)
    assert turned[0, 0, 0, 0].item() == 0.0
    nearest = rotate_images(torch.rand(2, 1, 9, 9), 45, interpolation="nearest")
    assert nearest.shape == (2, 1, 9, 9)


# ------------------------------------------------------------------------------------- IID


def test_iid_chunks_partition_the_training_pool() -> None:
    data = _data(n=61)
    tasks = IIDScenario(data, 4, seed=7).tasks()
    chunks = [_ids(task.train) for task in tasks]
    pool = sorted(set(range(61)) - set(_ids(tasks[0].test)))
    assert sorted(i for chunk in chunks for i in chunk) == pool
    sizes = [len(c) for c in chunks]
    assert max(sizes) - min(sizes) <= 1
    for task in tasks:
        assert task.test is tasks[0].test and task.classes == (0, 1, 2, 3)
        x = task.train.tensors[0]
        assert torch.equal(x, data.tensors[0][x[:, 0].long()])


# ------------------------------------------------------------------------- data-incremental


def _domains(n: int) -> torch.Tensor:
    """Sample i of ``_data(n)`` comes from domain (i // 5) % 4: blocks of five samples."""
    return (torch.arange(n) // 5) % 4


def test_data_incremental_tasks_hold_the_samples_of_their_domains() -> None:
    data, domains = _data(n=80), _domains(80)
    scenario = DataIncrementalScenario(data, domains, groupings=[[3], [0, 2]], seed=5)
    tasks = scenario.tasks()
    assert scenario.num_tasks == len(tasks) == 2
    train_ids = [_ids(task.train) for task in tasks]
    test_ids = [_ids(task.test) for task in tasks]
    for group, train, test in zip([[3], [0, 2]], train_ids, test_ids):
        assert {int(domains[i]) for i in train + test} == set(group)
        assert not set(train) & set(test)
        assert train == sorted(train) and test == sorted(test)  # the data set's order
    # Every sample of the chosen domains is in exactly one pool; domain 1 is left out.
    chosen = [i for i in range(80) if int(domains[i]) in (0, 2, 3)]
    assert sorted(train_ids[0] + train_ids[1] + test_ids[0] + test_ids[1]) == chosen
    # The test pool holds out a quarter of every (domain, class) pair.
    for domain in range(4):
        for label in range(4):
            pair = [i for i in range(80) if domains[i] == domain and i % 4 == label]
            held = [i for i in pair if i in test_ids[0] + test_ids[1]]
            assert int(domain) == 1 or len(held) == round(0.25 * len(pair))
    assert [task.classes for task in tasks] == [(0, 1, 2, 3), (0, 1, 2, 3)]
    x = tasks[1].train.tensors[0]
    assert torch.equal(x, data.tensors[0][x[:, 0].long()])


def test_data_incremental_data_ids_make_one_task_per_domain_in_order() -> None:
    data, domains = _data(n=80), _domains(80)
    by_ids = DataIncrementalScenario(data, domains, data_ids=[2, 0], seed=1).tasks()
    by_groups = DataIncrementalScenario(data, domains, groupings=[[2], [0]], seed=1).tasks()
    for a, b in zip(_tensors(by_ids), _tensors(by_groups)):
        assert torch.equal(a, b)
    assert [{int(domains[i]) for i in _ids(task.train)} for task in by_ids] == [{2}, {0}]


def test_data_incremental_with_a_test_dataset_and_from_datasets() -> None:
    data, domains = _data(n=40), _domains(40)
    test, test_domains = _data(n=20, seed=1), _domains(20)
    tasks = DataIncrementalScenario(
        data, domains, data_ids=[1, 3], test_dataset=test, test_domains=test_domains
    ).tasks()
    assert [len(task.train) for task in tasks] == [10, 10]
    assert [len(task.test) for task in tasks] == [5, 5]
    assert torch.equal(tasks[1].test.tensors[0], test.tensors[0][test_domains == 3])
    parts = [TensorDataset(*data[domains == d]) for d in range(4)]
    tests = [TensorDataset(*test[test_domains == d]) for d in range(4)]
    built = DataIncrementalScenario.from_datasets(parts, test_datasets=tests, data_ids=[1, 3])
    for a, b in zip(_tensors(tasks), _tensors(built.tasks())):  # one domain per task: same order
        assert torch.equal(a, b)


def test_data_incremental_is_not_the_iid_scenario() -> None:
    assert DataIncrementalScenario is not IIDScenario
    assert not issubclass(DataIncrementalScenario, IIDScenario)


# --------------------------------------------------------------------------- feature sorting


def test_feature_sorting_is_monotone_across_tasks() -> None:
    data = _data(n=90)
    tasks = FeatureSortingScenario(data, 3, feature_idx=3).tasks()
    for split in ("train", "test"):
        values = [getattr(task, split).tensors[0][:, 3] for task in tasks]
        for earlier, later in itertools.pairwise(values):
            assert earlier.max() <= later.min()
    train = [i for task in tasks for i in _ids(task.train)]
    test = [i for task in tasks for i in _ids(task.test)]
    assert sorted(train + test) == list(range(90))
    for task in tasks:
        labels = torch.cat([task.train.tensors[1], task.test.tensors[1]])
        assert task.classes == tuple(torch.unique(labels).tolist())


def test_feature_sorting_randomness_swaps_but_still_partitions() -> None:
    data = _data(n=90)
    exact = FeatureSortingScenario(data, 3, feature_idx=3).tasks()
    soft = FeatureSortingScenario(data, 3, feature_idx=3, randomness=1.0).tasks()
    assert [_ids(t.train) for t in exact] != [_ids(t.train) for t in soft]
    assert sorted(i for t in soft for i in _ids(t.train)) == sorted(
        i for t in exact for i in _ids(t.train)
    )


def test_feature_sorting_of_images_sorts_by_channel_mean() -> None:
    inputs = torch.rand(40, 2, 3, 3)
    data = TensorDataset(inputs, torch.arange(40) % 2)
    tasks = FeatureSortingScenario(data, 2, feature_idx=1).tasks()
    first, second = (t.train.tensors[0][:, 1].mean(dim=(1, 2)) for t in tasks)
    assert first.max() <= second.min()


# ---------------------------------------------------------------------------- named scenarios


def test_split_digits() -> None:
    pytest.importorskip("sklearn")
    tasks = split_digits(seed=0).tasks()
    assert [task.classes for task in tasks] == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]
    assert sum(len(t.train) + len(t.test) for t in tasks) == 1797
    assert sum(len(t.test) for t in tasks) == pytest.approx(0.25 * 1797, abs=10)
    other = split_digits(seed=1, test_fraction=0.5).tasks()
    assert sum(len(t.test) for t in other) == pytest.approx(0.5 * 1797, abs=10)


def test_permuted_and_rotated_digits() -> None:
    pytest.importorskip("sklearn")
    permuted = permuted_digits(num_tasks=3, seed=0)
    assert permuted.num_tasks == 3 and permuted.tasks()[2].train.tensors[0].shape[1:] == (64,)
    rotated = rotated_digits(degrees=(0, 90), seed=0)
    tasks = rotated.tasks()
    images = tasks[0].test.tensors[0].reshape(-1, 1, 8, 8)
    torch.testing.assert_close(
        tasks[1].test.tensors[0].reshape(-1, 1, 8, 8),
        torch.rot90(images, 1, (-2, -1)),
        atol=1e-5,
        rtol=0,
    )
    assert rotated_digits().degrees == (0.0, 45.0, 90.0, 135.0, 180.0)


def test_registry_names() -> None:
    expected = {
        "split-digits": split_digits,
        "permuted-digits": permuted_digits,
        "rotated-digits": rotated_digits,
    }
    assert expected == SCENARIOS
    for make in SCENARIOS.values():
        assert "seed" in inspect.signature(make).parameters


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("make", "error", "words"),
    [
        (lambda d: ClassIncrementalScenario(d, [[0, 1], [7]]), ValueError, ["[7]", "class_groups"]),
        (lambda d: ClassIncrementalScenario(d, [[0, 1], [1, 2]]), ValueError, ["[1]", "once"]),
        (lambda d: ClassIncrementalScenario(d, [[0], []]), ValueError, ["non-empty"]),
        (lambda d: ClassIncrementalScenario(d, [[0, -1]]), ValueError, ["class ids"]),
        (lambda d: ClassIncrementalScenario(d), ValueError, ["class_groups", "num_tasks"]),
        (lambda d: ClassIncrementalScenario(d, num_tasks=5), ValueError, ["[1, 4]", "5"]),
        (lambda d: ClassIncrementalScenario(d, [[0], [1]], num_tasks=3), ValueError, ["2 groups"]),
        (lambda d: IIDScenario(d, 45), ValueError, ["45 tasks", "has 44"]),
        (lambda d: IIDScenario(d, 0), ValueError, ["num_tasks", ">= 1"]),
        (lambda d: PermutationScenario(d, 2.0), ValueError, ["num_tasks"]),
        (lambda d: FeatureSortingScenario(d, 17, 0), ValueError, ["test pool", "has 16"]),
        (lambda d: FeatureSortingScenario(d, 2, 5), ValueError, ["feature_idx", "[0, 5)"]),
        (lambda d: FeatureSortingScenario(d, 2, 0, randomness=2), ValueError, ["[0, 1]"]),
        (lambda d: RotationScenario(d, ()), ValueError, ["degrees"]),
        (lambda d: RotationScenario(d, (0, float("nan"))), ValueError, ["finite"]),
        (lambda d: RotationScenario(d, (0, 90)), ValueError, ["image_shape=(C, H, W)"]),
        (lambda d: RotationScenario(d, (0,), (2, 2)), ValueError, ["5 values"]),
        (
            lambda d: RotationScenario(d, (0,), (5, 1), interpolation="cubic"),
            ValueError,
            ["interpol"],
        ),
        (lambda d: IIDScenario(d, 2, test_fraction=1.0), ValueError, ["(0, 1)"]),
        (lambda d: IIDScenario(d, 2, test_fraction=0.2, test_dataset=d), ValueError, ["not both"]),
        (lambda d: IIDScenario(d, 2, seed=-1), ValueError, ["seed"]),
        (lambda d: IIDScenario(d, 2, test_dataset=_images()), ValueError, ["per-sample shape"]),
        (
            lambda d: DataIncrementalScenario(d, _domains(60)),
            ValueError,
            ["data_ids", "groupings", "not both"],
        ),
        (
            lambda d: DataIncrementalScenario(d, _domains(60), data_ids=[0], groupings=[[0]]),
            ValueError,
            ["not both"],
        ),
        (
            lambda d: DataIncrementalScenario(d, _domains(59), data_ids=[0]),
            ValueError,
            ["domains", "per sample (60)", "(59,)"],
        ),
        (
            lambda d: DataIncrementalScenario(d, _domains(60).float(), data_ids=[0]),
            ValueError,
            ["integer domain id", "float32"],
        ),
        (
            lambda d: DataIncrementalScenario(d, -_domains(60), data_ids=[0]),
            ValueError,
            [">= 0", "-3"],
        ),
        (
            lambda d: DataIncrementalScenario(d, _domains(60), data_ids=[7]),
            ValueError,
            ["[7]", "no training samples", "[0, 1, 2, 3]"],
        ),
        (
            lambda d: DataIncrementalScenario(d, _domains(60), groupings=[[0, 0]]),
            ValueError,
            ["[0, 0]", "repeats"],
        ),
        (
            lambda d: DataIncrementalScenario(d, _domains(60), data_ids=["a"]),
            ValueError,
            ["data_ids", "int domain ids"],
        ),
        (
            lambda d: DataIncrementalScenario(d, _domains(60), data_ids=[0], test_dataset=d),
            ValueError,
            ["test_domains", "per sample (60)"],
        ),
        (
            lambda d: DataIncrementalScenario(
                d, _domains(60), data_ids=[0, 1], test_dataset=d, test_domains=_domains(60) * 0
            ),
            ValueError,
            ["task 1 (domains [1]) has no test samples"],
        ),
        (
            lambda d: DataIncrementalScenario(d, _domains(60), data_ids=[0], test_domains=[0]),
            ValueError,
            ["test_domains", "give test_dataset"],
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(make, error, words) -> None:
    with pytest.raises(error) as info:
        make(_data())
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_task_without_test_samples_is_refused() -> None:
    data = TensorDataset(torch.zeros(3, 1), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match=r"task 1 \(classes \[1\]\) has no test samples"):
        ClassIncrementalScenario(data, [[0], [1]])


@pytest.mark.parametrize(
    ("data", "error", "words"),
    [
        (TensorDataset(torch.zeros(3, 2), torch.zeros(3)), TypeError, ["targets.long()"]),
        (TensorDataset(torch.zeros(3, 2), torch.tensor([0, -1, 1])), ValueError, [">= 0", "-1"]),
        (TensorDataset(torch.zeros(3), torch.tensor([0, 1, 1])), ValueError, ["unsqueeze"]),
        (TensorDataset(torch.zeros(3, 2)), TypeError, ["exactly two tensors"]),
        (TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)), ValueError, ["empty"]),
        ([(torch.zeros(2), 0.5)], TypeError, ["integer class id"]),
        ([(torch.zeros(2), 0), (torch.zeros(3), 1)], ValueError, ["same shape"]),
        ([torch.zeros(2)], TypeError, ["(inputs, target) pair"]),
        (42, TypeError, ["map-style Dataset"]),
    ],
)
def test_bad_data_raises_clear_errors(data, error, words) -> None:
    with pytest.raises(error) as info:
        IIDScenario(data, 1)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_rotation_needs_floating_inputs() -> None:
    data = TensorDataset(torch.zeros(8, 1, 4, 4, dtype=torch.uint8), torch.arange(8) % 2)
    with pytest.raises(TypeError, match=r"inputs\.float\(\)"):
        RotationScenario(data, (0, 90))


def test_task_validates_its_fields() -> None:
    data = _data(n=4)
    with pytest.raises(ValueError, match="distinct"):
        Task(task_id=0, train=data, test=data, classes=(1, 1))
    with pytest.raises(ValueError, match="task_id"):
        Task(task_id=-1, train=data, test=data, classes=(0,))
    with pytest.raises(TypeError):
        Task(task_id=0, train=[1, 2], test=data, classes=(0,))
    assert Task(task_id=0, train=data, test=data, classes=torch.tensor([2, 0])).classes == (2, 0)


def _scenario_modules() -> list:
    import importlib
    import pkgutil

    names = [info.name for info in pkgutil.iter_modules(scenarios.__path__)]
    return [scenarios] + [importlib.import_module(f"renate_events.scenarios.{n}") for n in names]


def test_no_object_serialization_in_the_module() -> None:
    for module in _scenario_modules():
        source = inspect.getsource(module)
        for word in ("pickle", "torch.save", "torch.load"):
            assert word not in source, (module.__name__, word)


def test_docstring_examples_run() -> None:
    pytest.importorskip("sklearn")
    attempted = 0
    for module in _scenario_modules():
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__
        attempted += result.attempted
    assert attempted > 0
