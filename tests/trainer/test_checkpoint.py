"""Safetensors checkpoints: round trips, exact resume, listener state, mismatches, atomicity."""

from __future__ import annotations

import json
import os
import re

import pytest
import safetensors
import torch

from tests.helpers import (
    StatefulCounter,
    assert_same_tensors,
    assert_same_tree,
    classification_step,
    make_data,
    make_loader,
    make_model,
    parameters_of,
)
from trainer import (
    CheckpointFormatError,
    CheckpointMismatchError,
    ListenerError,
    ListenerState,
    Trainer,
    read_checkpoint,
    write_checkpoint,
)


def _setup(seed=0, dropout=0.2, **trainer_kwargs):
    model = make_model(dropout=dropout, seed=seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    trainer = Trainer(device="cpu", **trainer_kwargs)
    counter = StatefulCounter()
    trainer.subscribe(counter, name="counter")
    return trainer, model, optimizer, scheduler, counter


def _run(trainer, model, optimizer, scheduler, **kwargs):
    loader = make_loader(make_data(n=40), batch_size=8, shuffle=True)
    return trainer.fit(
        model, optimizer, loader, classification_step(model), scheduler=scheduler, **kwargs
    )


def _full_state(model, optimizer, counter):
    return (parameters_of(model), optimizer.state_dict(), counter.count, counter.history.clone())


def _assert_same_state(a, b):
    assert_same_tensors(a[0], b[0])
    for key, value in a[1]["state"].items():
        assert_same_tensors(value, b[1]["state"][key])
    assert a[2] == b[2]
    assert torch.equal(a[3], b[3])


def test_round_trip_is_bit_exact(tmp_path):
    trainer, model, optimizer, scheduler, counter = _setup(max_epochs=2)
    _run(trainer, model, optimizer, scheduler)
    path = tmp_path / "ckpt.safetensors"
    trainer.save_checkpoint(path)
    saved = _full_state(model, optimizer, counter)
    saved_lr = scheduler.get_last_lr()

    other, model2, optimizer2, scheduler2, counter2 = _setup(seed=1)
    other.load_checkpoint(path, model=model2, optimizer=optimizer2, scheduler=scheduler2)
    _assert_same_state(saved, _full_state(model2, optimizer2, counter2))
    assert scheduler2.get_last_lr() == saved_lr
    assert (other.state.global_step, other.state.optimizer_steps) == (10, 10)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_at_epoch_boundary_is_bit_identical(tmp_path, accumulate):
    torch.manual_seed(123)
    trainer, model, optimizer, scheduler, counter = _setup(
        max_epochs=4, accumulate_grad_batches=accumulate
    )
    _run(trainer, model, optimizer, scheduler)
    uninterrupted = _full_state(model, optimizer, counter)

    torch.manual_seed(123)
    trainer, model, optimizer, scheduler, counter = _setup(
        max_epochs=2, accumulate_grad_batches=accumulate
    )
    _run(trainer, model, optimizer, scheduler)
    trainer.save_checkpoint(tmp_path / "epoch2.safetensors")

    torch.manual_seed(999)  # a fresh process would start from another RNG state
    trainer, model, optimizer, scheduler, counter = _setup(
        seed=5, max_epochs=4, accumulate_grad_batches=accumulate
    )
    result = _run(trainer, model, optimizer, scheduler, resume_from=tmp_path / "epoch2.safetensors")
    assert result.steps == 20 and result.epochs == 2
    _assert_same_state(uninterrupted, _full_state(model, optimizer, counter))


class SaveThenCrash:
    """Saves at the batch_end of step ``stop_at`` and dies at the next batch, as a killed process
    would (the save is written once every listener has handled that batch_end)."""

    def __init__(self, path, stop_at):
        self.path, self.stop_at = path, stop_at

    def on_batch_end(self, trainer, state):
        if state.global_step == self.stop_at:
            trainer.save_checkpoint(self.path)

    def on_batch_start(self, state):
        if state.global_step == self.stop_at:
            raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("stop_at", "accumulate", "priority"),
    [(7, 1, 0), (3, 2, 5), (13, 2, 0), (12, 3, -1), (5, 1, 5), (10, 2, 0), (5, 2, -5)],
)
def test_resume_mid_epoch_is_bit_identical(tmp_path, stop_at, accumulate, priority):
    """Steps 5 and 10 are the last batches of epochs 0 and 1; priority 5 saves before the other
    listener has seen the batch, which must not matter."""
    torch.manual_seed(5)
    trainer, model, optimizer, scheduler, counter = _setup(
        max_epochs=3, accumulate_grad_batches=accumulate
    )
    _run(trainer, model, optimizer, scheduler)
    uninterrupted = _full_state(model, optimizer, counter)

    torch.manual_seed(5)
    trainer, model, optimizer, scheduler, counter = _setup(
        max_epochs=3, accumulate_grad_batches=accumulate
    )
    trainer.subscribe(SaveThenCrash(tmp_path / "mid.safetensors", stop_at), priority=priority)
    with pytest.raises(KeyboardInterrupt):
        _run(trainer, model, optimizer, scheduler)

    trainer, model, optimizer, scheduler, counter = _setup(
        seed=9, max_epochs=3, accumulate_grad_batches=accumulate
    )
    _run(trainer, model, optimizer, scheduler, resume_from=tmp_path / "mid.safetensors")
    _assert_same_state(uninterrupted, _full_state(model, optimizer, counter))
    assert scheduler.get_last_lr() == pytest.approx([0.01 * 0.9**3])


