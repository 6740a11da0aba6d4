"""``--tracker mlflow|wandb|tensorboard`` on ``run`` and ``update``: what each tracker holds after
the command, read back with the tracker's own reader from temporary folders (no network)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from renate_events.cli import main
from tests.helpers import new_mlflow_store, one_line_cli_error, wandb_offline_env, wandb_runs

pytest.importorskip("sklearn")

RUN = ["run", "--epochs", "1", "--hidden", "16", "--no-progress", "--memory-size", "40"]


def _data_file(folder):
    import safetensors.torch

    path = folder / "new.safetensors"
    generator = torch.Generator().manual_seed(0)
    safetensors.torch.save_file(
        {
            "inputs": torch.rand(40, 64, generator=generator),
            "targets": torch.randint(0, 10, (40,), generator=generator),
        },
        str(path),
    )
    return path


def test_run_with_tensorboard_logs_scalars_accuracies_params_and_artifacts(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    assert main([*RUN, "--output-dir", str(out), "--tracker", "tensorboard"]) == 0
    folder = tmp_path / "tracking" / "out-seed0"  # default: tracking/ beside the output
    events = EventAccumulator(str(folder))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train_loss", "train_loss_epoch", "epoch", "update", "average_accuracy"} <= tags
    accuracies = [e.value for e in events.Scalars("accuracy_task_0")]
    results = json.loads((out / "results.json").read_text())["runs"][0]
    assert accuracies == pytest.approx([row[0] for row in results["class_incremental"]["rows"]])
    assert [e.value for e in events.Scalars("update")] == [1, 2, 3, 4, 5]
    average = events.Scalars("final_average_accuracy")[0].value
    assert average == pytest.approx(results["metrics"]["average_accuracy"])
    assert {"hyperparameters/text_summary", "artifacts/text_summary"} <= set(
        events.Tags()["tensors"]
    )


@pytest.mark.slow  # the session's first MLflow store takes 4 to 25 s on a shared machine
def test_run_and_update_with_mlflow_log_params_metrics_results_and_the_state(
    tmp_path, mlflow_store_template
):
    from mlflow.tracking import MlflowClient

    store = new_mlflow_store(mlflow_store_template, tmp_path / "store")
    out = tmp_path / "out"
    tracking = ["--tracker", "mlflow", "--tracker-dir", str(store), "--tracker-project", "cl"]
    assert main([*RUN, "--output-dir", str(out), *tracking, "--tracker-run-name", "er"]) == 0
    next_state = tmp_path / "next"
    update = ["update", "--input-state", str(out / "state" / "seed-0"), "--no-progress"]
    update += ["--data", str(_data_file(tmp_path)), "--output-state", str(next_state)]
    assert main([*update, *tracking]) == 0

    client = MlflowClient(tracking_uri=f"sqlite:///{store}/mlflow.db")
    experiment = client.get_experiment_by_name("cl").experiment_id
    runs = {run.info.run_name: run for run in client.search_runs([experiment])}
    assert set(runs) == {"er-seed0", "next"}
    run, updated = runs["er-seed0"], runs["next"]
    assert run.info.status == updated.info.status == "FINISHED"
    assert run.data.params["options.epochs"] == "1" and run.data.params["seed"] == "0"
    assert run.data.params["learner_kwargs.memory_size"] == "40"
    assert run.data.params["max_epochs"] == "1"  # the updater's argument, not the trainer's
    assert updated.data.params["max_epochs"] == "1"  # the input state's, kept
    history = client.get_metric_history(run.info.run_id, "average_accuracy")
    assert len(history) == 5 and [m.step for m in history] == sorted(m.step for m in history)
    results = json.loads((out / "results.json").read_text())["runs"][0]["metrics"]
    final = run.data.metrics["final_average_accuracy"]
    assert final == pytest.approx(results["average_accuracy"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"results.json", "metrics.csv", "state"} <= artifacts
    state = {a.path for a in client.list_artifacts(updated.info.run_id, "state")}
    assert "state/manifest.json" in state
    assert updated.data.params["learner"] == run.data.params["learner"]
    assert "train_loss" in updated.data.metrics


def test_update_with_wandb_offline_logs_the_config_and_the_output_state(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, value in wandb_offline_env(tmp_path / "w").items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    assert main([*RUN, "--output-dir", str(out)]) == 0
    data, next_state = _data_file(tmp_path), tmp_path / "next"
    update = ["update", "--input-state", str(out / "state" / "seed-0"), "--no-progress"]
    update += ["--data", str(data), "--output-state", str(next_state)]
    folder = tmp_path / "wandb-here"
    assert main([*update, "--tracker", "wandb", "--tracker-dir", str(folder)]) == 0
    # a state written under a tracker is an input like any other (trackers keep no state)
    again = ["update", "--input-state", str(next_state), "--data", str(data), "--no-progress"]
    assert main([*again, "--output-state", str(tmp_path / "again")]) == 0
    (run,) = wandb_runs(folder)
    assert (run["name"], run["project"], run["exit_code"]) == ("next", "renate-events", 0)
    assert run["config"]["learner_kwargs.memory_size"] == 40
    assert any("train_loss" in row for row in run["history"])
    ((name, kind, files),) = run["artifacts"]
    assert (name, kind) == ("state", "folder") and "manifest.json" in files


@pytest.mark.parametrize(
    ("module", "tracker"),
    [("mlflow.tracking", "mlflow"), ("wandb", "wandb"), ("torch.utils.tensorboard", "tensorboard")],
)
def test_a_tracker_that_is_not_installed_is_one_line_before_anything_trains(
    tmp_path, capsys, monkeypatch, module, tracker
):
    monkeypatch.setitem(sys.modules, module, None)
    out = tmp_path / "out"
    one_line_cli_error(
        capsys,
        ["run", "--output-dir", str(out), "--tracker", tracker],
        f"--tracker {tracker}:",
        f"pip install 'renate-events[{tracker}]'",
    )
    assert not out.exists() and not (tmp_path / "tracking").exists()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--tracker-dir", "t"], "--tracker-dir needs --tracker"),
        (["--tracker-run-name", "a"], "--tracker-run-name needs --tracker"),
        (["--tracker", "tensorboard", "--tracking-uri", "http://x"], "--tracking-uri is MLflow's"),
    ],
)
def test_tracker_options_that_do_not_fit_are_one_line(tmp_path, capsys, extra, words):
    out = tmp_path / "out"
    one_line_cli_error(capsys, ["run", "--output-dir", str(out), *extra], words)
    assert not out.exists()


def test_a_tracked_search_is_refused(tmp_path, capsys):
    config = tmp_path / "config.py"
    config.write_text("")
    argv = ["update", "--config-file", str(config), "--output-state", str(tmp_path / "s")]
    argv += ["--search", "2", "--tracker", "tensorboard"]
    one_line_cli_error(capsys, argv, "--tracker with --search")
