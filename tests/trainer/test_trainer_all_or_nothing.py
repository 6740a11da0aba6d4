"""Resume at an epoch boundary, re-entrancy, all-or-nothing loads and the strict checkpoint schema.

Each test here failed before its fix (issue 14's resume bug, issue 15's rollback, re-entrancy and
schema items).
"""

from __future__ import annotations

import math
import os

import attrs
import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers import classification_step, make_data, make_model, parameters_of
from trainer import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    ListenerError,
    Trainer,
    read_checkpoint,
    write_checkpoint,
)


def _loader(seed: int = 5) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(make_data(n=40), batch_size=8, shuffle=True, generator=generator)


def _fit(trainer: Trainer, model: torch.nn.Module, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return trainer.fit(model, optimizer, _loader(), classification_step(model), **kwargs)


def _uninterrupted(epochs: int) -> dict[str, torch.Tensor]:
    model = make_model()
    _fit(Trainer(max_epochs=epochs, device="cpu", seed=0), model)
    return parameters_of(model)


@attrs.define
class _SaveAfterEpoch:
    trainer: Trainer
    path: str
    epoch: int

    def on_epoch_end(self, state):
        if state.epoch == self.epoch:
            self.trainer.save_checkpoint(self.path)


def test_epoch_boundary_resume_with_a_loader_generator_is_exact(tmp_path):
    path = str(tmp_path / "epoch1.safetensors")
    first = Trainer(max_epochs=2, device="cpu", seed=0)
    first.subscribe(_SaveAfterEpoch(first, path, epoch=1))
    _fit(first, make_model())
    model = make_model(seed=3)  # other initial values: everything must come from the file
    _fit(Trainer(max_epochs=4, device="cpu"), model, resume_from=path)
    expected = _uninterrupted(4)
    for key, value in parameters_of(model).items():
        assert torch.equal(value, expected[key]), key


def test_a_finished_run_resumed_with_more_epochs_continues_the_shuffle(tmp_path):
    path = str(tmp_path / "done.safetensors")
    trainer = Trainer(max_epochs=2, device="cpu", seed=0)
    _fit(trainer, make_model())
    trainer.save_checkpoint(path)
    model = make_model(seed=3)
    _fit(Trainer(max_epochs=4, device="cpu"), model, resume_from=path)
    expected = _uninterrupted(4)
    for key, value in parameters_of(model).items():
        assert torch.equal(value, expected[key]), key


def test_fit_from_inside_a_hook_is_refused_and_the_outer_fit_goes_on():
    trainer = Trainer(max_epochs=1, device="cpu")
    inner = make_model()

    def nested(state):
        _fit(trainer, inner)

    trainer.connect("epoch_start", nested)
    with pytest.raises(ListenerError, match="already fitting") as info:
        _fit(trainer, make_model())
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.all_or_nothing
def test_save_checkpoint_from_on_save_checkpoint_is_a_clear_error(tmp_path):
    trainer = Trainer(max_epochs=1, device="cpu")

    @attrs.define
    class Recursive:
        def on_save_checkpoint(self, checkpoint):
            trainer.save_checkpoint(tmp_path / "again.safetensors")

    trainer.subscribe(Recursive())
    _fit(trainer, make_model())
    with pytest.raises(ListenerError, match="called from an on_save_checkpoint hook"):
        trainer.save_checkpoint(tmp_path / "ckpt.safetensors")
    assert not list(tmp_path.iterdir())


@attrs.define
class _Counter:
    """A listener with state; ``refuse`` makes its load fail after it took the file's value."""

    count: int = 0
    refuse: bool = False

    def on_batch_end(self):
        self.count += 1

    def on_save_checkpoint(self, checkpoint):
        checkpoint["count"] = self.count

    def on_load_checkpoint(self, checkpoint):
        self.count = checkpoint["count"]
        if self.refuse:
            raise ValueError("this state is not for me")


def _trained_with_counters(tmp_path):
    trainer = Trainer(max_epochs=1, device="cpu", seed=0)
    first, second = _Counter(), _Counter()
    trainer.subscribe(first, name="first")
    trainer.subscribe(second, name="second")
    model = make_model()
    _fit(trainer, model)
    path = str(tmp_path / "ckpt.safetensors")
    trainer.save_checkpoint(path)
    return trainer, model, first, second, path


@pytest.mark.all_or_nothing
def test_a_later_listener_refusing_its_state_puts_the_earlier_ones_back(tmp_path):
    trainer, model, first, second, path = _trained_with_counters(tmp_path)
    _fit(trainer, model)  # one more epoch: the live counts now differ from the file's
    live = (first.count, second.count)
    params, state = parameters_of(model), attrs.asdict(trainer.state, recurse=False)
    second.refuse = True
    with pytest.raises(ListenerError, match="not for me"):
        trainer.load_checkpoint(path)
    assert (first.count, second.count)[0] == live[0]
    for key, value in parameters_of(model).items():
        assert torch.equal(value, params[key]), key
    after = attrs.asdict(trainer.state, recurse=False)
    assert {k: v for k, v in after.items() if "rng" not in k} == {
        k: v for k, v in state.items() if "rng" not in k
    }


@pytest.mark.all_or_nothing
def test_a_refused_load_with_new_objects_keeps_the_attached_ones(tmp_path):
    trainer, _, _, second, path = _trained_with_counters(tmp_path)
    other = make_model(seed=1)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    second.refuse = True
    attached = (trainer.model, trainer.optimizer)
    with pytest.raises(ListenerError):
        trainer.load_checkpoint(path, model=other, optimizer=other_optimizer)
    assert (trainer.model, trainer.optimizer) == attached
    wrong = torch.nn.Linear(3, 3)
    with pytest.raises(CheckpointMismatchError):
        trainer.load_checkpoint(path, model=wrong, optimizer=torch.optim.SGD(wrong.parameters()))
    assert (trainer.model, trainer.optimizer) == attached


@pytest.mark.all_or_nothing
def test_a_refused_resume_keeps_the_trainer_state(tmp_path):
    trainer, model, _, _, path = _trained_with_counters(tmp_path)
    steps = trainer.state.global_step
    adam = torch.optim.Adam(model.parameters())
    with pytest.raises(CheckpointMismatchError, match="written by SGD"):
        trainer.fit(model, adam, _loader(), classification_step(model), resume_from=path)
    assert trainer.state.global_step == steps
    assert trainer.optimizer is not adam


# -- the schema of everything read back ----------------------------------------------------------


def _saved(tmp_path, *, scheduler: bool = False, optimizer: str = "sgd", accumulate: int = 1):
    model = make_model()
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters())
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1) if scheduler else None
    trainer = Trainer(max_steps=3, device="cpu", accumulate_grad_batches=accumulate, seed=0)
    trainer.fit(model, opt, _loader(), classification_step(model), scheduler=sched)
    path = str(tmp_path / "ckpt.safetensors")
    trainer.save_checkpoint(path)
    return trainer, model, path