def test_checkpoint_at_epoch_end_resumes_with_the_pending_validation(tmp_path):
    """A plateau scheduler stepped from validation_end sees every validation exactly once."""

    class Plateau:
        def __init__(self, optimizer):
            self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
            self.seen = 0

        def on_validation_end(self, metrics, state):
            self.scheduler.step(metrics["val_loss"] + self.seen)  # always worse: lr drops
            assert state.epoch == self.seen  # the pending validation reports its own epoch
            self.seen += 1

        def on_save_checkpoint(self, checkpoint):
            checkpoint["plateau"] = self.scheduler.state_dict()
            checkpoint["seen"] = self.seen

        def on_load_checkpoint(self, checkpoint):
            self.scheduler.load_state_dict(checkpoint["plateau"])
            self.seen = checkpoint["seen"]

    class SaveAtEpochEnd:
        def on_epoch_end(self, trainer, state):
            if state.epoch == 1:
                trainer.save_checkpoint(tmp_path / "e.safetensors")

        def on_epoch_start(self, state):
            if state.epoch == 2:
                raise KeyboardInterrupt

    def run(crash, resume=None):
        model = make_model(seed=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = Trainer(max_epochs=4, device="cpu")
        plateau = Plateau(optimizer)
        trainer.subscribe(plateau, name="plateau")
        if crash:
            trainer.subscribe(SaveAtEpochEnd())
        loader = make_loader(make_data(n=16), batch_size=8)
        trainer.fit(
            model,
            optimizer,
            loader,
            classification_step(model),
            val_loader=loader,
            resume_from=resume,
        )
        return parameters_of(model), plateau.seen, optimizer.param_groups[0]["lr"]

    reference = run(False)
    with pytest.raises(KeyboardInterrupt):
        run(True)
    resumed = run(False, resume=tmp_path / "e.safetensors")
    assert_same_tensors(reference[0], resumed[0])
    assert reference[1:] == resumed[1:] == (4, pytest.approx(0.1 * 0.1**3))


def test_checkpoint_is_readable_with_safe_open_alone(tmp_path):
    trainer, model, optimizer, scheduler, counter = _setup(max_epochs=1)
    _run(trainer, model, optimizer, scheduler)
    path = tmp_path / "ckpt.safetensors"
    trainer.save_checkpoint(path)
    with safetensors.safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        assert metadata["format"] == "trainer.checkpoint"
        assert metadata["format_version"] == "1"
        tree = json.loads(metadata["tree"])
        assert torch.equal(handle.get_tensor("model.0.weight"), model[0].weight)
        assert torch.equal(handle.get_tensor("listeners.counter.history"), counter.history)
    assert tree["listeners"]["counter"]["count"] == 5
    assert tree["trainer"]["listener_order"] == ["counter"]
    assert tree["model"]["0.weight"] == {"$tensor": "model.0.weight"}


def test_listener_state_is_namespaced_per_listener(tmp_path):
    trainer, model, optimizer, scheduler, _ = _setup(max_epochs=1)
    second = StatefulCounter()
    trainer.subscribe(second)
    _run(trainer, model, optimizer, scheduler)
    trainer.save_checkpoint(tmp_path / "c.safetensors")
    tree = read_checkpoint(tmp_path / "c.safetensors")
    assert set(tree["listeners"]) == {"counter", "stateful_counter_0"}
    assert tree["listeners"]["stateful_counter_0"]["nested"]["names"] == ["a", "b"]
    second.count = -1
    trainer.load_checkpoint(tmp_path / "c.safetensors")
    assert second.count == 5


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 4)
            self.out = torch.nn.Linear(4, 5, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, x):
            return self.out(self.embed(x))

    model = Tied()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(max_epochs=1, device="cpu")
    data = [(torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]))]
    trainer.fit(
        model, optimizer, data, lambda b: torch.nn.functional.cross_entropy(model(b[0]), b[1])
    )
    trainer.save_checkpoint(tmp_path / "tied.safetensors")
    with safetensors.safe_open(str(tmp_path / "tied.safetensors"), "pt") as handle:
        assert [k for k in handle.keys() if k.startswith("model.")] == ["model.embed.weight"]  # noqa: SIM118
    fresh = Tied()
    trainer.load_checkpoint(
        tmp_path / "tied.safetensors",
        model=fresh,
        optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1),
    )
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    assert fresh.out.weight is fresh.embed.weight


