"""A listener with state that survives a checkpoint round trip.

``BestLossTracker`` remembers the lowest validation loss and the epoch it happened at. Its state
goes into the checkpoint through ``on_save_checkpoint`` and comes back, into the instance that is
subscribed at load time, through ``on_load_checkpoint``.

Run: ``python examples/custom_listener.py``
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import attrs
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer import Trainer


@attrs.define(eq=False)
class BestLossTracker:
    best: float = math.inf
    best_epoch: int = -1

    def on_validation_end(self, state, metrics: dict[str, float]) -> None:
        if metrics["val_loss"] < self.best:
            self.best, self.best_epoch = metrics["val_loss"], state.epoch

    def on_save_checkpoint(self, checkpoint) -> None:
        checkpoint["best"] = self.best  # JSON-able values and tensors are accepted
        checkpoint["best_epoch"] = self.best_epoch

    def on_load_checkpoint(self, checkpoint) -> None:
        self.best, self.best_epoch = checkpoint["best"], checkpoint["best_epoch"]


def main() -> BestLossTracker:
    torch.manual_seed(0)
    x, y = torch.randn(256, 10), torch.randint(0, 3, (256,))
    train = DataLoader(TensorDataset(x[:192], y[:192]), batch_size=32, shuffle=True)
    val = DataLoader(TensorDataset(x[192:], y[192:]), batch_size=64)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))

    def step(batch):
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(model(inputs), targets)

    trainer = Trainer(max_epochs=3, device="cpu")
    tracker = BestLossTracker()
    trainer.subscribe(tracker, name="best_loss")  # the name keys its state in the checkpoint
    trainer.fit(model, torch.optim.Adam(model.parameters(), lr=1e-2), train, step, val_loader=val)

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.safetensors"
        trainer.save_checkpoint(path)
        # A new process would build the same objects, subscribe a fresh tracker and load:
        restored = BestLossTracker()
        other = Trainer(device="cpu")
        other.subscribe(restored, name="best_loss")
        other.load_checkpoint(path, model=model, optimizer=torch.optim.Adam(model.parameters()))
    print(f"best val_loss {restored.best:.4f} at epoch {restored.best_epoch}")
    return restored


if __name__ == "__main__":
    main()
