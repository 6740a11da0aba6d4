"""A command that writes a path finds out before its work that it cannot create it: run
--output-dir, update --output-state, predict --output and the tracker's folder are refused in one
line (exit 2) before anything trains, and nothing is left behind (outside trial 5)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from renate_events.cli import main
from tests.helpers import one_line_cli_error
from trainer import Trainer

QUICK = os.path.join(
    os.path.dirname(__file__), *[os.pardir] * 3, "examples/configs/quick_config.py"
)
NAME_MAX = os.pathconf("/", "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
needs_proc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.isdir("/proc"),
    reason="/proc, where nothing can be created (also by root), is Linux's",
)


@pytest.fixture
def fits(monkeypatch):
    """The number of Trainer.fit calls so far (a refused command makes none)."""
    calls = []
    original = Trainer.fit

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "fit", counted)
    return calls


def _listing(folder) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(root, name), folder)
        for root, dirs, files in os.walk(folder)
        for name in dirs + files
    )


def _unwritable(tmp_path) -> dict[str, str]:
    """Paths that cannot be created, even by root: under a file, a name over NAME_MAX, a path
    over PATH_MAX (made of names that each fit)."""
    (tmp_path / "afile").write_text("mine\n")
    return {
        "under a file": str(tmp_path / "afile" / "out"),
        "long name": str(tmp_path / ("n" * (NAME_MAX + 1))),
        "name without room for its temporary": str(tmp_path / ("n" * (NAME_MAX - 5))),
        "long path": str(tmp_path / os.path.join(*["p" * 200] * 25)),
    }


RUN = ["run", "--hidden", "16", "--memory-size", "20", "--memory-batch-size", "8"]
RUN += ["--epochs", "1", "--no-progress"]


@needs_proc
def test_run_refuses_an_output_dir_under_proc_before_training(fits, capsys):
    err = one_line_cli_error(capsys, [*RUN, "--output-dir", "/proc/forbidden"], "--output-dir")
    assert "nothing can be created in /proc" in err and "nothing was written" in err
    assert fits == [] and not os.path.exists("/proc/forbidden")


def test_run_refuses_unwritable_output_dirs_before_training(tmp_path, fits, capsys):
    for what, path in _unwritable(tmp_path).items():
        before = _listing(tmp_path)
        err = one_line_cli_error(capsys, [*RUN, "--output-dir", path], "--output-dir")
        assert ("is not a folder" in err) == (what == "under a file"), err
        assert ("bytes long" in err) == ("name" in what), err
        assert ("too long" in err) == (what == "long path"), err
        assert _listing(tmp_path) == before, what  # no probe, no parent folder left
    assert fits == []
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_writable_output_dir_trains_and_leaves_no_probe(tmp_path, fits, capsys):
    out = tmp_path / "new" / "out"
    assert main([*RUN, "--output-dir", str(out)]) == 0
    assert fits and sorted(os.listdir(tmp_path)) == ["new"]
    assert sorted(os.listdir(tmp_path / "new")) == ["out"]


@needs_proc
def test_update_refuses_an_output_state_under_proc_before_training(tmp_path, fits, capsys):
    argv = ["update", "--config-file", QUICK, "--no-progress", "--output-state", "/proc/nope/s"]
    err = one_line_cli_error(capsys, argv, "/proc/nope/s", "nothing can be created in /proc")
    assert "choose another folder" in err and fits == []


def test_update_refuses_unwritable_output_states_before_training(tmp_path, fits, capsys):
    for what, path in _unwritable(tmp_path).items():
        before = _listing(tmp_path)
        argv = ["update", "--config-file", QUICK, "--no-progress", "--output-state", path]
        one_line_cli_error(capsys, argv, "cannot be written")
        assert _listing(tmp_path) == before, what
    assert fits == []


@needs_proc
def test_the_tracker_folder_is_checked_before_training(tmp_path, fits, capsys):
    argv = [*RUN, "--output-dir", str(tmp_path / "out"), "--tracker", "tensorboard"]
    err = one_line_cli_error(capsys, [*argv, "--tracker-dir", "/proc/t"], "--tracker-dir /proc/t")
    assert "nothing can be created in /proc" in err
    argv = ["update", "--config-file", QUICK, "--no-progress", "--output-state"]
    argv += [str(tmp_path / "s"), "--tracker", "mlflow", "--tracker-dir", "/proc/m"]
    one_line_cli_error(capsys, argv, "--tracker-dir /proc/m cannot be written")
    assert fits == [] and os.listdir(tmp_path) == []


def test_predict_refuses_an_unwritable_output_before_predicting(tmp_path, capsys):
    state = str(tmp_path / "state")
    assert main(["update", "--config-file", QUICK, "--no-progress", "--output-state", state]) == 0
    data = str(tmp_path / "new.npz")
    np.savez(data, inputs=np.zeros((4, 8), dtype=np.float32))
    argv = ["predict", "--state", state, "--data", data, "--output"]
    long = str(tmp_path / ("n" * (NAME_MAX - 5) + ".npz"))
    one_line_cli_error(capsys, [*argv, long], "--output", "bytes long", "choose another file")
    if os.path.isdir("/proc"):
        one_line_cli_error(capsys, [*argv, "/proc/p.npz"], "nothing can be created in /proc")
    assert sorted(os.listdir(tmp_path)) == [".state.lock", "new.npz", "state"]


@needs_proc
def test_a_scratch_dir_in_which_nothing_can_be_created_is_refused(tmp_path, fits, capsys):
    argv = ["update", "--config-file", QUICK, "--no-progress", "--buffer-storage", "mapped"]
    argv += ["--output-state", str(tmp_path / "s"), "--scratch-dir", "/proc"]
    one_line_cli_error(capsys, argv, "--scratch-dir /proc must be an existing folder that may be")
    assert fits == [] and os.listdir(tmp_path) == []
