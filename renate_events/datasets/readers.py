"""The readers of the standard data sets' own file formats: digits, MNIST, Fashion-MNIST, CIFAR-10
and CIFAR-100 (plain file reading, no Pillow), and :func:`root_dir`, the folder check every reader
shares."""

from __future__ import annotations

import gzip
import math
import os
import pathlib
import struct
import zlib
from collections.abc import Sequence

import torch
from torch.utils.data import TensorDataset

from trainer import validators

__all__ = [
    "load_cifar10",
    "load_cifar100",
    "load_digits",
    "load_fashion_mnist",
    "load_mnist",
    "reshape_inputs",
    "root_dir",
]

_EXTRA_HINT = "install the optional dependencies with `pip install renate-events[examples]`"

_MNIST_URL = "https://yann.lecun.com/exdb/mnist/ (or any mirror of the four IDX files)"
_FASHION_URL = "https://github.com/zalandoresearch/fashion-mnist (folder data/fashion)"
_CIFAR_URL = (
    "https://www.cs.toronto.edu/~kriz/cifar.html: take the 'CIFAR-10 binary version (suitable for "
    "C programs)', cifar-10-binary.tar.gz, and extract it with `tar xzf cifar-10-binary.tar.gz "
    "-C ROOT` (ROOT/cifar-10-batches-bin/data_batch_1.bin ... data_batch_5.bin, test_batch.bin)"
)
_CIFAR100_URL = (
    "https://www.cs.toronto.edu/~kriz/cifar.html: take the 'CIFAR-100 binary version (suitable "
    "for C programs)', cifar-100-binary.tar.gz, and extract it with `tar xzf "
    "cifar-100-binary.tar.gz -C ROOT` (ROOT/cifar-100-binary/train.bin, test.bin)"
)

_IDX_UINT8 = 0x08
_MNIST_SHAPE = (28, 28)
_MNIST_CLASSES = 10
_CIFAR_SHAPE = (3, 32, 32)
_CIFAR_RECORD = 1 + 3 * 32 * 32
_CIFAR_CLASSES = 10
_CIFAR100_RECORD = 2 + 3 * 32 * 32
_CIFAR100_CLASSES = {"coarse": 20, "fine": 100}  # label byte 0 is coarse, byte 1 fine
_INPUT_DTYPES = (torch.float32, torch.uint8)
_DIGITS_COLUMNS = 65
_DIGITS_MAX = 16


# --------------------------------------------------------------------------------------------
# Public loaders
# --------------------------------------------------------------------------------------------


def load_digits(
    root: str | os.PathLike[str] | None = None, *, flatten: bool = True
) -> TensorDataset:
    """Loads the 8x8 handwritten digits (1 797 samples, 10 classes) bundled with scikit-learn.

    Pixel values ``0..16`` are divided by 16, so inputs lie in ``[0, 1]``.

    Args:
        root: ``None`` to use scikit-learn's bundled copy (needs scikit-learn). Or a folder holding
            ``digits.csv.gz`` or ``digits.csv`` in scikit-learn's format (one sample per line:
            64 pixel values, then the label, comma-separated), to load without scikit-learn.
        flatten: ``True`` for inputs of shape ``(N, 64)``; ``False`` for images ``(N, 1, 8, 8)``.

    Returns:
        ``TensorDataset(inputs, targets)``: ``float32`` inputs and ``int64`` targets.

    Raises:
        ImportError: ``root`` is ``None`` and scikit-learn is not installed.
        FileNotFoundError: ``root`` has no ``digits.csv.gz`` / ``digits.csv``.
        ValueError: The file in ``root`` is malformed.

    Example:
        >>> from renate_events.datasets import load_digits
        >>> inputs, targets = load_digits().tensors
        >>> inputs.shape, targets[:5].tolist()
        (torch.Size([1797, 64]), [0, 1, 2, 3, 4])
    """
    _check_flag("flatten", flatten)
    if root is None:
        pixels, targets = _digits_from_sklearn()
    else:
        pixels, targets = _digits_from_folder(root_dir(root, "load_digits"))
    inputs = pixels.to(torch.float32) / _DIGITS_MAX
    if not flatten:
        inputs = inputs.reshape(-1, 1, 8, 8)
    return TensorDataset(inputs, targets)


