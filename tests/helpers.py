"""What the tests share: the repository's root, small models, data and listeners, fresh processes
and the command line run as a user runs it."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import pathlib
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, TensorDataset

# The repository's root (the folder holding pyproject.toml), for tests that read its files or run
# its scripts; one home, so that a test file can move between the folders of tests/.
ROOT = pathlib.Path(__file__).resolve().parents[1]

# Modules every child of the fork server needs: importing torch alone takes ~2.5 s, which a
# test starting ten processes would otherwise pay ten times.
_PRELOAD = ["torch", "safetensors.torch", "renate_events.updater", "renate_events.cli"]


def fresh_processes() -> Any:
    """A ``multiprocessing`` context whose processes fork from a server that imported torch and
    this library once (``forkserver``): each child is a separate process with its own memory,
    as a fresh interpreter would be, but starts in milliseconds. Targets must be importable
    (module-level functions)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def run_in_fresh_process(target: Callable[..., Any], *args: Any, timeout: float = 300) -> int:
    """Run ``target(*args)`` in a child of :func:`fresh_processes`; return its exit code
    (``-9`` when it was killed by SIGKILL, 1 when it raised)."""
    process = fresh_processes().Process(target=target, args=args)
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        raise AssertionError(f"{target.__name__}{args} did not finish within {timeout} s")
    return process.exitcode


def _cli_main(args: list[str], cwd: str | None, env: dict[str, str], out: str, err: str) -> None:
    torch.set_num_threads(1)  # as this process (tests/conftest.py): bit-equal convolutions
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    from renate_events.cli import main

    with (
        open(out, "w") as stdout,
        open(err, "w") as stderr,
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        try:
            code = main(args)
        except BaseException:  # what the console script would print, then exit 1
            traceback.print_exc()
            code = 1
    sys.exit(code)


def run_cli(
    *args: Any, cwd: Any = None, env: dict[str, str] | None = None, timeout: float = 300
) -> tuple[int, str, str]:
    """``renate-events ARGS`` in a process of its own (see :func:`fresh_processes`), as a user
    runs it: (exit status, stdout, stderr)."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        where = None if cwd is None else str(cwd)
        code = run_in_fresh_process(
            _cli_main, [str(a) for a in args], where, dict(env or {}), out, err, timeout=timeout
        )
        with open(out) as stdout, open(err) as stderr:
            return code, stdout.read(), stderr.read()


def make_data(n: int = 48, features: int = 6, classes: int = 3, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, features, generator=generator)
    targets = torch.randint(0, classes, (n,), generator=generator)
    return TensorDataset(inputs, targets)


def make_model(features: int = 6, classes: int = 3, seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(features, 16),
        torch.nn.ReLU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(16, classes),
    )


def labelled(labels: list[int], seed: int, features: int = 6) -> TensorDataset:
    """Random inputs of ``features`` features (seeded) with exactly ``labels`` as targets."""
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(len(labels), features, generator=generator), torch.tensor(labels)
    )


def make_loader(dataset: TensorDataset, batch_size: int = 8, shuffle: bool = True) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


def small_mlp() -> torch.nn.Module:
    """An 8-16-4 MLP (seed 0); module ``"1"`` gives features."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def two_class_task(task: int, n: int = 32, width: int = 8) -> TensorDataset:
    """``n`` random inputs of ``width`` features, labelled ``2 * task`` or ``2 * task + 1``."""
    g = torch.Generator().manual_seed(task)
    inputs = torch.randn(n, width, generator=g)
    return TensorDataset(inputs, torch.randint(2 * task, 2 * task + 2, (n,), generator=g))


def scaled(x: torch.Tensor) -> torch.Tensor:
    """uint8 values as floats in [0, 1]."""
    return x.float() / 255


# A learner's train, test and buffer transforms for the inputs of uint8_task.
SCALED_TRANSFORMS: dict[str, Any] = {
    "train_transform": scaled,
    "test_transform": scaled,
    "buffer_transform": scaled,
}


def uint8_task(task: int) -> TensorDataset:
    """uint8 inputs the model can only take through the learner's transforms (as the CIFAR
    presets keep images): 16 samples of 8 features, labelled ``2 * task`` or ``2 * task + 1``."""
    g = torch.Generator().manual_seed(task)
    inputs = torch.randint(0, 255, (16, 8), dtype=torch.uint8, generator=g)
    return TensorDataset(inputs, torch.randint(2 * task, 2 * task + 2, (16,), generator=g))


def classification_step(model: torch.nn.Module):
    def step(batch):
        x, y = batch
        logits = model(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "logits": logits}

    return step


def parameters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the model's state: its values wherever it lives (a trained model is on CUDA
    where one is available, a restored one where its owner put it); a test that cares where the
    model is asserts the device itself."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        _check_same_device(a[key], b[key], key)
        assert torch.equal(a[key], b[key]), key


