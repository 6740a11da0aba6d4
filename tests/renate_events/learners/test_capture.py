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


class _InFloat64(torch.nn.Module):
    """Casts the transformed images to float64, for a model in float64."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs.double()


def _derpp(
    capture: str, device: str, dtype: torch.dtype = torch.float32
) -> tuple[Any, Callable[[int], TensorDataset]]:
    """DER++ on the reduced ResNet-18; with ``dtype=torch.float64`` the model computes in float64
    (the images and the transforms stay as they are)."""
    torch.manual_seed(0)
    model = resnet18(num_classes=CLASSES, nf=2)
    if dtype != torch.float32:
        model = torch.nn.Sequential(_InFloat64(), model.to(dtype))
    learner = DarkExperienceReplayLearner(
        model=model,
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


def _in_bf16(make: Callable[..., Any]) -> Callable[..., Any]:
    """``make``'s learner, trained under ``precision="bf16-mixed"``."""

    def bf16(capture: str, device: str) -> tuple[Any, Callable[[int], TensorDataset]]:
        learner, data = make(capture, device)
        learner.trainer.precision = "bf16-mixed"
        return learner, data

    return bf16


@pytest.mark.usefixtures("aot_eager")
@pytest.mark.parametrize(
    ("name", "tolerance"),
    [
        ("er-mlp", {"rel": 1e-5, "abs": 1e-6}),
        # Equal up to the first compiled backward pass, then apart by bfloat16's rounding (its
        # 8-bit mantissa: 1e-3 at the next step, 2.5e-2 at the eighth, measured): the compiled
        # backward of the convolutions and batch norms rounds in another order under autocast.
        ("derpp-resnet18-uint8", {"abs": 5e-2}),
    ],
)
def test_a_compiled_bf16_step_keeps_to_the_eager_losses(name, tolerance, monkeypatch):
    if name.startswith("derpp-resnet18"):  # the step alone, as in the float32 test above
        monkeypatch.setattr(
            trainer.run,
            "optimizer_stepper",
            lambda mode, optimizer: trainer.capture.optimizer_stepper("off", optimizer),
        )
    eager = _losses(_in_bf16(WORKLOADS[name]), "off")
    compiled = _losses(_in_bf16(WORKLOADS[name]), "compile")
    assert len(compiled) == len(eager) == 2 * BATCHES
    # equal until the first compiled backward pass has changed the weights
    assert compiled[:2] == pytest.approx(eager[:2], rel=1e-5, abs=1e-6)
    assert compiled == pytest.approx(eager, **tolerance)


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


class _Steps:
    """The fit (from 1) and the step in it (from 0) that the trainer is at, and whether it is
    inside that step (a learner's checks also run the model, before a fit's first step)."""

    def __init__(self) -> None:
        self.fit, self.step, self.inside = 0, 0, False

    def on_train_start(self) -> None:
        self.fit, self.step = self.fit + 1, 0

    def on_batch_start(self) -> None:
        self.inside = True

    def on_batch_end(self) -> None:
        self.step, self.inside = self.step + 1, False


@pytest.mark.usefixtures("aot_eager")
@pytest.mark.parametrize("capture", ["off", "compile"])
def test_the_first_step_of_every_fit_runs_eagerly_and_no_later_one(capture):
    """The first fit of an update, and each fit's first step, has an answer (docs/capture.rst,
    "Shapes"): its step runs eagerly (its checks of the batch against the buffer and the model),
    the steps after it run captured, with memory or without."""
    learner, data = _er(capture, "cpu")
    at, eager = _Steps(), set()
    learner.trainer.subscribe(at)

    def note(module: Any, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling() and at.inside:  # a traced call notes nothing
            eager.add((at.fit, at.step))

    learner.model.register_forward_hook(note)
    for task in range(2):
        learner.fit(data(task))
    steps = range(BATCHES) if capture == "off" else range(1)
    assert eager == {(fit, step) for fit in (1, 2) for step in steps}


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
    """The ResNet computes in float64 here: in float32 this tiny ResNet (batch norm over 8
    samples) grows any change in the last bits to about 1e-2 in the loss within the second
    update (a 1e-7 nudge of the weights does too, eagerly), and inductor's kernels round
    differently from eager ones (on the CPU: 8e-3 in float32, 2e-9 in float64)."""
    torch._dynamo.reset()
    make = WORKLOADS[name]
    if make is _derpp:
        make = functools.partial(_derpp, dtype=torch.float64)
    eager = _losses(make, "off", "cuda")
    captured = _losses(make, "graph", "cuda")
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