def load_mnist(
    root: str | os.PathLike[str], *, train: bool = True, flatten: bool = False
) -> TensorDataset:
    """Reads MNIST from its IDX files in a local folder (never downloads).

    The files are looked for in ``root`` and in ``root/MNIST/raw`` (torchvision's layout), each
    plain or with a ``.gz`` suffix: ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte`` for
    the training set, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` for the test set.

    Args:
        root: Folder with the files.
        train: ``True`` for the 60 000 training images, ``False`` for the 10 000 test images.
        flatten: ``False`` for inputs of shape ``(N, 1, 28, 28)``, ``True`` for ``(N, 784)``.

    Returns:
        ``TensorDataset(inputs, targets)``: ``float32`` inputs in ``[0, 1]``, ``int64`` targets.

    Raises:
        FileNotFoundError: ``root`` or one of the two files is missing.
        ValueError: A file is corrupt (magic number, dimensions, size, labels out of range) or
            the image and label files disagree on the number of samples.

    Example:
        >>> from renate_events.datasets import load_mnist
        >>> test = load_mnist("data/mnist", train=False)  # doctest: +SKIP
        >>> test.tensors[0].shape  # doctest: +SKIP
        torch.Size([10000, 1, 28, 28])
    """
    return _load_idx_pair(root, "MNIST", ("MNIST", "raw"), _MNIST_URL, train, flatten)


def load_fashion_mnist(
    root: str | os.PathLike[str], *, train: bool = True, flatten: bool = False
) -> TensorDataset:
    """Reads Fashion-MNIST from its IDX files in a local folder (never downloads).

    Fashion-MNIST uses MNIST's file names and format; they are looked for in ``root`` and in
    ``root/FashionMNIST/raw`` (torchvision's layout), plain or ``.gz``. Keep it in another folder
    than MNIST.

    Args:
        root: Folder with the files.
        train: ``True`` for the 60 000 training images, ``False`` for the 10 000 test images.
        flatten: ``False`` for inputs of shape ``(N, 1, 28, 28)``, ``True`` for ``(N, 784)``.

    Returns:
        ``TensorDataset(inputs, targets)``: ``float32`` inputs in ``[0, 1]``, ``int64`` targets.

    Raises:
        FileNotFoundError: ``root`` or one of the two files is missing.
        ValueError: A file is corrupt or the two files disagree on the number of samples.

    Example:
        >>> from renate_events.datasets import load_fashion_mnist
        >>> train = load_fashion_mnist("data/fashion", flatten=True)  # doctest: +SKIP
        >>> train.tensors[0].shape  # doctest: +SKIP
        torch.Size([60000, 784])
    """
    return _load_idx_pair(
        root, "Fashion-MNIST", ("FashionMNIST", "raw"), _FASHION_URL, train, flatten
    )


