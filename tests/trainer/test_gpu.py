"""Steady-state steps on a CUDA device do not synchronise the host with the device.

Each test warms up with one fit, then runs a second fit whose steady-state steps (from
``batch_start`` of its second batch to ``batch_end`` of its last) run under
``torch.cuda.set_sync_debug_mode("error")``: any operation that waits for the device (``.item()``,
``bool(tensor)``, a blocking host-to-device copy, ...) raises ``RuntimeError: called a
synchronizing CUDA operation``. The loss check is off (``nonfinite_loss="off"``): it reads one
bool per step by design. All tests are skipped without CUDA (see ``conftest.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from renate_events.memory import ReservoirBuffer
from renate_events.methods import ExperienceReplayLearner
from tests.helpers import sync_errors_in_steady_state
from trainer import TensorLoader, Trainer

pytestmark = pytest.mark.gpu

SYNC = "synchronizing CUDA operation"
BATCH = 16
BATCHES = 10


@pytest.fixture(autouse=True)
def _sync_debug_off() -> Iterator[None]:
    yield
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(0)


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(BATCH * BATCHES, 20, generator=generator)
    return inputs, torch.randint(0, 5, (BATCH * BATCHES,), generator=generator)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5)
    ).cuda()


def _step(model: torch.nn.Module):
    def step(batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)

    return step


def test_the_check_catches_a_synchronising_step():
    """The default loss check reads a bool from the device every step: the window sees it."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = TensorLoader(_data(), batch_size=BATCH, device="cuda")
    trainer = Trainer(max_epochs=1, device="cuda")  # nonfinite_loss="raise"
    trainer.fit(model, optimizer, loader, _step(model))
    with (
        pytest.raises(RuntimeError, match=SYNC),
        sync_errors_in_steady_state(trainer, BATCHES - 1),
    ):
        trainer.fit(model, optimizer, loader, _step(model))


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_trainer_steps_on_device_resident_data_do_not_synchronise(precision):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = TensorLoader(_data(), batch_size=BATCH, device="cuda")
    trainer = Trainer(max_epochs=1, device="cuda", precision=precision, nonfinite_loss="off")
    trainer.fit(model, optimizer, loader, _step(model))
    with sync_errors_in_steady_state(trainer, BATCHES - 1):
        result = trainer.fit(model, optimizer, loader, _step(model))
    assert result.steps == BATCHES


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_experience_replay_steps_with_the_buffer_on_the_device_do_not_synchronise(precision):
    buffer = ReservoirBuffer(64, seed=0, device="cuda")
    learner = ExperienceReplayLearner(
        model=_model(),
        memory_size=64,
        memory_batch_size=BATCH,
        batch_size=BATCH,
        buffer=buffer,
        trainer=Trainer(max_epochs=1, device="cuda", precision=precision, nonfinite_loss="off"),
    )
    loader = TensorLoader(_data(), batch_size=BATCH, device="cuda")
    learner.fit(loader)  # warm-up: the memory is full afterwards, so every step replays
    assert len(buffer) == 64
    seen = buffer.num_seen
    with sync_errors_in_steady_state(learner.trainer, BATCHES - 1):
        learner.fit(loader)
    assert buffer.num_seen == seen + BATCH * BATCHES


class _PinnedOnly:
    """Yields the loader's batches, checking that they are in pinned host memory."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for inputs, targets in self.loader:
            assert inputs.is_pinned() and targets.is_pinned()
            yield inputs, targets


class _OnDevice:
    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_batch_start(self, batch: Any) -> None:
        self.devices.update(t.device.type for t in batch)


def test_batches_from_pinned_memory_are_moved_without_blocking():
    """A blocking copy synchronises: under the check, only a non_blocking move passes."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = _PinnedOnly(DataLoader(TensorDataset(*_data()), batch_size=BATCH, pin_memory=True))
    trainer = Trainer(max_epochs=1, device="cuda", nonfinite_loss="off")
    seen = _OnDevice()
    trainer.subscribe(seen)
    trainer.fit(model, optimizer, loader, _step(model))
    with sync_errors_in_steady_state(trainer, BATCHES - 1):
        trainer.fit(model, optimizer, loader, _step(model))
    assert seen.devices == {"cuda"}


def test_batches_from_pageable_memory_are_caught_by_the_check():
    """The counterpart: a pageable batch is copied blockingly, which the check reports."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(*_data()), batch_size=BATCH)
    trainer = Trainer(max_epochs=1, device="cuda", nonfinite_loss="off")
    trainer.fit(model, optimizer, loader, _step(model))
    with (
        pytest.raises(RuntimeError, match=SYNC),
        sync_errors_in_steady_state(trainer, BATCHES - 1),
    ):
        trainer.fit(model, optimizer, loader, _step(model))
