"""Mapped buffers in state folders (ModelUpdater and the CLI's --buffer-storage mapped): the same
model and buffer as in memory, input folders left byte for byte, bad input refused early."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import resource
import signal
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from renate_events.cli import main
from renate_events.memory.mapped import MappedReservoirBuffer
from renate_events.state_folder import StateFolderError, read_manifest
from renate_events.updater import ModelUpdater, UpdateInputError
from tests.helpers import one_line_cli_error, run_in_fresh_process, small_mlp
from trainer import CheckpointError, read_checkpoint
from trainer.exceptions import ListenerError


def _task(seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g))


def _updater(storage, learner="der", **kwargs):
    torch.manual_seed(0)
    return ModelUpdater(
        torch.nn.Linear(4, 3),
        learner=learner,
        buffer="greedy-class-balancing" if learner == "gdumb" else "reservoir",
        learner_kwargs={"memory_size": 16, "memory_batch_size": 4, "batch_size": 8, "seed": 3},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        buffer_storage=storage,
        **kwargs,
    )


def _chain(tmp_path, storage, learner="der"):
    """Two updates, the second from the first's folder in a new updater."""
    first, second = tmp_path / f"{storage}-1", tmp_path / f"{storage}-2"
    _updater(storage, learner, output_state_folder=first).update(_task(0), task_id="a")
    updater = _updater(storage, learner, input_state_folder=first, output_state_folder=second)
    updater.update(_task(1), task_id="b")
    return first, second, updater


def _files(root):
    root = pathlib.Path(root)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _buffer_rows(updater):
    """Every stored row (inputs, targets, metadata) of the updater's buffer, and its count."""
    buffer = updater.learner_instance.buffer
    return [t[: len(buffer)].clone() for t in buffer._storage()], buffer.num_seen


def _same_state(a, b):
    """The same checkpoint contents, model and buffer files (the checkpoint's bytes may be laid
    out otherwise; ``model.json`` and the manifest record the folders' history and times)."""
    ours, theirs = _files(a), _files(b)
    kept = [n for n in ours if n.startswith("buffer.") or n == "model.safetensors"]
    assert sorted(kept) == sorted(n for n in theirs if n.startswith("buffer.") or n in kept)
    for name in kept:
        assert ours[name] == theirs[name], name
    for name, tensor in load_file(a / "learner.safetensors").items():
        assert torch.equal(tensor, load_file(b / "learner.safetensors")[name]), name
    with (
        safe_open(a / "learner.safetensors", "pt") as x,
        safe_open(b / "learner.safetensors", "pt") as y,
    ):
        assert x.metadata() == y.metadata()


@pytest.mark.parametrize("learner", ["der", "gdumb"])
def test_mapped_storage_gives_the_in_memory_model_and_buffer_bit_for_bit(tmp_path, learner):
    _, memory_folder, memory = _chain(tmp_path, "memory", learner)
    _, mapped_folder, mapped = _chain(tmp_path, "mapped", learner)
    for name, tensor in memory.model.state_dict().items():
        assert torch.equal(tensor, mapped.model.state_dict()[name]), name
    rows, seen = _buffer_rows(memory)
    mapped_rows, mapped_seen = _buffer_rows(mapped)
    assert seen == mapped_seen and all(torch.equal(a, b) for a, b in zip(rows, mapped_rows))
    manifest = read_manifest(mapped_folder)
    assert manifest["buffer_storage"] == "mapped" and "buffer_storage" not in read_manifest(
        memory_folder
    )
    buffer_files = sorted(n for n in manifest["files"] if n.startswith("buffer."))
    assert buffer_files == sorted(p.name for p in mapped_folder.glob("buffer.*.bin"))
    assert len(buffer_files) == (3 if learner == "der" else 2)  # inputs, targets, DER's logits
    # the checkpoint holds no buffer rows: it is smaller than the in-memory one
    assert (mapped_folder / "learner.safetensors").stat().st_size < (
        memory_folder / "learner.safetensors"
    ).stat().st_size
    # no working file is left anywhere: they never had a name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["memory-1", "memory-2", "mapped-1", "mapped-2", ".memory-1.lock", ".memory-2.lock",
         ".mapped-1.lock", ".mapped-2.lock"]
    )  # fmt: skip