def load_cifar10(
    root: str | os.PathLike[str],
    *,
    train: bool = True,
    flatten: bool = False,
    dtype: torch.dtype = torch.float32,
) -> TensorDataset:
    """Reads CIFAR-10 from the official binary version in a local folder (never downloads).

    The files ``data_batch_1.bin`` ... ``data_batch_5.bin`` (training) and ``test_batch.bin``
    (test) are looked for in ``root/cifar-10-batches-bin`` (where the archive extracts to) and in
    ``root`` itself. Each record is one label byte and 3 072 image bytes (red, green, blue planes
    of 32x32 pixels, row by row).

    Args:
        root: Folder holding ``cifar-10-batches-bin`` (or the ``.bin`` files themselves).
        train: ``True`` for the 50 000 training images, ``False`` for the 10 000 test images.
        flatten: ``False`` for inputs of shape ``(N, 3, 32, 32)``, ``True`` for ``(N, 3072)``.
        dtype: ``torch.float32`` (default) for inputs in ``[0, 1]``; ``torch.uint8`` for the
            raw bytes ``0..255`` (convert them per batch later, in a transform).

    Returns:
        ``TensorDataset(inputs, targets)``: inputs of ``dtype``, ``int64`` targets.

    Raises:
        FileNotFoundError: ``root`` or one of the files is missing (the message says where to
            get the files and how to lay them out).
        ValueError: A file is empty, not a whole number of records, or has a label above 9;
            ``dtype`` is neither ``torch.float32`` nor ``torch.uint8``.

    Example:
        >>> from renate_events.datasets import load_cifar10
        >>> test = load_cifar10("data", train=False)  # doctest: +SKIP
        >>> test.tensors[0].shape  # doctest: +SKIP
        torch.Size([10000, 3, 32, 32])
    """
    _check_flag("train", train)
    _check_flag("flatten", flatten)
    _check_dtype("load_cifar10", dtype)
    folder = root_dir(root, "load_cifar10", _CIFAR_URL)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] if train else ["test_batch.bin"]
    candidates = [folder / "cifar-10-batches-bin", folder]
    images, labels = [], []
    for name in names:
        path = _find_file(candidates, name, "CIFAR-10", _CIFAR_URL, allow_gz=False)
        batch_images, batch_labels = _read_cifar_file(path)
        images.append(batch_images)
        labels.append(batch_labels)
    inputs = _convert_images(torch.cat(images), flatten, dtype)
    return TensorDataset(inputs, torch.cat(labels))


def load_cifar100(
    root: str | os.PathLike[str],
    *,
    train: bool = True,
    labels: str = "fine",
    flatten: bool = False,
    dtype: torch.dtype = torch.float32,
) -> TensorDataset:
    """Reads CIFAR-100 from the official binary version in a local folder (never downloads).

    The files ``train.bin`` (50 000 images) and ``test.bin`` (10 000) are looked for in
    ``root/cifar-100-binary`` (where the archive extracts to) and in ``root`` itself. Each record
    is the coarse label byte (20 superclasses), the fine label byte (100 classes) and 3 072 image
    bytes laid out as in CIFAR-10.

    Args:
        root: Folder holding ``cifar-100-binary`` (or the ``.bin`` files themselves).
        train: ``True`` for ``train.bin``, ``False`` for ``test.bin``.
        labels: ``"fine"`` (default) for the 100 classes, ``"coarse"`` for the 20 superclasses.
        flatten: ``False`` for inputs of shape ``(N, 3, 32, 32)``, ``True`` for ``(N, 3072)``.
        dtype: ``torch.float32`` (default) for inputs in ``[0, 1]``; ``torch.uint8`` for the
            raw bytes.

    Returns:
        ``TensorDataset(inputs, targets)``: inputs of ``dtype``, ``int64`` targets.

    Raises:
        FileNotFoundError: ``root`` or the file is missing.
        ValueError: The file is empty, not a whole number of 3 074-byte records, or has a fine
            label above 99 or a coarse label above 19; a bad ``labels`` or ``dtype``.

    Example:
        >>> from renate_events.datasets import load_cifar100
        >>> train = load_cifar100("data", labels="coarse")  # doctest: +SKIP
        >>> int(train.tensors[1].max())  # doctest: +SKIP
        19
    """
    _check_flag("train", train)
    _check_flag("flatten", flatten)
    _check_dtype("load_cifar100", dtype)
    validators.check_one_of("load_cifar100: labels", labels, tuple(_CIFAR100_CLASSES))
    folder = root_dir(root, "load_cifar100", _CIFAR100_URL)
    name = "train.bin" if train else "test.bin"
    candidates = [folder / "cifar-100-binary", folder]
    path = _find_file(candidates, name, "CIFAR-100", _CIFAR100_URL, allow_gz=False)
    records = _read_records(path, _CIFAR100_RECORD, "CIFAR-100", "2 label bytes + 3072 image bytes")
    for column, (kind, classes) in enumerate(_CIFAR100_CLASSES.items()):
        largest = int(records[:, column].max())
        if largest >= classes:
            raise ValueError(
                f"{path}: {kind} labels (byte {column} of each record) must lie in "
                f"0..{classes - 1}, found {largest}; is this CIFAR-10 or a corrupt file?"
            )
    targets = records[:, list(_CIFAR100_CLASSES).index(labels)].to(torch.int64)
    images = records[:, 2:].reshape(-1, *_CIFAR_SHAPE)
    return TensorDataset(_convert_images(images, flatten, dtype), targets)


