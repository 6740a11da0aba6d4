"""load_tiny_imagenet on Tiny-ImageNet's folder layout, written with tiny random JPEGs."""

from __future__ import annotations

import pathlib

import pytest
import torch

from renate_events.datasets import ImageFolderDataset, load_tiny_imagenet

Image = pytest.importorskip("PIL.Image")

WNIDS = ("n02", "n01", "n03")  # wnids.txt order; the classes are sorted


def _jpeg(path: pathlib.Path, seed: int, size: int = 8, mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    channels = 3 if mode == "RGB" else 1
    pixels = torch.randint(0, 256, (size, size, channels), generator=generator, dtype=torch.uint8)
    Image.frombytes(mode, (size, size), bytes(pixels.flatten().tolist())).save(path, "JPEG")


def write_tiny_imagenet(
    root: pathlib.Path,
    per_class: int = 2,
    val_per_class: int = 1,
    size: int = 8,
    wnids: tuple[str, ...] = WNIDS,
) -> pathlib.Path:
    """The official layout under ``root/tiny-imagenet-200`` with ``size`` x ``size`` JPEGs."""
    base = root / "tiny-imagenet-200"
    base.mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    words = "".join(f"{w}\tthing {w}, other name\n" for w in (*wnids, "n99"))
    (base / "words.txt").write_text(words)
    seed = 0
    for wnid in wnids:
        for i in range(per_class):
            _jpeg(base / "train" / wnid / "images" / f"{wnid}_{i}.JPEG", seed, size)
            seed += 1
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
    lines = []
    for i in range(val_per_class * len(wnids)):
        _jpeg(base / "val" / "images" / f"val_{i}.JPEG", 100 + i, size, "L" if i == 0 else "RGB")
        lines.append(f"val_{i}.JPEG\t{wnids[i % len(wnids)]}\t0\t0\t7\t7")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return base


def test_reads_both_splits_with_sorted_wnids(tmp_path: pathlib.Path) -> None:
    write_tiny_imagenet(tmp_path, per_class=2, val_per_class=2)
    train = load_tiny_imagenet(tmp_path)
    assert isinstance(train, ImageFolderDataset)
    assert train.classes == ("n01", "n02", "n03")
    assert train.names == (
        "thing n01, other name",
        "thing n02, other name",
        "thing n03, other name",
    )
    images, targets = train.tensors
    assert images.shape == (6, 3, 8, 8) and images.dtype == torch.uint8
    assert targets.tolist() == [0, 0, 1, 1, 2, 2]
    assert train.files[0].name == "n01_0.JPEG"
    val = load_tiny_imagenet(tmp_path / "tiny-imagenet-200", train=False)
    assert val.tensors[0].shape == (6, 3, 8, 8)  # the grey JPEG read as RGB
    assert val.tensors[1].tolist() == [1, 0, 2, 1, 0, 2]  # n02, n01, n03, ... by annotation


def test_words_txt_is_optional(tmp_path: pathlib.Path) -> None:
    base = write_tiny_imagenet(tmp_path)
    (base / "words.txt").unlink()
    assert load_tiny_imagenet(base).names == ("n01", "n02", "n03")


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("remove", "train", "words"),
    [
        ("wnids.txt", True, "wnids.txt' is missing"),
        ("train/n03", True, "n03"),
        ("val/val_annotations.txt", False, "val_annotations.txt' is missing"),
        ("val/images/val_1.JPEG", False, "val_1.JPEG' is missing"),
    ],
)
def test_a_missing_file_is_named(tmp_path: pathlib.Path, remove: str, train: bool, words: str):
    base = write_tiny_imagenet(tmp_path)
    target = base / remove
    if target.is_dir():
        for path in sorted(target.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        target.rmdir()
    else:
        target.unlink()
    with pytest.raises(FileNotFoundError, match=words):
        load_tiny_imagenet(tmp_path, train=train)


@pytest.mark.hostile
def test_an_unknown_wnid_in_the_annotations_is_refused(tmp_path: pathlib.Path) -> None:
    base = write_tiny_imagenet(tmp_path)
    (base / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn77\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match="line 1 must be 'FILE<TAB>WNID"):
        load_tiny_imagenet(base, train=False)


def test_a_missing_root_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tiny-imagenet-200\.zip"):
        load_tiny_imagenet(tmp_path / "absent")
