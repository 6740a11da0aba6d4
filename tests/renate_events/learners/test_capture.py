"""A learner's step under ``Trainer(capture=...)`` gives the losses of the eager step.

ER on an MLP and DER++ on the reduced ResNet-18 with a ``uint8`` buffer, the CIFAR preset as
train and buffer transform and ``memory_forward="separate"`` (the workload whose compiled step
failed with ``InternalTorchDynamoError: RecursionError``: the step wrote attrs fields, whose
validating ``__setattr__`` sent dynamo into endless recursion). Two updates each, so the second
one replays from its first step; the losses of every step are compared with an eager run from
the same model, data and seed. On the CPU ``torch.compile`` runs with the ``aot_eager`` backend
(dynamo's tracing and graph breaks and AOTAutograd's backward, without inductor's code
generation, which takes minutes for a ResNet on two cores); the ``slow`` test compiles ER with
inductor itself, and the ``gpu`` tests run ``capture="graph"`` (CUDA graphs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import trainer.capture
import trainer.run
from renate_events.memory import ReservoirBuffer
from renate_events.methods import (
    LEARNERS,
    METHODS,
    DarkExperienceReplayLearner,
    ExperienceReplayLearner,
    ExtendedDarkExperienceReplayLearner,
)
from renate_events.models import MultiHeadClassificationModel, mlp, resnet18, vit
from renate_events.transforms import cifar_train_transform
from renate_events.updater import ModelUpdater
from tests.renate_events.methods.test_prompting import SMALL_ARGS, TINY
from trainer import CaptureError, Trainer

BATCH = 8
BATCHES = 4
MEMORY = 24
CLASSES = 4


class _Losses:
    """Notes the loss of every step."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_batch_end(self, loss: torch.Tensor) -> None:
        self.values.append(loss.detach().item())


