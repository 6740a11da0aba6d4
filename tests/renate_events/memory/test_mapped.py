"""Memory-mapped buffers (renate_events.memory.mapped): same semantics, files, crash safety."""

from __future__ import annotations

import copy
import errno
import hashlib
import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from renate_events.memory import (
    GreedyClassBalancingBuffer,
    InfiniteBuffer,
    ReservoirBuffer,
    SlidingWindowBuffer,
)
from renate_events.memory.mapped import (
    MappedFileError,
    MappedGreedyClassBalancingBuffer,
    MappedInfiniteBuffer,
    MappedReservoirBuffer,
    MappedSlidingWindowBuffer,
)
from renate_events.methods import ExperienceReplayLearner
from renate_events.transforms import ToFloat
from trainer import Trainer, read_checkpoint


def _stream(steps=12, batch=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (batch, 3, 4, 4), dtype=torch.uint8, generator=generator),
            torch.randint(0, 5, (batch,), generator=generator),
            {"logits": torch.randn(batch, 5, generator=generator)},
        )
        for _ in range(steps)
    ]


def _same_sample(a, b):
    (xa, ya), ma = a
    (xb, yb), mb = b
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


@pytest.mark.parametrize(
    ("mapped", "plain"),
    [
        (MappedReservoirBuffer, ReservoirBuffer),
        (MappedSlidingWindowBuffer, SlidingWindowBuffer),
        (MappedGreedyClassBalancingBuffer, GreedyClassBalancingBuffer),
    ],
)
def test_mapped_buffers_keep_and_draw_what_the_in_memory_ones_do(tmp_path, mapped, plain):
    ours, theirs = mapped(30, folder=tmp_path, seed=4), plain(30, seed=4)
    for inputs, targets, metadata in _stream():
        ours.update(inputs, targets, metadata)
        theirs.update(inputs, targets, metadata)
        _same_sample(ours.sample(6), theirs.sample(6))
    assert len(ours) == len(theirs) and ours.num_seen == theirs.num_seen
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"buffer.work.{i}.bin" for i in range(3)]
    assert ours.sample(1)[0][0].dtype == torch.uint8


def test_state_names_files_only_and_resumes_exactly(tmp_path):
    buffer, reference = MappedReservoirBuffer(20, folder=tmp_path), ReservoirBuffer(20)
    for inputs, targets, metadata in _stream():
        buffer.update(inputs, targets, metadata)
        reference.update(inputs, targets, metadata)
    state = buffer.state_dict()
    assert state["inputs"] == [] and state["targets"] is None and state["metadata"] == {}
    assert [f["file"] for f in state["mapped"]["files"]] == [f"buffer.g1.{i}.bin" for i in range(3)]
    assert state["mapped"]["files"][0] == {
        "file": "buffer.g1.0.bin",
        "shape": [20, 3, 4, 4],
        "dtype": "torch.uint8",
    }
    restored = MappedReservoirBuffer(20, folder=tmp_path)
    restored.load_state_dict(state)
    for inputs, targets, metadata in _stream(4, seed=1):
        restored.update(inputs, targets, metadata)
        reference.update(inputs, targets, metadata)
        _same_sample(restored.sample(5), reference.sample(5))


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_killed_update_leaves_the_checkpointed_files_intact(tmp_path):
    buffer = MappedReservoirBuffer(16, folder=tmp_path)
    reference = ReservoirBuffer(16)
    stream = _stream(6)
    for inputs, targets, metadata in stream:
        buffer.update(inputs, targets, metadata)
        reference.update(inputs, targets, metadata)
    state = buffer.state_dict()
    expected = reference.state_dict()
    digests = {p.name: _digest(p) for p in tmp_path.glob("buffer.g1.*.bin")}
    for inputs, targets, metadata in _stream(6, seed=2):  # the update that is then "killed"
        buffer.update(inputs, targets, metadata)
    assert {p.name: _digest(p) for p in tmp_path.glob("buffer.g1.*.bin")} == digests
    del buffer
    restored = MappedReservoirBuffer(16, folder=tmp_path)
    restored.load_state_dict(state)
    got = restored.state_dict()
    assert torch.equal(got["inputs"][0] if got["inputs"] else torch.empty(0), torch.empty(0))
    back = ReservoirBuffer(16)
    back.load_state_dict(expected)
    _same_sample(restored.sample(16), back.sample(16))
    # Two generations kept: g1 (loaded, rewritten as g2 by the state_dict above) and g2.
    assert {p.name.split(".")[1] for p in tmp_path.glob("buffer.g*.bin")} == {"g1", "g2"}
    restored.state_dict()
    assert {p.name.split(".")[1] for p in tmp_path.glob("buffer.g*.bin")} == {"g2", "g3"}