@pytest.mark.all_or_nothing
def test_listener_raising_during_save_leaves_no_file(tmp_path):
    trainer, model, optimizer, scheduler, _ = _setup(max_epochs=1)
    _run(trainer, model, optimizer, scheduler)
    good = tmp_path / "c.safetensors"
    trainer.save_checkpoint(good)
    before = good.read_bytes()

    class Broken:
        def on_save_checkpoint(self, checkpoint):
            checkpoint["partial"] = 1
            raise OSError("disk full, pretend")

    trainer.subscribe(Broken(), name="broken")
    with pytest.raises(ListenerError, match="'broken' raised OSError in event 'save_checkpoint'"):
        trainer.save_checkpoint(good)
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


def test_unstorable_value_is_a_type_error_saying_what_to_store():
    state = ListenerState("x")
    with pytest.raises(TypeError, match="store a tensor"):
        state["obj"] = object()
    with pytest.raises(TypeError, match="all-string or all-int keys"):
        state["d"] = {1: 2, "a": 3}
    with pytest.raises(TypeError, match="to_dense"):
        state["sparse"] = torch.eye(2).to_sparse()
    state["ok"] = {"a": [1, 2.5, None, True, "s", torch.ones(2)]}
    with pytest.raises(TypeError, match="read-only"):
        ListenerState("y", {"a": 1}, readonly=True)["a"] = 2


@pytest.mark.all_or_nothing
def test_mismatches_are_all_reported_and_nothing_changes(tmp_path):
    trainer, model, optimizer, scheduler, _ = _setup(max_epochs=1)
    _run(trainer, model, optimizer, scheduler)
    trainer.save_checkpoint(tmp_path / "c.safetensors")

    other_model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.Linear(4, 3)
    )
    other_optimizer = torch.optim.Adam(other_model.parameters())
    other = Trainer(device="cpu")
    stranger = StatefulCounter(count=42)
    other.subscribe(stranger, name="stranger")
    before = parameters_of(other_model)
    with pytest.raises(CheckpointMismatchError) as info:
        other.load_checkpoint(
            tmp_path / "c.safetensors", model=other_model, optimizer=other_optimizer
        )
    message = str(info.value)
    assert "model: missing key '2.weight'" in message
    assert "'3.weight' has shape (3, 16) in the file, (3, 4) in the model" in message
    assert "parameter groups of sizes [4] in the file, [6] in the optimizer" in message
    assert "scheduler: the file has a scheduler" in message
    assert "listener 'stranger': subscribed with on_load_checkpoint" in message
    assert "listener 'counter': the file has its state, but no listener of that name" in message
    assert_same_tensors(before, parameters_of(other_model))
    assert stranger.count == 42