def _check_same_device(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    """Tensors are compared where they are: a comparison across devices is a failing test with
    the two devices named, not torch's error (compare ``.cpu()`` copies when only values count)."""
    assert a.device == b.device, f"{where}: compared across devices, {a.device} and {b.device}"


def assert_same_tree(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts/lists of tensors and JSON values are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        _check_same_device(a, b, where)
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}.{i}")
    else:
        assert a == b, where


def _comparable_manifest(folder: pathlib.Path) -> dict:
    manifest = json.loads((folder / "manifest.json").read_text())
    for record in manifest["history"]:
        record.pop("seconds")  # the one timing
    # The checkpoint's bytes may be laid out otherwise (safetensors writes its metadata in no
    # fixed order): its tree is compared instead.
    manifest["files"].pop("learner.safetensors")
    return manifest


def assert_same_state_folder(a: pathlib.Path, b: pathlib.Path) -> None:
    """Every tensor of the learner checkpoint and the model equal, buffer files byte for byte,
    the manifests (file hashes included) equal apart from timings."""
    from trainer import read_checkpoint

    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    assert_same_tree(
        read_checkpoint(a / "learner.safetensors"), read_checkpoint(b / "learner.safetensors")
    )
    for path in a.glob("buffer.*.bin"):
        assert path.read_bytes() == (b / path.name).read_bytes(), path.name
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert _comparable_manifest(a) == _comparable_manifest(b)


@attrs.define(eq=False)
class Recorder:
    """Records every event it receives into a shared log as ``(event, tag)``."""

    log: list[tuple[str, Any]]
    tag: Any = None

    def _record(self, event: str) -> None:
        self.log.append((event, self.tag))

    def on_train_start(self) -> None:
        self._record("train_start")

    def on_epoch_start(self) -> None:
        self._record("epoch_start")

    def on_batch_start(self) -> None:
        self._record("batch_start")

    def on_batch_end(self) -> None:
        self._record("batch_end")

    def on_epoch_end(self) -> None:
        self._record("epoch_end")

    def on_validation_start(self) -> None:
        self._record("validation_start")

    def on_validation_end(self) -> None:
        self._record("validation_end")

    def on_train_end(self) -> None:
        self._record("train_end")

    def on_exception(self) -> None:
        self._record("exception")


@attrs.define(eq=False)
class StatefulCounter:
    """Counts batches; its count and a tensor go through checkpoints."""

    count: int = 0
    history: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0))

    def on_batch_end(self, loss: torch.Tensor) -> None:
        self.count += 1
        self.history = torch.cat([self.history, loss.detach().reshape(1)])

    def on_save_checkpoint(self, checkpoint) -> None:
        checkpoint["count"] = self.count
        checkpoint["history"] = self.history
        checkpoint["nested"] = {"names": ["a", "b"], "values": [self.history, 1.5]}

    def on_load_checkpoint(self, checkpoint) -> None:
        self.count = checkpoint["count"]
        self.history = checkpoint["history"].clone()


def one_line_cli_error(capsys: Any, argv: list[str], *words: str) -> str:
    """Run ``renate-events argv`` in-process: exit 2 and one line on stderr holding ``words``."""
    from renate_events.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


@contextlib.contextmanager
def sync_errors_in_steady_state(trainer: Any, last: int) -> Iterator[None]:
    """``set_sync_debug_mode("error")`` from the second ``batch_start`` to ``batch_end`` of batch
    ``last``; switched on before, and off after, every other receiver of those events."""

    def sync_on(state: Any) -> None:
        if state.batch_idx == 1:
            torch.cuda.set_sync_debug_mode("error")

    def sync_off(state: Any) -> None:
        if state.batch_idx == last:
            torch.cuda.set_sync_debug_mode(0)

    trainer.connect("batch_start", sync_on, priority=10**9)
    trainer.connect("batch_end", sync_off, priority=-(10**9))
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
        trainer.unsubscribe(sync_on)
        trainer.unsubscribe(sync_off)