def reshape_inputs(dataset: TensorDataset, shape: Sequence[int]) -> TensorDataset:
    """Returns ``dataset`` with every input reshaped to ``shape`` (targets unchanged).

    Use it to turn flat digits into images, ``reshape_inputs(load_digits(), (1, 8, 8))``, or
    images into flat vectors, ``reshape_inputs(images, (-1,))``. The tensors are views where
    possible, not copies.

    Args:
        dataset: A ``TensorDataset(inputs, targets)``.
        shape: The per-sample shape; one entry may be ``-1``.

    Returns:
        A new ``TensorDataset(inputs.reshape(N, *shape), targets)``.

    Raises:
        TypeError: ``dataset`` is not a two-tensor ``TensorDataset``.
        ValueError: ``shape`` does not hold the number of features of one input.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.zeros(5, 64), torch.zeros(5, dtype=torch.int64))
        >>> reshape_inputs(data, (1, 8, 8)).tensors[0].shape
        torch.Size([5, 1, 8, 8])
    """
    if not isinstance(dataset, TensorDataset) or len(dataset.tensors) != 2:
        raise TypeError(
            "reshape_inputs expects a TensorDataset(inputs, targets) with exactly two tensors, "
            f"got {_describe(dataset)}"
        )
    inputs, targets = dataset.tensors
    shape = tuple(shape)
    if not all(validators.is_int(s) for s in shape):
        raise ValueError(f"shape must be a sequence of ints, got {shape!r}")
    features = math.prod(inputs.shape[1:])
    known = math.prod(s for s in shape if s != -1)
    free = shape.count(-1)
    fits = (
        all(s > 0 or s == -1 for s in shape)
        and free <= 1
        and (features == known if free == 0 else known > 0 and features % known == 0)
    )
    if not fits:
        raise ValueError(
            f"cannot reshape inputs of per-sample shape {tuple(inputs.shape[1:])} ({features} "
            f"values) to {shape}: the new shape must hold exactly {features} values (use at most "
            "one -1)"
        )
    return TensorDataset(inputs.reshape(inputs.shape[0], *shape), targets)


# --------------------------------------------------------------------------------------------
# Digits
# --------------------------------------------------------------------------------------------


def _digits_from_sklearn() -> tuple[torch.Tensor, torch.Tensor]:
    try:
        from sklearn import datasets as sk_datasets
    except ImportError as exc:
        raise ImportError(
            "load_digits() with root=None needs scikit-learn, which ships the digits data: "
            f"{_EXTRA_HINT}, or pass root=<folder with digits.csv.gz>"
        ) from exc
    bunch = sk_datasets.load_digits()
    pixels = torch.as_tensor(bunch.data).to(torch.uint8)
    targets = torch.as_tensor(bunch.target).to(torch.int64)
    return pixels, targets


