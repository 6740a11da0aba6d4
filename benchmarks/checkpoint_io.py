"""Checkpoint save and load time: ``trainer``'s safetensors files against ``torch.save/load``.

For a state of about 50 MB (and, with ``--large``, about 500 MB) of float32 weights, made of
``Linear(1024, 1024)`` layers, times the median of ``--repeats`` interleaved repetitions of:

save
  * ``write_checkpoint``: :func:`trainer.write_checkpoint` of ``{"model": state_dict}``
    (SHA-256 checksums, safetensors, temporary file, fsync, rename, fsync of the folder);
  * ``Trainer.save_checkpoint``: the whole training state of that model (SGD without momentum,
    so the optimizer adds no tensors; plus progress, RNG states, listener namespaces);
  * ``safetensors save_file``: the bare format, no checksums, no fsync;
  * ``torch.save``: pickle + zip, no fsync (the reference of the save ratios);
  * ``torch.save + fsync + rename``: the same durability as ``write_checkpoint``;

load
  * ``read_checkpoint``: :func:`trainer.read_checkpoint` (layout checks, checksums, decode);
  * ``Trainer.load_checkpoint``: read, check against the live model and optimizer, restore;
  * ``safetensors load_file`` (memory-mapped too), and the same copied into the model;
  * ``torch.load(mmap=True, weights_only=True)``: the reference of the load ratios; it maps the
    file and returns without reading the tensor bytes;
  * ``torch.load(mmap) + load_state_dict``: the same, copied into the model (every byte read), the
    fair counterpart of ``Trainer.load_checkpoint``.

The files are written to a temporary folder (``--dir``) and read back right after, so reads come
from the page cache: they measure the CPU work of each format, not the disk. Writes include the
disk only where they fsync.

Usage: python benchmarks/checkpoint_io.py [--large] [--repeats 5] [--dir /tmp]
       [--markdown docs/benchmarks/checkpoint_io.md]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import pathlib
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from _report import command_line, page_header, write_page
from safetensors.torch import load_file, save_file

from trainer import Trainer, read_checkpoint, write_checkpoint

LAYER = 1024
MB = 1_000_000
DEFAULT_MARKDOWN = pathlib.Path(__file__).resolve().parents[1] / "docs/benchmarks/checkpoint_io.md"


def make_model(megabytes: int) -> torch.nn.Module:
    per_layer = (LAYER * LAYER + LAYER) * 4
    layers = max(1, round(megabytes * MB / per_layer))
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(LAYER, LAYER) for _ in range(layers)))


def state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _fsync_file(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _atomic_torch_save(state: Any, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(state, tmp)
    _fsync_file(tmp)
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_all(state: dict[str, torch.Tensor]) -> None:
    for tensor in state.values():
        hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).numpy()).digest()


def variants(model: torch.nn.Module, folder: str) -> dict[str, dict[str, Callable[[], Any]]]:
    state = model.state_dict()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(device="cpu")
    trainer.attach(model, optimizer)
    paths = {
        name: os.path.join(folder, name)
        for name in ("ours.safetensors", "trainer.safetensors", "raw.safetensors", "torch.pt")
    }
    atomic = os.path.join(folder, "atomic.pt")

    def torch_load_and_copy() -> None:
        loaded = torch.load(paths["torch.pt"], mmap=True, weights_only=True)
        model.load_state_dict(loaded)

    save = {
        "write_checkpoint": lambda: write_checkpoint(paths["ours.safetensors"], {"model": state}),
        "Trainer.save_checkpoint": lambda: trainer.save_checkpoint(paths["trainer.safetensors"]),
        "safetensors save_file": lambda: save_file(state, paths["raw.safetensors"]),
        "torch.save": lambda: torch.save(state, paths["torch.pt"]),
        "torch.save + fsync + rename": lambda: _atomic_torch_save(state, atomic),
        "(SHA-256 of every tensor byte)": lambda: _sha256_all(state),
    }
    load = {
        "read_checkpoint": lambda: read_checkpoint(paths["ours.safetensors"]),
        "Trainer.load_checkpoint": lambda: trainer.load_checkpoint(paths["trainer.safetensors"]),
        "safetensors load_file": lambda: load_file(paths["raw.safetensors"]),
        "safetensors load_file + load_state_dict": lambda: model.load_state_dict(
            load_file(paths["raw.safetensors"])
        ),
        "torch.load(mmap=True, weights_only=True)": lambda: torch.load(
            paths["torch.pt"], mmap=True, weights_only=True
        ),
        "torch.load(mmap) + load_state_dict": torch_load_and_copy,
    }
    return {"save": save, "load": load}


def measure(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per call; one warm-up call each, then ``repeats`` interleaved rounds."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            gc.collect()
            start = time.perf_counter()
            result = run()
            times[name].append(time.perf_counter() - start)
            del result
    return {name: statistics.median(values) for name, values in times.items()}


def report(kind: str, size: int, medians: dict[str, float], reference: str) -> list[str]:
    """Print one table; return it as markdown lines."""
    base = medians[reference]
    title = f"{kind}, {size / MB:.0f} MB of tensors (ratios against {reference})"
    print(f"\n{title}")
    width = max(len(name) for name in medians)
    print(f"{'':{width}s}  {'ms':>9s}  {'MB/s':>8s}  {'ratio':>7s}")
    markdown = [f"**{title}**", "", "| | ms | MB/s | ratio |", "| --- | ---: | ---: | ---: |"]
    for name, seconds in medians.items():
        print(
            f"{name:{width}s}  {seconds * 1e3:9.1f}  {size / MB / seconds:8.0f}  "
            f"{seconds / base:6.2f}x"
        )
        markdown.append(
            f"| {name} | {seconds * 1e3:.1f} | {size / MB / seconds:.0f} | {seconds / base:.2f}x |"
        )
    return [*markdown, ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="also the ~500 MB state")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--dir", default=None, help="folder for the files (default: a temp dir)")
    parser.add_argument(
        "--markdown",
        type=pathlib.Path,
        default=DEFAULT_MARKDOWN,
        help="where to write the tables (default: docs/benchmarks/checkpoint_io.md)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    torch.set_num_threads(1)
    setting = (
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, 1 "
        f"thread, median of {args.repeats} interleaved repetitions after one warm-up; reads come "
        "from the page cache"
    )
    print(setting)
    markdown = page_header(command_line("checkpoint_io.py", argv), setting)
    sizes = (50, 500) if args.large else (50,)
    for megabytes in sizes:
        model = make_model(megabytes)
        size = state_bytes(model)
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-io-") as folder:
            runs = variants(model, folder)
            saved = measure(runs["save"], args.repeats)
            loaded = measure(runs["load"], args.repeats)
            files = {
                name: os.path.getsize(os.path.join(folder, name)) / MB
                for name in sorted(os.listdir(folder))
                if not name.startswith(".")
            }
        markdown += report("save", size, saved, "torch.save")
        markdown += report("load", size, loaded, "torch.load(mmap=True, weights_only=True)")
        sizes_line = "file sizes (MB): " + ", ".join(f"{n} {s:.1f}" for n, s in files.items())
        print(sizes_line)
        markdown += [sizes_line, ""]
        del model, runs
        gc.collect()
    write_page(args.markdown, markdown)


if __name__ == "__main__":
    main()
