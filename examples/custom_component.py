"""A new ``Component`` used in ``BaseExperienceReplayLearner`` next to a preset's components.

``L2PullComponent`` adds ``weight * ||theta - theta_start||^2`` to the loss on memory batches,
pulling the parameters towards where they were when the update started (an L2 anchor, a simple
relative of EWC without the Fisher weighting). It snapshots the parameters in
``on_train_start(model)`` and keeps the snapshot in checkpoints.

Run: ``python examples/custom_component.py``
"""

from __future__ import annotations

import attrs
import torch
from torch.utils.data import TensorDataset

from renate_events.components import Component
from renate_events.methods import DarkExperienceReplayLearner
from trainer import Trainer


@attrs.define(eq=False)
class L2PullComponent(Component):
    weight: float = 0.01
    _model: torch.nn.Module | None = attrs.field(default=None, init=False)
    _anchor: list[torch.Tensor] = attrs.field(factory=list, init=False)

    def on_train_start(self, model: torch.nn.Module) -> None:
        self._model = model
        self._anchor = [p.detach().clone() for p in model.parameters()]

    def loss(self, outputs_memory, batch_memory, intermediate_representation_memory):
        if self.weight == 0 or self._model is None:
            return outputs_memory.new_zeros(())
        pulls = [((p - a) ** 2).sum() for p, a in zip(self._model.parameters(), self._anchor)]
        return self.weight * torch.stack(pulls).sum()

    def on_save_checkpoint(self, checkpoint) -> None:
        checkpoint["anchor"] = self._anchor

    def on_load_checkpoint(self, checkpoint) -> None:
        self._anchor = [t.clone() for t in checkpoint["anchor"]]


@attrs.define(eq=False)
class DarkExperienceReplayWithPull(DarkExperienceReplayLearner):
    """DER++'s components (``memory_loss``, ``mse_loss``) followed by ``l2_pull``."""

    pull_weight: float = attrs.field(default=0.01, kw_only=True)

    def default_components(self) -> dict[str, Component]:
        return {**super().default_components(), "l2_pull": L2PullComponent(weight=self.pull_weight)}


def main() -> list[str]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    learner = DarkExperienceReplayWithPull(
        model=model,
        memory_size=64,
        memory_batch_size=16,
        batch_size=16,
        pull_weight=0.01,
        trainer=Trainer(max_epochs=2, device="cpu"),
    )
    # The same list, given explicitly to the base learner, works as well:
    # BaseExperienceReplayLearner(model=..., components={"memory_loss": ..., "l2_pull": ...})
    for task in range(2):
        x, y = torch.randn(64, 8), torch.randint(2 * task, 2 * task + 2, (64,))
        result = learner.fit(TensorDataset(x, y))
        print(f"task {task}: {result.steps} steps, train_loss {result.metrics['train_loss']:.4f}")
    names = [key for key, _ in learner.trainer.listeners]
    print("listeners in dispatch order:", names)
    return names


if __name__ == "__main__":
    main()