@pytest.mark.all_or_nothing
def test_bad_folders_full_disks_and_shapes_are_refused_before_anything_changes(
    tmp_path, monkeypatch
):
    with pytest.raises(ValueError, match="existing folder"):
        MappedReservoirBuffer(4, folder=tmp_path / "missing")
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match="writable folder"):
        MappedReservoirBuffer(4, folder=tmp_path)
    monkeypatch.undo()

    buffer = MappedReservoirBuffer(10_000, folder=tmp_path)

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    inputs, targets, metadata = _stream(1)[0]
    with pytest.raises(ValueError, match="the disk is full"):
        buffer.update(inputs, targets, metadata)
    assert len(buffer) == 0 and buffer.num_seen == 0 and buffer.capacity == 0
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    buffer.update(inputs, targets, metadata)
    with pytest.raises(ValueError, match="per-sample shape"):
        buffer.update(torch.zeros(8, 3, 5, 5, dtype=torch.uint8), targets, metadata)
    assert buffer.num_seen == 8


@pytest.mark.hostile
def test_tampered_or_foreign_snapshot_files_are_refused(tmp_path):
    buffer = MappedReservoirBuffer(8, folder=tmp_path)
    for inputs, targets, metadata in _stream(2):
        buffer.update(inputs, targets, metadata)
    state = buffer.state_dict()
    other = MappedReservoirBuffer(8, folder=tmp_path, name="other")
    bad = {
        **state,
        "mapped": {**state["mapped"], "files": [dict(f) for f in state["mapped"]["files"]]},
    }
    bad["mapped"]["files"][0]["file"] = "../../etc.g1.0.bin"
    with pytest.raises(ValueError, match="not a snapshot file name"):
        other.load_state_dict(bad)
    with open(tmp_path / "buffer.g1.1.bin", "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ValueError, match="must hold"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="state\\['mapped'\\]: missing"):
        other.load_state_dict(ReservoirBuffer(8).state_dict())
    assert len(other) == 0


def test_learner_checkpoints_a_mapped_buffer_without_its_data(tmp_path):
    folder = tmp_path / "memory"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randint(0, 256, (32, 3, 4, 4), dtype=torch.uint8, generator=generator),
        torch.randint(0, 5, (32,), generator=generator),
    )

    def learner():
        torch.manual_seed(0)
        return ExperienceReplayLearner(
            model=nn.Sequential(nn.Flatten(), nn.Linear(48, 5)),
            memory_size=16,
            memory_batch_size=4,
            batch_size=8,
            buffer=MappedReservoirBuffer(16, folder=folder, seed=2),
            train_transform=ToFloat(),
            buffer_transform=ToFloat(),
            trainer=Trainer(max_epochs=1, device="cpu"),
        )

    first = learner()
    first.fit(data)
    first.save_checkpoint(tmp_path / "state.safetensors")
    saved = read_checkpoint(tmp_path / "state.safetensors")["listeners"]["learner"]["buffer"]
    assert saved["inputs"] == [] and saved["metadata"] == {}  # no images in the checkpoint
    assert saved["mapped"]["files"][0]["shape"] == [16, 3, 4, 4]
    second = learner()
    second.load_checkpoint(tmp_path / "state.safetensors")
    _same_sample(first.buffer.sample(8), second.buffer.sample(8))


