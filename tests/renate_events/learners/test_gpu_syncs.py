"""The replay learners' steady-state steps on a CUDA device do not synchronise the host with it.

ER and DER++ on an MLP with the buffer on the device; the image path: DER++ on the reduced
ResNet-18 with a ``uint8`` buffer on the device and the CIFAR preset as train and buffer
transform; GDumb, which trains on batches gathered from its ``uint8`` buffer on the device. Each
test warms up with one fit (a replay learner's memory is full afterwards, so every later step
replays), then runs a second fit whose steady-state steps (from ``batch_start`` of its second
batch to ``batch_end`` of its last: the step, transforms, memory sampling, losses, backward,
optimizer step and the buffer's update) run under ``torch.cuda.set_sync_debug_mode("error")``.
The loss check is off (``nonfinite_loss="off"``): ``"raise"`` and ``"skip"`` read one value per
step by design. What a fit does once (the data checks read the label range) is outside the
window. All tests are skipped without CUDA (see ``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.choices import BUFFERS
from renate_events.memory import GreedyClassBalancingBuffer, ReservoirBuffer
from renate_events.methods import (
    METHODS,
    DarkExperienceReplayLearner,
    ExperienceReplayLearner,
    GDumbLearner,
)
from renate_events.models import resnet18
from renate_events.transforms import cifar_test_transform, cifar_train_transform
from tests.helpers import sync_errors_in_steady_state
from tests.renate_events.learners import test_capture as capture_tests
from trainer import TensorLoader, Trainer

pytestmark = pytest.mark.gpu

BATCH = 16
BATCHES = 8
MEMORY = 64
CLASSES = 5


@pytest.fixture(autouse=True)
def _sync_debug_off() -> Iterator[None]:
    yield
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(0)


def _vectors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(BATCH * BATCHES, 20, generator=generator)
    return inputs, torch.randint(0, CLASSES, (BATCH * BATCHES,), generator=generator)


def _images(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH * BATCHES, 3, 32, 32)
    inputs = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    return inputs, torch.randint(0, CLASSES, (BATCH * BATCHES,), generator=generator)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    ).cuda()


def _er(precision: str) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
    learner = ExperienceReplayLearner(
        model=_mlp(),
        memory_size=MEMORY,
        memory_batch_size=BATCH,
        batch_size=BATCH,
        buffer=ReservoirBuffer(MEMORY, seed=0, device="cuda"),
        trainer=Trainer(max_epochs=1, device="cuda", precision=precision, nonfinite_loss="off"),
    )
    return learner, _vectors()


def _derpp(precision: str) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
    learner = DarkExperienceReplayLearner(
        model=_mlp(),
        memory_size=MEMORY,
        memory_batch_size=BATCH,
        batch_size=BATCH,
        alpha=0.2,
        beta=0.5,
        buffer=ReservoirBuffer(MEMORY, seed=0, device="cuda"),
        trainer=Trainer(max_epochs=1, device="cuda", precision=precision, nonfinite_loss="off"),
    )
    return learner, _vectors()


def _derpp_images(precision: str) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
    """The image path: reduced ResNet-18, ``uint8`` buffer on the device, the CIFAR preset."""
    torch.manual_seed(0)
    learner = DarkExperienceReplayLearner(
        model=resnet18(num_classes=CLASSES, nf=8).cuda(),
        memory_size=MEMORY,
        memory_batch_size=BATCH,
        batch_size=BATCH,
        alpha=0.2,
        beta=0.5,
        buffer=ReservoirBuffer(MEMORY, seed=0, device="cuda"),
        train_transform=cifar_train_transform(),
        buffer_transform=cifar_train_transform(),
        test_transform=cifar_test_transform(),
        trainer=Trainer(max_epochs=1, device="cuda", precision=precision, nonfinite_loss="off"),
    )
    return learner, _images()


def _gdumb(precision: str) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
    """A learner that trains from its buffer: batches of slots from a ``uint8`` GPU buffer."""
    torch.manual_seed(0)
    learner = GDumbLearner(
        model=resnet18(num_classes=CLASSES, nf=8).cuda(),
        memory_size=BATCH * BATCHES,
        batch_size=BATCH,
        buffer=GreedyClassBalancingBuffer(BATCH * BATCHES, seed=0, device="cuda"),
        train_transform=cifar_train_transform(),
        test_transform=cifar_test_transform(),
        trainer=Trainer(max_epochs=1, device="cuda", precision=precision, nonfinite_loss="off"),
    )
    return learner, _images()


LEARNERS: dict[str, Callable[[str], tuple[Any, tuple[torch.Tensor, torch.Tensor]]]] = {
    "er": _er,
    "der++": _derpp,
    "der++ images": _derpp_images,
}


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("name", list(LEARNERS))
def test_replay_steps_do_not_synchronise(name, precision):
    learner, data = LEARNERS[name](precision)
    loader = TensorLoader(data, batch_size=BATCH, device="cuda")
    learner.fit(loader)  # warm-up: the memory is full afterwards, so every step replays
    buffer = learner.buffer
    assert len(buffer) == MEMORY and buffer.device.type == "cuda"
    if name == "der++ images":
        assert buffer.dataset()[0][0].dtype == torch.uint8  # raw images are stored
    seen = buffer.num_seen
    with sync_errors_in_steady_state(learner.trainer, BATCHES - 1):
        learner.fit(loader)
    assert buffer.num_seen == seen + BATCH * BATCHES


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_steps_from_a_buffer_on_the_device_do_not_synchronise(precision):
    """GDumb fills its buffer with the update's data before training, then trains on batches of
    its slots: those batches are gathered on the device without a blocking copy or a read."""
    learner, data = _gdumb(precision)
    learner.fit(TensorDataset(*data))  # warm-up
    with sync_errors_in_steady_state(learner.trainer, BATCHES - 1):
        result = learner.fit(TensorDataset(*data))
    assert result.steps == BATCHES


def _method(name: str, device: str) -> tuple[Any, Callable[[int], TensorDataset]]:
    """The learner of the registered method ``name`` as the capture tests make it (a small MLP,
    a tiny ViT for the prompt methods, two classes a task), its buffer on ``device`` (but
    joint training's own store), its data on ``device`` (batches from pageable host memory
    are copied blockingly: a synchronisation every step)."""
    make = capture_tests._method(name)
    learner, data = make("off", device)
    spec = METHODS[name]
    if not spec.own_buffer:  # a memory-free method given a memory_size fills it too
        learner.buffer = BUFFERS[spec.default_buffer](MEMORY, seed=0, device=device)
    learner.trainer.nonfinite_loss = "off"

    def on_device(task: int) -> TensorDataset:
        return TensorDataset(*(tensor.to(device) for tensor in data(task).tensors))

    return learner, on_device


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_steady_steps_of_every_method_do_not_synchronise(name):
    """Every registered method, its buffer on the device: the second update's steady steps
    (after its first, which checks the batch) run under ``set_sync_debug_mode("error")``."""
    learner, data = _method(name, "cuda")
    learner.fit(data(0))
    with sync_errors_in_steady_state(learner.trainer, capture_tests.BATCHES - 1):
        result = learner.fit(data(1))
    assert result.steps >= capture_tests.BATCHES  # GDumb, Joint: the buffer's samples too
