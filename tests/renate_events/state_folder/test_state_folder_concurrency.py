"""Concurrent writers and readers of one state folder, in separate processes, for fixed rounds.

Every round, two writers update the same folder in place while a reader reads it. Nothing may be
lost: no round starts with an emptied folder, no call raises anything but a clear refusal, every
read succeeds, and the folder ends with exactly the updates that reported success.

Reads of a folder that has no lock file yet (a freshly copied one) run without a lock and are
retried under it when a writer appears meanwhile: a retry must give the same learner as one read
(:func:`run_fresh_rounds`, with Python loads and ``renate-events evaluate`` as the readers).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os
import shutil
import sys
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.cli._zoo import mlp
from renate_events.state_folder import StateFolderBusyError, StateFolderConflictError, read_manifest
from renate_events.updater import ModelUpdater
from tests.helpers import fresh_processes, run_cli
from trainer.files import lock_path

ROUNDS = 30
READS_PER_ROUND = 3


def _updater(**kwargs):
    return ModelUpdater(
        torch.nn.Linear(4, 2),
        learner="er",
        learner_kwargs={"memory_size": 10, "memory_batch_size": 4, "batch_size": 8},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        lock_timeout=60.0,
        **kwargs,
    )


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g))


def _writer(state, name, barrier, results):
    torch.set_num_threads(1)
    outcomes = []
    for round_ in range(ROUNDS):
        barrier.wait(timeout=300)
        task_id = f"{name}-{round_}"
        try:
            updater = _updater(input_state_folder=state, output_state_folder=state, in_place=True)
            updater.update(_data(round_), task_id=task_id)
            outcomes.append(("ok", task_id))
        except (StateFolderConflictError, StateFolderBusyError) as exc:
            outcomes.append(("refused", type(exc).__name__))
        except Exception as exc:  # what the test counts as a failure: a raw error
            outcomes.append(("raw", f"{type(exc).__name__}: {exc}"))
    results.put((name, outcomes))


def _reader(state, barrier, results):
    torch.set_num_threads(1)
    emptied, failures, reads = 0, [], 0
    for _ in range(ROUNDS):
        barrier.wait(timeout=300)  # both writers have finished the previous round
        emptied += not os.path.isfile(os.path.join(state, "manifest.json"))
        for _ in range(READS_PER_ROUND):
            try:
                read_manifest(state)
                _updater(input_state_folder=state).learner_instance  # noqa: B018
                reads += 1
            except Exception as exc:  # what the test counts as a failure
                failures.append(f"{type(exc).__name__}: {exc}")
    results.put(("reader", (emptied, failures, reads)))


@pytest.mark.slow
def test_two_writers_and_a_reader_lose_nothing(tmp_path):
    state = str(tmp_path / "s")
    _updater(output_state_folder=state).update(_data(-1), task_id="start")
    context = fresh_processes()
    barrier, results = context.Barrier(3), context.Queue()
    processes = [
        context.Process(target=_writer, args=(state, "a", barrier, results)),
        context.Process(target=_writer, args=(state, "b", barrier, results)),
        context.Process(target=_reader, args=(state, barrier, results)),
    ]
    for process in processes:
        process.start()
    reports = dict(results.get(timeout=600) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    outcomes = reports["a"] + reports["b"]
    emptied, failures, reads = reports["reader"]
    succeeded = [detail for kind, detail in outcomes if kind == "ok"]
    assert [detail for kind, detail in outcomes if kind == "raw"] == []
    assert (emptied, failures, reads) == (0, [], ROUNDS * READS_PER_ROUND)
    assert len(succeeded) >= ROUNDS  # a refusal means that the other writer's update went in
    manifest = read_manifest(state)
    assert manifest["updates"] == 1 + len(succeeded)  # no update reported success and was lost
    assert sorted(manifest["task_ids"][1:]) == sorted(succeeded)
    assert sorted(os.listdir(tmp_path)) == [".s.lock", "s"]  # no staging folder left behind


def _cli_state(folder):
    torch.manual_seed(0)
    ModelUpdater(
        mlp(8, [16], 4),
        learner="er",
        learner_kwargs={"memory_size": 20, "memory_batch_size": 4, "batch_size": 8},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        metadata={"model": {"kind": "mlp", "inputs": 8, "hidden": [16], "classes": 4}},
        output_state_folder=folder,
    ).update(TensorDataset(torch.rand(32, 8), torch.randint(0, 4, (32,))), task_id="start")


@pytest.mark.slow
def test_two_concurrent_cli_updates_lose_nothing(tmp_path):
    import safetensors.torch

    state, data = tmp_path / "s", tmp_path / "new.safetensors"
    _cli_state(state)
    safetensors.torch.save_file(
        {"inputs": torch.rand(32, 8), "targets": torch.randint(0, 4, (32,))}, str(data)
    )
    command = ["update", "--input-state", state, "--data", data, "--output-state", state]
    command += ["--in-place", "--no-progress"]
    succeeded = 0
    for trial in range(3):
        # two commands at once, each in a process of its own
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(run_cli, *command, "--task-id", f"{trial}-{i}") for i in range(2)]
            outcomes = [run.result() for run in runs]
        for code, _, err in outcomes:
            if code == 0:
                succeeded += 1
            else:
                assert code == 2, err
                assert len(err.strip().splitlines()) == 1 and "changed by another update" in err
        manifest = read_manifest(state)
        assert manifest["updates"] == 1 + succeeded
    assert sorted(os.listdir(tmp_path)) == [".s.lock", "new.safetensors", "s"]


# -- reads of a folder that has no lock file yet ----------------------------------------------


def _fresh_updater(storage, **kwargs):
    """The command line's kind of updater (an MLP with its description in the metadata)."""
    torch.manual_seed(0)
    return ModelUpdater(
        mlp(8, [16], 4),
        learner="er",
        learner_kwargs={"memory_size": 20, "memory_batch_size": 4, "batch_size": 8},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        metadata={"model": {"kind": "mlp", "inputs": 8, "hidden": [16], "classes": 4}},
        buffer_storage=storage,
        lock_timeout=60.0,
        **kwargs,
    )


