"""The experiment trackers (MLflow, Weights & Biases, TensorBoard) against the real packages,
writing to temporary folders and read back with each package's own reader; no network."""

from __future__ import annotations

import sys

import attrs
import pytest
import torch

from tests.helpers import (
    classification_step,
    make_data,
    make_loader,
    make_model,
    new_mlflow_store,
    wandb_offline_env,
    wandb_runs,
)
from trainer import ListenerError, MissingPackageError, Trainer
from trainer.listeners import (
    ExperimentTracker,
    MLflowLogger,
    TensorBoardLogger,
    WandbLogger,
    flat_params,
)

BATCHES = 6  # make_data() has 48 samples; batches of 8
PARAMS = {"lr": 0.1, "trainer": {"max_epochs": 2, "device": "cpu"}, "hidden": [8, 4]}


def _fit(trainer, crash_at=None):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    val = make_loader(make_data(n=16, seed=1), shuffle=False)
    step = classification_step(model)
    if crash_at is not None:

        def crash(state):
            if state.global_step == crash_at:
                raise RuntimeError("simulated crash")

        trainer.connect("batch_end", crash)
    return trainer.fit(model, optimizer, make_loader(make_data()), step, val_loader=val)


def _artifact_folder(tmp_path):
    folder = tmp_path / "state"
    (folder / "sub").mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    (folder / "sub" / "weights.bin").write_bytes(b"\0" * 16)
    return folder


# -- MLflow ----------------------------------------------------------------------------------------


@pytest.fixture
def mlflow_folder(mlflow_store_template, tmp_path):
    return new_mlflow_store(mlflow_store_template, tmp_path / "mlflow")


def _mlflow_client(logger):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=logger.store_uri)


def _history(client, run_id, name):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, name)]


@pytest.mark.slow  # the session's first MLflow store: 4 to 25 s on a shared machine
def test_mlflow_logger_logs_params_step_and_epoch_metrics_and_an_artifact(mlflow_folder, tmp_path):
    trainer = Trainer(max_epochs=2, device="cpu", seed=0)
    logger = MLflowLogger(
        experiment="fit", run_name="first", folder=mlflow_folder, log_every_n_steps=4
    )
    trainer.subscribe(logger, name="tracker")
    logger.log_params(PARAMS)
    run_id = logger.run_id
    _fit(trainer)
    assert logger.run_id is None  # ended at train_end
    client = _mlflow_client(logger)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    assert run.data.params == {
        "lr": "0.1",
        "trainer.max_epochs": "2",
        "trainer.device": "cpu",
        "hidden": "[8, 4]",
    }
    assert [s for s, _ in _history(client, run_id, "train_loss")] == [4, 8, 12]
    assert [s for s, _ in _history(client, run_id, "val_loss")] == [6, 12]
    assert _history(client, run_id, "epoch") == [(6, 0.0), (12, 1.0)]
    epoch_means = _history(client, run_id, "train_loss_epoch")
    assert [s for s, _ in epoch_means] == [6, 12] and all(v > 0 for _, v in epoch_means)
    assert {"lr", "samples_per_s"} <= set(run.data.metrics)

    logger.log_artifact(_artifact_folder(tmp_path), name="state")  # a new run: the fit ended it
    files = [a.path for a in client.list_artifacts(logger.run_id, "state")]
    assert files == ["state/manifest.json", "state/sub"]
    assert [a.path for a in client.list_artifacts(logger.run_id, "state/sub")] == [
        "state/sub/weights.bin"
    ]
    assert str(mlflow_folder) in client.get_run(logger.run_id).info.artifact_uri
    logger.finish()


@pytest.mark.slow
def test_mlflow_logger_kept_open_continues_the_steps_and_a_crash_fails_the_run(mlflow_folder):
    logger = MLflowLogger(
        experiment="fit", folder=mlflow_folder, log_every_n_steps=3, keep_open=True
    )
    for _ in range(2):
        trainer = Trainer(max_epochs=1, device="cpu")
        trainer.subscribe(logger)
        _fit(trainer)
    run_id = logger.run_id
    logger.log_metrics({"accuracy_task_0": 0.5})  # at the run's step: after both fits
    logger.finish()
    client = _mlflow_client(logger)
    assert [s for s, _ in _history(client, run_id, "train_loss")] == [3, 6, 9, 12]
    assert _history(client, run_id, "accuracy_task_0") == [(12, 0.5)]
    assert client.get_run(run_id).info.status == "FINISHED"

    crashing = MLflowLogger(experiment="fit", folder=mlflow_folder, log_every_n_steps=2)
    trainer = Trainer(max_epochs=1, device="cpu")
    trainer.subscribe(crashing)
    trainer.connect("train_start", lambda: crashing.log_params({"lr": 0.1}))
    with pytest.raises(ListenerError, match="simulated crash"):
        _fit(trainer, crash_at=3)
    runs = client.search_runs([client.get_experiment_by_name("fit").experiment_id])
    failed = [run for run in runs if run.info.status == "FAILED"]
    assert len(failed) == 1 and failed[0].data.metrics["train_loss"] > 0


# -- Weights & Biases ------------------------------------------------------------------------------


@pytest.fixture
def wandb_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    folder = tmp_path / "wandb-runs"
    for name, value in wandb_offline_env(folder).items():
        monkeypatch.setenv(name, value)
    return folder