def test_the_input_folder_stays_byte_identical_after_an_update_and_a_failed_one(tmp_path):
    first, second, _ = _chain(tmp_path, "mapped")
    before = _files(first)
    assert _files(first) == before  # the update from it (in _chain) changed nothing

    class Fails:
        def on_train_batch_end(self, model):
            raise RuntimeError("boom")

    failing = _updater(
        "mapped", input_state_folder=second, output_state_folder=second, in_place=True,
        listeners=[Fails()],
    )  # fmt: skip
    middle = _files(second)
    with pytest.raises(ListenerError, match="boom"):
        failing.update(_task(2))
    assert _files(second) == middle and _files(first) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".mapped-2.")) == [
        ".mapped-2.lock"
    ]
    # and the folder still continues exactly: in place now, as a fresh folder before
    _updater("mapped", input_state_folder=second, output_state_folder=tmp_path / "again").update(
        _task(2)
    )
    _updater("mapped", input_state_folder=second, output_state_folder=second, in_place=True).update(
        _task(2)
    )
    assert _files(second) != middle
    _same_state(second, tmp_path / "again")


def _killed_update(folder, output):
    """An in-place update that kills its own process at its second training step."""

    class Kill:
        steps = 0

        def on_train_batch_end(self, model):
            Kill.steps += 1
            if Kill.steps == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    _updater("mapped", input_state_folder=folder, output_state_folder=output, in_place=True,
             listeners=[Kill()]).update(_task(2))  # fmt: skip


@pytest.mark.slow  # a process of its own
def test_a_killed_update_leaves_the_input_intact_and_the_rerun_exact(tmp_path):
    _, second, _ = _chain(tmp_path, "mapped")
    before = _files(second)
    assert run_in_fresh_process(_killed_update, str(second), str(second)) == -9
    assert _files(second) == before
    _updater("mapped", input_state_folder=second, output_state_folder=tmp_path / "c").update(
        _task(2)
    )
    reference = tmp_path / "reference"
    _updater("mapped", input_state_folder=second, output_state_folder=reference).update(_task(2))
    _same_state(tmp_path / "c", reference)


def test_the_storage_is_recorded_and_a_different_one_refused(tmp_path):
    first, _, _ = _chain(tmp_path, "mapped")
    with pytest.raises(StateFolderError, match="buffer_storage: the folder has 'mapped'"):
        _updater("memory", input_state_folder=first).learner_instance  # noqa: B018
    memory_first, _, _ = _chain(tmp_path, "memory")
    with pytest.raises(StateFolderError, match="buffer_storage: the folder has 'memory'"):
        _updater("mapped", input_state_folder=memory_first).learner_instance  # noqa: B018


def _rewrite_manifest(folder, change):
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.hostile
@pytest.mark.parametrize("damage", ["truncated", "replaced", "longer", "missing", "unlisted"])
def test_damaged_buffer_files_are_refused_naming_the_file(tmp_path, damage):
    first, _, _ = _chain(tmp_path, "mapped")
    target = sorted(first.glob("buffer.*.bin"))[0]
    data = target.read_bytes()
    if damage == "truncated":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "replaced":
        target.write_bytes(bytes(len(data)))
    elif damage == "longer":
        target.write_bytes(data + b"\0" * 8)
    elif damage == "missing":
        target.unlink()
    else:
        _rewrite_manifest(first, lambda m: m["files"].pop(target.name))
    before = _files(first)
    updater = _updater("mapped", input_state_folder=first, output_state_folder=tmp_path / "out")
    with pytest.raises(StateFolderError, match=target.name if damage != "unlisted" else "files"):
        updater.learner_instance  # noqa: B018
    assert _files(first) == before and not (tmp_path / "out").exists()


def test_a_manifest_listing_buffer_files_without_mapped_storage_is_refused(tmp_path):
    first, _, _ = _chain(tmp_path, "mapped")
    _rewrite_manifest(first, lambda m: m.pop("buffer_storage"))
    with pytest.raises(StateFolderError, match="'files' must list exactly"):
        read_manifest(first)
    _rewrite_manifest(first, lambda m: m.update(buffer_storage="disk"))
    with pytest.raises(StateFolderError, match="buffer_storage"):
        read_manifest(first)