def _digits_from_folder(folder: pathlib.Path) -> tuple[torch.Tensor, torch.Tensor]:
    path = _find_file(
        [folder],
        "digits.csv",
        "digits",
        "scikit-learn's sklearn/datasets/data/digits.csv.gz (copy it from an installation)",
        allow_gz=True,
    )
    text = _read_bytes(path).decode("ascii", errors="replace")
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            values = [int(v) for v in line.split(",")]
        except ValueError:
            values = []
        if len(values) != _DIGITS_COLUMNS:
            raise ValueError(
                f"{path}: line {number} is not {_DIGITS_COLUMNS} comma-separated integers (64 "
                "pixel values and the label); is this scikit-learn's digits.csv.gz?"
            )
        rows.append(values)
    if not rows:
        raise ValueError(f"{path}: the file holds no samples")
    table = torch.tensor(rows, dtype=torch.int64)
    pixels, targets = table[:, :-1], table[:, -1]
    if bool((pixels < 0).any() | (pixels > _DIGITS_MAX).any()):
        raise ValueError(f"{path}: pixel values must lie in 0..{_DIGITS_MAX}")
    if bool((targets < 0).any() | (targets > 9).any()):
        raise ValueError(f"{path}: labels (last column) must lie in 0..9")
    return pixels.to(torch.uint8), targets


# --------------------------------------------------------------------------------------------
# IDX (MNIST, Fashion-MNIST)
# --------------------------------------------------------------------------------------------


def _load_idx_pair(
    root: str | os.PathLike[str],
    name: str,
    subfolder: tuple[str, ...],
    url: str,
    train: bool,
    flatten: bool,
) -> TensorDataset:
    _check_flag("train", train)
    _check_flag("flatten", flatten)
    folder = root_dir(root, f"load_{name.lower().replace('-', '_')}")
    candidates = [folder, folder.joinpath(*subfolder)]
    prefix = "train" if train else "t10k"
    image_path = _find_file(candidates, f"{prefix}-images-idx3-ubyte", name, url, allow_gz=True)
    label_path = _find_file(candidates, f"{prefix}-labels-idx1-ubyte", name, url, allow_gz=True)
    images = _read_idx(image_path, ndim=3)
    labels = _read_idx(label_path, ndim=1)
    if tuple(images.shape[1:]) != _MNIST_SHAPE:
        raise ValueError(
            f"{image_path}: expected {name} images of {_MNIST_SHAPE[0]}x{_MNIST_SHAPE[1]} pixels, "
            f"the header says {images.shape[1]}x{images.shape[2]}"
        )
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{image_path} holds {images.shape[0]} images but {label_path} holds "
            f"{labels.shape[0]} labels; the two files must come from the same {name} split"
        )
    if labels.numel() and int(labels.max()) >= _MNIST_CLASSES:
        raise ValueError(
            f"{label_path}: labels must lie in 0..{_MNIST_CLASSES - 1}, found {int(labels.max())}"
        )
    inputs = _to_float(images.unsqueeze(1), flatten)
    return TensorDataset(inputs, labels.to(torch.int64))


def _read_idx(path: pathlib.Path, ndim: int) -> torch.Tensor:
    """Reads an IDX file of unsigned bytes with ``ndim`` dimensions into a uint8 tensor."""
    data = _read_bytes(path)
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(
            f"{path}: file too short ({len(data)} bytes) for an IDX header of {header} bytes; "
            "the file is truncated or not an IDX file"
        )
    zero, dtype, dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != _IDX_UINT8 or dims != ndim:
        magic = struct.unpack(">I", data[:4])[0]
        expected = (_IDX_UINT8 << 8) | ndim
        raise ValueError(
            f"{path}: bad IDX magic number 0x{magic:08X}, expected 0x{expected:08X} (unsigned "
            f"bytes, {ndim} dimension{'s' if ndim > 1 else ''}); is this the right file?"
        )
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected_size = header + math.prod(shape)
    if len(data) != expected_size:
        raise ValueError(
            f"{path}: the header announces shape {shape} ({expected_size} bytes in all) but the "
            f"file has {len(data)} bytes; the file is truncated or corrupt, fetch it again"
        )
    body = bytearray(data[header:])
    if not body:  # a dimension of size 0; frombuffer refuses empty buffers
        return torch.zeros(shape, dtype=torch.uint8)
    return torch.frombuffer(body, dtype=torch.uint8).reshape(shape)