def test_dtype_mismatch_is_reported(tmp_path):
    trainer, model, optimizer, scheduler, _ = _setup(max_epochs=1)
    _run(trainer, model, optimizer, scheduler)
    trainer.save_checkpoint(tmp_path / "c.safetensors")
    model.double()
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape("'0.weight' has dtype torch.float32 in the file, torch.float64"),
    ):
        trainer.load_checkpoint(tmp_path / "c.safetensors")


def test_strict_false_downgrades_listener_mismatches_to_warnings(tmp_path):
    trainer, model, optimizer, scheduler, counter = _setup(max_epochs=1)
    _run(trainer, model, optimizer, scheduler)
    trainer.save_checkpoint(tmp_path / "c.safetensors")
    trainer.unsubscribe(counter)
    newcomer = StatefulCounter(count=7)
    trainer.subscribe(newcomer, name="newcomer")
    with pytest.warns(UserWarning) as warned:
        trainer.load_checkpoint(tmp_path / "c.safetensors", strict=False)
    messages = " ".join(str(w.message) for w in warned)
    assert "'newcomer'" in messages and "'counter'" in messages
    assert newcomer.count == 7


def test_files_that_are_not_checkpoints_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_checkpoint(tmp_path / "missing.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 3)
    with pytest.raises(CheckpointFormatError, match="not a readable safetensors checkpoint"):
        read_checkpoint(garbage)
    foreign = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(CheckpointFormatError, match="not a trainer checkpoint"):
        read_checkpoint(foreign)
    future = tmp_path / "future.safetensors"
    safetensors.torch.save_file(
        {},
        str(future),
        metadata={"format": "trainer.checkpoint", "format_version": "99", "tree": "{}"},
    )
    with pytest.raises(CheckpointFormatError, match="format version '99'"):
        read_checkpoint(future)
    dangling = tmp_path / "dangling.safetensors"
    safetensors.torch.save_file(
        {},
        str(dangling),
        metadata={
            "format": "trainer.checkpoint",
            "format_version": "1",
            "tree": json.dumps({"x": {"$tensor": "nope"}}),
        },
    )
    with pytest.raises(CheckpointFormatError, match="refers to tensor 'nope'"):
        read_checkpoint(dangling)


def test_write_read_tree_round_trip(tmp_path):
    t = torch.arange(6.0).reshape(2, 3)
    tree = {
        "a": {"b": t, "view": t.t(), "same": t, "empty": torch.zeros(0, 2)},
        "lst": [1, "x", None, float("inf")],
        "bf": torch.ones(2, dtype=torch.bfloat16),
    }
    write_checkpoint(tmp_path / "t.safetensors", tree)
    back = read_checkpoint(tmp_path / "t.safetensors")
    assert torch.equal(back["a"]["b"], t) and torch.equal(back["a"]["view"], t.t())
    assert back["a"]["same"] is back["a"]["b"]
    assert back["a"]["empty"].shape == (0, 2)
    assert back["lst"] == [1, "x", None, float("inf")]
    assert back["bf"].dtype == torch.bfloat16


def test_save_or_load_without_attached_model_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="no model and optimizer are attached"):
        Trainer().save_checkpoint(tmp_path / "x.safetensors")


def test_optimizer_state_of_the_wrong_shape_is_reported(tmp_path):
    trainer, model, optimizer, scheduler, _ = _setup(max_epochs=1)
    _run(trainer, model, optimizer, scheduler)
    trainer.save_checkpoint(tmp_path / "c.safetensors")
    wide = torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.0), torch.nn.Linear(32, 3)
    )
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape(
            "state 'exp_avg' of parameter 0 has shape (16, 6) in the file, the parameter has "
            "shape (32, 6)"
        ),
    ):
        trainer.load_checkpoint(
            tmp_path / "c.safetensors", model=wide, optimizer=torch.optim.Adam(wide.parameters())
        )