def _edit(path: str, change) -> None:
    """Change the file's tree and write it again: the checksums are valid, the content is not."""
    tree = read_checkpoint(path)
    change(tree)
    write_checkpoint(path, tree)


def _progress(key, value):
    return lambda tree: tree["trainer"]["progress"].__setitem__(key, value)


def _python_rng(tree):
    tree["rng"]["current"]["python"]["state"] = [1, 2, 3]


def _torch_rng_i64(tree):
    tree["rng"]["current"]["torch"] = tree["rng"]["current"]["torch"].to(torch.int64)


def _pending(tree):
    tree["pending_grads"] = [torch.zeros(3) for _ in tree["pending_grads"]]


@pytest.mark.all_or_nothing
@pytest.mark.hostile
@pytest.mark.parametrize(
    ("change", "key"),
    [
        (_progress("epoch", "zero"), "trainer.progress.epoch"),
        (_progress("global_step", 1.5), "trainer.progress.global_step"),
        (_progress("batch", -5), "trainer.progress.batch"),
        (_progress("epoch", True), "trainer.progress.epoch"),
        (_progress("validation_pending", 1), "trainer.progress.validation_pending"),
        (lambda tree: tree["trainer"].__setitem__("progress", {}), "trainer.progress"),
        (_python_rng, "rng.current.python"),
        (_torch_rng_i64, "rng.current.torch"),
    ],
)
def test_edited_sections_are_refused_naming_the_file_and_key(tmp_path, change, key):
    trainer, model, path = _saved(tmp_path)
    _edit(path, change)
    before = parameters_of(model)
    with pytest.raises(CheckpointFormatError, match=key) as info:
        trainer.load_checkpoint(path)
    assert path in str(info.value)
    for name, value in parameters_of(model).items():
        assert torch.equal(value, before[name]), name


