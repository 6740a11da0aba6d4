"""Tests for renate_events.datasets: digits, and IDX / CIFAR-10 binary files written here."""

from __future__ import annotations

import doctest
import gzip
import inspect
import pathlib
import struct
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events import datasets
from renate_events.datasets import (
    load_cifar10,
    load_digits,
    load_fashion_mnist,
    load_mnist,
    reshape_inputs,
)

# ----------------------------------------------------------------------------------- writers


def _write(path: pathlib.Path, payload: bytes, gz: bool = False) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as handle:
            handle.write(payload)
    else:
        path.write_bytes(payload)
    return path


def _idx(array: torch.Tensor) -> bytes:
    """IDX bytes of a uint8 tensor: 0x0000, type 0x08, ndim, big-endian sizes, data."""
    header = struct.pack(">HBB", 0, 0x08, array.dim()) + struct.pack(
        f">{array.dim()}I", *array.shape
    )
    return header + bytes(array.flatten().tolist())


def _mnist_like(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 28, 28), generator=generator, dtype=torch.uint8)
    labels = torch.randint(0, 10, (n,), generator=generator, dtype=torch.uint8)
    return images, labels


def _write_mnist(folder: pathlib.Path, prefix: str, n: int, gz: bool = False, seed: int = 0):
    images, labels = _mnist_like(n, seed)
    _write(folder / f"{prefix}-images-idx3-ubyte", _idx(images), gz)
    _write(folder / f"{prefix}-labels-idx1-ubyte", _idx(labels), gz)
    return images, labels


def _cifar_records(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, bytes]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 32, 32), generator=generator, dtype=torch.uint8)
    labels = torch.randint(0, 10, (n,), generator=generator, dtype=torch.uint8)
    payload = b"".join(
        bytes([int(labels[i])]) + bytes(images[i].flatten().tolist()) for i in range(n)
    )
    return images, labels, payload


def _write_cifar(
    folder: pathlib.Path,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    train_images, train_labels = [], []
    for i in range(1, 6):
        images, labels, payload = _cifar_records(2, seed=i)
        _write(folder / f"data_batch_{i}.bin", payload)
        train_images.append(images)
        train_labels.append(labels)
    test_images, test_labels, payload = _cifar_records(3, seed=9)
    _write(folder / "test_batch.bin", payload)
    return torch.cat(train_images), torch.cat(train_labels), test_images, test_labels


# ------------------------------------------------------------------------------------ digits


def test_load_digits_shapes_range_and_dtypes() -> None:
    pytest.importorskip("sklearn")
    inputs, targets = load_digits().tensors
    assert inputs.shape == (1797, 64) and inputs.dtype == torch.float32
    assert targets.shape == (1797,) and targets.dtype == torch.int64
    assert float(inputs.min()) == 0.0 and float(inputs.max()) == 1.0
    assert sorted(torch.unique(targets).tolist()) == list(range(10))
    images = load_digits(flatten=False).tensors[0]
    assert images.shape == (1797, 1, 8, 8)
    assert torch.equal(images.reshape(1797, 64), inputs)


def test_load_digits_from_a_folder_matches_scikit_learn(tmp_path: pathlib.Path) -> None:
    sklearn = pytest.importorskip("sklearn")
    bundled = pathlib.Path(sklearn.__file__).parent / "datasets" / "data" / "digits.csv.gz"
    (tmp_path / "digits.csv.gz").write_bytes(bundled.read_bytes())
    ours, reference = load_digits(tmp_path).tensors, load_digits().tensors
    assert torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])


