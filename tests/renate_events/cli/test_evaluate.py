"""``renate-events evaluate --scenario``: the tasks a state folder's run trained on (its seed, class
order and blurry boundaries, recorded in the manifest), a contradicting ``--seed`` or
``--class-order`` one line, and a folder written before the record evaluated as before."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

pytest.importorskip("sklearn")

from renate_events.cli import main
from renate_events.scenarios import shuffled_classes
from tests.helpers import one_line_cli_error

FAST = ["--no-progress", "--device", "cpu", "--learner", "er", "--hidden", "16", "--epochs", "1"]
FAST += ["--memory-size", "20", "--batch-size", "10", "--memory-batch-size", "10"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> pathlib.Path:
    """A run of seed 2 on Split-Digits in a seeded class order with blurry boundaries."""
    out = tmp_path_factory.mktemp("evaluate") / "out"
    argv = ["run", "--seeds", "2", "--class-order", "seed:3", "--blurry", "0.1"]
    assert main([*argv, "--output-dir", str(out), *FAST]) == 0
    return out


def _accuracies(capsys, argv: list[str]) -> list[str]:
    capsys.readouterr()
    assert main(["evaluate", *argv]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("task ")]


def _last_row(run: pathlib.Path) -> list[str]:
    rows = json.loads((run / "results.json").read_text())["runs"][0]["class_incremental"]["rows"]
    return [f"{value:.4f}" for value in rows[-1]]


def test_evaluate_builds_the_tasks_the_run_recorded(run, capsys):
    state = run / "state" / "seed-2"
    metadata = json.loads((state / "manifest.json").read_text())["metadata"]
    assert metadata["scenario"] == "split-digits"
    assert metadata["scenario_args"] == {"seed": 2, "class_order": "seed:3", "blurry": 0.1}
    lines = _accuracies(capsys, ["--state", str(state), "--scenario", "split-digits"])
    assert [line.split()[3] for line in lines] == _last_row(run)  # the run's last evaluation
    # repeating the record, also as the list that seed:3 stands for, changes nothing
    order = ",".join(map(str, shuffled_classes(range(10), 3)))
    # the same tasks (classes of each task as sets, in task order) in another permutation, too
    pairs = shuffled_classes(range(10), 3)
    swapped = ",".join(str(c) for i in range(0, 10, 2) for c in (pairs[i + 1], pairs[i]))
    given_ways = (["--seed", "2", "--class-order", "seed:3"], ["--class-order", order])
    for given in (*given_ways, ["--class-order", swapped]):
        argv = ["--state", str(state), "--scenario", "split-digits", *given]
        assert _accuracies(capsys, argv) == lines


def _tasks_reversed(order: tuple[int, ...]) -> list[int]:
    """The five tasks of ``order`` (two classes each) in reverse task order."""
    return [c for i in range(8, -1, -2) for c in order[i : i + 2]]


@pytest.mark.parametrize(
    ("given", "words"),
    [
        (["--seed", "0"], ["--seed 0:", "with --seed 2 (its manifest records it)", "leave --seed"]),
        (["--class-order", "seed:4"], ["--class-order seed:4:", "with --class-order seed:3"]),
        (["--class-order", "0,1,2,3,4,5,6,7,8,9"], ["with --class-order seed:3"]),
        (  # seed:3's tasks in another task order: other tasks
            ["--class-order", ",".join(map(str, _tasks_reversed(shuffled_classes(range(10), 3))))],
            ["with --class-order seed:3", "puts other classes in a task makes other tasks"],
        ),
        (["--class-order", "1,2"], ["--class-order 1,2", "exactly once"]),
    ],
)
def test_a_contradicting_seed_or_class_order_is_one_line(run, capsys, given, words):
    argv = ["evaluate", "--state", str(run / "state" / "seed-2"), "--scenario", "split-digits"]
    one_line_cli_error(capsys, [*argv, *given], *words)
    assert capsys.readouterr().out == ""


def test_a_class_order_without_a_scenario_is_refused(run, tmp_path, capsys):
    config = tmp_path / "config.py"
    config.write_text("")
    state = str(run / "state" / "seed-2")
    for source in (["--data", str(tmp_path / "new.npz")], ["--config-file", str(config)]):
        argv = ["evaluate", "--state", state, *source, "--class-order", "seed:3"]
        one_line_cli_error(capsys, argv, "--class-order orders the tasks of a --scenario")


def _without_record(run: pathlib.Path, folder: pathlib.Path, record: object = None) -> str:
    """A copy of the run's state folder as written before the record (or with ``record``)."""
    shutil.copytree(run / "state" / "seed-2", folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    if record is None:
        del manifest["metadata"]["scenario_args"]
    else:
        manifest["metadata"]["scenario_args"] = record
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return str(folder)


def test_a_folder_without_the_record_is_evaluated_as_before(run, tmp_path, capsys):
    old = _without_record(run, tmp_path / "old")
    default = _accuracies(capsys, ["--state", old, "--scenario", "split-digits"])
    sorted_seed_0 = ["--seed", "0", "--class-order", ",".join(map(str, range(10)))]
    argv = ["--state", old, "--scenario", "split-digits"]
    assert _accuracies(capsys, [*argv, *sorted_seed_0]) == default  # seed 0, sorted: as before
    recorded = _accuracies(capsys, [*argv, "--seed", "2", "--class-order", "seed:3"])
    assert [line.split()[3] for line in recorded] == _last_row(run)  # the flags say what it was
    assert recorded != default


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("record", "key"),
    [
        ("seed 2", "'metadata.scenario_args' must be an object"),
        ({"seed": 2, "class_order": "seed:3"}, "'metadata.scenario_args' must be an object"),
        ({"seed": -1, "class_order": None, "blurry": 0.0}, "'metadata.scenario_args.seed'"),
        (
            {"seed": 2, "class_order": [1, "a"], "blurry": 0.0},
            "'metadata.scenario_args.class_order'",
        ),
        ({"seed": 2, "class_order": None, "blurry": 2}, "'metadata.scenario_args.blurry'"),
    ],
)
def test_a_tampered_record_is_one_line_naming_the_file_and_key(run, tmp_path, capsys, record, key):
    folder = _without_record(run, tmp_path / "tampered", record)
    before = (tmp_path / "tampered" / "manifest.json").read_bytes()
    argv = ["evaluate", "--state", folder, "--scenario", "split-digits"]
    one_line_cli_error(capsys, argv, f"{folder}/manifest.json: key {key}")
    assert (tmp_path / "tampered" / "manifest.json").read_bytes() == before


