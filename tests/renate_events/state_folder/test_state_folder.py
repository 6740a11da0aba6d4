"""State folders: nothing that is not one is replaced, locks, lost updates, the manifest schema,
and failed writes that leave the old state and no litter."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.state_folder import (
    StateFolderBusyError,
    StateFolderConflictError,
    StateFolderError,
    StateFolderOverwriteError,
    read_manifest,
    state_token,
)
from renate_events.state_folder import manifest as updater_module
from renate_events.updater import ModelUpdater
from tests.helpers import ROOT
from trainer import CheckpointError
from trainer.files import FileLock, lock_path


def _updater(**kwargs):
    return ModelUpdater(
        kwargs.pop("model", None) or torch.nn.Linear(4, 2),
        learner="er",
        learner_kwargs={"memory_size": 10, "memory_batch_size": 4, "batch_size": 8},
        max_epochs=kwargs.pop("max_epochs", 1),
        trainer_kwargs={"device": "cpu"},
        **kwargs,
    )


def _task(seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g))


def _snapshot(root):
    """Every path under ``root`` with its bytes (folders as None): to prove nothing changed."""
    root = pathlib.Path(root)
    return {
        str(path.relative_to(root)): None if path.is_dir() else path.read_bytes()
        for path in sorted(root.rglob("*"))
    }


def _state(tmp_path, name="s", task_id="first"):
    _updater(output_state_folder=tmp_path / name).update(_task(), task_id=task_id)
    return tmp_path / name


def _parameters(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _unchanged(model, before):
    return all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


# -- nothing that is not a state folder is replaced -------------------------------------------


def test_a_folder_that_is_not_a_state_folder_is_refused_before_training(tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('precious')\n")
    (project / "README").write_text("keep me\n")
    before = _snapshot(tmp_path)
    updater = _updater(output_state_folder=project)
    weights = _parameters(updater.model)
    with pytest.raises(StateFolderError, match=r"is not a state folder .* refusing to replace it"):
        updater.update(_task())
    assert _snapshot(tmp_path) == before  # not even a lock file beside it
    assert _unchanged(updater.model, weights)  # refused before training


@pytest.mark.parametrize("kind", ["file", "link", "foreign manifest", "extra file"])
def test_files_links_and_folders_with_foreign_content_are_refused(tmp_path, kind):
    target = tmp_path / "out"
    if kind == "file":
        target.write_text("data\n")
    elif kind == "link":
        (tmp_path / "elsewhere").mkdir()
        target.symlink_to(tmp_path / "elsewhere")
    elif kind == "foreign manifest":
        target.mkdir()
        (target / "manifest.json").write_text('{"name": "a web app"}')
    else:
        _state(tmp_path, "out")
        (target / "notes.txt").write_text("mine\n")
    before = _snapshot(tmp_path)
    with pytest.raises(StateFolderError, match=r"refusing to replace it|is not a folder"):
        _updater(output_state_folder=target).update(_task())
    assert _snapshot(tmp_path) == before


def test_an_empty_folder_or_a_state_folder_is_replaced(tmp_path):
    (tmp_path / "empty").mkdir()
    _updater(output_state_folder=tmp_path / "empty").update(_task(), task_id="a")
    assert read_manifest(tmp_path / "empty")["task_ids"] == ["a"]
    # another lineage's state (a first update over it): replaced only when asked (issue 25)
    with pytest.raises(StateFolderOverwriteError, match="pass overwrite=True"):
        _updater(output_state_folder=tmp_path / "empty").update(_task(), task_id="b")
    assert read_manifest(tmp_path / "empty")["task_ids"] == ["a"]
    _updater(output_state_folder=tmp_path / "empty", overwrite=True).update(_task(), task_id="b")
    assert read_manifest(tmp_path / "empty")["task_ids"] == ["b"]


def test_the_input_is_replaced_only_in_place(tmp_path):
    state = _state(tmp_path)
    before = _snapshot(tmp_path)
    updater = _updater(input_state_folder=state, output_state_folder=state)
    with pytest.raises(StateFolderError, match="is the input_state_folder; pass in_place=True"):
        updater.update(_task())
    with pytest.raises(StateFolderError, match="is inside the input_state_folder"):
        _updater(input_state_folder=state, output_state_folder=state / "next").update(_task())
    assert _snapshot(tmp_path) == before
    _updater(input_state_folder=state, output_state_folder=state, in_place=True).update(
        _task(1), task_id="second"
    )
    assert read_manifest(state)["task_ids"] == ["first", "second"]


# -- locks --------------------------------------------------------------------------------------


def test_a_second_writer_waits_for_the_lock_then_is_refused_clearly(tmp_path):
    state = _state(tmp_path)
    before = _snapshot(tmp_path)
    updater = _updater(input_state_folder=state, output_state_folder=state, in_place=True)
    updater.lock_timeout = 0.2
    with (
        FileLock(lock_path(state)),  # another writer in the middle of its swap
        pytest.raises(StateFolderBusyError, match="is locked by another update"),
    ):
        updater.update(_task(1))
    assert _snapshot(tmp_path) == before


def test_a_reader_never_repairs_a_swap_that_a_live_writer_holds(tmp_path):
    state = _state(tmp_path)
    retired = tmp_path / ".s.old.0123456789abcdef"
    with FileLock(lock_path(state)):  # a live writer, between its two renames
        state.rename(retired)
        with pytest.raises(StateFolderBusyError):
            read_manifest(state, timeout=0.2)
        assert retired.is_dir() and not state.exists()  # the reader left the swap alone
        retired.rename(state)  # the writer finishes
    assert read_manifest(state)["task_ids"] == ["first"]


def test_readers_share_the_lock_and_create_no_lock_file(tmp_path):
    state = _state(tmp_path)
    with FileLock(lock_path(state), shared=True):  # another reader
        assert read_manifest(state, timeout=0.2)["updates"] == 1
    os.unlink(lock_path(state))  # a folder copied without its lock file
    before = _snapshot(tmp_path)
    assert read_manifest(state)["updates"] == 1
    assert state_token(tmp_path / "absent") is None
    assert _snapshot(tmp_path) == before


def test_leftovers_of_dead_writers_are_removed_and_nothing_else(tmp_path):
    state = _state(tmp_path)
    (tmp_path / ".s.staging.0123456789abcdef").mkdir()  # a writer killed while staging
    (tmp_path / ".s.old.fedcba9876543210").mkdir()  # a writer killed before removing the old
    (tmp_path / ".s.backup").mkdir()  # the user's own
    (tmp_path / ".s.staging.mine").mkdir()  # not a name this library makes
    _updater(input_state_folder=state, output_state_folder=state, in_place=True).update(_task())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".s.backup",
        ".s.lock",
        ".s.staging.mine",
        "s",
    ]


# -- lost updates -------------------------------------------------------------------------------


def test_an_update_of_a_state_that_changed_meanwhile_is_refused(tmp_path):
    state = _state(tmp_path)
    slow = _updater(input_state_folder=state, output_state_folder=state, in_place=True)
    slow.learner_instance  # noqa: B018 - reads the folder now
    _updater(input_state_folder=state, output_state_folder=state, in_place=True).update(
        _task(1), task_id="fast"
    )
    before = _snapshot(tmp_path)
    with pytest.raises(StateFolderConflictError, match="changed by another update"):
        slow.update(_task(2), task_id="slow")
    assert _snapshot(tmp_path) == before  # the other update is kept
    assert read_manifest(state)["task_ids"] == ["first", "fast"]


def test_an_output_written_by_another_update_meanwhile_is_not_overwritten(tmp_path):
    state = _state(tmp_path)
    first = _updater(input_state_folder=state, output_state_folder=tmp_path / "next")
    second = _updater(input_state_folder=state, output_state_folder=tmp_path / "next")

    class FirstWritesMeanwhile:  # the first update is written while the second trains
        def on_train_end(self):
            first.update(_task(1), task_id="first-writer")

    second.learner_instance.trainer.subscribe(FirstWritesMeanwhile())
    with pytest.raises(StateFolderConflictError):
        second.update(_task(2), task_id="second-writer")
    assert read_manifest(tmp_path / "next")["task_ids"] == ["first", "first-writer"]


# -- the manifest schema ------------------------------------------------------------------------


def _edit(state, edit):
    path = state / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _passwd_hash():
    return hashlib.sha256(pathlib.Path("/etc/passwd").read_bytes()).hexdigest()


def _set(key, value):
    return lambda manifest: manifest.__setitem__(key, value)


def _files(files):
    return lambda manifest: manifest.__setitem__("files", files(manifest))


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (_files(lambda m: {"../../../../etc/passwd": _passwd_hash()}), "'files'"),
        (
            _files(lambda m: {**m["files"], "../escape": m["files"]["learner.safetensors"]}),
            "'files'",
        ),
        (
            _files(lambda m: {**m["files"], "learner.safetensors": "abc"}),
            "'files.learner.safetensors'",
        ),
        (_set("format_version", "1"), "format version '1'"),
        (_set("format_version", True), "format version True"),
        (_set("format_version", 1.0), "format version 1.0"),
        (_set("updates", 1.5), "'updates'"),
        (_set("updates", -1), "'updates'"),
        (_set("updates", "1"), "'updates'"),
        (_set("task_ids", "first"), "'task_ids'"),
        (_set("task_ids", ["a", "b"]), "'task_ids'"),
        (_set("task_ids", [{"a": 1}]), "'task_ids'"),
        (_set("learner", "gem"), "'learner'"),
        (_set("buffer", "ring"), "'buffer'"),
        (_set("learner_kwargs", []), "'learner_kwargs'"),
        (_set("learner_kwargs", {"bogus": 1}), "'learner_kwargs' has unknown arguments"),
        (_set("optimizer", {"name": "adam", "lr": "x"}), "'optimizer'"),
        (_set("optimizer", {"name": "lbfgs"}), "'optimizer'"),
        (_set("trainer", {"bogus": 1}), "'trainer' has unknown arguments"),
        (_set("model", {"weight": [[-2, 4], "float32"]}), "'model.weight' shape"),
        (_set("model", {"weight": [[2, 4], "not_a_dtype"]}), "'model.weight' names no torch dtype"),
        (_set("model", {"weight": "big"}), "'model.weight' must be [shape, dtype]"),
        (_set("metadata", "x"), "'metadata'"),
        (_set("extra", 1), "unknown keys ['extra']"),
        (lambda manifest: manifest.pop("task_ids"), "missing keys ['task_ids']"),
    ],
)
def test_manifests_breaking_the_schema_are_refused_naming_file_and_key(tmp_path, edit, key):
    state = _state(tmp_path)
    _edit(state, edit)
    model = torch.nn.Linear(4, 2)
    weights = _parameters(model)
    with pytest.raises(StateFolderError) as info:
        read_manifest(state)
    assert str(state / "manifest.json") in str(info.value) and key in str(info.value)
    with pytest.raises(StateFolderError):
        _updater(model=model, input_state_folder=state).learner_instance  # noqa: B018
    assert _unchanged(model, weights)  # nothing applied


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"a": ' * 200_000 + "1" + "}" * 200_000, "nests deeper than 64 levels"),
        ("[" * 200_000, "nests deeper than 64 levels"),
        ('{"format": "renate_events.state", "updates": NaN}', "NaN is not a JSON number"),
        ('{"format": "a", "format": "b"}', "appears twice"),
        ('{"format": "renate_events.state", "updates": 1' + "0" * 5000 + "}", "not valid JSON"),
    ],
)
def test_hostile_json_is_refused_without_recursion_errors(tmp_path, text, problem):
    state = _state(tmp_path)
    (state / "manifest.json").write_text(text)
    with pytest.raises(StateFolderError, match=problem):
        read_manifest(state)


def test_an_oversized_manifest_and_a_linked_checkpoint_are_refused(tmp_path, monkeypatch):
    state = _state(tmp_path)
    monkeypatch.setattr(updater_module, "_MAX_MANIFEST_BYTES", 100)
    with pytest.raises(StateFolderError, match="is larger than"):
        read_manifest(state)
    monkeypatch.undo()
    checkpoint = state / "learner.safetensors"
    checkpoint.rename(tmp_path / "outside.safetensors")
    checkpoint.symlink_to(tmp_path / "outside.safetensors")  # same bytes, same hash
    with pytest.raises(StateFolderError, match=r"lacks the plain file learner\.safetensors"):
        read_manifest(state)


# -- failed writes ------------------------------------------------------------------------------


def _full_disk(monkeypatch):
    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.all_or_nothing
def test_a_full_disk_leaves_the_old_state_and_no_litter(tmp_path, monkeypatch):
    state = _state(tmp_path)
    updater = _updater(input_state_folder=state, output_state_folder=state, in_place=True)
    updater.learner_instance  # noqa: B018
    before = _snapshot(tmp_path)
    _full_disk(monkeypatch)
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        updater.update(_task(1))
    monkeypatch.undo()
    assert "\n" not in str(info.value) and "is unchanged" in str(info.value)
    assert _snapshot(tmp_path) == before
    assert read_manifest(state)["task_ids"] == ["first"]


def test_a_failed_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    state = _state(tmp_path)
    before = _snapshot(tmp_path)
    rename = os.rename

    def failing_rename(source, target):
        if ".staging." in os.fspath(source):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        rename(source, target)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(CheckpointError, match="Input/output error"):
        _updater(input_state_folder=state, output_state_folder=state, in_place=True).update(
            _task(1)
        )
    monkeypatch.undo()
    assert _snapshot(tmp_path) == before


FILE_SIZE_LIMIT = textwrap.dedent(
    """
    import resource, sys, torch
    from torch.utils.data import TensorDataset
    from renate_events.updater import ModelUpdater
    from trainer import CheckpointError

    state = sys.argv[1]
    updater = ModelUpdater(torch.nn.Linear(64, 8), learner="er",
        learner_kwargs={"memory_size": 200, "memory_batch_size": 4, "batch_size": 8},
        max_epochs=1, trainer_kwargs={"device": "cpu"}, input_state_folder=state,
        output_state_folder=state, in_place=True)
    updater.learner_instance
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        updater.update(TensorDataset(torch.randn(16, 64), torch.randint(0, 8, (16,))))
    except CheckpointError as exc:
        print("refused:", exc)
    """
)


@pytest.mark.all_or_nothing
def test_a_file_size_limit_is_a_checkpoint_error_and_leaves_the_old_state(tmp_path):
    state = tmp_path / "s"
    ModelUpdater(
        torch.nn.Linear(64, 8),
        learner="er",
        learner_kwargs={"memory_size": 200, "memory_batch_size": 4, "batch_size": 8},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        output_state_folder=state,
    ).update(TensorDataset(torch.randn(300, 64), torch.randint(0, 8, (300,))), task_id="kept")
    assert (state / "learner.safetensors").stat().st_size > 20_000  # so the limit bites
    before = _snapshot(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMIT, str(state)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: could not write the state folder")
    assert "File too large" in done.stdout
    assert _snapshot(tmp_path) == before
    assert read_manifest(state)["task_ids"] == ["kept"]
