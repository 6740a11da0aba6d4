"""``Trainer(capture=...)``: the modes, the CUDA-only refusal of ``"graph"``, the deprecated
``compile_step``, capture failures as :class:`~trainer.CaptureError`, and compiled losses equal
to eager ones (``aot_eager`` backend on the CPU; CUDA graphs under the ``gpu`` marker)."""

from __future__ import annotations

import collections
import functools
import gc
import logging
import re
import warnings
import weakref

import attrs
import pytest
import torch

from tests.helpers import classification_step, make_data, make_loader, make_model
from trainer import CaptureError, Trainer
from trainer.capture import (
    CAPTURE_MODES,
    CompiledOptimizerStep,
    capture_mode,
    capture_steps,
    eager,
    keep_gradients,
    optimizer_stepper,
)


@pytest.fixture
def aot_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


class _Losses:
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_batch_end(self, loss: torch.Tensor) -> None:
        self.values.append(loss.detach().item())


def _fit_losses(capture: str, device: str = "cpu", **kwargs) -> list[float]:
    model = make_model(seed=0)
    torch.manual_seed(0)
    loader = make_loader(make_data(n=44), batch_size=8)  # a last batch of 4
    trainer = Trainer(max_epochs=2, device=device, seed=0, capture=capture, **kwargs)
    losses = _Losses()
    trainer.subscribe(losses)
    step = classification_step(model)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, step)
    return losses.values


def test_the_modes_are_the_settings():
    assert CAPTURE_MODES == ("off", "compile", "graph")
    assert attrs.fields(Trainer).capture.default == "off"


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_graph_is_refused_on_a_device_that_is_not_cuda(device):
    with pytest.raises(ValueError, match=r"capture='graph' records CUDA graphs and needs a CUDA"):
        Trainer(capture="graph", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is CUDA here")
def test_graph_with_auto_is_refused_without_cuda():
    with pytest.raises(
        ValueError, match=r"'auto' on a machine without CUDA; use capture='compile'"
    ):
        Trainer(capture="graph")


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"Trainer.capture must be one of"):
        Trainer(capture="cudagraph")


def test_compile_step_is_the_deprecated_spelling_of_compile():
    with pytest.warns(DeprecationWarning, match=r"use Trainer\(capture='compile'\)"):
        trainer = Trainer(compile_step=True, device="cpu")
    assert capture_mode(trainer) == "compile"
    assert capture_mode(Trainer(device="cpu")) == "off"


def test_compile_step_contradicts_graph():
    with pytest.raises(ValueError, match=r"contradicts"):
        Trainer(compile_step=True, capture="graph", device="cpu")


@pytest.mark.usefixtures("aot_eager")
@pytest.mark.parametrize("kwargs", [{}, {"accumulate_grad_batches": 2}, {"nonfinite_loss": "off"}])
def test_compiled_losses_are_the_eager_ones(kwargs):
    eager = _fit_losses("off", **kwargs)
    compiled = _fit_losses("compile", **kwargs)
    assert len(compiled) == 12  # 6 batches (the last one of 4 samples) x 2 epochs
    assert compiled == pytest.approx(eager, rel=1e-6)


@pytest.mark.usefixtures("aot_eager")
def test_a_compiled_step_skips_the_nonfinite_losses_the_eager_one_skips():
    def fit(capture: str) -> tuple[list[float], int]:
        model = make_model(seed=0)
        data = make_data(n=48)
        data.tensors[0][20] = float("nan")  # in the third batch of 8
        trainer = Trainer(max_epochs=1, device="cpu", capture=capture, nonfinite_loss="skip")
        losses = _Losses()
        trainer.subscribe(losses)
        loader = make_loader(data, batch_size=8, shuffle=False)
        trainer.fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loader, classification_step(model)
        )
        return losses.values, trainer.state.skipped_batches

    (eager, skipped), (compiled, skipped_compiled) = fit("off"), fit("compile")
    assert skipped == skipped_compiled == 1
    assert compiled == pytest.approx(eager, rel=1e-6, nan_ok=True)


