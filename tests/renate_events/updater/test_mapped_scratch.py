"""Mapped states on read-only or full storage (issue 26.5): evaluated without writing a file,
used as an input with the working files beside the output or in ``--scratch-dir``.

Tests run as root, where chmod does not stop writes: read-only storage is simulated by refusing,
with EROFS, every ``os.open`` that would write under a folder (and ``os.access`` saying so), a
full disk by ENOSPC from ``os.posix_fallocate`` and from opening an unnamed file. Every file
opened for writing is recorded, so the tests say where the working files went.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pathlib

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.cli import main
from renate_events.state_folder import read_manifest
from renate_events.updater import ModelUpdater, UpdateInputError
from tests.helpers import one_line_cli_error

CONFIG = """
import torch


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def data_fn(chunk_id, seed):
    g = torch.Generator().manual_seed(100 * chunk_id + seed)
    return torch.utils.data.TensorDataset(torch.randn(24, 6, generator=g), torch.arange(24) % 3)


def test_data_fn(chunk_id, seed):
    return data_fn(chunk_id + 7, seed)
"""
_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TMPFILE
_COMMON = ["--epochs", "1", "--memory-size", "10", "--batch-size", "8", "--memory-batch-size", "4"]
_COMMON += ["--device", "cpu", "--no-progress"]


def _files(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(pathlib.Path(root).rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def state(tmp_path):
    """A mapped state folder ``ro/in`` (two updates), the config file, and a writable ``rw``."""
    config = tmp_path / "config.py"
    config.write_text(CONFIG)
    (tmp_path / "ro").mkdir()
    (tmp_path / "rw").mkdir()
    first, second = tmp_path / "ro" / "first", tmp_path / "ro" / "in"
    argv = ["update", "--config-file", str(config), *_COMMON, "--buffer-storage", "mapped"]
    assert main([*argv, "--output-state", str(first)]) == 0
    assert main([*argv, "--input-state", str(first), "--output-state", str(second)]) == 0
    return tmp_path, config, second


def _storage(monkeypatch, read_only=(), full=False):
    """Writes under the folders ``read_only`` fail with EROFS; with ``full``, every new file's
    blocks fail with ENOSPC. Returns the list of paths opened for writing (that succeeded)."""
    opened: list[str] = []
    real_open, real_access = os.open, os.access
    roots = [str(folder) for folder in read_only]

    def under(path):
        return any(str(path) == root or str(path).startswith(root + os.sep) for root in roots)

    def guarded_open(path, flags, *args):
        if flags & _WRITES and under(path):
            raise OSError(errno.EROFS, "Read-only file system")
        if full and flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.ENOSPC, "No space left on device")
        fd = real_open(path, flags, *args)
        if flags & _WRITES:
            opened.append(str(path))
        return fd

    def no_room(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    def guarded_access(path, mode, **kwargs):
        return not (mode & os.W_OK and under(path)) and real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "open", guarded_open)
    monkeypatch.setattr(os, "access", guarded_access)
    if full:
        monkeypatch.setattr(os, "posix_fallocate", no_room)
    return opened


@pytest.mark.parametrize("where", ["read-only", "full"])
def test_a_mapped_state_on_read_only_or_full_storage_is_evaluated_writing_nothing(
    state, monkeypatch, capsys, where
):
    tmp_path, config, folder = state
    argv = ["evaluate", "--config-file", str(config), "--state", str(folder)]
    capsys.readouterr()
    assert main(argv) == 0
    expected = capsys.readouterr().out
    before = _files(tmp_path / "ro")
    with monkeypatch.context() as patch:
        roots = [tmp_path / "ro"] if where == "read-only" else []
        opened = _storage(patch, read_only=roots, full=where == "full")
        assert main(argv) == 0, capsys.readouterr().err
        assert [p for p in opened if not p.endswith(".lock")] == []  # no working file anywhere
    assert capsys.readouterr().out == expected
    assert _files(tmp_path / "ro") == before


def test_an_update_from_read_only_storage_works_beside_the_output(state, monkeypatch, capsys):
    tmp_path, config, folder = state
    before = _files(tmp_path / "ro")
    out = tmp_path / "rw" / "out"
    opened = _storage(monkeypatch, read_only=[tmp_path / "ro"])
    argv = ["update", "--config-file", str(config), *_COMMON, "--input-state", str(folder)]
    assert main([*argv, "--output-state", str(out)]) == 0, capsys.readouterr().err
    assert read_manifest(out)["updates"] == 3
    unnamed = [p for p in opened if os.path.isdir(p)]  # O_TMPFILE opens name the folder
    assert unnamed and all(p == str(tmp_path / "rw") for p in unnamed), opened
    monkeypatch.undo()
    assert _files(tmp_path / "ro") == before


def test_scratch_dir_holds_the_working_files_and_a_bad_one_is_one_line(state, monkeypatch, capsys):
    tmp_path, config, folder = state
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    argv = ["update", "--config-file", str(config), *_COMMON, "--input-state", str(folder)]
    argv += ["--output-state", str(tmp_path / "rw" / "out")]
    one_line_cli_error(capsys, [*argv, "--scratch-dir", str(tmp_path / "nowhere")], "--scratch-dir")
    assert not (tmp_path / "rw" / "out").exists()
    with monkeypatch.context() as patch:
        opened = _storage(patch)
        assert main([*argv, "--scratch-dir", str(scratch)]) == 0, capsys.readouterr().err
    unnamed = [p for p in opened if os.path.isdir(p)]
    assert unnamed and all(p == str(scratch) for p in unnamed), opened
    assert list(scratch.iterdir()) == []  # unnamed: nothing is left
    evaluate = ["evaluate", "--config-file", str(config), "--state", str(folder)]
    assert main([*evaluate, "--scratch-dir", str(scratch)]) == 0


def _task(seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(24, 6, generator=g), torch.arange(24) % 3)


def _updater(folder, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return ModelUpdater(
        model,
        learner="der",
        learner_kwargs={"memory_size": 10, "memory_batch_size": 4, "batch_size": 8, "seed": 0},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        buffer_storage="mapped",
        input_state_folder=folder,
        **kwargs,
    )


@pytest.mark.all_or_nothing
def test_a_state_read_without_an_output_refuses_a_full_disk_before_training(state, monkeypatch):
    """Read lazily (no output folder), the state makes its working files before training: a full
    disk refuses the update with nothing changed, and with room again the same updater gives
    what an updater with an output folder gives."""
    tmp_path, _, folder = state
    reference = _updater(folder, output_state_folder=tmp_path / "rw" / "x")
    reference.update(_task(5), write=False)
    updater = _updater(folder)
    assert str(updater.learner_instance.buffer.folder) == str(folder.parent)
    weights = {k: v.clone() for k, v in updater.model.state_dict().items()}
    with monkeypatch.context() as patch:
        _storage(patch, full=True)
        with pytest.raises(UpdateInputError, match="the disk is full"):
            updater.update(_task(5), write=False)
    assert all(torch.equal(weights[k], v) for k, v in updater.model.state_dict().items())
    assert updater.history == reference.history[:-1]
    updater.update(_task(5), write=False)
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(tensor, updater.model.state_dict()[name]), name
    ours, theirs = updater.learner_instance.buffer, reference.learner_instance.buffer
    assert ours.num_seen == theirs.num_seen
    for a, b in zip(ours._storage(), theirs._storage()):
        assert torch.equal(a[: len(ours)], b[: len(theirs)])