@pytest.mark.all_or_nothing
def test_a_listener_refusing_its_state_leaves_everything_as_it_was(tmp_path):
    trainer, model, optimizer, scheduler, counter = _setup(max_epochs=1)
    _run(trainer, model, optimizer, scheduler)
    trainer.save_checkpoint(tmp_path / "c.safetensors")
    _run(trainer, model, optimizer, scheduler)  # train on: the live state now differs
    before = (parameters_of(model), counter.count, scheduler.get_last_lr(), torch.get_rng_state())
    exp_avg = optimizer.state[model[0].weight]["exp_avg"].clone()

    class Refuses:
        def on_load_checkpoint(self, checkpoint):
            raise ValueError("this state belongs to another buffer size")

        def on_save_checkpoint(self, checkpoint):
            checkpoint["x"] = 1

    refuses = Refuses()
    trainer.subscribe(refuses, name="refuses")
    trainer.save_checkpoint(tmp_path / "with-refuses.safetensors")
    counter.count = before[1]
    with pytest.raises(ListenerError, match="another buffer size"):
        trainer.load_checkpoint(tmp_path / "with-refuses.safetensors")
    assert_same_tensors(before[0], parameters_of(model))
    assert torch.equal(optimizer.state[model[0].weight]["exp_avg"], exp_avg)
    assert scheduler.get_last_lr() == before[2]
    assert torch.equal(torch.get_rng_state(), before[3])


def test_optimizer_of_another_class_is_reported(tmp_path):
    trainer, model, optimizer, scheduler, _ = _setup(max_epochs=1)
    _run(trainer, model, optimizer, scheduler)
    trainer.save_checkpoint(tmp_path / "c.safetensors")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointMismatchError, match="written by Adam, the trainer has SGD"):
        trainer.load_checkpoint(
            tmp_path / "c.safetensors",
            optimizer=sgd,
            scheduler=torch.optim.lr_scheduler.StepLR(sgd, 1),
        )


def test_resuming_a_finished_run_warns_that_nothing_trains(tmp_path):
    trainer, model, optimizer, scheduler, _ = _setup(max_epochs=1)
    _run(trainer, model, optimizer, scheduler)
    trainer.save_checkpoint(tmp_path / "c.safetensors")
    with pytest.warns(UserWarning, match="finished run"):
        result = _run(trainer, model, optimizer, scheduler, resume_from=tmp_path / "c.safetensors")
    assert result.epochs == 0


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 2),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [1, 3, 3]),
    "ExponentialLR": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 5),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=50),
    "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.01, 0.1, step_size_up=3),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [torch.optim.lr_scheduler.ConstantLR(o), torch.optim.lr_scheduler.ExponentialLR(o, 0.9)],
        milestones=[2],
    ),
    "ConstantLR": lambda o: torch.optim.lr_scheduler.ConstantLR(o, 0.5, total_iters=3),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda epoch: 0.9**epoch),
    "MultiplicativeLR": lambda o: torch.optim.lr_scheduler.MultiplicativeLR(o, lambda e: 0.9),
    "PolynomialLR": lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=4),
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        o, 2, T_mult=2
    ),
    "ChainedScheduler": lambda o: torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.ConstantLR(o), torch.optim.lr_scheduler.ExponentialLR(o, 0.9)]
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_torch_schedulers_round_trip(tmp_path, name):
    def make():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, optimizer, SCHEDULERS[name](optimizer)

    model, optimizer, scheduler = make()
    trainer = Trainer(max_epochs=2, device="cpu")
    loader = make_loader(make_data(n=16), batch_size=8)
    trainer.fit(
        model,
        optimizer,
        loader,
        classification_step(model),
        scheduler=scheduler,
        scheduler_interval="step",
    )
    trainer.save_checkpoint(tmp_path / "s.safetensors")
    _, optimizer2, scheduler2 = make()
    trainer.load_checkpoint(
        tmp_path / "s.safetensors", model=make_model(), optimizer=optimizer2, scheduler=scheduler2
    )
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    for _ in range(3):  # both continue the same schedule
        optimizer.step()
        optimizer2.step()
        scheduler.step()
        scheduler2.step()
        assert scheduler2.get_last_lr() == scheduler.get_last_lr()


def test_int_keyed_dicts_round_trip(tmp_path):
    from collections import Counter

    write_checkpoint(
        tmp_path / "t.safetensors", {"c": Counter({3: 2, 1: 1}), "t": {0: torch.ones(2)}}
    )
    back = read_checkpoint(tmp_path / "t.safetensors")
    assert back["c"] == {3: 2, 1: 1} and torch.equal(back["t"][0], torch.ones(2))
    with pytest.raises(TypeError, match="all-string or all-int keys"):
        ListenerState("x")["mixed"] = {1: 1, "a": 2}


