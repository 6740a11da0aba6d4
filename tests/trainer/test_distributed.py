"""Tests of trainer.distributed: sharding, rank-aware listeners, and real 2-process gloo runs.

The multi-process tests start two processes with ``torch.multiprocessing`` on a free port of
127.0.0.1, forked from a server that imported torch once (``tests.helpers.fresh_processes``);
each writes what it observed to a JSON or safetensors file in ``tmp_path``.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from renate_events.methods import ExperienceReplayLearner, FineTuningLearner
from tests.helpers import fresh_processes
from trainer import CheckpointMismatchError, TensorLoader, Trainer
from trainer.checkpoint import read_checkpoint
from trainer.distributed import DistributedContext, RankFailedError
from trainer.exceptions import SubscriptionError
from trainer.state import rank_path

WORLD = 2
DEADLINE_S = 60


# -- single-process checks -------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n", [10, 11, 16])
def test_tensor_loader_shards_cover_the_data_equally(shuffle, n):
    data = torch.arange(n)
    shards = []
    for rank in range(WORLD):
        loader = TensorLoader((data,), batch_size=3, shuffle=shuffle, rank=rank, world_size=WORLD)
        loader = attrs.evolve(loader, seed=5)
        loader.set_epoch(2)
        shards.append(torch.cat([batch[0] for batch in loader]))
    assert len(shards[0]) == len(shards[1]) == -(-n // WORLD)
    assert set(torch.cat(shards).tolist()) == set(range(n))


def test_strided_shards_make_the_single_process_batches():
    data = torch.arange(12)
    one = [b[0] for b in TensorLoader((data,), batch_size=4, seed=0)]
    two = [
        [b[0] for b in TensorLoader((data,), batch_size=2, seed=0, rank=r, world_size=2)]
        for r in range(2)
    ]
    for i, batch in enumerate(one):
        assert sorted(batch.tolist()) == sorted(torch.cat([two[0][i], two[1][i]]).tolist())


def test_rank_path_and_payload_defaults():
    assert rank_path("a/last.safetensors", 3) == "a/last.rank3.safetensors"
    assert rank_path("ckpt", 0) == "ckpt.rank0"
    seen = []

    def on_epoch_end(rank, world_size):
        seen.append((rank, world_size))

    trainer = Trainer(max_epochs=1, device="cpu")
    trainer.connect("epoch_end", on_epoch_end)
    model = torch.nn.Linear(2, 1)
    trainer.fit(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [torch.randn(4, 2)],
        lambda x: model(x).pow(2).mean(),
    )
    assert seen == [(0, 1)]
    assert not trainer.dist.enabled


def test_rank_zero_listeners_are_skipped_on_other_ranks():
    @attrs.define(eq=False)
    class Counter:
        runs_on = "rank_zero"
        calls: int = 0

        def on_epoch_end(self):
            self.calls += 1

    trainer = Trainer()
    counter, everywhere = Counter(), Counter()
    trainer.subscribe(counter)
    trainer.subscribe(everywhere, runs_on="all")
    trainer.events.rank = 1
    trainer.events.epoch_end.send(trainer, **trainer._common())
    assert (counter.calls, everywhere.calls) == (0, 1)
    with pytest.raises(SubscriptionError, match="runs_on='everywhere'"):
        trainer.subscribe(Counter(), runs_on="everywhere")


def test_distributed_mode_is_validated_and_init_needs_torchrun(monkeypatch):
    with pytest.raises(ValueError, match="distributed must be one of"):
        Trainer(distributed="yes")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match="torchrun"):
        Trainer(distributed="init", device="cpu").fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.randn(2, 2)], model
        )


def test_a_lone_context_does_nothing():
    ctx = DistributedContext()
    loader = TensorLoader((torch.arange(4),))
    assert ctx.shard(loader, 0) is loader
    assert ctx.safe_point("batch_end", stop=True) is True
    assert ctx.mean(2.5) == 2.5


# -- two processes ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, port: int, scenario: str, folder: str, options: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=DEADLINE_S),
    )
    try:
        report = globals()[scenario](rank, folder, **options)
        # Written before the teardown: gloo has been seen to abort the process while it tears
        # down after a failed run on a loaded machine ("terminate called without an active
        # exception"), after the scenario itself had finished.
        with open(os.path.join(folder, f"{scenario}.rank{rank}.json"), "w") as handle:
            json.dump(report, handle)
    finally:
        dist.destroy_process_group()


def _spawn(scenario: str, folder: str, **options: Any) -> tuple[list[dict[str, Any]], float]:
    """Run ``scenario`` on two ranks; return their reports and the wall time."""
    started = time.monotonic()
    fresh_processes()  # the fork server's preloaded modules
    context = mp.start_processes(
        _entry,
        args=(_free_port(), scenario, str(folder), options),
        nprocs=WORLD,
        join=False,
        start_method="forkserver",
    )
    try:
        while not context.join(timeout=1):
            if time.monotonic() - started > DEADLINE_S:
                raise AssertionError(f"{scenario} did not finish within {DEADLINE_S} s")
    except mp.ProcessExitedException:
        # A crash after every rank wrote its report is gloo's teardown, not the scenario.
        reports = [os.path.join(folder, f"{scenario}.rank{r}.json") for r in range(WORLD)]
        if not all(os.path.exists(path) for path in reports):
            raise
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    reports = []
    for rank in range(WORLD):
        with open(os.path.join(folder, f"{scenario}.rank{rank}.json")) as handle:
            reports.append(json.load(handle))
    return reports, time.monotonic() - started


def _data(n: int = 48) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(n, 4, generator=generator)
    return torch.utils.data.TensorDataset(inputs, (inputs[:, 0] > 0).long() + (inputs[:, 1] > 0))


def _er(rank: int) -> ExperienceReplayLearner:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return ExperienceReplayLearner(
        model=model,
        memory_size=12,
        memory_batch_size=4,
        batch_size=4,
        seed=0,
        trainer=Trainer(max_epochs=2, device="cpu", distributed="auto"),
    )


@attrs.define(eq=False)
class _RankZeroCounter:
    runs_on = "rank_zero"
    starts: int = 0
    batches: int = 0

    def on_train_start(self) -> None:
        self.starts += 1

    def on_batch_end(self) -> None:
        self.batches += 1


@attrs.define(eq=False)
class _SaveAt:
    runs_on = "collective"
    path: str
    step: int
    crash_at: int | None = None

    def on_batch_end(self, trainer: Trainer, state: Any) -> None:
        if state.global_step == self.step:
            trainer.save_checkpoint(self.path)
        if state.global_step == self.crash_at:
            raise RuntimeError("simulated crash after the checkpoint")


@attrs.define(eq=False)
class _BufferProbe:
    """At the first batch after a resume: does the buffer hold this rank's saved buffer?"""

    learner: Any
    saved: dict[str, torch.Tensor]
    matches: bool | None = None

    def on_batch_start(self) -> None:
        if self.matches is None:
            live = self.learner.buffer.state_dict()
            self.matches = _flat_equal(live, self.saved)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, (list, tuple)):
        return _flat(dict(enumerate(tree)), prefix)
    return {prefix: tree}