def test_wandb_logger_offline_logs_config_history_and_an_artifact(wandb_folder, tmp_path):
    trainer = Trainer(max_epochs=2, device="cpu", seed=0)
    # dir given: W&B reads WANDB_DIR once per process (its first run's), not per run
    logger = WandbLogger(
        project="fit", name="first", dir=wandb_folder, log_every_n_steps=4, keep_open=True
    )
    trainer.subscribe(logger)
    logger.log_params(PARAMS)
    _fit(trainer)
    logger.log_artifact(_artifact_folder(tmp_path), name="state folder")
    logger.finish()
    (run,) = wandb_runs(wandb_folder)
    assert (run["name"], run["project"], run["exit_code"]) == ("first", "fit", 0)
    assert {key: run["config"][key] for key in flat_params(PARAMS)} == flat_params(PARAMS)
    steps = {row["_step"]: row for row in run["history"]}
    assert sorted(steps) == [4, 6, 8, 12]
    assert {"train_loss", "lr", "samples_per_s"} <= set(steps[4])
    assert {"val_loss", "train_loss_epoch", "epoch"} <= set(steps[6])
    assert steps[12]["epoch"] == 1 and "train_loss" in steps[12]
    assert run["artifacts"] == [("state-folder", "folder", ["manifest.json", "sub/weights.bin"])]


def test_wandb_logger_ends_a_crashed_fit_with_exit_code_1(wandb_folder):
    trainer = Trainer(max_epochs=1, device="cpu")
    trainer.subscribe(logger := WandbLogger(log_every_n_steps=2, dir=wandb_folder))
    with pytest.raises(ListenerError, match="simulated crash"):
        _fit(trainer, crash_at=3)
    assert logger.run is None
    (run,) = wandb_runs(wandb_folder)
    assert run["exit_code"] == 1 and [row["_step"] for row in run["history"]] == [2]


# -- what every tracker shares ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "make", "extra"),
    [
        ("mlflow.tracking", lambda: MLflowLogger(), "mlflow"),
        ("wandb", lambda: WandbLogger(), "wandb"),
        ("torch.utils.tensorboard", lambda: TensorBoardLogger("runs"), "tensorboard"),
    ],
)
def test_a_tracker_without_its_package_names_the_extra(monkeypatch, module, make, extra):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(
        MissingPackageError, match=rf"pip install 'renate-events\[{extra}\]'"
    ) as info:
        make()
    assert isinstance(info.value, ImportError) and info.value.extra == extra


def test_mlflow_logger_with_a_database_uri_needs_sqlalchemy(monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    with pytest.raises(MissingPackageError, match=r"sqlite:///x\.db needs the sqlalchemy package"):
        MLflowLogger(tracking_uri="sqlite:///x.db")
    MLflowLogger(tracking_uri="http://localhost:5000")  # a server: no SQLAlchemy here


def test_tensorboard_logger_logs_params_epoch_means_and_artifact_paths(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path / "tb", log_every_n_steps=4, keep_open=True)
    for _ in range(2):  # the second fit's steps follow the first's
        trainer = Trainer(max_epochs=1, device="cpu")
        trainer.subscribe(logger)
        _fit(trainer)
    logger.log_params(PARAMS)
    logger.log_artifact(_artifact_folder(tmp_path))
    logger.finish()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == [4, 6, 10, 12]
    assert [e.step for e in events.Scalars("train_loss_epoch")] == [6, 12]
    assert set(events.Tags()["tensors"]) >= {
        "hyperparameters/text_summary",
        "artifacts/text_summary",
    }


@attrs.define(eq=False)
class _Recording(ExperimentTracker):
    """A tracker that keeps what it is sent."""

    log_every_n_steps: int = 1
    sent: list = attrs.field(factory=list)

    def _start_run(self):
        self.sent.append(("start",))

    def _send_metrics(self, values, step):
        self.sent.append(("metrics", step, values))

    def _send_params(self, params):
        self.sent.append(("params", params))

    def _send_artifact(self, path, name):
        self.sent.append(("artifact", name))

    def _flush(self):
        pass

    def _end_run(self, failed):
        self.sent.append(("end", failed))


def test_log_metrics_and_log_artifact_refuse_what_they_cannot_log(tmp_path):
    tracker = _Recording()
    with pytest.raises(
        TypeError, match=r"'loss' must be a number \(a tensor: call .item\(\) once\)"
    ):
        tracker.log_metrics({"loss": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="log_metrics step"):
        tracker.log_metrics({"loss": 1.0}, step=-1)
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        tracker.log_artifact(tmp_path / "missing")
    assert tracker.sent == [] and not tracker.running  # nothing opened
    tracker.log_metrics({"loss": float("nan")}, step=3)
    tracker.finish()
    tracker.finish()  # once only
    assert [entry[0] for entry in tracker.sent] == ["start", "metrics", "end"]


def _host_reads_of_a_fit(monkeypatch, tracker):
    """Calls of the tensor methods that copy a value to the host, in a 2-epoch fit."""
    count = [0]
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    trainer = Trainer(max_epochs=2, device="cpu", seed=0)
    if tracker is not None:
        trainer.subscribe(tracker)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer.fit(model, optimizer, make_loader(make_data()), classification_step(model))
    monkeypatch.undo()
    return count[0]


def test_a_tracker_reads_the_device_once_per_row_and_once_per_epoch(monkeypatch):
    bare = _host_reads_of_a_fit(monkeypatch, None)
    tracker = _Recording(log_every_n_steps=4)
    tracked = _host_reads_of_a_fit(monkeypatch, tracker)
    rows = [entry for entry in tracker.sent if entry[0] == "metrics"]
    assert [(step, "epoch" in values) for _, step, values in rows] == [
        (4, False),
        (6, True),
        (8, False),
        (12, False),
        (12, True),
    ]
    assert tracked - bare == len(rows)  # 12 steps: 3 training rows and 2 epoch means
