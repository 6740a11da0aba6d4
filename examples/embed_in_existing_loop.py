"""An existing codebase keeps its model, optimizer and data code, and gains events and safe,
resumable checkpoints by handing its step function to ``Trainer.fit``.

Before::

    for epoch in range(3):
        for x, y in loader:
            optimizer.zero_grad()
            loss = my_loss(model(x), y)
            loss.backward()
            optimizer.step()

After: the same ``my_loss`` and objects, the loop is the trainer's.

Run: ``python examples/embed_in_existing_loop.py``
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset


# --- the existing codebase, unchanged ---------------------------------------------------------
def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(512, 16)
    y = x[:, :1] * 2 + 0.1 * torch.randn(512, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    return model, optimizer, loader


def my_loss(prediction, target):
    return torch.nn.functional.mse_loss(prediction, target)


# --- what changes ------------------------------------------------------------------------------
def main() -> float:
    from trainer import Trainer

    model, optimizer, loader = build()

    def step(batch):
        x, y = batch
        return my_loss(model(x), y)

    trainer = Trainer(max_epochs=3, device="cpu", gradient_clip_val=1.0)
    trainer.connect("epoch_end", lambda state: print(f"epoch {state.epoch} done"))
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = Path(folder) / "run.safetensors"
        trainer.connect("epoch_end", lambda trainer: trainer.save_checkpoint(checkpoint))
        result = trainer.fit(model, optimizer, loader, step)
        # A crash after epoch 3 would resume here, exactly, with a larger budget:
        model2, optimizer2, loader2 = build()
        again = Trainer(max_epochs=5, device="cpu", gradient_clip_val=1.0)

        def step2(batch):
            x, y = batch
            return my_loss(model2(x), y)

        resumed = again.fit(model2, optimizer2, loader2, step2, resume_from=checkpoint)
    print(
        f"loss after 3 epochs {result.metrics['train_loss']:.4f}; "
        f"after resuming to 5 {resumed.metrics['train_loss']:.4f}"
    )
    return resumed.metrics["train_loss"]


if __name__ == "__main__":
    main()
