"""CIFAR-10 / CIFAR-100 binary readers and the Seq-CIFAR scenarios, on files written in the real
binary format (records of label bytes followed by 3 072 image bytes)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from renate_events.datasets import load_cifar10, load_cifar100
from renate_events.scenarios import IMAGE_SCENARIOS, SCENARIOS, seq_cifar10, seq_cifar100
from trainer.validators import WrongTypeError


def _images(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 32, 32), generator=generator, dtype=torch.uint8)


def _records(labels: torch.Tensor, images: torch.Tensor) -> bytes:
    """The binary layout: each row is the label bytes then the image bytes, plane by plane."""
    return (
        torch.cat([labels.to(torch.uint8).reshape(len(images), -1), images.flatten(1)], 1)
        .numpy()
        .tobytes()
    )


def write_cifar10(folder: pathlib.Path, per_class: int, test_per_class: int, seed: int = 0):
    """data_batch_1..5.bin and test_batch.bin with ``per_class`` training images of each class."""
    folder.mkdir(parents=True, exist_ok=True)
    labels = torch.arange(10).repeat(per_class)
    images = _images(len(labels), seed)
    for index, part in enumerate(torch.tensor_split(torch.arange(len(labels)), 5), start=1):
        (folder / f"data_batch_{index}.bin").write_bytes(_records(labels[part], images[part]))
    test_labels = torch.arange(10).repeat(test_per_class)
    test_images = _images(len(test_labels), seed + 1)
    (folder / "test_batch.bin").write_bytes(_records(test_labels, test_images))
    return images, labels, test_images, test_labels


def write_cifar100(folder: pathlib.Path, per_class: int, test_per_class: int = 1):
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, count, seed in (("train.bin", per_class, 0), ("test.bin", test_per_class, 1)):
        fine = torch.arange(100).repeat(count)
        coarse = fine % 20
        images = _images(len(fine), seed)
        (folder / name).write_bytes(_records(torch.stack([coarse, fine], 1), images))
        out += [images, fine, coarse]
    return out


def test_cifar10_uint8_and_float(tmp_path: pathlib.Path) -> None:
    images, labels, test_images, test_labels = write_cifar10(
        tmp_path / "cifar-10-batches-bin", 2, 1
    )
    raw = load_cifar10(tmp_path, dtype=torch.uint8)
    assert raw.tensors[0].dtype == torch.uint8 and raw.tensors[1].dtype == torch.int64
    assert torch.equal(raw.tensors[0], images) and torch.equal(raw.tensors[1], labels)
    test = load_cifar10(tmp_path / "cifar-10-batches-bin", train=False, dtype=torch.uint8)
    assert torch.equal(test.tensors[0], test_images) and torch.equal(test.tensors[1], test_labels)
    floats = load_cifar10(tmp_path, train=False, flatten=True)
    assert torch.equal(floats.tensors[0], test_images.flatten(1).float() / 255)


def test_cifar_bad_dtype(tmp_path: pathlib.Path) -> None:
    write_cifar10(tmp_path, 1, 1)
    with pytest.raises(ValueError, match=r"torch\.float32 .* or torch\.uint8"):
        load_cifar10(tmp_path, dtype=torch.float64)
    with pytest.raises(WrongTypeError, match=r"dtype must be a torch\.dtype"):
        load_cifar100(tmp_path, dtype="uint8")


def test_cifar_missing_folder_says_where_to_get_the_files(tmp_path: pathlib.Path) -> None:
    for loader, words in (
        (load_cifar10, "cifar-10-batches-bin"),
        (load_cifar100, "cifar-100-binary"),
    ):
        with pytest.raises(FileNotFoundError) as info:
            loader(tmp_path / "nowhere")
        message = str(info.value)
        assert "https://www.cs.toronto.edu/~kriz/cifar.html" in message and words in message
        assert str(tmp_path / "nowhere") in message


def test_cifar100_fine_and_coarse(tmp_path: pathlib.Path) -> None:
    images, fine, coarse, test_images, test_fine, _ = write_cifar100(
        tmp_path / "cifar-100-binary", 2
    )
    train = load_cifar100(tmp_path, dtype=torch.uint8)
    assert train.tensors[0].shape == (200, 3, 32, 32)
    assert torch.equal(train.tensors[0], images) and torch.equal(train.tensors[1], fine)
    assert torch.equal(load_cifar100(tmp_path, labels="coarse").tensors[1], coarse)
    test = load_cifar100(tmp_path / "cifar-100-binary", train=False)
    assert torch.equal(test.tensors[0], test_images.float() / 255)
    assert torch.equal(test.tensors[1], test_fine)
    with pytest.raises(ValueError, match="labels must be one of"):
        load_cifar100(tmp_path, labels="superclass")


def test_cifar100_missing_file(tmp_path: pathlib.Path) -> None:
    write_cifar100(tmp_path / "cifar-100-binary", 1)
    (tmp_path / "cifar-100-binary" / "test.bin").unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_cifar100(tmp_path, train=False)
    assert "test.bin" in str(info.value) and "kriz/cifar.html" in str(info.value)


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b"", "multiple of the CIFAR-100 record size 3074"),
        (bytes(3074 * 2 + 1), "multiple of the CIFAR-100 record size 3074"),
        (bytes([3, 100]) + bytes(3072), "fine labels (byte 1 of each record) must lie in 0..99"),
        (bytes([20, 5]) + bytes(3072), "coarse labels (byte 0 of each record) must lie in 0..19"),
    ],
)
def test_cifar100_rejects_corrupt_files(tmp_path: pathlib.Path, payload: bytes, words: str) -> None:
    folder = tmp_path / "cifar-100-binary"
    write_cifar100(folder, 1)
    (folder / "train.bin").write_bytes(payload)
    with pytest.raises(ValueError) as info:
        load_cifar100(tmp_path)
    assert str(folder / "train.bin") in str(info.value) and words in str(info.value)


def test_cifar10_file_of_cifar100_records_is_refused(tmp_path: pathlib.Path) -> None:
    write_cifar10(tmp_path, 1, 1)
    (tmp_path / "test_batch.bin").write_bytes(bytes([7]) + bytes(3072) + bytes([12]) + bytes(3072))
    with pytest.raises(ValueError, match=r"test_batch\.bin: labels must lie in 0\.\.9, found 12"):
        load_cifar10(tmp_path, train=False)


# ------------------------------------------------------------------------------ Seq-CIFAR


def test_seq_cifar10_tasks(tmp_path: pathlib.Path) -> None:
    images, labels, test_images, test_labels = write_cifar10(
        tmp_path / "cifar-10-batches-bin", 3, 2
    )
    scenario = seq_cifar10(tmp_path, seed=0)
    tasks = scenario.tasks()
    assert [task.classes for task in tasks] == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]
    for task in tasks:
        x, y = task.train.tensors
        assert x.dtype == torch.uint8 and x.shape == (6, 3, 32, 32)
        assert set(y.tolist()) == set(task.classes)
        # the samples are the files' own, unchanged, and the test set is the test batch's
        assert torch.equal(x, images[torch.isin(labels, torch.tensor(task.classes))])
        assert torch.equal(
            task.test.tensors[0], test_images[torch.isin(test_labels, torch.tensor(task.classes))]
        )


def test_seq_cifar100_tasks(tmp_path: pathlib.Path) -> None:
    write_cifar100(tmp_path / "cifar-100-binary", 1)
    tasks = seq_cifar100(tmp_path).tasks()
    assert len(tasks) == 10
    assert [task.classes for task in tasks] == [
        tuple(range(10 * t, 10 * t + 10)) for t in range(10)
    ]
    assert all(len(task.train) == 10 and len(task.test) == 10 for task in tasks)


def test_image_scenarios_registry() -> None:
    # issue 27 added Seq-TinyImageNet and the domain-incremental image scenarios beside these
    expected = dict(zip(("seq-cifar10", "seq-cifar100"), (seq_cifar10, seq_cifar100)))
    assert expected == {name: IMAGE_SCENARIOS[name] for name in expected}
    assert not set(IMAGE_SCENARIOS) & set(SCENARIOS)  # the CLI's table stays path-free


def test_seq_cifar_missing_folder(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"kriz/cifar\.html"):
        seq_cifar10(tmp_path / "absent")