# --------------------------------------------------------------------------------------------
# CIFAR-10 binary version
# --------------------------------------------------------------------------------------------


def _read_records(path: pathlib.Path, size: int, dataset: str, layout: str) -> torch.Tensor:
    """The whole file as a ``(records, size)`` uint8 tensor, read at once."""
    data = _read_bytes(path)
    if not data or len(data) % size:
        raise ValueError(
            f"{path}: {len(data)} bytes is not a positive multiple of the {dataset} record size "
            f"{size} ({layout}); the file is truncated or not from the binary version"
        )
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(-1, size)


def _read_cifar_file(path: pathlib.Path) -> tuple[torch.Tensor, torch.Tensor]:
    records = _read_records(path, _CIFAR_RECORD, "CIFAR-10", "1 label byte + 3072 image bytes")
    labels = records[:, 0].to(torch.int64)
    if int(labels.max()) >= _CIFAR_CLASSES:
        raise ValueError(
            f"{path}: labels must lie in 0..{_CIFAR_CLASSES - 1}, found {int(labels.max())}; is "
            "this CIFAR-100 or a corrupt file?"
        )
    return records[:, 1:].reshape(-1, *_CIFAR_SHAPE), labels


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def root_dir(root: str | os.PathLike[str], caller: str, source: str = "") -> pathlib.Path:
    """``root`` as a path to an existing folder; else :class:`FileNotFoundError` naming
    ``caller`` and where the files come from (``source``), or :class:`TypeError` for no path."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"{caller}: root must be a path (str or os.PathLike), got {root!r}")
    folder = pathlib.Path(root)
    if not folder.is_dir():
        where = f" (get them from {source})" if source else ""
        raise FileNotFoundError(
            f"{caller}: root folder {str(folder)!r} does not exist or is not a folder; nothing "
            f"is downloaded, so put the data files there first{where}"
        )
    return folder


def _find_file(
    candidates: Sequence[pathlib.Path], name: str, dataset: str, source: str, *, allow_gz: bool
) -> pathlib.Path:
    names = [name, f"{name}.gz"] if allow_gz else [name]
    for folder in candidates:
        for candidate in names:
            path = folder / candidate
            if path.is_file():
                return path
    looked = ", ".join(str(folder / n) for folder in candidates for n in names)
    raise FileNotFoundError(
        f"{dataset} file {name!r} not found; looked for {looked}. Nothing is downloaded: get the "
        f"files from {source} and put them into {str(candidates[0])!r}"
    )


def _read_bytes(path: pathlib.Path) -> bytes:
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as handle:
            return handle.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(
            f"{path}: cannot decompress this gzip file ({exc}); it is truncated or corrupt, "
            "fetch it again"
        ) from exc


def _to_float(images: torch.Tensor, flatten: bool) -> torch.Tensor:
    inputs = images.to(torch.float32).div_(255.0)
    return inputs.reshape(inputs.shape[0], -1) if flatten else inputs


def _convert_images(images: torch.Tensor, flatten: bool, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        return _to_float(images, flatten)
    return images.reshape(images.shape[0], -1) if flatten else images


def _check_dtype(caller: str, dtype: object) -> None:
    if not isinstance(dtype, torch.dtype):
        raise validators.WrongTypeError(
            f"{caller}: dtype must be a torch.dtype (torch.float32 or torch.uint8), got {dtype!r}"
        )
    if dtype not in _INPUT_DTYPES:
        raise ValueError(
            f"{caller}: dtype must be torch.float32 (inputs in [0, 1]) or torch.uint8 (raw "
            f"bytes), got {dtype}"
        )


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise validators.WrongTypeError(f"{name} must be True or False, got {value!r}")


def _describe(value: object) -> str:
    if isinstance(value, TensorDataset):
        return f"a TensorDataset with {len(value.tensors)} tensors"
    return type(value).__name__