@pytest.mark.hostile
def test_non_finite_progress_cannot_even_be_read(tmp_path):
    trainer, _, path = _saved(tmp_path)
    with pytest.raises((CheckpointFormatError, TypeError, ValueError)):
        _edit(path, _progress("epoch", math.inf))
        trainer.load_checkpoint(path)


@pytest.mark.hostile
def test_pending_gradients_of_the_wrong_shape_are_refused(tmp_path):
    trainer, _, path = _saved(tmp_path, accumulate=2)
    mid_window = str(tmp_path / "mid.safetensors")

    def save(state):
        if state.accumulated == 1 and state.global_step == 1:
            trainer.save_checkpoint(mid_window)

    trainer.connect("batch_end", save)
    model = trainer.model
    trainer.fit(model, trainer.optimizer, _loader(), classification_step(model))
    path = mid_window
    assert read_checkpoint(path)["pending_grads"] is not None
    _edit(path, _pending)
    with pytest.raises(CheckpointMismatchError, match="pending_grads: gradient 0"):
        trainer.load_checkpoint(path)


@pytest.mark.hostile
def test_optimizer_state_that_cannot_belong_to_its_parameter_is_refused(tmp_path):
    trainer, _, path = _saved(tmp_path, optimizer="adam")
    _edit(path, lambda tree: tree["optimizer"]["state"]["0"].__setitem__("exp_avg", torch.ones(96)))
    with pytest.raises(CheckpointMismatchError, match="'exp_avg' of parameter 0 has shape"):
        trainer.load_checkpoint(path)


def test_a_scheduler_of_another_class_is_refused(tmp_path):
    trainer, _, path = _saved(tmp_path, scheduler=True)
    exponential = torch.optim.lr_scheduler.ExponentialLR(trainer.optimizer, gamma=0.5)
    with pytest.raises(CheckpointMismatchError, match="written by StepLR, the trainer has Expon"):
        trainer.load_checkpoint(path, scheduler=exponential)


@pytest.mark.hostile
def test_a_scheduler_state_without_the_class_name_is_checked_by_its_keys(tmp_path):
    trainer, _, path = _saved(tmp_path, scheduler=True)
    _edit(path, lambda tree: tree["trainer"].pop("scheduler_class"))
    exponential = torch.optim.lr_scheduler.ExponentialLR(trainer.optimizer, gamma=0.5)
    with pytest.raises(CheckpointMismatchError, match="scheduler: unexpected key 'step_size'"):
        trainer.load_checkpoint(path, scheduler=exponential)


@pytest.mark.hostile
def test_a_learning_rate_that_is_not_a_number_is_refused(tmp_path):
    trainer, _, path = _saved(tmp_path)
    _edit(path, lambda tree: tree["optimizer"]["param_groups"][0].__setitem__("lr", "x"))
    with pytest.raises(CheckpointMismatchError, match=r"param_groups\[0\].lr"):
        trainer.load_checkpoint(path)


def test_checkpoint_error_is_the_base_of_every_refusal():
    assert issubclass(CheckpointFormatError, CheckpointError)
    assert issubclass(CheckpointMismatchError, CheckpointError)


# -- temporary files and full disks ----------------------------------------------------------------


def _temporary(folder, target: str, pid: int) -> object:
    from trainer.files import host_name as _host

    path = folder / f".{target}.{_host()}.{pid}.abc123.tmp"
    path.write_bytes(b"half a checkpoint")
    return path


def test_the_next_save_removes_temporaries_of_killed_saves_but_not_of_live_ones(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead_pid = int(dead.stdout)
    stale = _temporary(tmp_path, "ckpt.safetensors", dead_pid)
    live = _temporary(tmp_path, "ckpt.safetensors", os.getpid())
    other_target = _temporary(tmp_path, "other.safetensors", dead_pid)
    write_checkpoint(tmp_path / "ckpt.safetensors", {"w": torch.ones(2)})
    assert not stale.exists()
    assert live.exists() and other_target.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "ckpt.safetensors"
    ]


