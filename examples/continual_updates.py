"""Three model updates through state folders, as a production job would run them (one per day).

Each ``ModelUpdater`` could live in its own process: everything it needs (model, replay buffer,
components, the learner's configuration) is read from the previous day's folder and the new
state is written, atomically, to a new folder.

Run: ``python examples/continual_updates.py``
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from renate_events import ModelUpdater


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))


def data_of_day(day: int) -> TensorDataset:
    g = torch.Generator().manual_seed(day)
    x = torch.randn(96, 8, generator=g) + day
    y = torch.randint(2 * day, 2 * day + 2, (96,), generator=g)  # two new classes per day
    return TensorDataset(x, y)


def main() -> list[str]:
    with tempfile.TemporaryDirectory() as root:
        previous = None
        for day in range(3):
            folder = Path(root) / f"day-{day}"
            updater = ModelUpdater(
                make_model(),
                learner="der",
                learner_kwargs={"memory_size": 60, "memory_batch_size": 16, "batch_size": 16},
                max_epochs=3,
                trainer_kwargs={"device": "cpu"},
                input_state_folder=previous,
                output_state_folder=folder,
            )
            result = updater.update(data_of_day(day), task_id=f"day-{day}")
            print(
                f"day {day}: {result.steps} steps, state in {folder.name}: "
                f"{sorted(p.name for p in folder.iterdir())}"
            )
            previous = folder
        from renate_events.state_folder import read_manifest

        task_ids = read_manifest(previous)["task_ids"]
    print("updates recorded:", task_ids)
    return task_ids


if __name__ == "__main__":
    main()