def test_load_digits_from_a_small_plain_csv(tmp_path: pathlib.Path) -> None:
    rows = [[16] * 64 + [3], [0] * 63 + [8, 9]]
    (tmp_path / "digits.csv").write_text("\n".join(",".join(map(str, r)) for r in rows) + "\n")
    inputs, targets = load_digits(str(tmp_path)).tensors
    assert targets.tolist() == [3, 9]
    assert inputs[0].tolist() == [1.0] * 64 and inputs[1, -1].item() == 0.5


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("1,2,3\n", ["line 1", "65"]),
        (",".join(["17"] * 64 + ["1"]), ["0..16"]),
        (",".join(["1"] * 64 + ["10"]), ["labels", "0..9"]),
        ("\n\n", ["no samples"]),
    ],
)
def test_load_digits_rejects_malformed_files(tmp_path: pathlib.Path, text: str, words) -> None:
    (tmp_path / "digits.csv").write_text(text)
    with pytest.raises(ValueError) as info:
        load_digits(tmp_path)
    assert "digits.csv" in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_load_digits_missing_file_and_folder(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"digits\.csv\.gz"):
        load_digits(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_digits(tmp_path / "nowhere")


def test_load_digits_without_scikit_learn_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(ImportError, match=r"pip install renate-events\[examples\]"):
        load_digits()


# ------------------------------------------------------------------------------------- MNIST


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("loader", [load_mnist, load_fashion_mnist])
def test_idx_readers_return_scaled_images(tmp_path: pathlib.Path, gz: bool, loader) -> None:
    train_images, train_labels = _write_mnist(tmp_path, "train", 5, gz, seed=0)
    test_images, test_labels = _write_mnist(tmp_path, "t10k", 3, gz, seed=1)
    inputs, targets = loader(tmp_path).tensors
    assert inputs.shape == (5, 1, 28, 28) and inputs.dtype == torch.float32
    assert torch.equal(inputs[:, 0], train_images.float() / 255)
    assert targets.dtype == torch.int64 and torch.equal(targets, train_labels.long())
    inputs, targets = loader(tmp_path, train=False, flatten=True).tensors
    assert inputs.shape == (3, 784)
    assert torch.equal(inputs, test_images.reshape(3, 784).float() / 255)
    assert torch.equal(targets, test_labels.long())


def test_idx_readers_find_torchvision_layout(tmp_path: pathlib.Path) -> None:
    _, labels = _write_mnist(tmp_path / "MNIST" / "raw", "train", 2)
    _, fashion_labels = _write_mnist(tmp_path / "FashionMNIST" / "raw", "train", 4, gz=True)
    assert torch.equal(load_mnist(tmp_path).tensors[1], labels.long())
    assert torch.equal(load_fashion_mnist(tmp_path).tensors[1], fashion_labels.long())


def test_idx_missing_file_names_the_path_and_the_source(tmp_path: pathlib.Path) -> None:
    images, _ = _mnist_like(2, 0)
    _write(tmp_path / "train-images-idx3-ubyte", _idx(images))
    with pytest.raises(FileNotFoundError) as info:
        load_mnist(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "train-labels-idx1-ubyte") in message
    assert "train-labels-idx1-ubyte.gz" in message and "yann.lecun.com" in message
    with pytest.raises(FileNotFoundError, match="zalandoresearch"):
        load_fashion_mnist(tmp_path, train=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mnist(tmp_path / "missing")


def _corrupt_cases():
    images, labels = _mnist_like(3, 0)
    good_images, good_labels = _idx(images), _idx(labels)
    bad_magic = b"\x00\x00\x08\x02" + good_images[4:]
    wrong_type = b"\x00\x00\x0d\x03" + good_images[4:]
    small = _idx(torch.zeros(3, 27, 28, dtype=torch.uint8))
    too_many_labels = _idx(torch.zeros(4, dtype=torch.uint8))
    big_label = _idx(torch.tensor([1, 2, 10], dtype=torch.uint8))
    return {
        "bad magic": (bad_magic, good_labels, "images", "magic"),
        "wrong data type": (wrong_type, good_labels, "images", "magic"),
        "truncated": (good_images[:-5], good_labels, "images", "truncated"),
        "trailing bytes": (good_images + b"\x00", good_labels, "images", "truncated"),
        "short header": (good_images[:6], good_labels, "images", "too short"),
        "image size": (small, good_labels, "images", "28x28"),
        "count mismatch": (good_images, too_many_labels, "labels", "4 labels"),
        "label range": (good_images, big_label, "labels", "0..9"),
    }


@pytest.mark.parametrize("case", sorted(_corrupt_cases()))
def test_idx_rejects_corrupt_files_naming_them(tmp_path: pathlib.Path, case: str) -> None:
    image_bytes, label_bytes, culprit, words = _corrupt_cases()[case]
    _write(tmp_path / "train-images-idx3-ubyte", image_bytes)
    _write(tmp_path / "train-labels-idx1-ubyte", label_bytes)
    with pytest.raises(ValueError) as info:
        load_mnist(tmp_path)
    assert f"train-{culprit}-idx" in str(info.value)
    assert words in str(info.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_idx_rejects_broken_gzip(tmp_path: pathlib.Path, damage: str) -> None:
    _write_mnist(tmp_path, "train", 3, gz=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    data = path.read_bytes()
    path.write_bytes(b"not a gzip stream at all" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte\.gz.*gzip"):
        load_mnist(tmp_path)


# ---------------------------------------------------------------------------------- CIFAR-10


@pytest.mark.parametrize("inside", [False, True])
def test_cifar10_reads_the_binary_version(tmp_path: pathlib.Path, inside: bool) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    train_images, train_labels, test_images, test_labels = _write_cifar(folder)
    root = folder if inside else tmp_path
    inputs, targets = load_cifar10(root).tensors
    assert inputs.shape == (10, 3, 32, 32) and inputs.dtype == torch.float32
    assert torch.equal(inputs, train_images.float() / 255)  # channel planes in R, G, B order
    assert torch.equal(targets, train_labels.long())
    inputs, targets = load_cifar10(root, train=False, flatten=True).tensors
    assert inputs.shape == (3, 3072)
    assert torch.equal(inputs, test_images.reshape(3, -1).float() / 255)
    assert torch.equal(targets, test_labels.long())


def test_cifar10_missing_batch(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    _write_cifar(folder)
    (folder / "data_batch_3.bin").unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_cifar10(tmp_path)
    assert str(folder / "data_batch_3.bin") in str(info.value)
    assert "binary version" in str(info.value)
    load_cifar10(tmp_path, train=False)  # the test batch alone still loads


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b"", "multiple"),
        (bytes(3073 + 10), "multiple"),
        (bytes([10]) + bytes(3072), "0..9"),
    ],
)
def test_cifar10_rejects_corrupt_files(tmp_path: pathlib.Path, payload: bytes, words: str) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    _write_cifar(folder)
    _write(folder / "test_batch.bin", payload)
    with pytest.raises(ValueError) as info:
        load_cifar10(tmp_path, train=False)
    assert "test_batch.bin" in str(info.value) and words in str(info.value)


# ------------------------------------------------------------------------------------ shared


def test_reshape_inputs() -> None:
    data = TensorDataset(torch.arange(10.0).reshape(5, 2), torch.arange(5))
    assert reshape_inputs(data, (1, 2)).tensors[0].shape == (5, 1, 2)
    assert reshape_inputs(reshape_inputs(data, (2, 1)), [-1]).tensors[0].shape == (5, 2)
    assert reshape_inputs(data, (1, -1)).tensors[1] is data.tensors[1]
    for shape in [(3,), (-1, -1), (0, 2), (4, -1)]:
        with pytest.raises(ValueError, match="2 values"):
            reshape_inputs(data, shape)
    with pytest.raises(TypeError, match="exactly two tensors"):
        reshape_inputs(TensorDataset(torch.zeros(2, 2)), (2,))


@pytest.mark.parametrize("loader", [load_mnist, load_fashion_mnist, load_cifar10])
def test_flags_must_be_bools(tmp_path: pathlib.Path, loader) -> None:
    with pytest.raises(TypeError, match="train must be True or False"):
        loader(tmp_path, train="yes")
    with pytest.raises(TypeError, match="root must be a path"):
        loader(3)


def test_no_object_serialization_in_the_module() -> None:
    source = "".join(inspect.getsource(m) for m in (datasets, datasets.readers, datasets.images))
    for word in ("pickle", "torch.save", "torch.load", "urllib", "requests", "torchvision"):
        if word == "torchvision":
            assert "import torchvision" not in source
        else:
            assert word not in source, word


def test_docstring_examples_run() -> None:
    pytest.importorskip("sklearn")
    for module in (datasets, datasets.readers, datasets.images):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0
    assert doctest.testmod(datasets, optionflags=doctest.ELLIPSIS).attempted > 0