def _fresh_data(seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))


def _fresh_writer(storage, folders, barrier, finished, results):
    torch.set_num_threads(1)
    raw = []
    for round_, folder in enumerate(folders):
        barrier.wait(timeout=300)
        try:
            updater = _fresh_updater(
                storage, input_state_folder=folder, output_state_folder=folder, in_place=True
            )
            updater.update(_fresh_data(round_), task_id=f"w-{round_}")
        except (StateFolderConflictError, StateFolderBusyError):
            pass  # the other writer's update went in first: a clear refusal
        except Exception as exc:  # what the test counts as a failure: a raw error
            raw.append((round_, f"{type(exc).__name__}: {exc}"))
        with finished.get_lock():
            finished.value += 1
    results.put(("writer", raw))


def _read_once(storage, folder, data, evaluate):
    """One read: a Python load, or ``renate-events evaluate`` (in this process); its error."""
    if evaluate:
        from renate_events.cli import main

        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(["evaluate", "--state", folder, "--data", data])
        return None if code == 0 else f"evaluate exit {code}: {err.getvalue().strip()}"
    try:
        learner = _fresh_updater(storage, input_state_folder=folder).learner_instance
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    keys = [key for key, _ in learner.trainer.listeners if key == "validation_memory"]
    return None if keys == ["validation_memory"] else f"listeners {learner.trainer.listeners}"


def _fresh_reader(storage, folders, data, writers, barrier, finished, results):
    """Reads each round's folder while its writers work (and once after), alternating Python
    loads and ``evaluate``; reports the rounds with a failed read."""
    torch.set_num_threads(1)
    failed, reads = [], 0
    for round_, folder in enumerate(folders):
        barrier.wait(timeout=300)
        errors = []
        done = False
        while not done:
            done = finished.value >= writers * (round_ + 1)  # then one last read
            error = _read_once(storage, folder, data, evaluate=reads % 2 == 1)
            reads += 1
            if error is not None:
                errors.append(error)
        if errors:
            failed.append((round_, errors[0]))
    results.put(("reader", (failed, reads)))


