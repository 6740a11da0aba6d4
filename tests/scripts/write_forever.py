"""Writes a large state folder (or checkpoint file) again and again until it is killed.

Usage: python write_forever.py FOLDER {folder|file}
Each write stores a model whose every weight equals the write's number, so a reader can tell a
complete write from a mixture of two.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import TensorDataset

from renate_events.updater import ModelUpdater

folder, kind = sys.argv[1], sys.argv[2]
model = torch.nn.Linear(256, 4)
updater = ModelUpdater(
    model,
    learner="er",
    learner_kwargs={"memory_size": 6000, "memory_batch_size": 8, "batch_size": 512},
    max_epochs=1,
    trainer_kwargs={"device": "cpu"},
    output_state_folder=folder if kind == "folder" else None,
)
data = TensorDataset(torch.randn(6000, 256), torch.randint(0, 4, (6000,)))
updater.update(data)  # fills the buffer: each write is ~6 MB
learner = updater.learner_instance
trainer = learner.trainer
for number in range(1, 10**6):
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float(number))
    if kind == "folder":
        from renate_events.state_folder import write_state_folder as _write_state_folder

        _write_state_folder(folder, learner, updater._manifest_now())
    else:
        trainer.save_checkpoint(f"{folder}/checkpoint.safetensors")
    print(number, flush=True)
