"""Training throughput of ``trainer.Trainer`` with 1 and 2 data-parallel processes.

Trains an MLP 784-512-512-10 on random in-memory data (:class:`trainer.TensorLoader`, per-rank
batch ``--batch``) for ``--steps`` steps per process after ``--warmup`` steps, and reports the
global samples per second (all ranks together) and the scaling against one process. On CPU the
processes use gloo and ``--threads`` intra-op threads each (default 1; 0 means
``cores // world_size``). On a 2-core machine expect no gain: the two processes share the cores
with everything else, and gloo's all-reduce of the ~670k gradients every step is time a single
process does not spend. (On the shared 2-core development machine, one process with 2 threads
was an order of magnitude slower than with 1 thread, so threads are pinned to 1 by default.)
With CUDA GPUs the same runs with NCCL, one GPU per process (2 processes only when there are 2
GPUs).

Usage: python benchmarks/ddp.py [--steps 60] [--warmup 10] [--batch 256]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer import TensorLoader, Trainer


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Clock:
    """Starts timing at ``batch_end`` of the last warm-up step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.started: float | None = None

    def on_batch_end(self, state, loss) -> None:
        if state.global_step == self.warmup:
            float(loss.detach())  # wait for the device
            self.started = time.perf_counter()


def _worker(rank: int, world: int, port: int, backend: str, args, out: str) -> None:
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    steps = args.steps + args.warmup
    samples = steps * args.batch * world
    x, y = torch.randn(samples, 784), torch.randint(0, 10, (samples,))
    loader = TensorLoader((x, y), batch_size=args.batch, seed=0, device=device)
    trainer = Trainer(max_steps=steps, device=device, nonfinite_loss="off")
    clock = _Clock(args.warmup)
    trainer.subscribe(clock)

    def step(batch):
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(trainer.training_model(inputs), targets)

    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.01), loader, step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - clock.started
    if rank == 0:
        with open(out, "w") as handle:
            handle.write(f"{args.steps * args.batch * world / seconds}")
    if world > 1:
        dist.destroy_process_group()


def _measure(world: int, backend: str, args) -> float:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rate")
        mp.start_processes(
            _worker,
            args=(world, _port(), backend, args, out),
            nprocs=world,
            start_method="spawn",
        )
        with open(out) as handle:
            return float(handle.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="per process (0: cores / N)")
    args = parser.parse_args()
    print(f"MLP 784-512-512-10, batch {args.batch} per process, {os.cpu_count()} CPU cores")
    configs = [("gloo", 1), ("gloo", 2)]
    gpus = torch.cuda.device_count()
    if gpus:
        configs += [("nccl", 1)] + ([("nccl", 2)] if gpus >= 2 else [])
    base: dict[str, float] = {}
    for backend, world in configs:
        rate = _measure(world, backend, args)
        base.setdefault(backend, rate)
        where = "CPU" if backend == "gloo" else "GPU"
        print(
            f"{backend:5s} {where} {world} process(es): {rate:10.0f} samples/s "
            f"(x{rate / base[backend]:.2f} of 1 process)"
        )
    if not gpus:
        print("no CUDA GPU: NCCL not measured")


if __name__ == "__main__":
    main()