def run_fresh_rounds(tmp_path, storage, rounds, writers=2, readers=2):
    """``rounds`` rounds, each on a copy of one state folder without a lock file: ``writers``
    update it in place while ``readers`` read it. Returns the rounds with a failed read (round,
    first error), the writers' raw errors and the number of reads."""
    template = str(tmp_path / "template")
    _fresh_updater(storage, output_state_folder=template).update(_fresh_data(-1), task_id="start")
    os.unlink(lock_path(template))
    data = str(tmp_path / "test.safetensors")
    import safetensors.torch

    safetensors.torch.save_file(dict(zip(("inputs", "targets"), _fresh_data(-2).tensors)), data)
    folders = [str(tmp_path / f"s{round_}") for round_ in range(rounds)]
    for folder in folders:
        shutil.copytree(template, folder)  # a freshly copied state folder: no lock file
    context = fresh_processes()
    barrier, results = context.Barrier(writers + readers), context.Queue()
    finished = context.Value("i", 0)
    processes = [
        context.Process(target=_fresh_writer, args=(storage, folders, barrier, finished, results))
        for _ in range(writers)
    ] + [
        context.Process(
            target=_fresh_reader,
            args=(storage, folders, data, writers, barrier, finished, results),
        )
        for _ in range(readers)
    ]
    for process in processes:
        process.start()
    reports = [results.get(timeout=900) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    failed: dict[int, str] = {}  # round: the first error any reader met in it
    raw, reads = [], 0
    for kind, report in reports:
        if kind == "writer":
            raw += report
        else:
            for round_, error in report[0]:
                failed.setdefault(round_, error)
            reads += report[1]
    return sorted(failed.items()), raw, reads
    return failed, raw, reads


class _WriterAppears:
    """A listener whose state loads while a writer starts: it makes the folder's lock file (as a
    writer's first step) during the first ``loads`` loads, and with ``fail`` the load then fails
    (as one whose files the writer swapped)."""

    def __init__(self, folder, loads=0, fail=False):
        self.folder, self.loads, self.fail, self.seen = folder, loads, fail, 0

    def on_save_checkpoint(self, checkpoint):
        checkpoint["seen"] = self.seen

    def on_load_checkpoint(self, checkpoint):
        self.seen += 1
        if self.seen <= self.loads:
            open(lock_path(self.folder), "a").close()
            if self.fail:
                raise ValueError("a file changed while it was read")


@pytest.mark.parametrize("storage", ["memory", "mapped"])
@pytest.mark.parametrize("fail", [False, True])
def test_a_read_retried_because_a_writer_appeared_gives_what_one_read_gives(
    tmp_path, storage, fail
):
    folder = str(tmp_path / "s")
    writer = _WriterAppears(folder)
    _fresh_updater(storage, output_state_folder=folder, listeners=[writer]).update(
        _fresh_data(0), _fresh_data(1), task_id="start"
    )
    os.unlink(lock_path(folder))  # a freshly copied folder
    expected = _fresh_updater(
        storage, input_state_folder=folder, listeners=[_WriterAppears(folder)]
    )
    expected.learner_instance  # noqa: B018 - one read, undisturbed
    assert not os.path.exists(lock_path(folder))

    listener = _WriterAppears(folder, loads=1, fail=fail)
    updater = _fresh_updater(storage, input_state_folder=folder, listeners=[listener])
    learner = updater.learner_instance  # read without a lock, then again under it
    assert listener.seen == 2 and os.path.exists(lock_path(folder))
    keys = [key for key, _ in learner.trainer.listeners]
    assert keys.count("validation_memory") == 1
    assert updater.history == expected.history
    for mine, theirs in zip(
        learner.model.state_dict().values(), expected.model.state_dict().values()
    ):
        assert torch.equal(mine, theirs)
    memory = dict(learner.trainer.listeners)["validation_memory"]
    assert memory is updater._memory
    assert torch.equal(memory.data()[0], expected._memory.data()[0])
    assert len(learner.buffer) == len(expected.learner_instance.buffer) > 0
    updater.update(_fresh_data(2), task_id="next", write=False)  # it trains as one read's would


@pytest.mark.parametrize("storage", ["memory", "mapped"])
def test_reads_of_a_folder_without_a_lock_file_during_writers_never_fail(tmp_path, storage):
    failed, raw, reads = run_fresh_rounds(tmp_path, storage, rounds=6)
    assert (failed, raw) == ([], [])
    assert reads >= 12


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["memory", "mapped"])
def test_reads_during_writers_stress(tmp_path, storage):
    failed, raw, reads = run_fresh_rounds(tmp_path, storage, rounds=25)
    assert (failed, raw) == ([], [])
    assert reads >= 50


if __name__ == "__main__":  # the figures of the report: python -m tests....concurrency ROUNDS
    import tempfile

    for kind in ("memory", "mapped"):
        with tempfile.TemporaryDirectory() as where:
            started = time.monotonic()
            rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 50
            failed, raw, reads = run_fresh_rounds(__import__("pathlib").Path(where), kind, rounds)
            print(
                f"{kind}: {len(failed)} of {rounds} rounds with a failed read ({reads} reads), "
                f"{len(raw)} raw writer errors, {time.monotonic() - started:.0f} s"
            )
            for round_, error in failed[:3]:
                print(f"  round {round_}: {error[:300]}")
            for error in raw[:3]:
                print(f"  writer: {str(error)[:300]}")
