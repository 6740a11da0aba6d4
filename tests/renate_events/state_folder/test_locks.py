"""What is around a state folder when it is read or written: its lock file (never a link
followed, never a folder), a manifest that is a link, and the leftovers of a killed writer, which
a read removes when no writer is live (or says why it cannot repair the folder)."""

from __future__ import annotations

import errno
import os
import pathlib

import pytest
import safetensors.torch
import torch
from torch.utils.data import TensorDataset

from renate_events.cli._zoo import mlp
from renate_events.state_folder import (
    StateFolderBusyError,
    StateFolderError,
    read_manifest,
    recovery,
    state_token,
)
from renate_events.updater import ModelUpdater
from tests.helpers import run_cli
from trainer.files import FileLock, lock_path

STAGING = ".s.staging.0123456789abcdef"  # a writer killed while staging
OLD = ".s.old.fedcba9876543210"  # a writer killed after its swap, before removing the old


def _updater(**kwargs):
    torch.manual_seed(0)
    return ModelUpdater(
        mlp(8, [16], 4),
        learner="er",
        learner_kwargs={"memory_size": 20, "memory_batch_size": 4, "batch_size": 8},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        metadata={"model": {"kind": "mlp", "inputs": 8, "hidden": [16], "classes": 4}},
        lock_timeout=5.0,
        **kwargs,
    )


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))


@pytest.fixture
def state(tmp_path):
    """``tmp_path/s``, a state folder, beside a data file ``test.safetensors``."""
    _updater(output_state_folder=tmp_path / "s").update(_data(), task_id="first")
    safetensors.torch.save_file(
        dict(zip(("inputs", "targets"), _data(1).tensors)), str(tmp_path / "test.safetensors")
    )
    return tmp_path / "s"


def _snapshot(root):
    """Every path under ``root`` (links not followed) with its bytes or its link's target."""
    found = {}
    for path in sorted(pathlib.Path(root).rglob("*")):
        if path.is_symlink():
            found[str(path)] = ("link", os.readlink(path))
        elif path.is_file():
            found[str(path)] = ("file", path.read_bytes())
        else:
            found[str(path)] = ("other", None)
    return found


def _evaluate(state):
    return run_cli("evaluate", "--state", state, "--data", state.parent / "test.safetensors")


def _one_line_error(code, err, *words):
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("renate-events: error: "), err
    for word in words:
        assert word in err, err


# -- the lock file ---------------------------------------------------------------------------------


def _put_at(path, kind, outside):
    if os.path.lexists(path):
        os.unlink(path)  # the lock file the first update made
    if kind == "dangling link":  # followed, it would create a file outside the folders
        os.symlink(outside / "created", path)
    elif kind == "link to a file":
        (outside / "theirs").write_bytes(b"someone's file")
        os.symlink(outside / "theirs", path)
    elif kind == "folder":
        os.mkdir(path)
        (pathlib.Path(path) / "inside").write_bytes(b"kept")
    else:
        os.mkfifo(path)


_READS_AND_WRITES = {
    "read_manifest": lambda state: read_manifest(state, timeout=0.5),
    "state_token": lambda state: state_token(state, timeout=0.5),
    "load": lambda state: _updater(input_state_folder=state).learner_instance,
    "update": lambda state: _updater(
        input_state_folder=state, output_state_folder=state, in_place=True
    ).update(_data(2)),
    "new output": lambda state: _updater(output_state_folder=state.parent / "t").update(_data(2)),
}


@pytest.mark.hostile
@pytest.mark.parametrize("call", list(_READS_AND_WRITES))
@pytest.mark.parametrize("kind", ["dangling link", "link to a file", "folder", "fifo"])
def test_anything_but_a_plain_file_at_the_lock_path_is_one_clear_error(state, kind, call):
    outside = state.parent / "outside"
    outside.mkdir()
    target = state if call != "new output" else state.parent / "t"
    _put_at(lock_path(target), kind, outside)
    before = _snapshot(state.parent)
    with pytest.raises(StateFolderError, match="cannot be locked: the lock file") as raised:
        _READS_AND_WRITES[call](state)
    message = str(raised.value)
    assert lock_path(target) in message and "remove it" in message
    assert _snapshot(state.parent) == before  # nothing created outside, nothing changed