@pytest.mark.hostile
def test_a_checkpoint_whose_buffer_file_record_lies_about_the_shape_is_refused(tmp_path):
    """The manifest's checksums can be rewritten by whoever edits the folder; the sizes against
    the checkpoint's shapes are checked too, before any slot changes."""
    first, _, _ = _chain(tmp_path, "mapped")
    target = sorted(first.glob("buffer.*.bin"))[0]
    target.write_bytes(target.read_bytes()[:-1])
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    _rewrite_manifest(first, lambda m: m["files"].update({target.name: digest}))
    updater = _updater("mapped", input_state_folder=first)
    with pytest.raises(StateFolderError, match=f"{target.name}.*must hold 256 bytes, got 255"):
        updater.learner_instance  # noqa: B018


def test_samples_of_another_shape_are_refused_before_training(tmp_path):
    first, _, _ = _chain(tmp_path, "mapped")
    before = _files(first)
    updater = _updater("mapped", input_state_folder=first, output_state_folder=tmp_path / "o")
    parameters = {k: v.clone() for k, v in updater.learner_instance.model.state_dict().items()}
    seen = updater.learner_instance.buffer.num_seen
    bad = TensorDataset(torch.randn(8, 5), torch.randint(0, 3, (8,)))
    with pytest.raises(ValueError, match="samples"):
        updater.update(bad)
    assert updater.learner_instance.buffer.num_seen == seen
    assert all(torch.equal(parameters[k], v) for k, v in updater.model.state_dict().items())
    assert _files(first) == before and not (tmp_path / "o").exists()
    buffer = MappedReservoirBuffer(4, folder=tmp_path)
    buffer.update(torch.zeros(2, 4), torch.arange(2))
    with pytest.raises(ValueError, match="per-sample shape"):
        buffer.update(torch.zeros(2, 5), torch.arange(2))
    assert buffer.num_seen == 2