def test_a_well_formed_file_with_misshapen_sections_is_a_format_error(tmp_path):
    trainer, model, optimizer, scheduler, _ = _setup(max_epochs=1)
    _run(trainer, model, optimizer, scheduler)
    tree = {
        "trainer": [],
        "model": {},
        "optimizer": {},
        "scheduler": None,
        "grad_scaler": None,
        "rng": {},
        "listeners": {},
        "pending_grads": None,
    }
    write_checkpoint(tmp_path / "odd.safetensors", tree)
    with pytest.raises(CheckpointFormatError, match=r"sections \['trainer'\] do not have"):
        trainer.load_checkpoint(tmp_path / "odd.safetensors")


def test_checkpoint_files_get_the_usual_permissions(tmp_path):
    import os

    umask = os.umask(0o022)
    try:
        write_checkpoint(tmp_path / "p.safetensors", {"x": torch.ones(2)})
    finally:
        os.umask(umask)
    assert (tmp_path / "p.safetensors").stat().st_mode & 0o777 == 0o644


def test_mid_epoch_resume_with_a_loader_that_has_its_own_generator(tmp_path):
    data = make_data(n=40)

    def run(resume=None, crash_at=None):
        torch.manual_seed(1)
        model = make_model(dropout=0.2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = Trainer(max_epochs=2, device="cpu")
        if crash_at is not None:
            trainer.subscribe(SaveThenCrash(tmp_path / "g.safetensors", crash_at))
        generator = torch.Generator().manual_seed(99)
        loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=generator)
        trainer.fit(model, optimizer, loader, classification_step(model), resume_from=resume)
        return parameters_of(model)

    reference = run()
    with pytest.raises(KeyboardInterrupt):
        run(crash_at=7)
    assert_same_tensors(reference, run(resume=tmp_path / "g.safetensors"))


# -- loading swaps the loaded tensors in (no copy of the model for a rollback) --------------------


class _HookedLoading(torch.nn.Sequential):
    """Loading code of its own: the trainer must use load_state_dict (and a snapshot) for it."""

    loads = 0

    def _load_from_state_dict(self, *args, **kwargs):
        type(self).loads += 1
        super()._load_from_state_dict(*args, **kwargs)


