"""A memory-mapped replay buffer far larger than the process's own memory, and its step cost.

Fills a :class:`~renate_events.memory.mapped.MappedReservoirBuffer` with ``--slots`` raw uint8
CIFAR-shaped samples (3x32x32, an int64 target, 10 float32 logits: 3 120 bytes a slot), in a
temporary folder (``--folder`` to choose the disk), then times one replay step (``update`` with
32 samples + ``sample(32)``) against an in-memory :class:`~renate_events.memory.ReservoirBuffer`
of the same size, in the same run, single-threaded. Reports the buffer's bytes next to the
process's resident memory from ``/proc/self/status``: ``RssAnon`` (the process's own memory,
which the in-memory buffer adds to) and ``RssFile`` (pages of the mapped files now in the page
cache, which the kernel can write back and drop under memory pressure). The mapped buffer is
measured first, before the in-memory one is allocated.

Run: ``python benchmarks/mmap_buffer.py`` (default 300 000 slots, ~900 MB on disk, under a
minute); ``--slots 1000000`` for ~3 GB.

``--state-folder`` measures instead what a :class:`~renate_events.updater.ModelUpdater` update
costs around its buffer, for ``buffer_storage="memory"`` and ``"mapped"``: an ER learner whose
reservoir of ``--slots`` uint8 CIFAR-shaped samples (with their logits, 3 120 bytes) is full
(an earlier update, untimed, trained on ``--slots`` samples),
trained for one epoch on 256 new samples, then the output state folder written
(``write_output``: checkpoint, buffer files, checksums) and read back by the next update's
updater (checksums verified, the buffer copied into its working files); plus, for scale, one
SHA-256 pass and one plain file copy of the buffer's bytes.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch.utils.data import Dataset, TensorDataset

from renate_events.memory import DataBuffer, ReservoirBuffer
from renate_events.memory.mapped import MappedReservoirBuffer
from renate_events.transforms import ToFloat
from renate_events.updater import ModelUpdater

BATCH = 32
SHAPE = (3, 32, 32)
CLASSES = 10
CHUNK = 4_096


def status_mib() -> dict[str, float]:
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                values[key] = int(line.split()[1]) / 1024
    return values


def _batch(n: int, generator: torch.Generator) -> tuple:
    return (
        torch.randint(0, 256, (n, *SHAPE), dtype=torch.uint8, generator=generator),
        torch.randint(0, CLASSES, (n,), generator=generator),
        {"logits": torch.randn(n, CLASSES, generator=generator)},
    )


def fill(buffer: DataBuffer, slots: int) -> None:
    inputs, targets, metadata = _batch(CHUNK, torch.Generator().manual_seed(0))
    while len(buffer) < slots:
        n = min(CHUNK, slots - len(buffer))
        buffer.update(inputs[:n], targets[:n], {"logits": metadata["logits"][:n]})


def step_cost(buffer: DataBuffer, steps: int) -> float:
    generator = torch.Generator().manual_seed(1)
    batches = [_batch(BATCH, generator) for _ in range(64)]
    times = []
    for i in range(steps):
        inputs, targets, metadata = batches[i % len(batches)]
        start = time.perf_counter()
        buffer.update(inputs, targets, metadata)
        buffer.sample(BATCH)
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:])


def _state_updater(storage: str, slots: int, **folders: str) -> ModelUpdater:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, CLASSES))
    return ModelUpdater(
        model,
        learner="er",
        learner_kwargs={"memory_size": slots, "batch_size": 64, "memory_batch_size": 64},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        transforms={"train_transform": ToFloat(), "buffer_transform": ToFloat()},
        buffer_storage=storage,
        validation_memory=False,
        **folders,
    )


def _timed(function: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _Cycled(Dataset):
    """``n`` CIFAR-shaped samples that cycle over one chunk: a first update that fills a large
    buffer by training on it, without holding ``n`` samples in memory."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.inputs, self.targets, _ = _batch(CHUNK, torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index % CHUNK], self.targets[index % CHUNK]