@pytest.mark.all_or_nothing
def test_a_full_disk_is_a_checkpoint_error_and_leaves_the_previous_file(tmp_path, monkeypatch):
    import safetensors

    import trainer.checkpoint as checkpoint

    path = tmp_path / "ckpt.safetensors"
    write_checkpoint(path, {"w": torch.ones(2)})

    def full(*args, **kwargs):
        raise safetensors.SafetensorError(
            "Error while serializing: IoError(No space left on device)"
        )

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(CheckpointError, match="No space left"):
        write_checkpoint(path, {"w": torch.zeros(2)})
    assert torch.equal(read_checkpoint(path)["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.safetensors"]


# -- behaviour kept through the restructuring (found by review) ------------------------------------


def test_fit_puts_a_model_given_in_eval_mode_into_train_mode():
    model = make_model(dropout=0.5).eval()
    modes = []
    trainer = Trainer(max_epochs=1, device="cpu")
    trainer.connect("train_start", lambda model: modes.append(model.training))
    trainer.connect("batch_end", lambda model: modes.append(model.training))
    _fit(trainer, model)
    assert modes and all(modes)


def test_a_listener_lowering_max_steps_stops_the_fit_there():
    trainer = Trainer(max_epochs=3, device="cpu", accumulate_grad_batches=2)

    def limit(state):
        state.max_steps = 3

    trainer.connect("train_start", limit)
    result = _fit(trainer, make_model())
    assert (result.steps, result.optimizer_steps) == (3, 2)


def test_legitimate_optimizer_variants_still_load(tmp_path):
    model = make_model()
    trainer = Trainer(max_steps=2, device="cpu")
    trainer.fit(model, torch.optim.Adam(model.parameters()), _loader(), classification_step(model))
    path = str(tmp_path / "adam.safetensors")
    trainer.save_checkpoint(path)
    for options in ({"foreach": True}, {"lr": torch.tensor(0.001)}):
        trainer.load_checkpoint(path, optimizer=torch.optim.Adam(model.parameters(), **options))


def test_fit_and_load_from_a_checkpoint_hook_are_refused(tmp_path):
    trainer = _trained_with_counters(tmp_path)[0]

    def nested(checkpoint):
        _fit(trainer, make_model())

    trainer.connect("save_checkpoint", nested, name="nested")
    with pytest.raises(ListenerError, match="handling an event"):
        trainer.save_checkpoint(tmp_path / "other.safetensors")


def test_a_temporary_with_a_number_no_process_has_is_left_alone(tmp_path):
    from trainer.files import host_name as _host

    odd = tmp_path / f".ckpt.safetensors.{_host()}.{10**20}.abc123.tmp"
    odd.write_bytes(b"x")
    write_checkpoint(tmp_path / "ckpt.safetensors", {"w": torch.ones(1)})
    assert odd.exists()


@pytest.mark.all_or_nothing
def test_a_resume_refused_by_a_listener_puts_the_trainer_back(tmp_path):
    trainer, model, _, second, path = _trained_with_counters(tmp_path)
    _fit(trainer, model)
    steps, attached = trainer.state.global_step, (trainer.model, trainer.optimizer)
    second.refuse = True
    other = make_model(seed=2)
    with pytest.raises(ListenerError, match="not for me"):
        _fit(trainer, other, resume_from=path)
    assert trainer.state.global_step == steps
    assert (trainer.model, trainer.optimizer) == attached


@pytest.mark.all_or_nothing
@pytest.mark.hostile
@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (_progress("optimizer_steps", 10**6), CheckpointFormatError, "optimizer_steps"),
        (
            lambda tree: tree["rng"]["current"]["python"].__setitem__("version", 99),
            CheckpointFormatError,
            "rng.current.python",
        ),
        (
            lambda tree: tree["rng"]["current"].__setitem__("cuda", 5),
            CheckpointFormatError,
            "rng.current.cuda",
        ),
        (
            lambda tree: tree["optimizer"]["param_groups"][0].__setitem__("params", [0, 1, 2, 9]),
            CheckpointMismatchError,
            "parameter ids",
        ),
    ],
)
def test_a_resume_from_an_edited_file_is_refused_before_train_start(tmp_path, change, error, match):
    trainer, model, path = _saved(tmp_path)
    _edit(path, change)
    started = []
    trainer.connect("train_start", lambda: started.append(True))
    with pytest.raises(error, match=match):
        trainer.fit(
            model, trainer.optimizer, _loader(), classification_step(model), resume_from=path
        )
    assert started == []


@pytest.mark.hostile
def test_adam_moments_of_a_broadcastable_but_wrong_shape_are_refused(tmp_path):
    trainer, _, path = _saved(tmp_path, optimizer="adam")
    _edit(
        path, lambda tree: tree["optimizer"]["state"]["0"].__setitem__("exp_avg", torch.ones(1, 6))
    )
    with pytest.raises(CheckpointMismatchError, match="'exp_avg' of parameter 0 has shape"):
        trainer.load_checkpoint(path)