@pytest.mark.parametrize("kind", [torch.nn.Sequential, _HookedLoading], ids=["swap", "copy"])
def test_loading_keeps_the_parameter_objects_and_rolls_back_either_way(tmp_path, kind):
    torch.manual_seed(0)
    model = kind(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    trainer = Trainer(max_epochs=2, device="cpu")
    data = [(torch.randn(8, 3), torch.randint(0, 2, (8,))) for _ in range(3)]

    def step(batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    trainer.fit(model, optimizer, data, step)
    saved = parameters_of(model)
    trainer.save_checkpoint(tmp_path / "a.safetensors")
    trainer.fit(model, optimizer, data, step)
    objects = list(model.parameters())
    trained = parameters_of(model)

    class Refuses:
        def on_load_checkpoint(self, checkpoint):
            raise ValueError("refused")

        def on_save_checkpoint(self, checkpoint):
            checkpoint["x"] = 1

    trainer.subscribe(Refuses(), name="refuses")
    trainer.save_checkpoint(tmp_path / "refused.safetensors")
    with pytest.raises(ListenerError, match="refused"):
        trainer.load_checkpoint(tmp_path / "refused.safetensors")
    assert_same_tensors(parameters_of(model), trained)
    trainer.unsubscribe(trainer.listeners[-1][1])
    trainer.load_checkpoint(tmp_path / "a.safetensors")
    assert_same_tensors(parameters_of(model), saved)
    assert list(model.parameters()) == objects and all(
        a is b for a, b in zip(model.parameters(), objects)
    )
    # The optimizer still steps the model's parameters, from the loaded state.
    assert all(p in optimizer.state for p in model.parameters())
    trainer.fit(model, optimizer, data, step)
    assert not torch.equal(model[0].weight, saved["0.weight"])
    if kind is _HookedLoading:
        assert _HookedLoading.loads > 0


def test_weights_tied_in_the_file_but_not_in_the_model_load_untied(tmp_path):
    class Pair(torch.nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.b = torch.nn.Linear(4, 4, bias=False)
            if tied:
                self.b.weight = self.a.weight

    tied = Pair(tied=True)
    trainer = Trainer(device="cpu")
    trainer.attach(tied, torch.optim.SGD(tied.parameters(), lr=0.1))
    trainer.save_checkpoint(tmp_path / "tied.safetensors")
    untied = Pair(tied=False)
    trainer.load_checkpoint(
        tmp_path / "tied.safetensors",
        model=untied,
        optimizer=torch.optim.SGD([untied.a.weight], lr=0.1),  # one parameter, as saved
    )
    assert torch.equal(untied.a.weight, tied.a.weight)
    assert torch.equal(untied.b.weight, tied.a.weight)
    assert untied.a.weight.data_ptr() != untied.b.weight.data_ptr()
    with torch.no_grad():
        untied.a.weight.add_(1.0)
    assert torch.equal(untied.b.weight, tied.a.weight)  # b did not move with a


def test_loaded_tensors_do_not_depend_on_the_file_afterwards(tmp_path):
    """Nothing read keeps the file mapped: truncating or rewriting it in place afterwards changes
    nothing (a mapped file would change under the model, or fault when truncated)."""
    model = torch.nn.Linear(64, 64)
    trainer = Trainer(device="cpu")
    trainer.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    path = tmp_path / "c.safetensors"
    trainer.save_checkpoint(path)
    saved = parameters_of(model)
    tree = read_checkpoint(path)
    fresh = torch.nn.Linear(64, 64)
    trainer.load_checkpoint(path, model=fresh, optimizer=torch.optim.SGD(fresh.parameters()))
    size = path.stat().st_size
    with open(path, "r+b") as handle:  # in place: the same file, other bytes
        handle.write(b"\xff" * size)
    os.truncate(path, 0)
    assert_same_tensors(parameters_of(fresh), saved)
    assert torch.equal(tree["model"]["weight"], saved["weight"])


class _WithExtraState(torch.nn.Linear):
    def __init__(self):
        super().__init__(2, 2)
        self.calls = torch.zeros(3)

    def get_extra_state(self):
        return self.calls

    def set_extra_state(self, state):
        self.calls = state.clone()


class _AliasingBuffer(torch.nn.Linear):
    def __init__(self):
        super().__init__(2, 2)
        self.register_buffer("row", self.weight.data[0], persistent=False)  # a view of weight


class _RemappingNorm(torch.nn.BatchNorm1d):
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict[prefix + "bias"] = state_dict[prefix + "bias"] + 100.0  # transforms on load
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@pytest.mark.parametrize(
    ("make", "check"),
    [
        (
            _WithExtraState,
            lambda fresh, source: torch.equal(fresh.calls, source.calls),
        ),
        (
            _AliasingBuffer,
            lambda fresh, source: torch.equal(fresh.row, source.weight.detach()[0]),
        ),
        (
            lambda: _RemappingNorm(2),
            lambda fresh, source: torch.equal(fresh.bias, source.bias.detach() + 100.0),
        ),
    ],
    ids=["extra-state", "aliasing-buffer", "norm-with-own-loading"],
)
def test_models_with_their_own_loading_or_aliases_are_loaded_in_place(tmp_path, make, check):
    from trainer import _runtime

    torch.manual_seed(0)
    source = make()
    with torch.no_grad():
        for tensor in source.state_dict().values():
            if tensor.is_floating_point():
                tensor.uniform_()
    if isinstance(source, _WithExtraState):
        source.calls = torch.tensor([1.0, 2.0, 3.0])
    trainer = Trainer(device="cpu")
    trainer.attach(source, torch.optim.SGD(source.parameters(), lr=0.1))
    trainer.save_checkpoint(tmp_path / "c.safetensors")
    fresh = make()
    assert _runtime.swap_plan(fresh, read_checkpoint(tmp_path / "c.safetensors")["model"]) is None
    trainer.load_checkpoint(
        tmp_path / "c.safetensors", model=fresh, optimizer=torch.optim.SGD(fresh.parameters())
    )
    assert check(fresh, source)


# Every optimizer of torch.optim that the trainer drives, with the options that add state: a
# checkpoint of each loads and resumes (issue 26.3 checks their values, trainer/optim_checks.py).
OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "Adam-amsgrad": lambda p: torch.optim.Adam(p, amsgrad=True, foreach=False),
    "Adam-fused": lambda p: torch.optim.Adam(p, fused=True),
    "Adam-tensor-lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01)),
    "AdamW": lambda p: torch.optim.AdamW(p, amsgrad=True),
    "Adamax": lambda p: torch.optim.Adamax(p),
    "NAdam": lambda p: torch.optim.NAdam(p),
    "RAdam": lambda p: torch.optim.RAdam(p),
    "RMSprop": lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "ASGD": lambda p: torch.optim.ASGD(p),
    "Rprop": lambda p: torch.optim.Rprop(p),
    "Adafactor": lambda p: torch.optim.Adafactor(p),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_torch_optimizers_round_trip(tmp_path, name):
    model = make_model()
    optimizer = OPTIMIZERS[name](model.parameters())
    loader = make_loader(make_data(n=16), batch_size=8)
    Trainer(max_epochs=1, device="cpu").fit(model, optimizer, loader, classification_step(model))
    trainer = Trainer(max_epochs=1, device="cpu")
    trainer.attach(model, optimizer)
    trainer.save_checkpoint(tmp_path / "o.safetensors")
    fresh = make_model(seed=4)
    other = OPTIMIZERS[name](fresh.parameters())
    trainer.load_checkpoint(tmp_path / "o.safetensors", model=fresh, optimizer=other)
    assert_same_tree(
        {k: v for k, v in optimizer.state_dict().items() if k == "state"},
        {k: v for k, v in other.state_dict().items() if k == "state"},
    )
    resumed = Trainer(max_epochs=2, device="cpu")
    resumed.fit(
        fresh, other, loader, classification_step(fresh), resume_from=tmp_path / "o.safetensors"
    )
    assert resumed.state.global_step == 4


class _Unchecked(torch.optim.Optimizer):
    """An optimizer of one's own: plain gradient descent, with no value rules registered."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])


def test_an_optimizer_without_value_rules_is_refused_until_registered(tmp_path):
    from trainer.optim_checks import OPTIMIZER_RULES, OptimizerRule, register_optimizer

    model = make_model()
    optimizer = _Unchecked(model.parameters())
    trainer = Trainer(max_epochs=1, device="cpu")
    trainer.fit(model, optimizer, make_loader(make_data(n=16)), classification_step(model))
    trainer.save_checkpoint(tmp_path / "u.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"_Unchecked has no value rules") as info:
        trainer.load_checkpoint(tmp_path / "u.safetensors")
    assert "register_optimizer" in str(info.value)
    register_optimizer(_Unchecked, OptimizerRule({}, scalars=()))
    try:
        trainer.load_checkpoint(tmp_path / "u.safetensors")
    finally:
        del OPTIMIZER_RULES[_Unchecked]
    with pytest.raises(TypeError, match="OptimizerRule"):
        register_optimizer(_Unchecked, {"lr": None})


def test_a_scheduler_without_value_rules_is_refused_until_registered(tmp_path):
    from trainer.optim_checks import SCHEDULER_RULES, SchedulerRule, register_scheduler

    class Halving(torch.optim.lr_scheduler.LRScheduler):
        def get_lr(self):
            return [group["lr"] * 0.5 for group in self.optimizer.param_groups]

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(max_epochs=1, device="cpu")
    loader = make_loader(make_data(n=16))
    trainer.fit(model, optimizer, loader, classification_step(model), scheduler=Halving(optimizer))
    trainer.save_checkpoint(tmp_path / "s.safetensors")
    with pytest.raises(CheckpointMismatchError, match="Halving has no value rules"):
        trainer.load_checkpoint(tmp_path / "s.safetensors")
    register_scheduler(Halving, SchedulerRule())
    try:
        trainer.load_checkpoint(tmp_path / "s.safetensors")
    finally:
        del SCHEDULER_RULES[Halving]
