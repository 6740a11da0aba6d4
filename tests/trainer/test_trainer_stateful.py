"""A hypothesis state machine drives one trainer through random subscribe / unsubscribe / fit /
save / load sequences and checks it against a plain Python model after every rule.

The model predicts, for each fit, the exact event sequence (the grammar of DESIGN.md), the order
of the receivers of each event (priority, then subscription order), the number of training and
optimizer steps, and which listener state a load must bring back.
"""

from __future__ import annotations

import itertools
import math
import pathlib
import tempfile

import attrs
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from trainer import CheckpointMismatchError, Trainer

EVENT_NAMES = (
    "train_start",
    "epoch_start",
    "batch_start",
    "batch_end",
    "epoch_end",
    "validation_start",
    "validation_end",
    "train_end",
)


@attrs.define(eq=False)
class Probe:
    """Records every loop event into a shared log; keeps state that goes through checkpoints."""

    ident: int
    log: list[tuple[str, int]]
    received: int = 0
    vector: torch.Tensor = attrs.field(factory=lambda: torch.zeros(3))

    def _hit(self, event: str) -> None:
        self.log.append((event, self.ident))
        self.received += 1

    def on_train_start(self):
        self._hit("train_start")

    def on_epoch_start(self):
        self._hit("epoch_start")

    def on_batch_start(self):
        self._hit("batch_start")

    def on_batch_end(self, loss):
        self._hit("batch_end")
        self.vector = self.vector + loss.detach()

    def on_epoch_end(self):
        self._hit("epoch_end")

    def on_validation_start(self):
        self._hit("validation_start")

    def on_validation_end(self):
        self._hit("validation_end")

    def on_train_end(self):
        self._hit("train_end")

    def on_save_checkpoint(self, checkpoint):
        checkpoint["received"] = self.received
        checkpoint["vector"] = self.vector

    def on_load_checkpoint(self, checkpoint):
        self.received = checkpoint["received"]
        self.vector = checkpoint["vector"].clone()


def expected_fit(max_epochs, max_steps, batches, validate, every, accumulate):
    """The events one fit publishes, its batch count and its optimizer-step count."""
    epochs_limit = max_epochs if max_epochs or max_steps else 1
    events, steps, optimizer_steps = ["train_start"], 0, 0
    for epoch in itertools.count():
        if (max_steps is not None and steps >= max_steps) or (
            epochs_limit is not None and epoch >= epochs_limit
        ):
            break
        events.append("epoch_start")
        window = 0
        for index in range(batches):
            events += ["batch_start", "batch_end"]
            steps, window = steps + 1, window + 1
            if window == accumulate or index + 1 == batches or steps == max_steps:
                optimizer_steps, window = optimizer_steps + 1, 0
            if steps == max_steps:
                break
        events.append("epoch_end")
        if validate and (epoch + 1) % every == 0:
            events += ["validation_start", "validation_end"]
    events.append("train_end")
    return events, steps, optimizer_steps


class TrainerMachine(RuleBasedStateMachine):
    probes = Bundle("probes")

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.folder = pathlib.Path(tempfile.mkdtemp(prefix="trainer-machine-"))
        self.model = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.trainer = Trainer(device="cpu")
        self.trainer.attach(self.model, self.optimizer)
        self.log: list[tuple[str, int]] = []
        self.subscribed: dict[int, tuple[Probe, int, int]] = {}  # ident -> (probe, priority, seq)
        self.unsubscribed: dict[int, tuple[Probe, int]] = {}  # ident -> (probe, events then)
        self.counter = itertools.count()
        self.saved: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}

    def ordered_idents(self):
        entries = sorted(self.subscribed.items(), key=lambda kv: (-kv[1][1], kv[1][2]))
        return [ident for ident, _ in entries]

    @rule(target=probes, priority=st.integers(-2, 2))
    def subscribe(self, priority):
        ident = next(self.counter)
        probe = Probe(ident, self.log)
        key = self.trainer.subscribe(probe, priority, name=f"probe{ident}")
        assert key == f"probe{ident}"
        self.subscribed[ident] = (probe, priority, ident)
        return ident

    @rule(ident=consumes(probes))
    def unsubscribe(self, ident):
        probe = self.subscribed.pop(ident)[0]
        self.trainer.unsubscribe(probe)
        self.unsubscribed[ident] = (probe, probe.received)

    @rule(
        max_epochs=st.one_of(st.none(), st.integers(1, 3)),
        max_steps=st.one_of(st.none(), st.integers(1, 7)),
        batches=st.integers(1, 4),
        validate=st.booleans(),
        every=st.integers(1, 2),
        accumulate=st.integers(1, 3),
    )
    def fit(self, max_epochs, max_steps, batches, validate, every, accumulate):
        self.trainer.max_epochs = max_epochs
        self.trainer.max_steps = max_steps
        self.trainer.check_val_every_n_epoch = every
        self.trainer.accumulate_grad_batches = accumulate
        data = [(torch.randn(2, 3), torch.randint(0, 2, (2,))) for _ in range(batches)]
        model = self.model

        def step(batch):
            return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

        self.log.clear()
        result = self.trainer.fit(
            model, self.optimizer, data, step, val_loader=data[:1] if validate else None
        )
        events, steps, optimizer_steps = expected_fit(
            max_epochs, max_steps, batches, validate, every, accumulate
        )
        order = self.ordered_idents()
        assert self.log == [(event, ident) for event in events for ident in order]
        assert result.steps == steps == events.count("batch_end")
        assert result.optimizer_steps == optimizer_steps
        if accumulate == 1:
            assert result.optimizer_steps == result.steps
        else:
            assert result.optimizer_steps >= math.ceil(result.steps / accumulate)

    @rule()
    def save(self):
        name = f"ckpt{len(self.saved)}.safetensors"
        self.trainer.save_checkpoint(self.folder / name)
        self.saved[name] = {
            ident: (probe.received, probe.vector.clone())
            for ident, (probe, _, _) in self.subscribed.items()
        }

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def load(self, data):
        name = data.draw(st.sampled_from(sorted(self.saved)))
        snapshot = self.saved[name]
        before = {i: (p.received, p.vector.clone()) for i, (p, _, _) in self.subscribed.items()}
        if set(snapshot) == set(self.subscribed):
            self.trainer.load_checkpoint(self.folder / name)
            for ident, (received, vector) in snapshot.items():
                probe = self.subscribed[ident][0]
                assert probe.received == received
                assert torch.equal(probe.vector, vector)
        else:
            try:
                self.trainer.load_checkpoint(self.folder / name)
            except CheckpointMismatchError as error:
                for ident in set(snapshot) ^ set(self.subscribed):
                    assert f"'probe{ident}'" in str(error)
            else:
                raise AssertionError("loading with other listeners subscribed must fail")
            for ident, (probe, _, _) in self.subscribed.items():
                assert probe.received == before[ident][0]
                assert torch.equal(probe.vector, before[ident][1])

    @invariant()
    def unsubscribed_probes_receive_nothing(self):
        for probe, received in self.unsubscribed.values():
            assert probe.received == received

    @invariant()
    def listeners_in_dispatch_order(self):
        keys = [key for key, _ in self.trainer.listeners]
        assert keys == [f"probe{ident}" for ident in self.ordered_idents()]


TestTrainerMachine = TrainerMachine.TestCase
TestTrainerMachine.settings = settings(max_examples=40, stateful_step_count=15)
