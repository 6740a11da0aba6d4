"""Resume an interrupted update (issue 25, "Resume"): with ``checkpoint_every`` an update killed
at any step and run again continues from its mid-update checkpoint and writes, on the CPU, what
the uninterrupted update writes; a checkpoint of another update, or a changed one, is refused
before anything changes unless ``restart=True``."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.methods import METHODS, method
from renate_events.models import vit
from renate_events.updater import MidUpdateCheckpointError, ModelUpdater
from tests.helpers import ROOT, assert_same_state_folder, assert_same_tree, one_line_cli_error
from tests.renate_events.methods.test_prompting import SMALL_ARGS


class _Interrupt:
    """Raises ``KeyboardInterrupt`` (Ctrl-C) at the end of training step ``at`` (None: never)."""

    def __init__(self, at: int | None = None) -> None:
        self.at = at

    def on_batch_end(self, state) -> None:
        if state.global_step == self.at:
            raise KeyboardInterrupt


def _data(seed: int, n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, :3].argmax(1) + (x[:, 3] > 1).long()) % 3)


def _images(seed: int, n: int = 96) -> TensorDataset:
    """``_data``'s labels with 8x8 RGB images, for the prompt methods' ViT."""
    g = torch.Generator().manual_seed(seed + 1000)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), _data(seed, n).tensors[1])


def _updater(learner: str, interrupt: _Interrupt, output, start=None, **kwargs) -> ModelUpdater:
    torch.manual_seed(0)
    own = {}
    if method(learner).model == "vit":  # a prompt method: a tiny ViT
        model = vit(num_classes=3, image_size=8, patch_size=4, dim=32, depth=2)
        own = SMALL_ARGS[learner]
    else:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return ModelUpdater(
        model,
        learner=learner,
        learner_kwargs={
            "memory_size": 20,
            "memory_batch_size": 4,
            "batch_size": 8,
            "seed": 3,
            **own,
        },
        max_epochs=kwargs.pop("max_epochs", 3),
        trainer_kwargs={"device": "cpu"},
        listeners=[interrupt],
        input_state_folder=start,
        output_state_folder=output,
        **kwargs,
    )


def _first_state(tmp_path: pathlib.Path, learner: str, **kwargs) -> pathlib.Path:
    first = tmp_path / "first"
    _updater(learner, _Interrupt(), first, **kwargs).update(_data(0), _data(10, 24), task_id="a")
    return first


def _update(updater: ModelUpdater, task_id: str = "b") -> None:
    updater.update(_data(1), _data(11, 24), task_id=task_id)


# ER, DER (stored logits), CLS-ER (EMA models: component state) and an end-of-update fill; with
# best-weights selection and early stopping (listener state of the updater's own).
CASES = [
    ("er", {}),
    ("der", {}),
    ("cls-er", {}),
    ("er", {"learner_kwargs_extra": {"buffer_filling": "end"}}),
    ("der", {"metric": "val_accuracy", "early_stopping_enabled": True}),
]


def _kwargs(case: dict) -> tuple[dict, dict]:
    case = dict(case)
    extra = case.pop("learner_kwargs_extra", {})
    return case, extra


@pytest.mark.parametrize(("learner", "case"), CASES)
def test_an_update_interrupted_at_random_steps_resumes_bit_identical(tmp_path, learner, case):
    kwargs, extra = _kwargs(case)
    first = _first_state(tmp_path, learner)

    def updater(interrupt, output, **more):
        made = _updater(learner, interrupt, output, first, **kwargs, **more)
        made.learner_kwargs.update(extra)
        return made

    _update(updater(_Interrupt(), tmp_path / "reference"))
    steps = 36  # 96 samples in batches of 8, 3 epochs
    kills = sorted(random.Random(learner).sample(range(1, steps + 1), 2))
    for at in kills:  # interrupted twice (the second time after resuming), then finished
        interrupted = updater(_Interrupt(at), tmp_path / "out", checkpoint_every=5)
        with pytest.raises(KeyboardInterrupt):
            _update(interrupted)
        assert not (tmp_path / "out").exists()
    _update(updater(_Interrupt(), tmp_path / "out", checkpoint_every=5))
    assert_same_state_folder(tmp_path / "reference", tmp_path / "out")
    litter = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert litter == ["first", "out", "reference"]  # the mid-update checkpoints are gone


@pytest.mark.slow
@pytest.mark.parametrize("learner", sorted(METHODS))
def test_every_method_resumes_bit_identical(tmp_path, learner):
    def updater(interrupt, output, start, **more):
        made = _updater(learner, interrupt, output, start, **more)
        if method(learner).features != "none":
            made.learner_kwargs["feature_modules"] = ["1"]  # the hidden layer
        return made

    data = _images if method(learner).model == "vit" else _data
    updater(_Interrupt(), tmp_path / "first", None).update(data(0), task_id="a")
    first = tmp_path / "first"
    updater(_Interrupt(), tmp_path / "reference", first).update(data(1), task_id="b")
    with pytest.raises(KeyboardInterrupt):
        at = random.Random(learner).randint(1, 6)  # 9 steps for learners training on the buffer
        updater(_Interrupt(at), tmp_path / "out", first, checkpoint_every=3).update(
            data(1), task_id="b"
        )
    updater(_Interrupt(), tmp_path / "out", first).update(data(1), task_id="b")
    assert_same_state_folder(tmp_path / "reference", tmp_path / "out")
    assert not (tmp_path / ".out.resume").exists()


def test_the_same_updater_continues_after_a_ctrl_c(tmp_path):
    first = _first_state(tmp_path, "der")
    _update(_updater("der", _Interrupt(), tmp_path / "reference", first))
    interrupt = _Interrupt(17)
    updater = _updater("der", interrupt, tmp_path / "out", first, checkpoint_every=4)
    with pytest.raises(KeyboardInterrupt):
        _update(updater)
    record = json.loads((tmp_path / ".out.resume" / "update.json").read_text())
    assert record["optimizer_steps"] == 16 and record["checkpoint"] == "checkpoint.16.safetensors"
    interrupt.at = None
    _update(updater)
    assert_same_state_folder(tmp_path / "reference", tmp_path / "out")
    assert not (tmp_path / ".out.resume").exists()


def _interrupted(tmp_path: pathlib.Path, at: int = 13) -> tuple[pathlib.Path, pathlib.Path]:
    """An update of ``first`` into ``out`` interrupted at step ``at`` (checkpoint every 4)."""
    first = _first_state(tmp_path, "er")
    with pytest.raises(KeyboardInterrupt):
        _update(_updater("er", _Interrupt(at), tmp_path / "out", first, checkpoint_every=4))
    return first, tmp_path / ".out.resume"


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _flip_a_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _edit_record(key, value):
    def edit(folder: pathlib.Path) -> None:
        record = json.loads((folder / "update.json").read_text())
        record[key] = value
        (folder / "update.json").write_text(json.dumps(record))

    return edit


TAMPERED = {
    "checkpoint bytes": (
        lambda f: _flip_a_byte(next(f.glob("checkpoint.*"))),
        "its SHA-256 is not the one update.json records",
    ),
    "record not JSON": (lambda f: (f / "update.json").write_text("{"), "not a readable record"),
    "record nested deep": (
        lambda f: (f / "update.json").write_text("[" * 100_000 + "]" * 100_000),
        "not a readable record of a mid-update checkpoint (it nests deeper than 8 levels)",
    ),
    "record format": (_edit_record("format", "other"), "key 'format'"),
    "record version": (_edit_record("format_version", 7), "key 'format_version'"),
    "record parts": (_edit_record("update", {"task_id": "x"}), "key 'update'"),
    "checkpoint outside": (_edit_record("checkpoint", "../first"), "key 'checkpoint'"),
    "checkpoint missing": (_edit_record("checkpoint", "checkpoint.99"), "key 'checkpoint'"),
    "digest type": (_edit_record("checkpoint_sha256", 3), "key 'checkpoint_sha256'"),
}


@pytest.mark.hostile
@pytest.mark.all_or_nothing
@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_changed_mid_update_checkpoint_is_refused_and_nothing_changes(tmp_path, case):
    first, folder = _interrupted(tmp_path)
    tamper, words = TAMPERED[case]
    tamper(folder)
    before = _files(folder)
    updater = _updater("er", _Interrupt(), tmp_path / "out", first, checkpoint_every=4)
    weights = {k: v.clone() for k, v in updater.learner_instance.model.state_dict().items()}
    buffer = updater.learner_instance.buffer.state_dict()
    with pytest.raises(MidUpdateCheckpointError, match="restart=True") as refused:
        _update(updater)
    message = str(refused.value)
    assert words in message and str(folder) in message and "\n" not in message
    assert _files(folder) == before and not (tmp_path / "out").exists()
    assert_same_tree(weights, dict(updater.learner_instance.model.state_dict()))
    assert_same_tree(buffer, updater.learner_instance.buffer.state_dict())


OTHER_UPDATES = {
    "task id": ({}, "c", "the task id"),
    "data": ({"data_seed": 5}, "b", "the training data"),
    "arguments": ({"optimizer": {"name": "adam", "lr": 0.01}}, "b", "the updater's arguments"),
    "epochs": ({"max_epochs": 2}, "b", "the updater's arguments"),  # not in trainer_kwargs
}


@pytest.mark.hostile
@pytest.mark.all_or_nothing
@pytest.mark.parametrize("case", sorted(OTHER_UPDATES))
def test_a_checkpoint_of_another_update_is_refused_until_restart(tmp_path, case):
    first, folder = _interrupted(tmp_path)
    before = _files(folder)
    kwargs, task_id, words = OTHER_UPDATES[case]
    kwargs = dict(kwargs)
    data = _data(kwargs.pop("data_seed", 1))

    def update(**more):
        updater = _updater("er", _Interrupt(), tmp_path / "out", first, **kwargs, **more)
        updater.update(data, _data(11, 24), task_id=task_id)

    with pytest.raises(MidUpdateCheckpointError, match="belongs to another update") as refused:
        update()
    assert words in str(refused.value) and "update.json" in str(refused.value)
    assert _files(folder) == before and not (tmp_path / "out").exists()
    update(restart=True)  # asked for: from the input state; the old checkpoint goes
    assert not folder.exists() and (tmp_path / "out" / "manifest.json").exists()


def test_restart_starts_from_the_input_state(tmp_path):
    first, folder = _interrupted(tmp_path, at=30)
    _update(_updater("er", _Interrupt(), tmp_path / "reference", first))
    _update(_updater("er", _Interrupt(), tmp_path / "out", first, restart=True, checkpoint_every=4))
    assert_same_state_folder(tmp_path / "reference", tmp_path / "out")
    assert not folder.exists()


def test_what_cannot_be_resumed_is_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every needs an output_state_folder"):
        _updater("er", _Interrupt(), None, checkpoint_every=3)
    with pytest.raises(ValueError, match="buffer_storage='mapped' is not supported"):
        _updater("er", _Interrupt(), tmp_path / "o", checkpoint_every=3, buffer_storage="mapped")
    with pytest.raises(ValueError, match="checkpoint_every must be"):
        _updater("er", _Interrupt(), tmp_path / "o", checkpoint_every=0)


_KILL_CONFIG = """
import os
import signal