def assert_next_update_steps_do_not_sync(learner: Any, first: Any, batch: Any) -> None:
    """Fit ``learner`` (on CUDA) on ``first``, start the next update and take its first step on
    ``batch`` (it checks the batch and may synchronise); then three more steps with backward
    under ``set_sync_debug_mode("error")``: a synchronising operation fails the test."""
    learner.fit(first)
    learner.on_train_start()  # the next update starts
    batch = tuple(tensor.cuda() for tensor in batch)
    learner.training_step(batch)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            learner.training_step(batch)["loss"].backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def wandb_offline_env(folder: Any) -> dict[str, str]:
    """Environment variables under which W&B runs offline, silent, without system statistics
    and with every folder of its own (runs, cache, artifacts, settings) under ``folder``: it never
    touches the network or the home folder. W&B reads them at its first run in a process and
    keeps them: give each run its folder (``WandbLogger(dir=...)``, ``--tracker-dir``)."""
    folder = str(folder)
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_X_DISABLE_META": "true",
        "WANDB_X_DISABLE_MACHINE_INFO": "true",
        "WANDB_DIR": folder,
        "WANDB_CACHE_DIR": os.path.join(folder, "cache"),
        "WANDB_DATA_DIR": os.path.join(folder, "data"),
        "WANDB_ARTIFACT_DIR": os.path.join(folder, "artifacts"),
        "WANDB_CONFIG_DIR": os.path.join(folder, "config"),
    }


def _wandb_records(path: str) -> Iterator[Any]:
    """The records of a W&B run file (``run-<id>.wandb``): a 7-byte header (``:W&B``, a magic
    number, the version), then LevelDB-log blocks of 32 KiB whose chunks (a 7-byte header:
    checksum, length, type full/first/middle/last) hold protobuf ``Record`` messages."""
    import struct

    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as handle:
        data = handle.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, block, parts = 7, 32768, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        parts += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_runs(folder: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    """What the offline W&B runs under ``folder`` logged, oldest first: ``name``, ``project``,
    ``config`` (name -> value), ``started``, ``history`` (one dict per logged step: ``_step``
    and the values), ``artifacts`` (``(name, type, sorted file paths)``) and ``exit_code``.

    ``run.finish()`` returns before W&B's service process has written the end of the run file:
    this waits up to ``timeout`` seconds for every run's exit record."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        runs = _read_wandb_runs(folder)
        if all(run["exit_code"] is not None for run in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.05)


def _item_key(item: Any) -> str:
    """A W&B record item's key (newer versions write it as ``nested_key``)."""
    return item.key or ".".join(item.nested_key)


def _read_wandb_runs(folder: Any) -> list[dict[str, Any]]:
    import glob
    import json

    runs = []
    for path in sorted(glob.glob(os.path.join(str(folder), "wandb", "offline-run-*", "*.wandb"))):
        run: dict[str, Any] = {"config": {}, "history": [], "artifacts": [], "exit_code": None}
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["name"], run["project"] = record.run.display_name, record.run.project
                started = record.run.start_time
                run["started"] = (started.seconds, started.nanos)
                updates = record.run.config.update
            elif kind == "config":
                updates = record.config.update
            else:
                updates = []
            for item in updates:
                run["config"][_item_key(item)] = json.loads(item.value_json)
            if kind == "history":
                run["history"].append(
                    {_item_key(item): json.loads(item.value_json) for item in record.history.item}
                )
            elif kind == "artifact":
                files = sorted(entry.path for entry in record.artifact.manifest.contents)
                run["artifacts"].append((record.artifact.name, record.artifact.type, files))
            elif kind == "exit":
                run["exit_code"] = record.exit.exit_code
        runs.append(run)
    return sorted(runs, key=lambda run: run.get("started", (0, 0)))


def new_mlflow_store(template: Any, folder: Any) -> pathlib.Path:
    """``folder`` (made if missing) holding a copy of the empty MLflow store ``template`` (the
    ``mlflow_store_template`` fixture) as ``mlflow.db``: what ``MLflowLogger(folder=folder)``
    opens, without the seconds of creating its tables."""
    import shutil

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, folder / "mlflow.db")
    return folder


class SaveThenCrash:
    """A listener that, once ``armed``, writes the trainer's checkpoint to ``path`` at the
    ``batch_end`` of global step ``step`` and interrupts the fit (``KeyboardInterrupt``) at the
    next ``batch_start``: an update killed right after a mid-update checkpoint."""

    def __init__(self, path: Any, step: int) -> None:
        self.path, self.step, self.armed = path, step, False

    def on_batch_end(self, trainer: Any, state: Any) -> None:
        if self.armed and state.global_step == self.step:
            trainer.save_checkpoint(self.path)

    def on_batch_start(self, state: Any) -> None:
        if self.armed and state.global_step == self.step:
            raise KeyboardInterrupt


def model_and_listeners(learner: Any, path: Any) -> dict[str, Any]:
    """The model and listener sections of ``learner``'s checkpoint, written to ``path``."""
    from trainer import read_checkpoint

    learner.save_checkpoint(path)
    tree = read_checkpoint(path)
    return {"model": tree["model"], "listeners": tree["listeners"]}