def _vectors(task: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(task)
    inputs = torch.randn(BATCH * BATCHES, 12, generator=generator)
    return TensorDataset(inputs, torch.randint(0, CLASSES, (BATCH * BATCHES,), generator=generator))


def _images(task: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(task)
    shape = (BATCH * BATCHES, 3, 32, 32)
    inputs = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    return TensorDataset(inputs, torch.randint(0, CLASSES, (BATCH * BATCHES,), generator=generator))


def _er(capture: str, device: str) -> tuple[Any, Callable[[int], TensorDataset]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES)
    )
    learner = ExperienceReplayLearner(
        model=model,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        memory_size=MEMORY,
        memory_batch_size=BATCH,
        batch_size=BATCH,
        buffer=ReservoirBuffer(MEMORY, seed=0, device=device),
        trainer=Trainer(max_epochs=1, device=device, capture=capture),
    )
    return learner, _vectors


def _derpp(capture: str, device: str) -> tuple[Any, Callable[[int], TensorDataset]]:
    torch.manual_seed(0)
    learner = DarkExperienceReplayLearner(
        model=resnet18(num_classes=CLASSES, nf=2),
        optimizer=functools.partial(torch.optim.SGD, lr=0.03),
        memory_size=MEMORY,
        memory_batch_size=BATCH,
        batch_size=BATCH,
        alpha=0.2,
        beta=0.5,
        buffer=ReservoirBuffer(MEMORY, seed=0, device=device),
        train_transform=cifar_train_transform(),
        buffer_transform=cifar_train_transform(),
        memory_forward="separate",
        trainer=Trainer(max_epochs=1, device=device, capture=capture),
    )
    return learner, _images


WORKLOADS = {"er-mlp": _er, "derpp-resnet18-uint8": _derpp}


def _losses(make: Callable[..., Any], capture: str, device: str = "cpu") -> list[float]:
    learner, data = make(capture, device)
    losses = _Losses()
    learner.trainer.subscribe(losses)
    for task in range(2):
        learner.fit(data(task))
    return losses.values


@pytest.fixture
def aot_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile`` with the ``aot_eager`` backend (see the module's docstring), except
    where a ``mode`` is asked for (``capture="graph"``: inductor's CUDA graphs)."""
    torch._dynamo.reset()
    compile_ = torch.compile

    def compile_on_the_cpu(function: Any, **kwargs: Any) -> Any:
        return (
            compile_(function, **kwargs)
            if "mode" in kwargs
            else compile_(function, backend="aot_eager")
        )

    monkeypatch.setattr(torch, "compile", compile_on_the_cpu)


@pytest.mark.usefixtures("aot_eager")
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_compiled_step_gives_the_eager_losses(name, monkeypatch):
    if name.startswith("derpp-resnet18"):
        # The step alone: under aot_eager the compiled optimizer step rounds twice (lr times
        # the gradient, then the sum) where the eager one rounds once, and this tiny ResNet
        # with batch norm over 8 samples grows those last bits to 1e-2 in the loss within four
        # steps. The compiled optimizer step is held to 1e-5 on the MLPs of every method below.
        monkeypatch.setattr(
            trainer.run,
            "optimizer_stepper",
            lambda mode, optimizer: trainer.capture.optimizer_stepper("off", optimizer),
        )
    eager = _losses(WORKLOADS[name], "off")
    torch._dynamo.utils.counters.clear()
    compiled = _losses(WORKLOADS[name], "compile")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # something was compiled
    assert len(compiled) == len(eager) == 2 * BATCHES
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


def _method(name: str) -> Callable[..., Any]:
    """The learner of the registered method ``name`` on a small MLP (its hidden layer as the
    features of a method that distils them), two-class tasks."""

    def make(capture: str, device: str) -> tuple[Any, Callable[[int], TensorDataset]]:
        torch.manual_seed(0)
        if METHODS[name].model == "vit":  # a prompt method: a tiny ViT on 8x8 images
            model, data, own = vit(**TINY), _two_classes_of_images, SMALL_ARGS[name]
        else:
            model = torch.nn.Sequential(
                torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES)
            )
            data, own = _two_classes, {}
        features = {} if METHODS[name].features == "none" else {"feature_modules": ("1",)}
        learner = LEARNERS[name](
            model=model,
            optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            memory_size=MEMORY,
            memory_batch_size=BATCH,
            batch_size=BATCH,
            trainer=Trainer(max_epochs=1, device=device, capture=capture),
            **features,
            **own,
        )
        return learner, data

    return make


def _two_classes_of_images(task: int) -> TensorDataset:
    inputs, labels = _two_classes(task).tensors
    generator = torch.Generator().manual_seed(task)
    return TensorDataset(torch.randn(len(inputs), 3, 8, 8, generator=generator), labels)


def _two_classes(task: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(task)
    inputs = torch.randn(BATCH * BATCHES, 12, generator=generator)
    labels = torch.randint(2 * task, 2 * task + 2, (BATCH * BATCHES,), generator=generator)
    return TensorDataset(inputs, labels)


@pytest.mark.usefixtures("aot_eager")
@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_compiles_to_its_eager_losses(name):
    eager = _losses(_method(name), "off")
    compiled = _losses(_method(name), "compile")
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


@pytest.mark.usefixtures("aot_eager")
def test_a_step_of_many_eager_parts_stays_below_the_recompile_limit(tmp_path):
    """X-DER's step calls many eager functions; their wrappers shared code objects, whose
    compiled variants (one per eager function and argument kind) added up: an update from a
    state folder in a new process (``renate-events update --capture compile``) was refused at
    dynamo's recompile limit after a few steps. Captured, it gives the eager losses."""
    name = next(n for n, s in METHODS.items() if s.learner is ExtendedDarkExperienceReplayLearner)

    def data(task: int, n: int) -> TensorDataset:
        generator = torch.Generator().manual_seed(task)
        inputs = torch.randn(n, 8, generator=generator)
        return TensorDataset(inputs, (inputs[:, 0] > 0).long() + 2 * (inputs[:, 1] > 0).long())

    def second_update(capture: str) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        noted = _Losses()
        updater = ModelUpdater(
            model,
            learner=name,
            learner_kwargs={"memory_size": 40},
            max_epochs=2,
            trainer_kwargs={"capture": capture, "device": "cpu"},
            input_state_folder=tmp_path / "first",
            output_state_folder=tmp_path / capture,
            listeners=[noted],
        )
        torch._dynamo.reset()  # as in a new process
        updater.update(data(1, 100), data(11, 40))
        return noted.values

    torch.manual_seed(0)
    ModelUpdater(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
        learner=name,
        learner_kwargs={"memory_size": 40},
        max_epochs=2,
        trainer_kwargs={"device": "cpu"},
        output_state_folder=tmp_path / "first",
    ).update(data(0, 100), data(10, 40))
    eager, compiled = second_update("off"), second_update("compile")
    assert len(compiled) == len(eager) == 8
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


def _filling(capture: str, device: str) -> tuple[Any, Callable[[int], TensorDataset]]:
    """DER++ on an MLP, a memory of 12 slots that replays once it holds a memory batch of 8,
    epochs ending in a partial batch of 5 (shapes the first graphs did not see)."""
    torch.manual_seed(0)
    learner = DarkExperienceReplayLearner(
        model=mlp(12, num_classes=CLASSES, hidden=[16]),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        memory_size=12,
        memory_batch_size=BATCH,
        batch_size=BATCH,
        trainer=Trainer(max_epochs=1, device=device, capture=capture),
    )
    return learner, _partial_last_batch


def _partial_last_batch(task: int, task_ids: bool = False) -> TensorDataset:
    generator = torch.Generator().manual_seed(task)
    n = BATCH * BATCHES - 3  # a last batch of 5
    inputs = torch.randn(n, 12, generator=generator)
    labels = torch.randint(0, 2, (n,), generator=generator)
    if not task_ids:
        return TensorDataset(inputs, labels)
    return TensorDataset(inputs, labels, torch.full((n,), task, dtype=torch.int64))


@pytest.mark.usefixtures("aot_eager")
def test_a_partial_batch_and_a_filling_memory_recompile_to_the_eager_losses():
    eager = _losses(_filling, "off")
    compiled = _losses(_filling, "compile")
    assert len(compiled) == 2 * BATCHES
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


def test_task_heads_picked_by_the_data_are_refused_before_training():
    """A multi-head model on data with task ids: the heads a batch needs depend on the data,
    so the step is not one graph; refused before anything changes, naming the fallback."""
    torch.manual_seed(0)
    model = MultiHeadClassificationModel.from_model(mlp(12, num_classes=2, hidden=[16]))
    learner = DarkExperienceReplayLearner(
        model=model,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        memory_size=12,
        memory_batch_size=BATCH,
        batch_size=BATCH,
        trainer=Trainer(max_epochs=1, device="cpu", capture="compile"),
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CaptureError, match=r"MultiHeadClassificationModel .*capture='off'"):
        learner.fit(_partial_last_batch(0, task_ids=True))
    assert model.state_dict().keys() == before.keys()  # no head added
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert len(learner.buffer) == 0


@pytest.mark.slow
def test_a_step_compiled_by_inductor_gives_the_eager_losses():
    torch._dynamo.reset()
    eager = _losses(_er, "off")
    compiled = _losses(_er, "compile")
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_step_in_cuda_graphs_gives_the_eager_losses(name):
    torch._dynamo.reset()
    eager = _losses(WORKLOADS[name], "off", "cuda")
    captured = _losses(WORKLOADS[name], "graph", "cuda")
    assert captured == pytest.approx(eager, rel=1e-4, abs=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["der", "er-ace", "icarl", "l2p", "lwf", "xder"])
def test_methods_whose_steps_keep_tensors_give_their_eager_losses_in_cuda_graphs(name):
    """Methods whose eager parts keep tensors of the step (stored logits, the classes seen, the
    outputs of the new batch for X-DER's future constraint, a frozen copy's outputs, prompt
    keys): a kept reference into a graph's memory would be overwritten by the next replay."""
    torch._dynamo.reset()
    eager = _losses(_method(name), "off", "cuda")
    captured = _losses(_method(name), "graph", "cuda")
    assert captured == pytest.approx(eager, rel=1e-4, abs=1e-5)


class _SaveAt:
    """Writes a checkpoint at ``batch_end`` of one step of the second update."""

    def __init__(self, path: Any, step: int) -> None:
        self.path, self.step, self.fits = path, step, 0

    def on_train_start(self) -> None:
        self.fits += 1

    def on_batch_end(self, trainer: Trainer, state: Any) -> None:
        if self.fits == 2 and state.global_step == self.step:
            trainer.save_checkpoint(self.path)


@pytest.mark.usefixtures("aot_eager")
@pytest.mark.parametrize(
    ("capture", "device"),
    [("compile", "cpu"), pytest.param("graph", "cuda", marks=pytest.mark.gpu)],
)
def test_a_captured_update_resumed_from_its_checkpoint_ends_where_the_uninterrupted_one_does(
    tmp_path, capture, device
):
    path = tmp_path / "mid.safetensors"
    learner, data = _er(capture, device)
    learner.trainer.subscribe(_SaveAt(path, 2))
    for task in range(2):
        learner.fit(data(task))
    resumed, _ = _er(capture, device)
    resumed.fit(data(0))
    resumed.fit(data(1), resume_from=path)
    # Bit for bit on the CPU; on a GPU to float tolerance (guarantees.rst: kernels may differ).
    same = torch.equal if device == "cpu" else functools.partial(torch.allclose, atol=1e-6)
    for (name, a), b in zip(
        learner.model.state_dict().items(), resumed.model.state_dict().values()
    ):
        assert same(a, b), name
    assert torch.equal(
        learner.buffer.state_dict()["targets"], resumed.buffer.state_dict()["targets"]
    )
