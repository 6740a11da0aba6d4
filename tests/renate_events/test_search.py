"""Hyperparameter search of one update: renate_events.search, `renate-events update --search`."""

from __future__ import annotations

import csv
import io
import os
import signal

import pytest
import torch

from renate_events import search
from renate_events.search import (
    Choice,
    FloatRange,
    IntRange,
    SearchSpaceError,
    TrialPruner,
    earlier_best,
    parse_space,
)
from renate_events.state_folder import read_manifest
from tests.helpers import run_in_fresh_process

optuna = pytest.importorskip("optuna")

from renate_events.cli import main  # noqa: E402

CONFIG = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _chunk(chunk_id, seed, n):
    g = torch.Generator().manual_seed(100 * chunk_id + seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


def data_fn(chunk_id, seed):
    return _chunk(chunk_id, seed, 64), _chunk(chunk_id, seed + 1, 32)
"""

SPACE = 'learner = "er"\nmemory-size = 32\nepochs = 3\nalpha = {low = 0.1, high = 1.0}\n'
SPACE += "lr = {low = 1e-3, high = 1e-1, log = true}\n"


@pytest.fixture
def files(tmp_path):
    (tmp_path / "c.py").write_text(CONFIG)
    (tmp_path / "space.toml").write_text(SPACE)
    return tmp_path


def _search(files, out, trials, *extra):
    args = ["update", "--config-file", files / "c.py", "--config", files / "space.toml"]
    args += ["--output-state", out, "--search", trials, "--device", "cpu", "--no-progress"]
    return main([*map(str, args), *map(str, extra)])


def _rows(folder):
    return list(csv.DictReader(io.StringIO((folder / "search.csv").read_text())))


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"alpha": {"low": 2.0, "high": 1.0}}, "alpha has low 2.0 > high 1.0"),
        ({"lr": {"low": 0.0, "high": 1.0, "log": True}}, "log-uniform, so low must be > 0"),
        ({"learner": {"choices": []}}, "choices must be a non-empty list"),
        ({"alpha": 0.5}, "alpha must be a table"),
        ({"alpha": {"low": 0.1}}, r"must be \{low = ..., high = ...\[, log = true\]\}"),
    ],
)
def test_bad_search_spaces_are_refused(space, message):
    with pytest.raises(SearchSpaceError, match=message):
        parse_space(space, "space.toml")


def test_spaces_parse_to_ranges_and_choices():
    space = parse_space(
        {"alpha": {"low": 0.1, "high": 1}, "epochs": {"low": 1, "high": 4}, "b": {"choices": [1]}},
        "s",
    )
    assert space == {
        "alpha": FloatRange(0.1, 1.0),
        "epochs": IntRange(1, 4),
        "b": Choice((1,)),
    }


def test_earlier_best_takes_the_best_complete_trials_inside_the_space():
    table = "number,state,value,steps,alpha\n0,COMPLETE,0.5,4,0.3\n1,PRUNED,0.1,2,0.2\n"
    table += "2,COMPLETE,0.2,4,0.9\n3,COMPLETE,0.3,4,5.0\n"
    space = {"alpha": FloatRange(0.1, 1.0)}
    assert earlier_best(table, space, "min") == [{"alpha": 0.9}, {"alpha": 0.3}]
    assert earlier_best(table, space, "max") == [{"alpha": 0.3}, {"alpha": 0.9}]


class _Trial:
    def __init__(self, prune_at):
        self.prune_at, self.reported = prune_at, []

    def report(self, value, step):
        self.reported.append((step, value))

    def should_prune(self):
        return len(self.reported) >= self.prune_at


def test_the_pruner_listener_reports_and_stops_the_fit():
    from renate_events.methods import ExperienceReplayLearner
    from trainer import Trainer

    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    learner = ExperienceReplayLearner(
        model=torch.nn.Linear(4, 2), memory_size=8, memory_batch_size=4, batch_size=8,
        trainer=Trainer(max_epochs=5, device="cpu"),
    )  # fmt: skip
    pruner = TrialPruner(_Trial(prune_at=2), "val_loss")
    learner.trainer.subscribe(pruner)
    result = learner.fit(data, data)
    assert pruner.pruned and result.stopped_early and result.epochs == 2
    assert [step for step, _ in pruner.trial.reported] == [0, 1]


def test_a_search_writes_the_best_trials_state_and_the_trials_table(files):
    out = files / "s0"
    assert _search(files, out, 5) == 0
    rows = _rows(out)
    assert len(rows) == 5 and {row["state"] for row in rows} <= {"COMPLETE", "PRUNED"}
    # the first trial is what the update would have used without a search (the defaults)
    assert (float(rows[0]["alpha"]), float(rows[0]["lr"])) == (1.0, 1e-3)
    complete = [row for row in rows if row["state"] == "COMPLETE"]
    best = min(complete, key=lambda row: float(row["value"]))
    record = read_manifest(out)["history"][-1]
    assert record["learner_kwargs"]["alpha"] == pytest.approx(float(best["alpha"]))
    assert record["best"]["value"] == pytest.approx(float(best["value"]), rel=1e-5)
    assert read_manifest(out)["optimizer"]["lr"] == pytest.approx(float(best["lr"]))
    # The next update's search tries the earlier best configuration first.
    assert _search(files, files / "s1", 2, "--input-state", out) == 0
    first = _rows(files / "s1")[0]
    assert (first["alpha"], first["lr"]) == (best["alpha"], best["lr"])


def test_the_next_search_tries_the_earlier_best_configurations_first(files):
    out = files / "s0"
    assert _search(files, out, 5, "--search-pruner", "none") == 0
    space = search.parse_space({"alpha": {"low": 0.1, "high": 1.0}, "lr": {"low": 1e-3,
                                "high": 1e-1, "log": True}}, "space.toml")  # fmt: skip
    earlier = earlier_best((out / "search.csv").read_text(), space, "min")
    assert _search(files, files / "s1", 4, "--input-state", out, "--search-pruner", "none") == 0
    rows = _rows(files / "s1")
    tried = [{"alpha": float(row["alpha"]), "lr": float(row["lr"])} for row in rows]
    # trial 0: the input state's own settings (the earlier best); then the other best ones
    assert tried[0] == earlier[0]
    assert tried[1:] == [params for params in earlier if params != tried[0]] + tried[3:]


def test_an_interrupted_search_resumes_from_its_storage(files):
    storage = f"sqlite:///{files / 'search.db'}"
    extra = ["--search-storage", storage, "--search-study", "day-0"]
    assert _search(files, files / "a", 2, *extra) == 0
    assert _search(files, files / "b", 3, *extra) == 0  # one more trial, three in the table
    assert len(_rows(files / "b")) == 3
    assert [row["number"] for row in _rows(files / "b")] == ["0", "1", "2"]


@pytest.mark.parametrize(
    ("space", "extra", "message"),
    [
        ("alpha = {low = 2.0, high = 1.0}\n", [], "alpha has low 2.0 > high 1.0"),
        ("gamma = {low = 0.1, high = 1.0}\n", [], "unknown options ['gamma']"),
        ('alpha = {choices = ["x", 0.5]}\n', [], "--search: alpha must be a number, got 'x'"),
        ('learner = {choices = ["er", "gem"]}\n', [], "learner choice 'gem' is not one of"),
        ("epochs = {low = 0, high = 3}\n", [], "epochs must be a number >= 1 in every trial"),
        ("alpha = {low = -1.0, high = 1.0}\n", [], "--search: alpha = -1.0 is refused: --alpha"),
        (
            "alpha = {low = 0.1, high = 1.0}\n",
            ["--search-storage", "sqlite:////no/such/folder/x.db"],
            "--search-storage sqlite:////no/such/folder/x.db: cannot open it",
        ),
    ],
)
def test_bad_searches_are_one_line_and_write_nothing(files, capsys, space, extra, message):
    (files / "space.toml").write_text(space)
    assert _search(files, files / "out", 2, *extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (files / "out").exists()


def test_a_search_with_the_same_seed_repeats_exactly(files):
    assert _search(files, files / "a", 3, "--search-pruner", "none") == 0
    assert _search(files, files / "b", 3, "--search-pruner", "none") == 0
    assert (files / "a" / "search.csv").read_text() == (files / "b" / "search.csv").read_text()
    weights = [(files / name / "model.safetensors").read_bytes() for name in ("a", "b")]
    assert weights[0] == weights[1]


def test_a_search_continues_from_a_state_whose_optimizer_came_from_optimizer_fn(files):
    (files / "c.py").write_text(
        CONFIG + "\n\ndef optimizer_fn(params):\n    return torch.optim.SGD(params, lr=0.1)\n"
    )
    (files / "space.toml").write_text(
        'learner = "er"\nepochs = 2\nalpha = {low = 0.1, high = 1.0}\n'
    )
    assert _search(files, files / "s0", 2) == 0
    assert _search(files, files / "s1", 2, "--input-state", files / "s0") == 0
    (files / "space.toml").write_text(
        "alpha = {low = 0.1, high = 1.0}\nlr = {low = 0.01, high = 1.0}\n"
    )
    assert _search(files, files / "s2", 2, "--input-state", files / "s1") == 2


def test_a_failed_trial_in_the_storage_does_not_count(files):
    storage = f"sqlite:///{files / 'search.db'}"
    study = optuna.create_study(storage=storage, study_name="day-0")
    study.tell(study.ask(), state=optuna.trial.TrialState.FAIL)  # an interrupted trial
    assert (
        _search(files, files / "a", 2, "--search-storage", storage, "--search-study", "day-0") == 0
    )
    rows = _rows(files / "a")
    assert rows[0]["state"] == "FAIL" and len(rows) == 3
    assert (float(rows[1]["alpha"]), float(rows[1]["lr"])) == (1.0, 1e-3)  # the current settings


@pytest.mark.parametrize(
    ("extra", "config_tail", "message"),
    [
        (["--metric", "val_f1"], "", "--metric 'val_f1' is not reported by validation"),
        ([], "\n\ndef data_fn(chunk_id, seed):\n    return _chunk(chunk_id, seed, 64)\n",
         "--search compares trials by val_loss, a validation metric"),
    ],
)  # fmt: skip
def test_search_checks_the_metric_before_any_trial(files, capsys, extra, config_tail, message):
    (files / "c.py").write_text(CONFIG + config_tail)
    storage = f"sqlite:///{files / 'search.db'}"
    assert _search(files, files / "out", 2, "--search-storage", storage, *extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (files / "out").exists() and not (files / "search.db").exists()


def _killed_search(files, storage):
    """A search worker killed (SIGKILL) inside its first trial."""
    from renate_events.updater import ModelUpdater

    ModelUpdater.update = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    _search(files, files / "killed", 2, "--search-storage", storage, "--search-study", "day-0")


def test_a_killed_workers_trial_is_marked_failed_in_the_study_and_the_csv(files):
    storage = f"sqlite:///{files / 'search.db'}"
    assert run_in_fresh_process(_killed_search, files, storage) == -signal.SIGKILL
    study = optuna.load_study(study_name="day-0", storage=storage)
    (killed,) = study.trials
    assert killed.state == optuna.trial.TrialState.RUNNING
    assert not (files / "killed").exists()
    alive = study.ask()  # a trial of a worker that still runs (this process): left alone
    alive.set_user_attr(search.WORKER, search.worker_id())
    extra = ["--search-storage", storage, "--search-study", "day-0"]
    assert _search(files, files / "a", 2, *extra) == 0
    rows = _rows(files / "a")
    assert [row["state"] for row in rows[:2]] == ["FAIL", "RUNNING"] and len(rows) == 4
    assert {row["state"] for row in rows[2:]} <= {"COMPLETE", "PRUNED"}
    states = [t.state for t in optuna.load_study(study_name="day-0", storage=storage).trials]
    assert states[:2] == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.RUNNING]
    assert search.fail_dead_trials(optuna, study) == []  # nothing more to fail
