"""Image files read with Pillow (the optional ``images`` extra): a folder of class folders
(:func:`load_image_folder`) and Tiny-ImageNet's own layout (:func:`load_tiny_imagenet`)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import TensorDataset

from renate_events.datasets.readers import root_dir
from trainer import validators

__all__ = ["ImageFolderDataset", "load_image_folder", "load_tiny_imagenet"]

_PILLOW_HINT = "install Pillow with `pip install renate-events[images]` (or `pip install Pillow`)"
_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
_TINY_SOURCE = (
    "http://cs231n.stanford.edu/tiny-imagenet-200.zip, extracted with `unzip "
    "tiny-imagenet-200.zip -d ROOT` (ROOT/tiny-imagenet-200/wnids.txt, train/, val/)"
)
_TINY_FOLDER = "tiny-imagenet-200"


# --------------------------------------------------------------------------------------------
# Image folders
# --------------------------------------------------------------------------------------------


class ImageFolderDataset(TensorDataset):
    """``TensorDataset(images, targets)`` read by :func:`load_image_folder`, with the class names.

    Attributes:
        classes: The class (sub-folder) names, sorted; target ``i`` is ``classes[i]``.
        files: The file of each sample, in order.
        names: A readable name per class (Tiny-ImageNet's ``words.txt``); else the classes.
    """

    def __init__(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        classes: Sequence[str],
        files: Sequence[pathlib.Path],
        names: Sequence[str] | None = None,
    ) -> None:
        super().__init__(images, targets)
        self.classes = tuple(classes)
        self.files = tuple(files)
        self.names = tuple(classes if names is None else names)


def _import_pillow() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(
            f"load_image_folder reads PNG and JPEG files with Pillow: {_PILLOW_HINT}"
        ) from exc
    return Image


def _check_size(size: object) -> tuple[int, int] | None:
    if size is None:
        return None
    if validators.is_int(size):
        size = (size, size)
    ok = (
        isinstance(size, (tuple, list))
        and len(size) == 2
        and all(validators.is_int(v) and 1 <= v <= 2**15 for v in size)
    )
    if not ok:
        raise ValueError(
            f"load_image_folder: size must be None, an int or (height, width) of ints in "
            f"[1, 32768], got {size!r}"
        )
    return (int(size[0]), int(size[1]))


def _image_files(folder: pathlib.Path) -> tuple[list[str], list[pathlib.Path], list[int]]:
    classes = sorted(entry.name for entry in folder.iterdir() if entry.is_dir())
    if not classes:
        raise FileNotFoundError(
            f"load_image_folder: {str(folder)!r} has no sub-folders; lay the images out as "
            "ROOT/<class name>/<image>.png (or .jpg), one sub-folder per class"
        )
    files, targets = [], []
    for index, name in enumerate(classes):
        found = sorted(
            path
            for path in (folder / name).iterdir()
            if path.is_file() and path.suffix.lower() in _IMAGE_EXTENSIONS
        )
        if not found:
            raise FileNotFoundError(
                f"load_image_folder: class folder {str(folder / name)!r} holds no "
                f"{'/'.join(_IMAGE_EXTENSIONS)} files; remove it or add images"
            )
        files += found
        targets += [index] * len(found)
    return classes, files, targets


def _read_image(
    image_module: Any, path: pathlib.Path, mode: str | None, size: tuple[int, int] | None
) -> torch.Tensor:
    """One image as a ``(H, W, C)`` uint8 tensor (from Pillow's raw bytes, no NumPy needed)."""
    try:
        with image_module.open(path) as image:
            if mode is not None and image.mode != mode:
                image = image.convert(mode)
            if size is not None and image.size != (size[1], size[0]):
                image = image.resize((size[1], size[0]), image_module.Resampling.BILINEAR)
            if image.mode not in ("L", "LA", "RGB", "RGBA", "CMYK", "P"):
                raise ValueError(f"mode {image.mode!r} is not 8 bits per channel; pass mode='RGB'")
            channels = len(image.getbands())
            data = bytearray(image.tobytes())
            width, height = image.size
    except (OSError, ValueError, SyntaxError) as exc:
        raise ValueError(f"{path}: cannot read this image ({exc})") from exc
    return torch.frombuffer(data, dtype=torch.uint8).reshape(height, width, channels)


def _read_images(
    image_module: Any, files: Sequence[pathlib.Path], mode: str | None, size: tuple[int, int] | None
) -> torch.Tensor:
    """The images of ``files`` as one ``uint8`` tensor ``(N, C, H, W)``, all of one shape."""
    arrays: list[torch.Tensor] = []
    for path in files:
        array = _read_image(image_module, path, mode, size)
        if arrays and array.shape != arrays[0].shape:
            height, width, channels = array.shape
            first = arrays[0].shape
            raise ValueError(
                f"{path}: image of {height}x{width} pixels with {channels} channels, but "
                f"{files[0]} has {first[0]}x{first[1]} with {first[2]}; pass size=(height, "
                "width) to resize every image, or mode='RGB' for one channel count"
            )
        arrays.append(array)
    return torch.stack(arrays).permute(0, 3, 1, 2).contiguous()


def load_image_folder(
    root: str | os.PathLike[str],
    *,
    size: int | tuple[int, int] | None = None,
    mode: str | None = "RGB",
) -> ImageFolderDataset:
    """Reads ``root/<class name>/*.png`` (or ``.jpg``, ``.jpeg``): one sub-folder per class.

    Classes are the sub-folder names in sorted order (target ``i`` is ``classes[i]``, as in
    torchvision's ``ImageFolder``); within a class, files are read in sorted order. Needs Pillow
    (``pip install renate-events[images]``).

    Args:
        root: The folder of class folders.
        size: ``None`` (default): every image must have the shape of the first one; an int or
            ``(height, width)``: every image is resized to it (bilinear).
        mode: The Pillow mode every image is converted to: ``"RGB"`` (default, 3 channels),
            ``"L"`` (grey, 1 channel), ``"RGBA"``, or ``None`` to keep each file's own (then all
            must have the same number of channels).

    Returns:
        :class:`ImageFolderDataset`: ``uint8`` images ``(N, C, H, W)``, ``int64`` targets, and
        ``classes`` and ``files``.

    Raises:
        ImportError: Pillow is not installed.
        FileNotFoundError: ``root`` is missing, has no class folders, or a class folder holds no
            image.
        ValueError: An image cannot be read, or (without ``size``) has another shape than the
            first one (the message names both files); a bad ``size``.

    Example:
        >>> from renate_events.datasets import load_image_folder
        >>> data = load_image_folder("data/flowers", size=64)  # doctest: +SKIP
        >>> data.tensors[0].shape[1:], data.classes[:2]  # doctest: +SKIP
        (torch.Size([3, 64, 64]), ('daisy', 'rose'))
    """
    image_module = _import_pillow()
    target_size = _check_size(size)
    if mode is not None and not isinstance(mode, str):
        raise validators.WrongTypeError(
            f"load_image_folder: mode must be a Pillow mode string such as 'RGB' or None, "
            f"got {mode!r}"
        )
    folder = root_dir(root, "load_image_folder", "your own files laid out as ROOT/<class>/*.png")
    classes, files, targets = _image_files(folder)
    images = _read_images(image_module, files, mode, target_size)
    return ImageFolderDataset(images, torch.tensor(targets, dtype=torch.int64), classes, files)


# --------------------------------------------------------------------------------------------
# Tiny-ImageNet
# --------------------------------------------------------------------------------------------


def _tiny_file(base: pathlib.Path, *parts: str) -> pathlib.Path:
    path = base.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(
            f"load_tiny_imagenet: {str(path)!r} is missing; Tiny-ImageNet's layout is "
            f"wnids.txt, words.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG and "
            f"val/val_annotations.txt (nothing is downloaded: get {_TINY_SOURCE})"
        )
    return path


def _tiny_lines(path: pathlib.Path) -> list[str]:
    try:
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read this text file ({exc})") from exc


def _tiny_names(base: pathlib.Path, classes: Sequence[str]) -> list[str]:
    """The readable name of each class from ``words.txt`` (``wnid<TAB>names``), if present."""
    path = base / "words.txt"
    if not path.is_file():
        return list(classes)
    words = dict(line.split("\t", 1) for line in _tiny_lines(path) if "\t" in line)
    return [words.get(wnid, wnid) for wnid in classes]


def _tiny_train_files(
    base: pathlib.Path, classes: Sequence[str]
) -> tuple[list[pathlib.Path], list[int]]:
    files: list[pathlib.Path] = []
    targets: list[int] = []
    for index, wnid in enumerate(classes):
        folder = _tiny_file(base, "train", wnid, "images")
        found = sorted(
            p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in _IMAGE_EXTENSIONS
        )
        if not found:
            raise FileNotFoundError(f"load_tiny_imagenet: {str(folder)!r} holds no JPEG files")
        files += found
        targets += [index] * len(found)
    return files, targets


def _tiny_val_files(
    base: pathlib.Path, classes: Sequence[str]
) -> tuple[list[pathlib.Path], list[int]]:
    annotations = _tiny_file(base, "val", "val_annotations.txt")
    folder = _tiny_file(base, "val", "images")
    index = {wnid: i for i, wnid in enumerate(classes)}
    files: list[pathlib.Path] = []
    targets: list[int] = []
    for number, line in enumerate(_tiny_lines(annotations), start=1):
        if not line:
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise ValueError(
                f"{annotations}: line {number} must be 'FILE<TAB>WNID<TAB>...' with a wnid of "
                f"wnids.txt, got {line[:80]!r}"
            )
        files.append(_tiny_file(folder, fields[0]))
        targets.append(index[fields[1]])
    if not files:
        raise ValueError(f"{annotations}: lists no validation images")
    return files, targets


def load_tiny_imagenet(root: str | os.PathLike[str], *, train: bool = True) -> ImageFolderDataset:
    """Reads Tiny-ImageNet (200 classes of 64x64 colour images) from its own folder layout.

    ``root`` is the folder ``tiny-imagenet-200`` of the official archive, or the folder above it.
    The classes are the wnids of ``wnids.txt`` in sorted order (target ``i`` is ``classes[i]``,
    as with :func:`load_image_folder` on ``train/``); ``names`` are their descriptions from
    ``words.txt`` (the wnids where it is absent). The training split is
    ``train/<wnid>/images/*.JPEG`` (500 per class); the test split (``train=False``) is the
    labelled validation set, ``val/images/*.JPEG`` with the labels of ``val/val_annotations.txt``
    (50 per class; the archive's ``test/`` has no labels). Every image is read as RGB (the few
    grey ones get three equal channels). Needs Pillow (``pip install renate-events[images]``).

    Args:
        root: The data's folder; nothing is downloaded.
        train: The training split (default) or the validation split.

    Returns:
        :class:`ImageFolderDataset`: ``uint8`` images ``(N, 3, 64, 64)``, ``int64`` targets,
        ``classes`` (wnids), ``names`` and ``files``.

    Raises:
        ImportError: Pillow is not installed.
        FileNotFoundError: ``root``, ``wnids.txt``, a class folder, the annotations or an image
            they list is missing (the message names the path).
        ValueError: A file cannot be read, an annotation names an unknown wnid, or images differ
            in size.

    Example:
        >>> from renate_events.datasets import load_tiny_imagenet
        >>> data = load_tiny_imagenet("data/tiny-imagenet-200")  # doctest: +SKIP
        >>> data.tensors[0].shape, len(data.classes)  # doctest: +SKIP
        (torch.Size([100000, 3, 64, 64]), 200)
    """
    image_module = _import_pillow()
    folder = root_dir(root, "load_tiny_imagenet", _TINY_SOURCE)
    nested = folder / _TINY_FOLDER
    base = nested if not (folder / "wnids.txt").exists() and nested.is_dir() else folder
    classes = sorted({line for line in _tiny_lines(_tiny_file(base, "wnids.txt")) if line})
    if not classes:
        raise ValueError(f"{base / 'wnids.txt'}: lists no classes")
    reader = _tiny_train_files if train else _tiny_val_files
    files, targets = reader(base, classes)
    images = _read_images(image_module, files, "RGB", None)
    names = _tiny_names(base, classes)
    return ImageFolderDataset(
        images, torch.tensor(targets, dtype=torch.int64), classes, files, names
    )