def test_a_first_update_on_a_disk_without_room_for_the_buffer_is_refused_before_training(
    tmp_path, monkeypatch
):
    updater = _updater("mapped", output_state_folder=tmp_path / "out")
    before = {k: v.clone() for k, v in updater.model.state_dict().items()}
    real = os.statvfs(tmp_path)

    class Almost:  # room for 15 of the 16 samples of 4 float32 and an int64 (24 bytes each)
        f_frsize, f_bavail = 1, 15 * 24

    monkeypatch.setattr(os, "statvfs", lambda path: Almost if str(tmp_path) in str(path) else real)
    with pytest.raises(UpdateInputError, match=r"at least 384 bytes .*has 360 bytes free"):
        updater.update(_task(0))
    assert all(torch.equal(before[k], v) for k, v in updater.model.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    updater.update(_task(0))  # room again: the same updater goes on
    assert read_manifest(tmp_path / "out")["updates"] == 1


@pytest.mark.all_or_nothing
def test_a_read_only_buffer_folder_or_file_system_is_refused_before_anything_changes(
    tmp_path, monkeypatch
):
    """As root (where chmod does not stop writes), the refusals are injected."""
    folder = tmp_path / "buffers"
    folder.mkdir()
    real_access, real_open = os.access, os.open
    monkeypatch.setattr(os, "access", lambda p, m: str(p) != str(folder) and real_access(p, m))
    with pytest.raises(ValueError, match=r"buffer_folder: .*must be a writable folder"):
        _updater("mapped", buffer_folder=folder).learner_instance  # noqa: B018
    monkeypatch.undo()
    first, _, _ = _chain(tmp_path, "mapped")
    before = _files(first)

    def read_only(path, flags, *args):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    updater = _updater("mapped", input_state_folder=first, output_state_folder=tmp_path / "o")
    with pytest.raises(StateFolderError, match="the file system is read-only"):
        updater.learner_instance  # noqa: B018
    assert _files(first) == before and not (tmp_path / "o").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_buffer_folder_is_refused_before_training(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(ValueError, match=r"buffer_folder.*writable"):
            _updater("mapped", buffer_folder=folder).learner_instance  # noqa: B018
    finally:
        folder.chmod(0o755)


@pytest.mark.all_or_nothing
def test_a_full_disk_while_loading_or_writing_changes_nothing(tmp_path, monkeypatch):
    first, _, _ = _chain(tmp_path, "mapped")
    before = _files(first)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:  # the work files of the loaded buffer
        patch.setattr(os, "posix_fallocate", full)
        updater = _updater("mapped", input_state_folder=first, output_state_folder=tmp_path / "o")
        with pytest.raises(StateFolderError, match=r"mapped-1: .*the disk is full"):
            updater.learner_instance  # noqa: B018
    updater = _updater("mapped", input_state_folder=first, output_state_folder=tmp_path / "o")
    updater.update(_task(2), write=False)
    with monkeypatch.context() as patch:  # the snapshot files of the output folder
        patch.setattr(os, "copy_file_range", full)
        with pytest.raises(CheckpointError, match=r"could not write the state folder .*/o: .*full"):
            updater.write_output()
    assert _files(first) == before and not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir() if ".o." in p.name] == [".o.lock"]
    updater.write_output()  # room again: the same update is written
    assert read_manifest(tmp_path / "o")["updates"] == 2


def _write_with_a_file_size_limit(folder, output, limit):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    try:
        _updater("mapped", input_state_folder=folder, output_state_folder=output).update(_task(2))
    except StateFolderError as exc:  # the work files of the loaded buffer exceed the limit
        if "cannot write the 256-byte buffer file" in str(exc) and "file-size limit" in str(exc):
            os._exit(3)
        raise


@pytest.mark.all_or_nothing
@pytest.mark.slow  # a process of its own
def test_a_file_size_limit_in_a_real_process_leaves_no_state_and_no_litter(tmp_path):
    first, _, _ = _chain(tmp_path, "mapped")
    before = _files(first)
    output = tmp_path / "limited"
    largest = max(p.stat().st_size for p in first.glob("buffer.*.bin"))
    assert run_in_fresh_process(_write_with_a_file_size_limit, str(first), str(output),
                                largest // 2) == 3  # fmt: skip
    assert _files(first) == before and not output.exists()
    assert [p.name for p in tmp_path.iterdir() if "limited" in p.name] == []


CONFIG = """
import torch


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def data_fn(chunk_id, seed):
    g = torch.Generator().manual_seed(100 * chunk_id + seed)
    return torch.utils.data.TensorDataset(torch.randn(24, 6, generator=g), torch.arange(24) % 3)
"""


def test_cli_update_with_mapped_storage_matches_memory(tmp_path, capsys):
    config = tmp_path / "config.py"
    config.write_text(CONFIG)
    common = [
        "--config-file",
        str(config),
        "--epochs",
        "1",
        "--memory-size",
        "10",
        "--batch-size",
        "8",
        "--memory-batch-size",
        "4",
        "--device",
        "cpu",
        "--no-progress",
    ]
    for storage in ("memory", "mapped"):
        first, second = tmp_path / f"{storage}-0", tmp_path / f"{storage}-1"
        assert (
            main(["update", *common, "--output-state", str(first), "--buffer-storage", storage])
            == 0
        )
        before = _files(first)
        assert (
            main(
                [
                    "update",
                    *common,
                    "--input-state",
                    str(first),  # storage: the input's
                    "--output-state",
                    str(second),
                ]
            )
            == 0
        )
        assert _files(first) == before
    assert read_manifest(tmp_path / "mapped-1")["buffer_storage"] == "mapped"
    assert (
        _files(tmp_path / "mapped-1")["model.safetensors"]
        == _files(tmp_path / "memory-1")["model.safetensors"]
    )
    saved = read_checkpoint(tmp_path / "memory-1" / "learner.safetensors")
    mapped = read_checkpoint(tmp_path / "mapped-1" / "learner.safetensors")
    buffer = saved["listeners"]["learner"]["buffer"]
    tensors = [*buffer["inputs"], buffer["targets"], *buffer["metadata"].values()]
    records = mapped["listeners"]["learner"]["buffer"]["mapped"]["files"]
    assert len(records) == len(tensors) == 3  # inputs, targets, DER's logits
    for tensor, record in zip(tensors, records):
        raw = bytearray((tmp_path / "mapped-1" / record["file"]).read_bytes())
        assert torch.equal(torch.frombuffer(raw, dtype=tensor.dtype).view(tensor.shape), tensor)
    capsys.readouterr()
    code = main(
        [
            "update",
            *common,
            "--input-state",
            str(tmp_path / "mapped-1"),
            "--output-state",
            str(tmp_path / "x"),
            "--buffer-storage",
            "memory",
        ]
    )
    assert code == 2 and not (tmp_path / "x").exists()
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--buffer-storage mapped" in err


def _mapped_updater(folder):
    torch.manual_seed(0)
    return ModelUpdater(
        torch.nn.Linear(4, 3),
        learner="er",
        learner_kwargs={"memory_size": 16, "memory_batch_size": 4, "batch_size": 8},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        buffer_storage="mapped",
        output_state_folder=folder,
    )


@pytest.mark.all_or_nothing
def test_a_file_size_limit_below_the_mapped_buffer_is_refused_before_training(tmp_path):
    updater = _mapped_updater(tmp_path / "out")
    before = {k: v.clone() for k, v in updater.model.state_dict().items()}
    data = TensorDataset(torch.randn(16, 4), torch.arange(16) % 3)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200, hard))  # the inputs file: 16 x 16 bytes
    try:
        with pytest.raises(UpdateInputError, match="file-size limit is 200 bytes"):
            updater.update(data)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert all(torch.equal(before[k], v) for k, v in updater.model.state_dict().items())
    assert list(tmp_path.iterdir()) == []


