"""Cost of a training step of the prompt methods against fine-tuning the same ViT.

The prompt methods of the registry (those whose spec needs a Vision Transformer: L2P, DualPrompt,
CODA-Prompt with their defaults) train only prompts, keys and the head of a frozen ViT; the
baseline fine-tunes every weight of the same ViT (``FineTuningLearner``). Each step is the
learner's ``training_step`` (the prompt methods' includes the frozen model's query pass), the
backward pass and an SGD step, on one batch of random images, after ``on_train_start`` as an
update would run it. The variants run interleaved round by round in one process
(single-threaded on the CPU); a variant's time per step is the median over its steps of a round
(``time.thread_time`` on the CPU, wall time after ``torch.cuda.synchronize`` on a GPU), and each
ratio is the median over the rounds of the ratio within a round.

Usage: python benchmarks/prompt_step.py [--quick] [--device cpu] [--dim 192] [--depth 6]
       [--rounds 7] [--steps 12] [--markdown docs/benchmarks/prompt_step.md]
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import time

import torch
from _report import command_line, page_header, write_page

from renate_events.methods import LEARNERS, METHODS
from renate_events.models import vit
from trainer import Trainer

BASELINE = "fine-tuning"


def _learner(name: str, args: argparse.Namespace):
    torch.manual_seed(0)
    model = vit(
        num_classes=100,
        image_size=args.image_size,
        patch_size=args.patch_size,
        dim=args.dim,
        depth=args.depth,
        heads=args.heads,
    ).to(args.device)
    learner = LEARNERS[name](
        model=model,
        optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.01),
        batch_size=args.batch,
        trainer=Trainer(max_epochs=1, device=args.device, seed=0),
    )
    learner.on_train_start()  # an update starts (the prompt methods start their task)
    optimizer = learner.optimizer(model.parameters())
    return learner, optimizer


def _clock(device: str) -> float:
    if device == "cpu":
        return time.thread_time()
    torch.cuda.synchronize()
    return time.perf_counter()


def _round(learner, optimizer, batch, steps: int, device: str) -> float:
    """The median seconds of one step over ``steps`` steps (after one warm-up step)."""
    times = []
    for step in range(steps + 1):
        start = _clock(device)
        optimizer.zero_grad(set_to_none=True)
        learner.training_step(batch)["loss"].backward()
        optimizer.step()
        if step:
            times.append(_clock(device) - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 steps")
    parser.add_argument("--markdown", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 2
    if args.device == "cpu":
        torch.set_num_threads(1)
    names = [BASELINE] + [name for name, spec in METHODS.items() if spec.model == "vit"]
    learners = {name: _learner(name, args) for name in names}
    generator = torch.Generator().manual_seed(0)
    size = (args.batch, 3, args.image_size, args.image_size)
    batch = (
        torch.randn(size, generator=generator).to(args.device),
        torch.randint(0, 100, (args.batch,), generator=generator).to(args.device),
    )
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            seconds[name].append(_round(*learners[name], batch, args.steps, args.device))
    rows = []
    for name in names:
        model = learners[name][0].model
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        ratio = statistics.median(a / b for a, b in zip(seconds[name], seconds[BASELINE]))
        milliseconds = 1000 * statistics.median(seconds[name])
        rows.append((name, trainable, milliseconds, ratio))
        print(f"{name:12} trainable {trainable:>9}  {milliseconds:8.2f} ms/step  x{ratio:.2f}")
    if args.markdown is not None:
        setting = (
            f"ViT dim {args.dim}, depth {args.depth}, {args.heads} heads, "
            f"{args.image_size}x{args.image_size} images in patches of {args.patch_size}, batch "
            f"{args.batch}, SGD; {args.rounds} rounds of {args.steps} steps on {args.device} "
            f"({platform.processor() or platform.machine()}, torch {torch.__version__})"
        )
        lines = page_header(command_line("prompt_step.py", argv), setting)
        lines += [
            "| method | trainable parameters | ms per step | step time / fine-tuning's |",
            "|---|---:|---:|---:|",
        ]
        for name, trainable, milliseconds, ratio in rows:
            lines.append(f"| {name} | {trainable} | {milliseconds:.2f} | {ratio:.2f}x |")
        write_page(args.markdown, [*lines, ""])


if __name__ == "__main__":
    main()