@pytest.mark.hostile
@pytest.mark.parametrize("kind", ["dangling link", "folder"])
def test_the_command_line_refuses_a_bad_lock_path_in_one_line(state, kind):
    outside = state.parent / "outside"
    outside.mkdir()
    _put_at(lock_path(state), kind, outside)
    before = _snapshot(state.parent)
    _one_line_error(*_evaluate(state)[::2], lock_path(state), "remove it")
    assert _snapshot(state.parent) == before


# -- the manifest as a link --------------------------------------------------------------------


@pytest.mark.hostile
@pytest.mark.parametrize("kind", ["link", "dangling link", "folder"])
def test_a_manifest_that_is_a_link_or_a_folder_is_refused_like_the_other_files(state, kind):
    manifest = state / "manifest.json"
    copy = state.parent / "elsewhere.json"
    os.rename(manifest, copy)
    if kind == "link":  # the same bytes: every checksum in it still holds
        os.symlink(copy, manifest)
    elif kind == "dangling link":
        os.symlink(state.parent / "absent.json", manifest)
    else:
        manifest.mkdir()
    before = _snapshot(state.parent)
    what = "a symbolic link" if "link" in kind else "not a plain file"
    for call in ("read_manifest", "state_token", "load", "update"):
        with pytest.raises(StateFolderError, match=f"manifest.json is {what}; the files of a"):
            _READS_AND_WRITES[call](state)
    _one_line_error(*_evaluate(state)[::2], str(manifest), what)
    assert _snapshot(state.parent) == before


# -- the leftovers of a killed writer ------------------------------------------------------------


def _litter(state):
    (state.parent / STAGING).mkdir()
    (state.parent / STAGING / "learner.safetensors").write_bytes(b"half written")
    (state.parent / OLD).mkdir()
    (state.parent / ".s.backup").mkdir()  # the user's own
    (state.parent / ".s.staging.mine").mkdir()  # not a name this library makes


def _evaluated(state):
    code, _, err = _evaluate(state)
    assert code == 0, err


_READS = {
    "read_manifest": lambda state: read_manifest(state),
    "load": lambda state: _updater(input_state_folder=state).learner_instance,
    "evaluate": _evaluated,
}


@pytest.mark.parametrize("call", list(_READS))
@pytest.mark.parametrize("lock_file", [True, False])
def test_a_read_removes_the_leftovers_of_a_dead_writer_and_nothing_else(state, call, lock_file):
    if not lock_file:  # a copied folder
        os.unlink(lock_path(state))
    _litter(state)
    before = _snapshot(state)
    _READS[call](state)
    names = sorted(p.name for p in state.parent.iterdir())
    assert names == [".s.backup", ".s.lock", ".s.staging.mine", "s", "test.safetensors"]
    assert _snapshot(state) == before


def test_a_read_leaves_a_live_writers_work_alone(state):
    (state.parent / STAGING).mkdir()
    with FileLock(lock_path(state)):  # a live writer, staging
        with pytest.raises(StateFolderBusyError):
            read_manifest(state, timeout=0.2)
        assert (state.parent / STAGING).is_dir()
    with FileLock(lock_path(state), shared=True):  # another reader: the leftover waits
        assert read_manifest(state, timeout=0.2)["task_ids"] == ["first"]
        assert (state.parent / STAGING).is_dir()
    assert read_manifest(state)["task_ids"] == ["first"]
    assert not (state.parent / STAGING).exists()


def test_a_read_moves_back_the_old_folder_of_an_interrupted_swap(state):
    os.unlink(lock_path(state))
    os.rename(state, state.parent / OLD)  # killed between the swap's two renames
    (state.parent / STAGING).mkdir()
    updater = _updater(input_state_folder=state)
    updater.learner_instance  # noqa: B018 - reads the folder
    assert updater.history[0]["task_id"] == "first"
    assert sorted(p.name for p in state.parent.iterdir()) == [".s.lock", "s", "test.safetensors"]


@pytest.mark.hostile
@pytest.mark.all_or_nothing
def test_a_read_that_cannot_move_back_the_old_folder_says_why_and_what_to_do(state, monkeypatch):
    os.rename(state, state.parent / OLD)
    before = _snapshot(state.parent)

    def refused(source, target):  # as on read-only storage
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), source)

    monkeypatch.setattr(recovery.os, "rename", refused)
    for call in ("read_manifest", "load"):
        with pytest.raises(StateFolderError, match="is missing: an update killed") as raised:
            _READS_AND_WRITES[call](state)
        message = str(raised.value)
        assert "Permission denied" in message
        assert f"mv {state.parent / OLD} {state}" in message
    assert _snapshot(state.parent) == before
