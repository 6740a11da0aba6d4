"""load_image_folder on PNG and JPEG files written with Pillow in tmp_path."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from renate_events.datasets import ImageFolderDataset, load_image_folder

Image = pytest.importorskip("PIL.Image")


def _save(path: pathlib.Path, pixels: torch.Tensor) -> None:
    """``pixels`` (H, W, 3) uint8 to a PNG or JPEG file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.frombytes(
        "RGB", (pixels.shape[1], pixels.shape[0]), bytes(pixels.flatten().tolist())
    ).save(path)


def _pixels(seed: int, height: int = 6, width: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)


def test_reads_classes_sorted_by_name(tmp_path: pathlib.Path) -> None:
    written = {}
    for seed, name in enumerate(["zebra/b.png", "zebra/a.png", "ant/x.png", "ant/notes.txt"]):
        if name.endswith(".png"):
            written[name] = _pixels(seed)
            _save(tmp_path / name, written[name])
        else:
            (tmp_path / name).write_text("not an image")
    data = load_image_folder(tmp_path)
    assert isinstance(data, ImageFolderDataset) and data.classes == ("ant", "zebra")
    images, targets = data.tensors
    assert images.dtype == torch.uint8 and images.shape == (3, 3, 6, 5)
    assert targets.tolist() == [0, 1, 1] and targets.dtype == torch.int64
    assert [p.relative_to(tmp_path).as_posix() for p in data.files] == [
        "ant/x.png",
        "zebra/a.png",
        "zebra/b.png",
    ]
    for image, path in zip(images, data.files):  # PNG is lossless: the exact pixels, (C, H, W)
        expected = written[path.relative_to(tmp_path).as_posix()]
        assert torch.equal(image, expected.permute(2, 0, 1))


def test_shape_mismatch_names_the_file_unless_size(tmp_path: pathlib.Path) -> None:
    _save(tmp_path / "a" / "1.png", _pixels(0))
    _save(tmp_path / "b" / "2.jpg", _pixels(1, height=8, width=8))
    with pytest.raises(ValueError) as info:
        load_image_folder(tmp_path)
    assert str(tmp_path / "b" / "2.jpg") in str(info.value) and "8x8" in str(info.value)
    images, targets = load_image_folder(tmp_path, size=(4, 7)).tensors
    assert images.shape == (2, 3, 4, 7) and targets.tolist() == [0, 1]
    grey = load_image_folder(tmp_path, size=4, mode="L").tensors[0]
    assert grey.shape == (2, 1, 4, 4)


def test_bad_input(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_image_folder(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="no sub-folders"):
        load_image_folder(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no"):
        load_image_folder(tmp_path)
    (tmp_path / "empty" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"broken\.png: cannot read this image"):
        load_image_folder(tmp_path)
    for size in (0, (3,), (2, -1), "4"):
        with pytest.raises(ValueError, match="size must be"):
            load_image_folder(tmp_path, size=size)


def test_missing_pillow_is_a_clear_import_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)  # makes `from PIL import Image` fail
    with pytest.raises(ImportError, match=r"Pillow.*renate-events\[images\]"):
        load_image_folder(tmp_path)
