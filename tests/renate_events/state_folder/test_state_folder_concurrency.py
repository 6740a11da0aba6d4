"""Concurrent writers and readers of one state folder, in separate processes, for fixed rounds.

Every round, two writers update the same folder in place while a reader reads it. Nothing may be
lost: no round starts with an emptied folder, no call raises anything but a clear refusal, every
read succeeds, and the folder ends with exactly the updates that reported success.
"""

from __future__ import annotations

import concurrent.futures
import os

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.cli._zoo import mlp
from renate_events.state_folder import StateFolderBusyError, StateFolderConflictError, read_manifest
from renate_events.updater import ModelUpdater
from tests.helpers import fresh_processes, run_cli

ROUNDS = 30
READS_PER_ROUND = 3


def _updater(**kwargs):
    return ModelUpdater(
        torch.nn.Linear(4, 2),
        learner="er",
        learner_kwargs={"memory_size": 10, "memory_batch_size": 4, "batch_size": 8},
        trainer_kwargs={"device": "cpu", "max_epochs": 1},
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
        trainer_kwargs={"device": "cpu", "max_epochs": 1},
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
