"""Resume check: kill ``renate-events update --checkpoint-every`` at random points and count how
many runs of the same command afterwards end bit-identical to the uninterrupted update.

A small config file (an MLP on 8 features, 4 classes; 320 training samples in batches of 16, so
20 steps an epoch; 3 epochs; DER) holds a listener that, at the end of training step
``$KILL_AT``, starts a timer that sends the process ``SIGKILL`` after ``$KILL_DELAY`` seconds:
the kill lands anywhere after that step (in the next steps, while a mid-update checkpoint or its
record is written, while the output folder is written). Each trial picks a random step and a
random delay of 0 to 30 ms, runs the update with ``--checkpoint-every 7`` until the kill, then
runs the same command again, and compares the output state folder with the reference (an
uninterrupted update without ``--checkpoint-every``): ``model.safetensors`` byte for byte, every
tensor and value of ``learner.safetensors``, the manifest apart from timings, and no mid-update
folder left. A kill that came too late (the update had finished) is counted apart.

Usage: python benchmarks/resume_kills.py [--kills 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

import torch

from trainer import read_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]

CONFIG = """
import os
import signal
import threading

import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def data_fn(chunk_id, seed):
    g = torch.Generator().manual_seed(100 * chunk_id + seed)
    x = torch.randn(400, 8, generator=g)
    y = x[:, :4].argmax(1)
    return TensorDataset(x[:320], y[:320]), TensorDataset(x[320:], y[320:])


class _KillAfter:
    \"\"\"SIGKILL this process $KILL_DELAY seconds after training step $KILL_AT ended.\"\"\"

    def on_batch_end(self, state):
        if state.global_step == int(os.environ.get("KILL_AT", "-1")):
            kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
            timer = threading.Timer(float(os.environ["KILL_DELAY"]), kill)
            timer.daemon = True
            timer.start()


def listeners():
    return [_KillAfter()]
"""

STEPS = 60  # 20 an epoch, 3 epochs
COMMON = ["--config-file", "c.py", "--device", "cpu", "--no-progress", "--epochs", "3"]
UPDATE = [*COMMON, "--input-state", "first", "--learner", "der", "--batch-size", "16"]


def _run(folder: pathlib.Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    command = [sys.executable, "-m", "renate_events.cli", "update", *args]
    return subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _manifest(folder: pathlib.Path) -> dict[str, Any]:
    manifest = json.loads((folder / "manifest.json").read_text())
    for record in manifest["history"]:
        record.pop("seconds")
    manifest["files"].pop("learner.safetensors")  # safetensors orders its metadata freely
    return manifest


def _identical(reference: pathlib.Path, out: pathlib.Path) -> bool:
    return (
        (reference / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
        and _same(
            read_checkpoint(reference / "learner.safetensors"),
            read_checkpoint(out / "learner.safetensors"),
        )
        and _manifest(reference) == _manifest(out)
        and not (out.parent / f".{out.name}.resume").exists()
    )


def _trial(folder: pathlib.Path, step: int, delay: float) -> tuple[str, int | None, bool]:
    """One kill and one rerun: (what happened, the step resumed from, bit-identical)."""
    out = folder / "out"
    args = [*UPDATE, "--output-state", "out", "--checkpoint-every", "7"]
    killed = _run(folder, args, KILL_AT=str(step), KILL_DELAY=str(delay))
    if killed.returncode == 0:
        return "finished before the kill", None, _identical(folder / "reference", out)
    if killed.returncode != -signal.SIGKILL:
        raise SystemExit(f"the killed run failed otherwise:\n{killed.stderr}")
    record = folder / ".out.resume" / "update.json"
    resumed_from = json.loads(record.read_text())["optimizer_steps"] if record.exists() else 0
    again = _run(folder, args)
    if again.returncode != 0:
        return f"rerun failed: {again.stderr.strip()}", resumed_from, False
    return "killed", resumed_from, _identical(folder / "reference", out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    rng = random.Random(options.seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        (folder / "c.py").write_text(CONFIG)
        for args in (
            [*COMMON, "--output-state", "first"],
            [*UPDATE, "--output-state", "reference"],
        ):
            if _run(folder, args).returncode != 0:
                raise SystemExit("the reference updates failed")
        identical = killed = 0
        header = (
            "trial  kill after step  delay ms  outcome                   resumed from  identical"
        )
        print(header, flush=True)
        for trial in range(options.kills):
            step, delay = rng.randint(1, STEPS), rng.uniform(0.0, 0.03)
            outcome, resumed_from, same = _trial(folder, step, delay)
            killed += outcome == "killed"
            identical += same and outcome == "killed"
            shown = "-" if resumed_from is None else str(resumed_from)
            print(
                f"{trial:5d}  {step:15d}  {delay * 1000:8.1f}  {outcome:24s}  {shown:>12s}  {same}",
                flush=True,
            )
            shutil.rmtree(folder / "out", ignore_errors=True)
    print(f"{identical} of {killed} killed updates resumed bit-identical ({options.kills} trials)")


if __name__ == "__main__":
    main()
