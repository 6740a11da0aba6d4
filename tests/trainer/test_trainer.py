"""The loop: steps, accumulation, limits, validation, precision, schedulers, bad input."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.helpers import (
    Recorder,
    assert_same_tensors,
    classification_step,
    make_data,
    make_loader,
    make_model,
    parameters_of,
)
from trainer import Trainer


def _fit(trainer, model=None, loader=None, **kwargs):
    model = model or make_model()
    loader = loader if loader is not None else make_loader(make_data(), batch_size=8)
    optimizer = kwargs.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    return trainer.fit(model, optimizer, loader, classification_step(model), **kwargs)


def test_fit_trains_and_reports():
    model = make_model()
    before = parameters_of(model)
    result = _fit(Trainer(max_epochs=2, device="cpu"), model)
    assert result.steps == 12 and result.optimizer_steps == 12 and result.epochs == 2
    assert set(result.metrics) == {"train_loss"}
    assert not torch.equal(before["0.weight"], model[0].weight)


def test_event_sequence_with_validation_every_second_epoch():
    log: list = []
    trainer = Trainer(max_epochs=3, check_val_every_n_epoch=2, device="cpu")
    trainer.subscribe(Recorder(log))
    loader = make_loader(make_data(n=16), batch_size=8)
    _fit(trainer, loader=loader, val_loader=loader)
    events = [e for e, _ in log]
    batch = ["batch_start", "batch_end"] * 2
    epoch = ["epoch_start", *batch, "epoch_end"]
    validation = ["validation_start", "validation_end"]
    assert events == ["train_start", *epoch, *epoch, *validation, *epoch, "train_end"]


@pytest.mark.parametrize(("accumulate", "expected"), [(1, 6), (2, 3), (4, 2), (5, 2)])
def test_accumulation_steps_the_optimizer_per_window_and_at_epoch_end(accumulate, expected):
    trainer = Trainer(max_epochs=1, accumulate_grad_batches=accumulate, device="cpu")
    result = _fit(trainer)
    assert result.steps == 6
    assert result.optimizer_steps == expected


def test_accumulation_matches_one_big_batch():
    data = make_data(n=16)
    small, big = make_model(), make_model()
    trainer = Trainer(max_epochs=1, accumulate_grad_batches=2, device="cpu")
    _fit(trainer, small, make_loader(data, batch_size=8, shuffle=False))
    _fit(Trainer(max_epochs=1, device="cpu"), big, make_loader(data, batch_size=16, shuffle=False))
    for a, b in zip(small.parameters(), big.parameters()):
        torch.testing.assert_close(a, b)


def test_max_steps_stops_mid_epoch_and_spans_epochs():
    assert _fit(Trainer(max_steps=4, device="cpu")).steps == 4
    result = _fit(Trainer(max_steps=9, device="cpu"))
    assert (result.steps, result.epochs) == (9, 2)
    result = _fit(Trainer(max_epochs=1, max_steps=100, device="cpu"))
    assert result.steps == 6


def test_should_stop_ends_the_fit():
    class StopAtThree:
        def on_batch_end(self, state):
            if state.global_step == 3:
                state.should_stop = True

    trainer = Trainer(max_epochs=5, device="cpu")
    trainer.subscribe(StopAtThree())
    result = _fit(trainer)
    assert result.steps == 3 and result.stopped_early


def test_validation_metrics_are_weighted_means_and_isolated_from_training_rng():
    data = make_data(n=20)
    val_loader = make_loader(data, batch_size=8, shuffle=False)  # batches of 8, 8, 4

    def run(with_validation):
        model = make_model(dropout=0.5)
        kwargs = {}
        if with_validation:
            kwargs = {"val_loader": make_loader(data, batch_size=8, shuffle=True)}
        torch.manual_seed(3)
        _fit(Trainer(max_epochs=2, device="cpu"), model, **kwargs)
        return parameters_of(model)

    assert_same_tensors(run(True), run(False))

    model = make_model()
    seen = {}
    trainer = Trainer(max_epochs=1, device="cpu")
    trainer.connect("validation_end", lambda metrics: seen.update(metrics))

    def val_step(batch):
        x, _ = batch
        return {"loss": x[:, 0].mean(), "val_size": torch.tensor(float(len(x)))}

    result = _fit(trainer, model, val_loader=val_loader, val_step=val_step)
    expected_loss = data.tensors[0][:, 0].mean().item()
    assert seen["val_loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert seen["val_size"] == pytest.approx((8 * 8 + 8 * 8 + 4 * 4) / 20)
    assert result.metrics["val_loss"] == seen["val_loss"]


def test_model_is_in_eval_mode_during_validation_and_train_mode_after():
    modes = []
    trainer = Trainer(max_epochs=1, device="cpu")
    trainer.connect("validation_start", lambda model: modes.append(model.training))
    trainer.connect("epoch_end", lambda model: modes.append(model.training))
    model = make_model()
    _fit(trainer, model, val_loader=make_loader(make_data(n=8)))
    assert modes == [True, False]
    assert model.training


def test_step_output_is_checked():
    model = make_model()
    trainer = Trainer(max_epochs=1, device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader(make_data(n=8))
    with pytest.raises(TypeError, match="mapping with a 'loss' tensor; got dict with keys"):
        trainer.fit(model, optimizer, loader, lambda batch: {"total": torch.zeros(())})
    with pytest.raises(ValueError, match="validation metrics must be scalars"):
        trainer.fit(
            model,
            optimizer,
            loader,
            classification_step(model),
            val_loader=loader,
            val_step=lambda batch: model(batch[0]),
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_epochs": 0}, "max_epochs must be a positive int"),
        ({"max_steps": -1}, "max_steps must be a positive int"),
        ({"precision": "16"}, "precision must be one of"),
        ({"gradient_clip_val": 0}, "gradient_clip_val must be a number > 0"),
        ({"gradient_clip_algorithm": "l2"}, "gradient_clip_algorithm must be one of"),
        ({"accumulate_grad_batches": 0}, "accumulate_grad_batches must be an int >= 1"),
        ({"device": "gpu7"}, "device must be 'auto'"),
    ],
)
def test_invalid_configuration_raises_value_error_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Trainer(**kwargs)


def test_fit_argument_errors():
    trainer = Trainer(max_epochs=1, device="cpu")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="yielded no batches"):
        trainer.fit(model, optimizer, [], classification_step(model))
    with pytest.raises(ValueError, match="scheduler_interval"):
        trainer.fit(model, optimizer, [], classification_step(model), scheduler_interval="batch")
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        trainer.fit(
            model,
            optimizer,
            [],
            classification_step(model),
            scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer),
        )
    with pytest.raises(TypeError, match="optimizer must be"):
        trainer.fit(model, None, [], classification_step(model))


@pytest.mark.parametrize(("interval", "expected_steps"), [("epoch", 2), ("step", 12)])
def test_scheduler_interval(interval, expected_steps):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _fit(
        Trainer(max_epochs=2, device="cpu"),
        model,
        optimizer=optimizer,
        scheduler=scheduler,
        scheduler_interval=interval,
    )
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5**expected_steps)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_bounds_the_update(algorithm):
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    loader = [(torch.tensor([[1.0]]), torch.tensor([[1000.0]]))]

    def step(batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    trainer = Trainer(
        max_epochs=1, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm, device="cpu"
    )
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=1.0), loader, step)
    assert model.weight.item() == pytest.approx(0.5)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_runs_on_cpu(precision):
    dtypes = []
    trainer = Trainer(max_epochs=1, precision=precision, device="cpu")
    trainer.connect("batch_end", lambda outputs: dtypes.append(outputs["logits"].dtype))
    model = make_model()
    result = _fit(trainer, model)
    expected = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    assert set(dtypes) == {expected}
    assert result.steps == 6 and torch.isfinite(model[0].weight).all()
    assert (trainer.grad_scaler is not None) == (precision == "16-mixed")


def test_nested_batches_are_moved_and_passed_through():
    seen = []
    model = make_model()

    def step(batch):
        seen.append(batch)
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["pair"][1])

    x, y = make_data(n=8).tensors
    Trainer(max_epochs=1, device="cpu").fit(
        model, torch.optim.SGD(model.parameters(), lr=0.1), [{"x": x, "pair": (x, y)}], step
    )
    assert isinstance(seen[0]["pair"], tuple) and torch.equal(seen[0]["pair"][1], y)


def test_seed_makes_fits_reproducible():
    runs = []
    for _ in range(2):
        model = make_model(dropout=0.3)
        _fit(Trainer(max_epochs=2, seed=7, device="cpu"), model)
        runs.append(parameters_of(model))
    assert_same_tensors(*runs)


def test_iterable_without_len_steps_the_optimizer_for_a_partial_window():
    data = make_data(n=24)

    def batches():
        yield from make_loader(data, batch_size=8, shuffle=False)

    class Once:
        def __iter__(self):
            return batches()

    result = _fit(Trainer(max_epochs=1, accumulate_grad_batches=2, device="cpu"), loader=Once())
    assert (result.steps, result.optimizer_steps) == (3, 2)


@pytest.mark.gpu
def test_cuda_device_moves_model_and_batches():
    seen = []
    trainer = Trainer(max_epochs=1, device="auto", precision="bf16-mixed")
    trainer.connect("batch_start", lambda batch: seen.append(batch[0].device.type))
    model = make_model()
    _fit(trainer, model)
    assert set(seen) == {"cuda"} and model[0].weight.device.type == "cuda"


def _nan_at(model, bad_step):
    calls = []

    def step(batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        calls.append(1)
        return loss * float("nan") if len(calls) == bad_step else loss

    return step


def test_nonfinite_loss_raises_naming_the_step_and_takes_no_optimizer_step():
    from trainer import NonFiniteLossError

    model = make_model()
    trainer = Trainer(max_epochs=1, device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader(make_data(), batch_size=8, shuffle=False)
    seen = {}
    trainer.connect("batch_end", lambda: seen.update(params=parameters_of(model)))
    with pytest.raises(NonFiniteLossError, match=r"step 2 \(epoch 0, batch 2\); no optimizer step"):
        trainer.fit(model, optimizer, loader, _nan_at(model, 3))
    assert_same_tensors(seen["params"], parameters_of(model))
    assert trainer.state.optimizer_steps == 2


def test_nonfinite_loss_skip_counts_and_flags_the_batch():
    model = make_model()
    flags = []
    trainer = Trainer(max_epochs=1, device="cpu", nonfinite_loss="skip")
    trainer.connect("batch_end", lambda state: flags.append(state.batch_skipped))
    result = trainer.fit(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        make_loader(make_data(), batch_size=8),
        _nan_at(model, 2),
    )
    assert flags == [False, True, False, False, False, False]
    assert result.skipped_batches == 1 and result.optimizer_steps == 5
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_keyboard_interrupt_fires_exception_and_train_end_and_can_write_a_checkpoint(tmp_path):
    events = []

    class Interrupt:
        def on_batch_start(self, state):
            if state.global_step == 3:
                raise KeyboardInterrupt

    class Flush:
        def on_exception(self, exception):
            events.append(("exception", type(exception).__name__))

        def on_train_end(self, trainer, result):
            events.append(("train_end", result.steps, result.stopped_early))
            trainer.save_checkpoint(tmp_path / "final.safetensors")

    trainer = Trainer(max_epochs=2, device="cpu")
    trainer.subscribe(Interrupt())
    trainer.subscribe(Flush())
    with pytest.raises(KeyboardInterrupt):
        _fit(trainer)
    assert events == [("exception", "KeyboardInterrupt"), ("train_end", 3, True)]
    assert (tmp_path / "final.safetensors").exists()


def test_compile_step_wraps_the_steps_in_torch_compile(monkeypatch):
    compiled = []

    def fake_compile(function):
        compiled.append(function)
        return function

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = make_model()
    loader = make_loader(make_data(n=16))
    step = classification_step(model)
    Trainer(max_epochs=1, device="cpu", compile_step=True).fit(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader, step, val_loader=loader
    )
    # step and val_step (traced with graph breaks refused), then the optimizer step
    assert inspect.unwrap(compiled[0]) is step and len(compiled) == 3
    assert compiled[2].__name__ == "_optimizer_step"