def test_another_scenario_is_evaluated_without_the_record(run, capsys):
    state = str(run / "state" / "seed-2")
    argv = ["--state", state, "--scenario", "permuted-digits"]
    assert len(_accuracies(capsys, argv)) == 5  # the run's seed and order are not its
    one_line_cli_error(
        capsys, ["evaluate", *argv, "--class-order", "seed:3"], "--class-order is for"
    )


def test_a_config_files_state_is_evaluated_on_a_data_file(tmp_path, capsys):
    import numpy as np
    import torch

    from tests.renate_events.cli.test_predict import config_model, config_state

    config, state = config_state(tmp_path)
    inputs = torch.randn(40, 8, generator=torch.Generator().manual_seed(5))
    targets = (inputs[:, 0] > 0).long() + 2 * (inputs[:, 1] > 0).long()
    np.savez(tmp_path / "new.npz", inputs=inputs.numpy(), targets=targets.numpy())
    argv = ["--state", state, "--config-file", str(config), "--data", str(tmp_path / "new.npz")]
    lines = _accuracies(capsys, argv)
    model = config_model(state)
    with torch.no_grad():
        accuracy = float((model(inputs).argmax(dim=1) == targets).double().mean())
    assert lines == [f"task 0: accuracy {accuracy:.4f} (40 samples)"]
    np.savez(tmp_path / "labels.npz", inputs=inputs.numpy(), targets=np.full(40, 7))
    bad = ["evaluate", *argv[:-1], str(tmp_path / "labels.npz")]
    one_line_cli_error(capsys, bad, f"--data {tmp_path / 'labels.npz'}: the test labels range")
    one_line_cli_error(capsys, ["evaluate", *argv, "--chunk-ids", "0"], "not both")
    # inputs the model cannot take: the model's error and what to do
    np.savez(tmp_path / "wide.npz", inputs=np.zeros((4, 9), np.float32), targets=np.zeros(4, int))
    np.savez(tmp_path / "f64.npz", inputs=np.zeros((4, 8)), targets=np.zeros(4, int))
    for name, fix in (
        ("wide.npz", "the model rejected samples of the shape (9,): give inputs of the shape"),
        ("f64.npz", "float64 (1, 8)"),
        ("f64.npz", "; save the inputs as float32 or convert them in test_transform"),
    ):
        wrong = ["evaluate", *argv[:-1], str(tmp_path / name)]
        one_line_cli_error(capsys, wrong, "the model fails on its inputs", fix)
    for other in (["--data", str(tmp_path / "new.npz")], ["--config-file", str(config)]):
        argv = ["evaluate", "--state", state, "--scenario", "split-digits", *other]
        one_line_cli_error(capsys, argv, f"--scenario and {other[0]}:")
    one_line_cli_error(capsys, ["evaluate", "--state", state], "one of the arguments --data")