def test_mapped_infinite_buffer_grows_its_files_in_place_and_matches_memory(tmp_path, monkeypatch):
    ours = MappedInfiniteBuffer(initial_capacity=8, folder=tmp_path, seed=1)
    theirs = InfiniteBuffer(initial_capacity=8, seed=1)
    for inputs, targets, metadata in _stream(5):
        ours.update(inputs, targets, metadata)
        theirs.update(inputs, targets, metadata)
        assert ours.capacity == theirs.capacity
        _same_sample(ours.sample(6), theirs.sample(6))
    assert ours.capacity == 64 and (tmp_path / "buffer.work.0.bin").stat().st_size == 64 * 48
    seen = ours.num_seen

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    inputs, targets, metadata = _stream(4, seed=3)[3]
    for _ in range(3):  # the fourth batch would need room beyond 64 rows
        ours.update(inputs, targets, metadata)
    rows = [t.clone() for t in ours._storage()]
    with pytest.raises(ValueError, match="the disk is full"):
        ours.update(inputs, targets, metadata)
    assert ours.num_seen == seen + 24 and ours.capacity == 64
    assert all(torch.equal(a, b) for a, b in zip(rows, ours._storage()))
    monkeypatch.undo()
    restored = MappedInfiniteBuffer(folder=tmp_path, name="again")
    restored.load_state_dict(ours.state_dict())
    _same_sample(restored.sample(8), ours.sample(8))


def test_unlinked_buffers_leave_no_files_and_hold_their_rollback_snapshots(tmp_path):
    buffer = MappedReservoirBuffer(20, folder=tmp_path, unlinked=True, seed=2)
    reference = ReservoirBuffer(20, seed=2)
    for inputs, targets, metadata in _stream(4):
        buffer.update(inputs, targets, metadata)
        reference.update(inputs, targets, metadata)
    saved, expected = buffer.state_dict(), reference.state_dict()  # held, not in the folder
    assert list(tmp_path.iterdir()) == []
    for inputs, targets, metadata in _stream(3, seed=5):
        buffer.update(inputs, targets, metadata)
    buffer.load_state_dict(saved)  # a rollback: back to the held snapshot
    reference.load_state_dict(expected)
    _same_sample(buffer.sample(10), reference.sample(10))
    out = tmp_path / "state"
    out.mkdir()
    with buffer.snapshots_to(out):
        state = buffer.state_dict()
    assert sorted(p.name for p in out.iterdir()) == [f"buffer.g2.{i}.bin" for i in range(3)]
    digests = {p.name: _digest(p) for p in out.iterdir()}
    other = MappedReservoirBuffer(20, folder=tmp_path, unlinked=True)
    with pytest.raises(ValueError, match="must hold"):
        other.load_state_dict(state)  # outside snapshots_from: not its files
    with other.snapshots_from(out):
        other.load_state_dict(state)
    for inputs, targets, metadata in _stream(3, seed=6):
        other.update(inputs, targets, metadata)
    assert {p.name: _digest(p) for p in out.iterdir()} == digests  # read through a private map
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_unlinked_work_files_without_o_tmpfile_are_named_then_unlinked(tmp_path, monkeypatch):
    real_open = os.open

    def no_tmpfile(path, flags, *args):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_tmpfile)
    buffer = MappedReservoirBuffer(8, folder=tmp_path, unlinked=True)
    inputs, targets, metadata = _stream(1)[0]
    buffer.update(inputs, targets, metadata)
    assert list(tmp_path.iterdir()) == [] and len(buffer) == 8
    assert torch.equal(buffer._storage()[0], inputs)  # the first 8 samples fill slots 0..7


def test_a_mapped_buffer_is_not_copied_with_its_open_files(tmp_path):
    buffer = MappedReservoirBuffer(4, folder=tmp_path, unlinked=True)
    buffer.update(torch.zeros(2, 3), torch.arange(2))
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(buffer)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.copy(buffer._files)
    assert len(buffer) == 2


