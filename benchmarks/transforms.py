"""Cost of the CIFAR training augmentation per batch: hand-written vectorised against kornia.

One batch = 128 raw ``uint8`` images of 3x32x32 (CIFAR-shaped) through random crop 32 with
padding 4 and a horizontal flip with probability 0.5, on the CPU, single-threaded. Two variants
are timed in the same run, alternating, and reported as a ratio:

* ``renate_events.transforms``: :class:`RandomCrop` then :class:`RandomHorizontalFlip`, on the
  ``uint8`` batch (one gather for all crops, one ``where`` for the flips);
* kornia (where installed): ``kornia.augmentation.RandomCrop((32, 32), padding=4)`` then
  ``RandomHorizontalFlip()``, on the batch as float32 in ``[0, 1]`` (kornia works on floats).

The whole preset (crop, flip, to float, normalise) is timed too, as the per-step cost a learner
pays for it. Run: ``python benchmarks/transforms.py`` (a few seconds; ``--repeats N``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from renate_events.transforms import RandomCrop, RandomHorizontalFlip, cifar_train_transform

BATCH = (128, 3, 32, 32)


def _time(function: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call over ``repeats`` calls (after two warm-up calls)."""
    function()
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    images = torch.randint(0, 256, BATCH, dtype=torch.uint8)
    floats = images.float().div_(255)
    crop, flip = RandomCrop(32, padding=4), RandomHorizontalFlip(0.5)
    ours = _time(lambda: flip(crop(images)), args.repeats)
    ours_float = _time(lambda: flip(crop(floats)), args.repeats)
    preset = cifar_train_transform()
    whole = _time(lambda: preset(images), args.repeats)
    print(f"torch {torch.__version__}, Python {platform.python_version()}, 1 thread, {BATCH}")
    print(f"hand-written crop+flip, uint8:   {ours * 1e3:8.3f} ms/batch")
    print(f"hand-written crop+flip, float32: {ours_float * 1e3:8.3f} ms/batch")
    print(f"hand-written CIFAR preset:       {whole * 1e3:8.3f} ms/batch (crop, flip, float, norm)")
    try:
        import kornia.augmentation as K
    except ImportError:
        print("kornia is not installed: pip install 'renate-events[kornia]' to compare")
        return
    augment = torch.nn.Sequential(K.RandomCrop((32, 32), padding=4), K.RandomHorizontalFlip(p=0.5))
    theirs = _time(lambda: augment(floats), args.repeats)
    print(f"kornia crop+flip, float32:       {theirs * 1e3:8.3f} ms/batch")
    print(f"kornia / hand-written (float32): {theirs / ours_float:8.1f}x")
    print(f"kornia / hand-written (uint8):   {theirs / ours:8.1f}x")


if __name__ == "__main__":
    main()