def _flat_equal(a: Any, b: Any) -> bool:
    a, b = _flat(a), _flat(b)
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def er_run(rank: int, folder: str, mode: str) -> dict[str, Any]:
    learner = _er(rank)
    counter = _RankZeroCounter()
    learner.trainer.subscribe(counter)
    ckpt = os.path.join(folder, "ckpt.safetensors")
    report: dict[str, Any] = {}
    if mode == "full":
        learner.trainer.subscribe(_SaveAt(os.path.join(folder, "full.safetensors"), step=5))
        result = learner.fit(_data())
        report.update(steps=result.steps, train_loss=result.metrics["train_loss"])
    elif mode == "crash":
        learner.trainer.subscribe(_SaveAt(ckpt, step=5, crash_at=7))
        with pytest.raises(Exception, match="simulated crash"):
            learner.fit(_data())
    else:  # resume
        learner.trainer.subscribe(_SaveAt(ckpt, step=-1))
        saved = read_checkpoint(rank_path(ckpt, rank))["listeners"]["learner"]["buffer"]
        probe = _BufferProbe(learner, saved)
        learner.trainer.subscribe(probe)
        learner.fit(_data(), resume_from=ckpt)
        report["buffer_restored"] = probe.matches
    save_file(_params(learner.model), os.path.join(folder, f"{mode}.params{rank}.safetensors"))
    report.update(
        starts=counter.starts,
        batches=counter.batches,
        rank=learner.trainer.dist.rank,
        keys=sorted(learner.model.state_dict()),
    )
    return report