import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def data_fn(chunk_id, seed):
    g = torch.Generator().manual_seed(100 * chunk_id + seed)
    x = torch.randn(120, 6, generator=g)
    y = x[:, :3].argmax(1)
    return TensorDataset(x[:96], y[:96]), TensorDataset(x[96:], y[96:])


class _KillAt:
    \"\"\"SIGKILLs this process at the end of training step $KILL_AT (never when unset).\"\"\"

    def on_batch_end(self, state):
        if state.global_step == int(os.environ.get("KILL_AT", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)


def listeners():
    return [_KillAt()]
"""


def _cli(tmp_path: pathlib.Path, *args: str, kill_at: int | None = None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KILL_AT", None)
    if kill_at is not None:
        env["KILL_AT"] = str(kill_at)
    common = ["--config-file", "c.py", "--device", "cpu", "--no-progress", "--epochs", "3"]
    command = [sys.executable, "-m", "renate_events.cli", "update", *common, *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_the_command_killed_with_sigkill_resumes_bit_identical(tmp_path):
    (tmp_path / "c.py").write_text(_KILL_CONFIG)
    assert _cli(tmp_path, "--output-state", "first").returncode == 0
    update = ["--input-state", "first", "--learner", "der"]
    assert _cli(tmp_path, *update, "--output-state", "reference").returncode == 0
    again = [*update, "--output-state", "out", "--checkpoint-every", "2"]
    for at in (3, 8):  # batches of 32: 3 steps an epoch
        assert _cli(tmp_path, *again, kill_at=at).returncode == -signal.SIGKILL
    assert _cli(tmp_path, *again).returncode == 0
    assert_same_state_folder(tmp_path / "reference", tmp_path / "out")
    assert not (tmp_path / ".out.resume").exists()


@pytest.mark.hostile
def test_the_command_line_refuses_in_one_line(tmp_path, capsys, monkeypatch):
    from renate_events.cli import main

    (tmp_path / "c.py").write_text(_KILL_CONFIG)
    monkeypatch.chdir(tmp_path)
    common = ["update", "--config-file", "c.py", "--device", "cpu", "--no-progress"]
    assert main([*common, "--output-state", "first"]) == 0
    folder = tmp_path / ".out.resume"
    folder.mkdir()
    (folder / "update.json").write_text("[]")
    err = one_line_cli_error(
        capsys, [*common, "--input-state", "first", "--output-state", "out"], str(folder)
    )
    assert "pass --restart to start again" in err and not (tmp_path / "out").exists()
    assert main([*common, "--input-state", "first", "--output-state", "out", "--restart"]) == 0
    assert not folder.exists()
    search = ["--search", "2", "--checkpoint-every", "2", "--output-state", "s"]
    one_line_cli_error(capsys, [*common, *search], "--search cannot be resumed")
    mapped = ["--buffer-storage", "mapped", "--checkpoint-every", "2", "--output-state", "m"]
    one_line_cli_error(capsys, [*common, *mapped], "--checkpoint-every with a mapped buffer")
