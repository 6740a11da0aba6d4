"""Quickstart: train a small classifier on scikit-learn's bundled digits with ``trainer.Trainer``.

No download and no Lightning: a model, an optimizer, a step function, a trainer and two
listeners, one that prints progress and a ready-made ``EarlyStopping``. Run it with
``python examples/quickstart.py``.
"""

from __future__ import annotations

import argparse

import attrs
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from trainer import Trainer
from trainer.listeners import EarlyStopping


@attrs.define(eq=False)
class PrintProgress:
    """Prints the mean training loss of each epoch and the validation metrics.

    The running sum stays on the device; one ``.item()`` per epoch reads it.
    """

    total: torch.Tensor | None = None
    batches: int = 0

    def on_epoch_start(self) -> None:
        self.total, self.batches = None, 0

    def on_batch_end(self, loss: torch.Tensor) -> None:
        loss = loss.detach()
        self.total = loss if self.total is None else self.total + loss
        self.batches += 1

    def on_epoch_end(self, state) -> None:
        mean = (self.total / self.batches).item() if self.total is not None else float("nan")
        print(f"epoch {state.epoch + 1}/{state.max_epochs}  train_loss {mean:.4f}", end="")

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        print("  " + "  ".join(f"{name} {value:.4f}" for name, value in metrics.items()))


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    digits = load_digits()
    inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    targets = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(targets))
    train, test = order[:1400], order[1400:]
    train_loader = DataLoader(TensorDataset(inputs[train], targets[train]), 32, shuffle=True)
    test_loader = DataLoader(TensorDataset(inputs[test], targets[test]), 256)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    def val_step(batch):
        x, y = batch
        logits = model(x)
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "accuracy": accuracy}

    trainer = Trainer(max_epochs=args.epochs, seed=args.seed)
    trainer.subscribe(PrintProgress())
    trainer.subscribe(EarlyStopping(monitor="val_loss", patience=2))
    result = trainer.fit(
        model, optimizer, train_loader, step, val_loader=test_loader, val_step=val_step
    )
    print(f"done: {result.steps} steps, test accuracy {result.metrics['val_accuracy']:.3f}")
    return result.metrics


if __name__ == "__main__":
    main()