LINEAR_CONFIG = """
import torch


def model_fn():
    return torch.nn.Linear(4, 3)


def data_fn(chunk_id, seed):
    return torch.utils.data.TensorDataset(torch.randn(16, 4), torch.arange(16) % 3)
"""


def test_a_mapped_buffer_file_failing_in_training_is_one_line_on_the_cli(
    tmp_path, capsys, monkeypatch
):
    config = tmp_path / "config.py"
    config.write_text(LINEAR_CONFIG)

    def too_large(*args):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(os, "posix_fallocate", too_large)  # the first buffer file, in training
    argv = ["update", "--config-file", str(config), "--output-state", str(tmp_path / "out")]
    argv += ["--buffer-storage", "mapped", "--epochs", "1", "--memory-size", "8"]
    argv += ["--batch-size", "8", "--memory-batch-size", "4", "--device", "cpu", "--no-progress"]
    one_line_cli_error(capsys, argv, "file-size limit")
    assert not (tmp_path / "out").exists()


def test_a_mapped_buffer_for_a_new_nested_output_works_beside_it_not_in_the_temp_folder(tmp_path):
    """The output's parent does not exist yet: its nearest existing ancestor, on its disk."""
    updater = _mapped_updater(tmp_path / "new" / "nested" / "out")
    assert str(updater.learner_instance.buffer.folder) == str(tmp_path)


def test_mapped_storage_without_a_mapped_herding_buffer_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"buffer_storage='mapped' has no 'herding' buffer"):
        ModelUpdater(
            torch.nn.Linear(4, 3),
            learner="icarl",
            buffer="herding",
            learner_kwargs={"memory_size": 6},
            max_epochs=1,
            trainer_kwargs={"device": "cpu"},
            buffer_storage="mapped",
            output_state_folder=tmp_path / "out",
        )
    assert list(tmp_path.iterdir()) == []


def test_a_mapped_herding_buffer_is_refused_in_one_line(tmp_path: Any, capsys: Any) -> None:
    # There is no memory-mapped HerdingBuffer: ModelUpdater raised a KeyError when it made the
    # buffer, and the command line printed a traceback (exit 1).
    with pytest.raises(ValueError, match=r"buffer_storage='mapped'.*'herding'"):
        ModelUpdater(
            model=small_mlp(),
            learner="icarl",
            buffer="herding",
            buffer_storage="mapped",
            learner_kwargs={"feature_modules": ["1"], "memory_size": 8},
        )
    config = tmp_path / "config.py"
    config.write_text(
        "import torch\n"
        "def model_fn():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),\n"
        "                               torch.nn.Linear(16, 4))\n"
        "def data_fn(chunk_id, seed):\n"
        "    return torch.randn(16, 8), torch.arange(16) % 4\n"
    )
    status = main(
        ["update", "--config-file", str(config), "--output-state", str(tmp_path / "state"),
         "--learner", "icarl", "--feature-modules", '["1"]', "--memory-size", "8",
         "--buffer-storage", "mapped", "--epochs", "1", "--no-progress"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "'herding'" in err, err
    assert not (tmp_path / "state").exists()