@pytest.mark.parametrize("kind", [MappedReservoirBuffer, MappedInfiniteBuffer])
def test_a_lazy_load_reads_the_snapshot_in_place_and_copies_it_only_before_a_write(
    tmp_path, monkeypatch, kind
):
    """A lazy buffer makes no file to load a state (a state on read-only or full storage can be
    read); its first write makes the work files, or refuses with nothing changed."""
    source, scratch = tmp_path / "state", tmp_path / "scratch"
    source.mkdir()
    scratch.mkdir()
    sizes = {"max_size": 20} if kind is MappedReservoirBuffer else {"initial_capacity": 8}
    writer = kind(**sizes, folder=source, seed=2)
    for inputs, targets, metadata in _stream(5):
        writer.update(inputs, targets, metadata)
    with writer.snapshots_to(source):
        state = writer.state_dict()
    files = {p.name: _digest(p) for p in source.glob("buffer.g*")}
    eager, lazy = (kind(**sizes, folder=scratch, seed=2, lazy=flag) for flag in (False, True))
    made = []
    real_open = os.open

    def recorded(path, flags, *args):
        if flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            made.append(str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", recorded)
    for buffer in (eager, lazy):
        with buffer.snapshots_from(source):
            buffer.load_state_dict(state)
    assert made and all(str(scratch) in path for path in made)  # the eager buffer's work files
    made.clear()
    with lazy.snapshots_from(source):  # loaded again: still nothing written
        lazy.load_state_dict(state)
    assert made == []
    _same_sample(eager.sample(6), lazy.sample(6))
    assert len(lazy) == len(eager) and lazy.num_seen == eager.num_seen
    with lazy.snapshots_to(tmp_path):  # a snapshot of a borrowed state: the same files
        again = lazy.state_dict()
    assert {p.name: _digest(p) for p in tmp_path.glob("buffer.g*")} == {
        name.replace("g1", "g2"): digest for name, digest in files.items()
    }
    assert again["mapped"]["length"] == state["mapped"]["length"]

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    inputs, targets, metadata = _stream(1, seed=9)[0]
    with pytest.raises(MappedFileError, match="the disk is full"):
        lazy.update(inputs, targets, metadata)
    assert len(lazy) == len(eager) and lazy.num_seen == eager.num_seen
    _same_sample(eager.sample(6), lazy.sample(6))
    monkeypatch.undo()
    for inputs, targets, metadata in _stream(3, seed=9):
        eager.update(inputs, targets, metadata)
        lazy.update(inputs, targets, metadata)
        _same_sample(eager.sample(6), lazy.sample(6))
    assert {p.name: _digest(p) for p in source.glob("buffer.g*")} == files  # never written


@pytest.mark.all_or_nothing
def test_a_pinned_rollback_snapshot_outlives_later_snapshots(tmp_path):
    # An update's undo copy is a held snapshot; checkpoints taken during the update hold newer
    # ones, and each closes all but the last two: the undo copy must stay until released.
    buffer = MappedReservoirBuffer(20, folder=tmp_path, unlinked=True, seed=2)
    reference = ReservoirBuffer(20, seed=2)
    for inputs, targets, metadata in _stream(4):
        buffer.update(inputs, targets, metadata)
        reference.update(inputs, targets, metadata)
    saved, expected = buffer.state_dict(), reference.state_dict()
    buffer.pin_snapshot(saved)
    for round_ in range(4):  # mid-update checkpoints
        for inputs, targets, metadata in _stream(2, seed=10 + round_):
            buffer.update(inputs, targets, metadata)
        buffer.state_dict()
    buffer.load_state_dict(saved)  # the undo, four snapshots later
    reference.load_state_dict(expected)
    _same_sample(buffer.sample(10), reference.sample(10))
    buffer.release_snapshot(saved)
    assert not buffer._files.pinned
