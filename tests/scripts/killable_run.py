"""A two-update continual-learning run that checkpoints every few steps and can kill itself.

Usage: python killable_run.py OUT_DIR KILL_TASK KILL_STEP
(KILL_TASK -1: never kill), or ``main(out, kill_task, kill_step)`` in a fresh process (the
tests fork it from a server that imported torch once). Run it again with the same OUT_DIR to
resume; when it finishes it writes OUT_DIR/final.safetensors.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import attrs
import torch
from torch.utils.data import TensorDataset

from renate_events.methods import DarkExperienceReplayLearner
from trainer import Trainer


@attrs.define
class Periodic:
    """Checkpoints every 3 steps into ckpt-task{i}.safetensors; kills the process on request."""

    out: str
    kill_task: int
    kill_step: int
    task: int = 0

    def on_batch_end(self, trainer, state):
        if state.global_step % 3 == 0:
            trainer.save_checkpoint(os.path.join(self.out, f"ckpt-task{self.task}.safetensors"))

    def on_batch_start(self, state):
        if self.task == self.kill_task and state.global_step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)


def task_data(i):
    g = torch.Generator().manual_seed(100 + i)
    return TensorDataset(
        torch.randn(48, 6, generator=g), torch.randint(3 * i, 3 * i + 3, (48,), generator=g)
    )


def _learner(periodic):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 6)
    )
    trainer = Trainer(max_epochs=2, device="cpu")
    trainer.subscribe(periodic, name="periodic")
    return DarkExperienceReplayLearner(
        model=model,
        memory_size=20,
        memory_batch_size=8,
        batch_size=8,
        seed=1,
        ema_memory_update_gamma=0.9,
        trainer=trainer,
    )


def main(out, kill_task, kill_step):
    torch.set_num_threads(1)
    os.makedirs(out, exist_ok=True)
    progress_file = os.path.join(out, "progress.json")
    periodic = Periodic(out, kill_task, kill_step)
    learner = _learner(periodic)
    first = 0
    if os.path.exists(progress_file):
        with open(progress_file) as handle:
            first = json.load(handle)["task"]
    for i in range(first, 2):
        with open(progress_file + ".tmp", "w") as handle:
            json.dump({"task": i}, handle)
        os.replace(progress_file + ".tmp", progress_file)
        periodic.task = i
        mid = os.path.join(out, f"ckpt-task{i}.safetensors")
        if i == first and os.path.exists(mid):
            learner.fit(task_data(i), resume_from=mid)
        else:
            if i == first and i > 0:
                learner.load_checkpoint(os.path.join(out, f"after-task{i - 1}.safetensors"))
            learner.fit(task_data(i))
        learner.save_checkpoint(os.path.join(out, f"after-task{i}.safetensors"))
    learner.save_checkpoint(os.path.join(out, "final.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