def state_folder_cost(slots: int, folder: str | None) -> None:
    """One update's buffer-related cost through state folders, in memory and mapped."""
    inputs, targets, _ = _batch(256, torch.Generator().manual_seed(2))
    new = TensorDataset(inputs, targets)
    for storage in ("memory", "mapped"):
        with tempfile.TemporaryDirectory(dir=folder) as root:
            # The buffer is filled by a first update that trained on ``slots`` samples (untimed):
            # a buffer filled behind the updater's back has seen more samples than the state
            # folder's updates trained on, which the next update's checks refuse.
            filled, first = os.path.join(root, "s0"), os.path.join(root, "s1")
            filling = _state_updater(storage, slots, output_state_folder=filled)
            filling.update(_Cycled(slots), None, None)
            filling.write_output()
            del filling
            gc.collect()
            updater = _state_updater(
                storage, slots, input_state_folder=filled, output_state_folder=first
            )
            _ = updater.learner_instance  # reading the filled folder is not the update's cost
            train = _timed(updater.update, new, None, None)
            write = _timed(updater.write_output)
            del updater
            gc.collect()
            following = _state_updater(storage, slots, input_state_folder=first)
            read = _timed(getattr, following, "learner_instance")
            sizes = {name: os.path.getsize(os.path.join(first, name)) for name in os.listdir(first)}
            total = sum(sizes.values()) / 2**20
            print(
                f"{storage}: update (1 epoch, 256 samples) {train:.2f} s; write the state folder "
                f"{write:.2f} s; read it into the next update {read:.2f} s; folder {total:.0f} MiB "
                f"(learner.safetensors {sizes['learner.safetensors'] / 2**20:.1f} MiB)"
            )
            if storage == "mapped":
                largest = max((n for n in sizes if n.startswith("buffer.")), key=sizes.get)
                path = os.path.join(first, largest)
                digest = _timed(_sha256, path)
                copy = _timed(shutil.copyfile, path, path + ".copy")
                print(
                    f"  for scale, on {largest} ({sizes[largest] / 2**20:.0f} MiB, page-cached): "
                    f"SHA-256 {digest:.2f} s, plain copy {copy:.2f} s"
                )
            del following
            gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=300_000)
    parser.add_argument("--steps", type=int, default=1_000)
    parser.add_argument("--folder", default=None)
    parser.add_argument("--state-folder", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.state_folder:
        print(f"torch {torch.__version__}, Python {platform.python_version()}, 1 thread")
        state_folder_cost(args.slots, args.folder)
        return
    slot_bytes = SHAPE[0] * SHAPE[1] * SHAPE[2] + 8 + 4 * CLASSES
    size_mib = args.slots * slot_bytes / 2**20
    print(f"torch {torch.__version__}, Python {platform.python_version()}, 1 thread")
    print(f"{args.slots} slots x {slot_bytes} B = {size_mib:.0f} MiB of buffer")
    before = status_mib()
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        mapped = MappedReservoirBuffer(args.slots, folder=folder, seed=0)
        start = time.perf_counter()
        fill(mapped, args.slots)
        fill_s = time.perf_counter() - start
        mapped_step = step_cost(mapped, args.steps)
        after = status_mib()
        anon = after["RssAnon"] - before["RssAnon"]
        print(
            f"mapped: filled in {fill_s:.1f} s; RSS {after['VmRSS']:.0f} MiB "
            f"(RssAnon {after['RssAnon']:.0f}, +{anon:.0f} MiB during the run; RssFile "
            f"{after['RssFile']:.0f}); buffer / RssAnon = {size_mib / after['RssAnon']:.1f}x"
        )
        del mapped
        gc.collect()
    memory = ReservoirBuffer(args.slots, seed=0)
    fill(memory, args.slots)
    memory_step = step_cost(memory, args.steps)
    after_memory = status_mib()
    print(
        f"in-memory: RSS {after_memory['VmRSS']:.0f} MiB (RssAnon "
        f"{after_memory['RssAnon']:.0f} MiB)"
    )
    print(
        f"step (update {BATCH} + sample {BATCH}): mapped {mapped_step * 1e6:.1f} us, "
        f"in-memory {memory_step * 1e6:.1f} us, ratio {mapped_step / memory_step:.2f}x"
    )


if __name__ == "__main__":
    main()