@attrs.define
class _Counter:
    calls: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))


def test_a_step_torch_compile_cannot_capture_is_a_capture_error_naming_the_fallback(aot_eager):
    # Writing a validated attrs field inside the step sends dynamo into endless recursion.
    model = make_model()
    counter = _Counter()

    def step(batch):
        counter.calls = counter.calls + 1
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    trainer = Trainer(max_epochs=1, device="cpu", capture="compile")
    with pytest.raises(CaptureError, match=r"could not capture the step .*step: .*capture='off'"):
        trainer.fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader(make_data()), step
        )


def test_a_step_writing_an_attrs_field_is_refused_naming_the_line_and_the_eager_marker(aot_eager):
    """The endless recursion of attrs' ``__setattr__`` under dynamo is reported as what it is:
    the line of the step that writes the field, and ``@trainer.capture.eager`` as the way out."""
    model = make_model()
    counter = _Counter()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def step(batch):
        x, y = batch
        counter.calls = counter.calls + 1  # the write
        return torch.nn.functional.cross_entropy(model(x), y)

    line = step.__code__.co_firstlineno + 2
    trainer = Trainer(max_epochs=1, device="cpu", capture="compile")
    with pytest.raises(CaptureError) as error:
        trainer.fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader(make_data()), step
        )
    message = str(error.value)
    assert "\n" not in message
    assert "writes a field of an attrs object" in message, message
    assert f"at {__file__}:{line} in step" in message, message
    assert "@trainer.capture.eager" in message and "capture='off'" in message
    assert counter.calls == 0 and trainer.state.optimizer_steps == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _CountingModel(torch.nn.Module):
    """A model of the user's that counts its calls in an int attribute (guarded by dynamo)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model(seed=0)
        self.calls = 0

    def forward(self, x):
        self.calls = self.calls + 1  # the state changed at every call
        return self.inner(x)


def test_a_step_recompiled_at_every_call_is_refused_naming_the_guard_and_its_line(
    aot_eager, caplog
):
    """Python state changed at every call fails a guard at every step: the step compiled again
    at every call until the recompile limit, which dynamo then ran eagerly (a many-line log) or
    refused without saying why. It is a refusal naming the guard, the line and the fallback."""
    model = _CountingModel()
    line = _CountingModel.forward.__code__.co_firstlineno + 1
    trainer = Trainer(max_epochs=3, device="cpu", capture="compile")
    loader = make_loader(make_data(n=32), batch_size=8)
    with caplog.at_level(logging.WARNING), pytest.raises(CaptureError) as error:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, _step_of(model))
    message = str(error.value)
    assert "\n" not in message
    assert re.search(r"recompile_limit \(8\), the guard '[^']*\.calls == \d+' failing", message)
    assert f"at {__file__}:{line} in forward" in message, message
    assert "@trainer.capture.eager" in message and "capture='off'" in message
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]
    # refused at the ninth call, before its optimizer step (a bare trainer undoes none before)
    assert trainer.state.optimizer_steps == 8


def _step_of(model):
    def step(batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    return step


def _host_read(model, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if loss.item() > 1e6:  # Python control flow on a tensor's value
        loss = loss * 0
    return loss


def _data_dependent_shape(model, x, y):
    outputs = model(x)
    confident = outputs[outputs.amax(dim=1) > 0]  # as many rows as the data says
    return torch.nn.functional.cross_entropy(outputs, y) + 0 * confident.sum()


def _printing(model, x, y):
    print("step")
    return torch.nn.functional.cross_entropy(model(x), y)


@pytest.mark.usefixtures("aot_eager")
@pytest.mark.parametrize(
    ("loss", "reason"),
    [
        (_host_read, r"Tensor\.item\(\)"),
        (_data_dependent_shape, r"Dynamic shape operator|Data dependent operator"),
        (_printing, r"print"),
    ],
)
def test_a_graph_break_in_the_step_is_refused_before_any_optimizer_step(loss, reason):
    model = make_model(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(batch):
        return loss(model, *batch)

    trainer = Trainer(max_epochs=1, device="cpu", capture="compile")
    with pytest.raises(CaptureError) as error:
        trainer.fit(model, optimizer, make_loader(make_data()), step)
    message = str(error.value)
    assert "\n" not in message
    assert re.search(reason, message), message
    assert f"{__file__}:" in message and loss.__name__ in message  # where it broke
    assert "capture='off'" in message  # the eager fallback
    assert trainer.state.optimizer_steps == 0 and not optimizer.state
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.usefixtures("aot_eager")
def test_the_eager_parts_of_a_step_and_a_listener_reading_the_loss_are_allowed():
    """A function marked :func:`eager` is a graph break a captured step allows; a listener
    reading the loss at every ``batch_end`` (``_Losses``: one host sync a step) runs between
    the steps, outside the graph."""
    model = make_model(seed=0)
    calls = collections.Counter()

    @eager
    def note(batch):
        calls["note"] += 1  # Python state written by the step

    def step(batch):
        note(batch)
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    trainer = Trainer(max_epochs=1, device="cpu", capture="compile")
    losses = _Losses()
    trainer.subscribe(losses)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader(make_data()), step)
    assert calls["note"] == len(losses.values) > 0


def test_graph_copies_the_outputs_out_of_the_graph_memory(monkeypatch):
    """Under ``"graph"`` each call marks a new CUDA-graph step and clones what it returns
    (the next replay would overwrite it); the clone still back-propagates."""
    marks = []
    monkeypatch.setattr(torch, "compile", lambda function, **kwargs: function)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    weight = torch.ones(3, requires_grad=True)
    kept = {}

    def step(batch):
        kept["loss"] = (weight * batch).sum()
        return {"loss": kept["loss"], "parts": [batch * 2], "name": "x"}

    captured, _ = capture_steps("graph", step, step)
    result = captured(torch.arange(3.0))
    assert marks == [1]
    assert result["loss"] is not kept["loss"] and result["name"] == "x"
    assert torch.equal(result["loss"], kept["loss"]) and torch.equal(
        result["parts"][0], 2 * torch.arange(3.0)
    )
    result["loss"].backward()
    assert torch.equal(weight.grad, torch.arange(3.0))


def test_graph_warns_once_when_inductor_records_no_cuda_graph(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda function, **kwargs: function)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    monkeypatch.setitem(torch._dynamo.utils.counters, "inductor", collections.Counter())

    def step(batch):
        torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] += 1  # as inductor does
        return batch.sum()

    captured, _ = capture_steps("graph", step, step)
    with pytest.warns(RuntimeWarning, match=r"recorded no CUDA graph for a part of the step"):
        captured(torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        captured(torch.ones(2))  # once


def test_off_leaves_the_steps_as_they_are():
    def step(batch):
        return batch

    assert capture_steps("off", step, step) == (step, step)


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [{}, {"accumulate_grad_batches": 2}])
@pytest.mark.parametrize("capture", ["compile", "graph"])
def test_captured_losses_on_cuda_are_the_eager_ones(capture, kwargs):
    """Accumulated gradients too: under ``"graph"`` the first step's gradients must survive
    the next replay of the recorded backward pass."""
    torch._dynamo.reset()
    eager = _fit_losses("off", "cuda", **kwargs)
    captured = _fit_losses(capture, "cuda", **kwargs)
    assert captured == pytest.approx(eager, rel=1e-4, abs=1e-5)


def test_kept_gradients_are_copies_of_the_same_values():
    model = make_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data(n=8).tensors
    torch.nn.functional.cross_entropy(model(x), y).backward()
    before = {p: p.grad for p in model.parameters()}
    keep_gradients(optimizer)
    for parameter, grad in before.items():
        assert parameter.grad is not grad and torch.equal(parameter.grad, grad)
        assert parameter.grad.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr()
    torch.nn.functional.cross_entropy(model(x), y).backward()  # accumulates into the copies
    for parameter, grad in before.items():
        torch.testing.assert_close(parameter.grad, 2 * grad)


def _twin_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    model = make_model(seed=0)
    twin = make_model(seed=0)
    twin.load_state_dict(model.state_dict())
    return model, twin


def _train(model, optimizer, stepper, scheduler=None, steps=6):
    """``steps`` optimizer steps on fixed batches, through ``stepper`` (None: eagerly)."""
    device = next(model.parameters()).device
    x, y = (tensor.to(device) for tensor in make_data(n=16).tensors)
    for index in range(steps):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if stepper is None:
            optimizer.step()
        else:
            stepper(first=index == 0)
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


@pytest.mark.usefixtures("aot_eager")
@pytest.mark.parametrize(
    "make",
    [
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-3),
        functools.partial(torch.optim.Adam, lr=0.01),
        functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
    ],
)
def test_a_compiled_optimizer_step_moves_the_parameters_as_the_eager_one(make):
    """The first step eagerly (it makes the state), the rest compiled; the learning rate of a
    per-step scheduler goes in as a tensor: no recompilation, the floats stay in the groups."""
    eager, compiled = _compare_optimizer_steps(make, "cpu", rtol=1e-5, atol=1e-6)
    assert all(type(group["lr"]) is float for group in compiled.param_groups)
    assert compiled.state_dict()["param_groups"][0]["lr"] == eager.param_groups[0]["lr"]


def _compare_optimizer_steps(make, device, rtol, atol):
    """Six steps of twin models on ``device``, eagerly and through a
    :class:`CompiledOptimizerStep`, each under a per-step StepLR: one compiled graph, the same
    parameters to the tolerance; the two optimizers."""
    model, twin = (m.to(device) for m in _twin_models())
    eager, compiled = make(model.parameters()), make(twin.parameters())
    stepper = CompiledOptimizerStep(compiled)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (eager, compiled)
    ]
    counters = torch._dynamo.utils.counters
    counters.clear()
    _train(model, eager, None, schedulers[0])
    _train(twin, compiled, stepper, schedulers[1])
    assert counters["stats"]["unique_graphs"] == 1  # five compiled steps, four learning rates
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    return eager, compiled


@pytest.mark.usefixtures("aot_eager")
def test_a_hyperparameter_changing_in_the_fit_makes_the_optimizer_step_eager_with_a_warning():
    model, twin = _twin_models()
    make = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    eager, compiled = make(model.parameters()), make(twin.parameters())
    schedulers = [
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10)
        for o in (eager, compiled)
    ]  # cycles the momentum at every step
    stepper = CompiledOptimizerStep(compiled)
    _train(model, eager, None, schedulers[0])
    with pytest.warns(RuntimeWarning, match="other than the learning rate changed") as warned:
        _train(twin, compiled, stepper, schedulers[1])
    assert len(warned) == 1 and stepper.eager
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("aot_eager")
def test_a_captured_fit_compiles_its_optimizer_step_and_keeps_the_eager_one_first():
    model = make_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(max_epochs=1, device="cpu", capture="compile")
    calls = collections.Counter()
    original = CompiledOptimizerStep.__call__

    def counted(self, first):
        calls[first] += 1
        original(self, first=first)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CompiledOptimizerStep, "__call__", counted)
        result = trainer.fit(
            model, optimizer, make_loader(make_data(n=32), batch_size=8), classification_step(model)
        )
    assert calls == {True: 1, False: result.optimizer_steps - 1}


@pytest.mark.usefixtures("aot_eager")
def test_many_fits_in_one_process_stay_below_the_recompile_limit(caplog):
    """Every fit makes its own optimizer; torch's ``wrapper`` around ``optimizer.step`` is a
    frame of its own, guarded on the optimizer object: its variants reached dynamo's recompile
    limit at the ninth fit of a process (``run --seeds`` with 9 seeds), whose optimizer step
    then ran eagerly behind a many-line log. Each fit drops the variants of earlier ones."""
    model = make_model(seed=0)
    loader = make_loader(make_data(n=24), batch_size=8)
    with caplog.at_level(logging.WARNING):
        for _ in range(10):
            trainer = Trainer(max_epochs=1, device="cpu", capture="compile")
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
            trainer.fit(model, optimizer, loader, classification_step(model))
            assert trainer.state.optimizer_steps == 3
    assert not [r.getMessage() for r in caplog.records if "recompile_limit" in r.getMessage()]


@pytest.mark.usefixtures("aot_eager")
def test_fits_that_step_the_same_optimizer_compile_its_step_once():
    """A fit reusing the previous captured fit's optimizer reuses its compiled step: the rounds
    of gpu_check.py (one learner, one optimizer, a fit per round) timed its compilation in
    every round. The parameters are the eager fits' to float tolerance."""
    loader = make_loader(make_data(n=32), batch_size=8, shuffle=False)
    models, graphs = [], []
    for capture in ("off", "compile"):
        model = make_model(seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for fit in range(3):
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            trainer = Trainer(max_epochs=1, device="cpu", capture=capture)
            trainer.fit(model, optimizer, loader, classification_step(model))
            if capture == "compile" and fit:
                graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
        models.append(model)
    assert graphs == [0, 0]
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("aot_eager")
def test_fits_alternating_between_two_optimizers_compile_each_step_once():
    """gpu_check.py's interleaved rounds: the compiled and the captured learner, each with its
    own optimizer, fit in turn; neither compiles its optimizer step again (after the first
    rounds: the steppers of earlier tests' optimizers may fill the kept ones once)."""
    loader = make_loader(make_data(n=32), batch_size=8, shuffle=False)
    models = [make_model(seed=0), make_model(seed=1)]
    optimizers = [torch.optim.Adam(model.parameters(), lr=0.01) for model in models]
    graphs = []
    for _ in range(3):
        for model, optimizer in zip(models, optimizers):
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            trainer = Trainer(max_epochs=1, device="cpu", capture="compile")
            trainer.fit(model, optimizer, loader, classification_step(model))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    assert graphs[-2:] == [0, 0]


def test_the_compiled_step_kept_for_the_next_fit_keeps_no_optimizer_alive():
    model = make_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = optimizer_stepper("compile", optimizer)
    assert optimizer_stepper("compile", optimizer) is stepper
    gone = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert gone() is None
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    assert optimizer_stepper("compile", other) is not stepper


@pytest.mark.usefixtures("aot_eager")
def test_a_captured_fit_logs_no_warning_about_the_optimizers_profiler_block(caplog):
    """``optimizer.step()`` holds torch's own ``record_function``; dynamo's warning that it
    ignores it was a line on stderr of every captured fit (``--capture compile``)."""
    torch._logging._internal.warning_once.cache_clear()  # dynamo warns once per process
    model = make_model(seed=0)
    trainer = Trainer(max_epochs=1, device="cpu", capture="compile")
    with caplog.at_level(logging.WARNING):
        trainer.fit(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            make_loader(make_data(n=32), batch_size=8),
            classification_step(model),
        )
    assert trainer.state.optimizer_steps == 4
    assert not [r.getMessage() for r in caplog.records if "Profiler" in r.getMessage()]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "make",
    [
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-3),
        functools.partial(torch.optim.Adam, lr=0.01),
    ],
)
def test_a_compiled_optimizer_step_on_cuda_moves_the_parameters_as_the_eager_one(make):
    """Inductor's optimizer step on CUDA parameters, the learning rate a CPU tensor changed by
    a per-step scheduler: one graph, the eager step's parameters to float tolerance."""
    torch._dynamo.reset()
    _compare_optimizer_steps(make, "cuda", rtol=1e-4, atol=1e-5)