def fail_run(rank: int, folder: str) -> dict[str, Any]:
    learner = _er(rank)

    def explode(state: Any, rank: int) -> None:
        if rank == 1 and state.global_step == 3:
            raise ValueError("listener broke on purpose")

    learner.trainer.connect("batch_end", explode)
    started = time.monotonic()
    try:
        learner.fit(_data())
    except Exception as exc:
        cause = exc.__cause__
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "cause": None if cause is None else type(cause).__name__,
            "seconds": time.monotonic() - started,
        }
    return {"type": None}


def grad_run(rank: int, folder: str, batch_size: int, bare: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    loader = TensorLoader(_data().tensors, batch_size=batch_size, seed=0)
    if bare:  # a step that calls the bare model: the trainer averages the gradients itself
        Trainer(max_epochs=3, device="cpu", seed=0).fit(
            model,
            torch.optim.SGD(model.parameters(), lr=0.2),
            loader,
            lambda batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1]),
        )
        save_file(_params(model), os.path.join(folder, f"grad.params{rank}.safetensors"))
        return {}
    learner = FineTuningLearner(
        model=model,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.2),
        seed=0,
        trainer=Trainer(max_epochs=3, device="cpu"),
    )
    learner.fit(loader)
    save_file(_params(model), os.path.join(folder, f"grad.params{rank}.safetensors"))
    return {}


@pytest.mark.slow
def test_two_process_er_completes_resumes_and_refuses_another_world_size(tmp_path):
    full, seconds = _spawn("er_run", tmp_path, mode="full")
    assert [r["steps"] for r in full] == [12, 12]  # 48 samples / 2 ranks / batch 4, 2 epochs
    assert full[0]["train_loss"] == pytest.approx(full[1]["train_loss"])
    assert [(r["starts"], r["batches"]) for r in full] == [(1, 12), (0, 0)]
    assert not any(key.startswith("module.") for key in full[0]["keys"])
    final = [load_file(tmp_path / f"full.params{r}.safetensors") for r in range(WORLD)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])  # replicas agree

    # Layout: the main file without listener state, one file per rank with its own buffer.
    main = read_checkpoint(tmp_path / "full.safetensors")
    assert main["listeners"] == {} and main["trainer"]["world_size"] == WORLD
    buffers = [
        read_checkpoint(rank_path(tmp_path / "full.safetensors", r))["listeners"]["learner"]
        for r in range(WORLD)
    ]
    assert not _flat_equal(buffers[0], buffers[1])  # each rank kept what it saw

    _spawn("er_run", tmp_path, mode="crash")
    resumed, _ = _spawn("er_run", tmp_path, mode="resume")
    assert [r["buffer_restored"] for r in resumed] == [True, True]
    for rank in range(WORLD):
        after = load_file(tmp_path / f"resume.params{rank}.safetensors")
        assert all(torch.equal(after[k], final[rank][k]) for k in after), rank

    learner = _er(0)
    with pytest.raises(CheckpointMismatchError, match="written by 2 process"):
        learner.fit(_data(), resume_from=tmp_path / "ckpt.safetensors")
    assert seconds < DEADLINE_S


@pytest.mark.slow
def test_a_listener_failing_on_rank_one_stops_both_ranks(tmp_path):
    reports, seconds = _spawn("fail_run", tmp_path)
    zero, one = reports
    assert one["type"] == "ListenerError" and one["cause"] == "ValueError"
    assert zero["type"] == RankFailedError.__name__
    assert "rank 1 failed" in zero["message"] and "listener broke on purpose" in zero["message"]
    # Both stopped well before the process group's timeout (DEADLINE_S), which a rank waiting
    # for the failed one would have run into: not a speed bound (10 s failed on a loaded machine).
    assert max(zero["seconds"], one["seconds"]) < DEADLINE_S / 2
    assert seconds < DEADLINE_S


@pytest.mark.slow
@pytest.mark.parametrize("bare", [False, True], ids=["ddp-forward", "bare-model-step"])
def test_two_ranks_average_gradients_like_one_process_with_twice_the_batch(tmp_path, bare):
    _spawn("grad_run", tmp_path, batch_size=4, bare=bare)
    os.makedirs(tmp_path / "one", exist_ok=True)
    grad_run(0, str(tmp_path / "one"), batch_size=8, bare=bare)
    alone = load_file(tmp_path / "one" / "grad.params0.safetensors")
    torch.manual_seed(0)
    start = torch.nn.Linear(4, 8).weight
    assert not torch.allclose(alone["0.weight"], start)  # it trained
    for rank in range(WORLD):
        ddp = load_file(tmp_path / f"grad.params{rank}.safetensors")
        for key in alone:
            torch.testing.assert_close(ddp[key], alone[key], rtol=1e-5, atol=1e-6)
