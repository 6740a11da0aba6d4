"""GPU check, precision rows: the DER++ image step with TF32 and channels-last on and off.

For the DER++ step of the reduced ResNet-18 of ``gpu_check.py`` (``nf`` 20 and 64, new batch 32 +
memory batch 32, 500 ``uint8`` slots on the GPU, the CIFAR preset), prints the median time per
step of ``DarkExperienceReplayLearner`` + ``Trainer`` in fp32 and bf16-mixed, each with
``Trainer(tf32=False | True)`` and ``Trainer(channels_last=False | True)``, as ratios to the bare
hand-written fp32 loop with TF32 off everywhere (torch's default allows TF32 in cuDNN
convolutions, so the bare loop under the default is listed too). TF32 needs an Ampere GPU or
later; on the CPU (``--cpu-dry-run``) the switches change nothing, and two learner rows (fp32 with
both switches off, bf16 with both on) only check the code paths. As in section 4 of
``gpu_check.py``, each run's first two steps are left out of its time (``SETTLE``).

``gpu_check.py`` calls :func:`section` with itself (its learner, bare loop and sizes); run alone,
``python benchmarks/gpu_precision.py [--steps 40] [--rounds 3] [--cpu-dry-run]`` does the same.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

STEPS, ROUNDS = 40, 3
"""Steps per timed run and rounds at most: 8 learner variants and 2 bare loops per width."""


@contextmanager
def tf32_everywhere(enabled: bool) -> Iterator[None]:
    """TF32 allowed or forbidden in matmuls and convolutions, for a bare loop (the learners use
    ``Trainer(tf32=...)``)."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


def _bare(check: ModuleType, nf: int, loader: Any, device: torch.device, tf32: bool | None) -> Any:
    torch.manual_seed(0)
    model = check.resnet18(num_classes=check.CLASSES, nf=nf).to(device)
    bare = check.BareImageDERpp(model, loader, "32", device)
    if tf32 is None:  # torch's default: TF32 in cuDNN convolutions, not in matmuls
        return bare.run

    def run() -> float:
        with tf32_everywhere(tf32):
            return bare.run()

    return run


def _learner(
    check: ModuleType,
    nf: int,
    precision: str,
    switches: tuple[bool, bool],
    loaders: tuple[Any, Any],
    device: Any,
) -> Callable[[], Any]:
    """A timed run of the learner: one fit over ``loader``, its steady steps' seconds."""
    tf32, channels_last = switches
    loader, warm = loaders
    learner = check.make_image_learner(nf, precision, device)
    learner.trainer.tf32, learner.trainer.channels_last = tf32, channels_last
    learner.fit(warm)  # fills the memory
    clock = check.SteadyClock(device, len(loader))
    learner.trainer.subscribe(clock)
    return lambda: clock.fit(learner, loader)


def _combinations(precisions: Any, device: torch.device) -> list[tuple[str, bool, bool]]:
    """Every precision with TF32 and channels-last off and on; in a CPU dry run, two of them
    (the code paths are the same, and a step of the CPU's bf16 emulation is slow)."""
    every = list(itertools.product(precisions, (False, True), (False, True)))
    return every if device.type == "cuda" else [every[0], every[-1]]


def section(check: ModuleType, device: torch.device, steps: int, rounds: int) -> None:
    """The precision rows, one table per width, every variant measured in the same rounds."""
    steps, rounds = min(steps, STEPS), min(rounds, ROUNDS)
    x, y = check.make_images(check.IMAGE_BATCH * steps, seed=6)
    warm_x, warm_y = check.make_images(check.IMAGE_MEMORY + check.IMAGE_BATCH, seed=7)
    loader = check.TensorLoader((x, y), batch_size=check.IMAGE_BATCH, shuffle=True, device=device)
    warm = check.TensorLoader(
        (warm_x, warm_y), batch_size=check.IMAGE_BATCH, shuffle=True, device=device
    )
    if device.type != "cuda":
        print("\n(5) precision rows: CPU dry run, TF32 changes nothing here (code paths only)")
    for nf in check.IMAGE_WIDTHS:
        variants: dict[str, Callable[[], Any]] = {
            "bare DER++ loop, fp32, TF32 off": _bare(check, nf, loader, device, tf32=False)
        }
        if device.type == "cuda":
            variants["bare DER++ loop, fp32, torch's default TF32"] = _bare(
                check, nf, loader, device, None
            )
        for precision, tf32, channels_last in _combinations(check.PRECISIONS, device):
            name = (
                f"learner {'fp32' if precision == '32' else precision}, "
                f"tf32={tf32}, channels_last={channels_last}"
            )
            switches = (tf32, channels_last)
            variants[name] = _learner(check, nf, precision, switches, (loader, warm), device)
        # the steady steps, as in section 4 (a fit's first steps are its own: see SETTLE)
        medians = check.measure(variants, steps - check.SETTLE, rounds, device)
        check.print_times(
            f"(5) precision rows: DER++ image step, resnet18(nf={nf}), batch "
            f"{check.IMAGE_BATCH} + memory batch {check.IMAGE_BATCH}, {check.IMAGE_MEMORY} uint8 "
            f"slots on the GPU, CIFAR preset; Trainer(tf32=..., channels_last=...); the steady "
            f"steps of each run (its first {check.SETTLE} left out)",
            medians,
            "bare DER++ loop, fp32, TF32 off",
        )


def main(argv: list[str] | None = None) -> int:
    import gpu_check as check  # the script's folder is on sys.path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per timed run")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved timed rounds")
    parser.add_argument("--cpu-dry-run", action="store_true", help="without CUDA: small, on CPU")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.cpu_dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # as gpu_check's dry run: tiny kernels on a shared CPU
        check.IMAGE_BATCH, check.IMAGE_MEMORY, check.IMAGE_WIDTHS = 8, 32, (4,)
    else:
        print("no CUDA device; nothing to check")
        return 0
    section(check, device, max(3, args.steps), max(1, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
