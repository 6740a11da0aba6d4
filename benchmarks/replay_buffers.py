"""Cost of one replay step against the size of the memory.

One step = ``update`` with a batch of 32 samples (784 float32 inputs, an int64 target and 10
float32 logits of metadata) + ``sample(32)``, on a full :class:`ReservoirBuffer` of 200, 5 000,
50 000 and 500 000 slots, single-threaded. The buffers are filled completely before timing, so
every step is in the replacement regime.

The same is timed on a full :class:`SlidingWindowBuffer`, which writes all 32 rows every step (a
full reservoir writes fewer and fewer as the stream grows), next to the bare memory traffic of
such a step (32 ring rows written and 32 random rows read with plain ``index_copy_`` and
``index_select`` on the same storage), to separate the buffer's own work from what the memory
hierarchy charges.

The baseline samples the way Renate does: build a ``DataLoader`` over a ``TensorDataset`` of the
filled storage (``shuffle=True``) and take one batch from a fresh iterator, every step. Its
``RandomSampler`` draws a permutation of the whole memory, so its cost grows with the size.

Run: ``python benchmarks/replay_buffers.py`` (well under a minute; needs ~2 GB of memory). It
prints the tables and writes them to ``docs/benchmarks/replay_buffers.md`` (``--markdown PATH``
to write elsewhere).
It reads the buffer's private storage tensors to build the baseline's dataset.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import resource
import statistics
import time

import torch
from _report import command_line, page_header, write_page
from torch.utils.data import DataLoader, TensorDataset

from renate_events.memory import DataBuffer, ReservoirBuffer, SlidingWindowBuffer

SIZES = (200, 5_000, 50_000, 500_000)
BATCH = 32
FEATURES = 784
CLASSES = 10
STEPS = 3_000
BASELINE_STEPS = 150
WARMUP = 50
FILL_CHUNK = 10_000
DEFAULT_MARKDOWN = pathlib.Path(__file__).resolve().parents[1] / "docs/benchmarks/replay_buffers.md"


def _machine() -> str:
    return f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}"


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def make_batches(count: int, generator: torch.Generator) -> list[tuple]:
    return [
        (
            torch.randn(BATCH, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (BATCH,), generator=generator),
            {"logits": torch.randn(BATCH, CLASSES, generator=generator)},
        )
        for _ in range(count)
    ]


def fill(buffer: DataBuffer, size: int, generator: torch.Generator) -> None:
    chunk = torch.randn(FILL_CHUNK, FEATURES, generator=generator)
    targets = torch.randint(0, CLASSES, (FILL_CHUNK,), generator=generator)
    logits = torch.randn(FILL_CHUNK, CLASSES, generator=generator)
    while len(buffer) < size:
        n = min(FILL_CHUNK, size - len(buffer))
        buffer.update(chunk[:n], targets[:n], {"logits": logits[:n]})


def time_steps(
    buffer: DataBuffer, batches: list[tuple], steps: int, rewind: bool = False
) -> tuple[float, ...]:
    """Median µs of update, of sample and of both, over ``steps`` steps (after a warm-up).

    With ``rewind``, a full reservoir is put back to the stream position ``max_size`` before
    every update (it reads its private count of samples seen), so that every step writes about
    as many rows (``~32 * max_size / (max_size + 16)``) whatever the size: the cost at equal work.
    """
    updates, samples, totals = [], [], []
    clock = time.perf_counter_ns
    for step in range(WARMUP + steps):
        inputs, targets, metadata = batches[step % len(batches)]
        if rewind:
            buffer._num_seen = buffer.max_size  # type: ignore[attr-defined]
        t0 = clock()
        buffer.update(inputs, targets, metadata)
        t1 = clock()
        buffer.sample(BATCH)
        t2 = clock()
        if step >= WARMUP:
            updates.append(t1 - t0)
            samples.append(t2 - t1)
            totals.append(t2 - t0)
    return tuple(statistics.median(v) / 1000 for v in (updates, samples, totals))


def time_memory_floor(buffer: DataBuffer, batches: list[tuple], steps: int) -> float:
    """Median µs of the bare memory traffic of a sliding-window step, without the buffer.

    32 rows written at the next ring positions and 32 read at random slots, with plain
    ``index_copy_``/``index_select`` on the same storage tensors and precomputed indices: what
    the hardware charges for the step (cache-resident or not), none of the buffer's logic.
    """
    storage = buffer._storage()
    generator = torch.Generator().manual_seed(1)
    size = len(buffer)
    reads = [torch.randint(0, size, (BATCH,), generator=generator) for _ in range(64)]
    writes = [(torch.arange(BATCH) + BATCH * i) % size for i in range(64)]
    totals = []
    clock = time.perf_counter_ns
    for step in range(WARMUP + steps):
        inputs, targets, metadata = batches[step % len(batches)]
        sources = [inputs, targets, metadata["logits"]]
        write, read = writes[step % len(writes)], reads[step % len(reads)]
        t0 = clock()
        for stored, source in zip(storage, sources):
            stored.index_copy_(0, write, source)
        for stored in storage:
            stored.index_select(0, read)
        t1 = clock()
        if step >= WARMUP:
            totals.append(t1 - t0)
    return statistics.median(totals) / 1000


def time_dataloader_steps(buffer: ReservoirBuffer, batches: list[tuple], steps: int) -> float:
    """Median µs of update + one batch from a fresh DataLoader over the filled storage."""
    totals = []
    clock = time.perf_counter_ns
    generator = torch.Generator().manual_seed(0)
    for step in range(WARMUP // 5 + steps):
        inputs, targets, metadata = batches[step % len(batches)]
        t0 = clock()
        buffer.update(inputs, targets, metadata)
        n = len(buffer)
        # The filled storage, as Renate's memory dataset would expose it (views, no copies).
        inputs_storage, targets_storage, logits_storage = buffer._storage()
        dataset = TensorDataset(inputs_storage[:n], targets_storage[:n], logits_storage[:n])
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=generator)
        next(iter(loader))
        t1 = clock()
        if step >= WARMUP // 5:
            totals.append(t1 - t0)
    return statistics.median(totals) / 1000


def expected_rows_written(size: int, first: int, count: int) -> float:
    """Mean rows a full reservoir writes per step while samples ``first .. first+count-1`` arrive.

    Sample ``n`` is kept with probability ``size / (n + 1)``.
    """
    return sum(min(1.0, size / (n + 1)) for n in range(first, first + count)) * BATCH / count


def cifar_slot_bytes() -> str:
    """Bytes per slot of a buffer holding CIFAR-shaped samples (3x32x32, an int64 target, 10
    float32 logits) as raw uint8 images against float32 images, read off the storage."""
    sizes = {}
    for dtype in (torch.uint8, torch.float32):
        buffer = ReservoirBuffer(1, seed=0)
        buffer.update(
            torch.zeros(1, 3, 32, 32, dtype=dtype),
            torch.zeros(1, dtype=torch.int64),
            {"logits": torch.zeros(1, CLASSES)},
        )
        sizes[dtype] = sum(t.element_size() * t[0].numel() for t in buffer._storage())
    raw, floats = sizes[torch.uint8], sizes[torch.float32]
    return (
        f"\nCIFAR-shaped slot (3x32x32 image, int64 target, {CLASSES} float32 logits): "
        f"{raw} bytes with uint8 images, {floats} bytes with float32 images "
        f"({floats / raw:.2f}x); 500 000 slots: {500_000 * raw / 2**20:.0f} MiB against "
        f"{500_000 * floats / 2**20:.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--markdown",
        type=pathlib.Path,
        default=DEFAULT_MARKDOWN,
        help="where to write the results for the docs (default: docs/benchmarks/replay_buffers.md)",
    )
    args = parser.parse_args()
    lines: list[str] = []

    def emit(text: str) -> None:
        print(text)
        lines.extend(text.splitlines())

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    batches = make_batches(64, generator)
    reservoir_rows, window_rows = [], []
    bytes_per_slot = rss_full = rss_before = 0.0
    started = time.perf_counter()
    for size in SIZES:
        rss_before = rss_mib()
        reservoir = ReservoirBuffer(size, seed=0)
        fill(reservoir, size, generator)
        written = expected_rows_written(size, size + WARMUP * BATCH, STEPS * BATCH)
        update_us, sample_us, step_us = time_steps(reservoir, batches, STEPS)
        baseline_us = time_dataloader_steps(reservoir, batches, BASELINE_STEPS)
        equal_us = time_steps(reservoir, batches, STEPS, rewind=True)[2]
        reservoir_rows.append((size, written, update_us, sample_us, step_us, baseline_us, equal_us))
        storage = reservoir._storage()
        bytes_per_slot = float(sum(t.element_size() * t[0].numel() for t in storage))
        if size == SIZES[-1]:
            rss_full = rss_mib()
        del reservoir, storage
        buffer = SlidingWindowBuffer(size, seed=0)
        fill(buffer, size, generator)
        update_us, sample_us, step_us = time_steps(buffer, batches, STEPS)
        floor_us = time_memory_floor(buffer, batches, STEPS)
        window_rows.append((size, update_us, sample_us, step_us, floor_us))
        del buffer

    emit(f"torch {torch.__version__}, threads={torch.get_num_threads()}, batch={BATCH}, "
          f"inputs={FEATURES} float32 + int64 target + logits={CLASSES} float32 metadata; "
          f"medians over {STEPS} steps ({BASELINE_STEPS} for the DataLoader baseline); "
          "buffers full before timing")  # fmt: skip
    emit("\nReservoirBuffer: update(32) + sample(32)")
    header = (
        f"{'slots':>7} | {'storage':>9} | {'rows written':>12} | {'update µs':>9} | "
        f"{'sample µs':>9} | {'step µs':>7} | {'vs 200':>6} | {'DataLoader step µs':>18} | "
        f"{'DataLoader / ours':>17} | {'step µs, ~31 rows':>17} | {'vs 200':>6}"
    )
    emit(header)
    emit("-" * len(header))
    base, base_equal = reservoir_rows[0][4], reservoir_rows[0][6]
    for size, written, update_us, sample_us, step_us, baseline_us, equal_us in reservoir_rows:
        mib = size * bytes_per_slot / 2**20
        emit(
            f"{size:>7} | {mib:>5.0f} MiB | {written:>12.1f} | {update_us:>9.1f} | "
            f"{sample_us:>9.1f} | {step_us:>7.1f} | {step_us / base:>5.2f}x | "
            f"{baseline_us:>18.1f} | {baseline_us / step_us:>16.1f}x | {equal_us:>17.1f} | "
            f"{equal_us / base_equal:>5.2f}x"
        )
    emit(
        "rows written = mean rows a step writes (a full reservoir keeps sample n with probability "
        "max_size/(n+1),\nso small reservoirs far into the stream write almost nothing); "
        "step µs, ~31 rows = the same step with the\nreservoir put back to stream position "
        "max_size before every update, so that every size writes ~30-32 rows"
    )
    emit("\nSlidingWindowBuffer (always writes 32 rows): update(32) + sample(32)")
    header = (
        f"{'slots':>7} | {'update µs':>9} | {'sample µs':>9} | {'step µs':>7} | {'vs 200':>6} | "
        f"{'raw rows µs':>11} | {'step - raw µs':>13} | {'vs 200':>6}"
    )
    emit(header)
    emit("-" * len(header))
    base, base_logic = window_rows[0][3], window_rows[0][3] - window_rows[0][4]
    for size, update_us, sample_us, step_us, floor_us in window_rows:
        logic = step_us - floor_us
        emit(
            f"{size:>7} | {update_us:>9.1f} | {sample_us:>9.1f} | {step_us:>7.1f} | "
            f"{step_us / base:>5.2f}x | {floor_us:>11.1f} | {logic:>13.1f} | "
            f"{logic / base_logic:>5.2f}x"
        )
    emit(
        "raw rows = bare index_copy_ of 32 ring rows + index_select of 32 random rows of the "
        "same storage\n(the memory traffic alone: cache-resident for small buffers, DRAM for "
        "large ones); step - raw = the buffer's own work"
    )
    emit(
        f"\n{SIZES[-1]}-slot buffer: {bytes_per_slot:.0f} bytes per slot "
        f"({bytes_per_slot * SIZES[-1] / 2**20:.0f} MiB of storage); process RSS "
        f"{rss_full:.0f} MiB when full ({rss_before:.0f} MiB before allocating it); peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )
    emit(cifar_slot_bytes())
    emit(f"total time {time.perf_counter() - started:.0f} s")
    if args.markdown is not None:
        text = [
            *page_header(command_line("replay_buffers.py"), _machine()),
            "```text",
            *lines,
            "```",
            "",
        ]
        write_page(args.markdown, text)


if __name__ == "__main__":
    main()