def test_a_recorded_list_is_the_order_it_lists(run, tmp_path, capsys):
    order = list(shuffled_classes(range(10), 3))  # what seed:3 stands for
    record = {"seed": 2, "class_order": order, "blurry": 0.1}
    folder = _without_record(run, tmp_path / "listed", record)
    argv = ["--state", folder, "--scenario", "split-digits"]
    assert [line.split()[3] for line in _accuracies(capsys, argv)] == _last_row(run)
    assert len(_accuracies(capsys, [*argv, "--class-order", "seed:3"])) == 5
    shown = ",".join(map(str, order))
    refused = ["evaluate", *argv, "--class-order", "seed:4"]
    one_line_cli_error(capsys, refused, f"with --class-order {shown} (its manifest records it)")


def _note(capsys, argv: list[str]) -> str:
    """What ``evaluate argv`` prints on stderr (it exits 0)."""
    capsys.readouterr()
    assert main(["evaluate", *argv]) == 0
    return capsys.readouterr().err


def test_a_folder_without_the_record_says_which_tasks_it_used(run, tmp_path, capsys):
    old = _without_record(run, tmp_path / "old")
    argv = ["--state", old, "--scenario", "split-digits"]
    err = _note(capsys, argv)
    assert err.count("\n") == 1 and err.startswith("renate-events: note: ")
    assert f"{old} records no seed or class order of its run" in err
    assert "evaluating on --seed 0 and the sorted classes: give the run's with --seed and " in err
    assert "--seed 2 and the sorted classes" in _note(capsys, [*argv, "--seed", "2"])
    assert "--seed 0 and that --class-order" in _note(capsys, [*argv, "--class-order", "seed:3"])
    assert _note(capsys, [*argv, "--seed", "2", "--class-order", "seed:3"]) == ""
    # with the record, no note
    assert (
        _note(capsys, ["--state", str(run / "state" / "seed-2"), "--scenario", "split-digits"])
        == ""
    )


def test_another_scenario_says_its_tasks_are_not_the_runs(run, capsys):
    state = str(run / "state" / "seed-2")
    err = _note(capsys, ["--state", state, "--scenario", "permuted-digits"])
    assert err == (
        f"renate-events: note: {state} was trained on --scenario split-digits, not "
        "permuted-digits: these tasks (--seed 0 and the sorted classes) are not its run's\n"
    )
