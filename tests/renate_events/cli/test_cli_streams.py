"""The command line's streams: ``run --online`` (anytime accuracy), ``--blurry``,
``--class-order``, Seq-TinyImageNet and the domain-incremental image scenarios; every bad input one
line, exit 2, before anything trains."""

from __future__ import annotations

import json
import pathlib

import pytest

from renate_events.cli import main
from renate_events.scenarios import IMAGE_SCENARIOS, shuffled_classes
from tests.helpers import one_line_cli_error
from tests.renate_events.datasets.test_readers_cifar import write_cifar10

FAST = ["--no-progress", "--device", "cpu", "--learner", "er", "--hidden", "16"]
FAST += ["--memory-size", "20", "--batch-size", "10", "--memory-batch-size", "10"]


def test_an_online_run_records_the_anytime_accuracy(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    argv = ["run", "--online", "--eval-every", "20", "--blurry", "0.1"]
    argv += ["--class-order", "seed:3", "--output-dir", str(out), *FAST]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["online"] is True and results["config"]["epochs"] == 1
    assert results["config"]["class_order"] == "seed:3" and results["config"]["blurry"] == 0.1
    run = results["runs"][0]
    order = shuffled_classes(range(10), 3)
    assert run["class_groups"] == [sorted(order[i : i + 2]) for i in range(0, 10, 2)]
    curve = run["anytime_accuracy"]
    assert curve["every"] == 20 and curve["step"][:3] == [20, 40, 60]
    assert curve["tasks_seen"][0] == 1 and curve["tasks_seen"][-1] == 5
    assert all(0.0 <= value <= 1.0 for value in curve["accuracy"])
    # one pass: the samples seen are the training pool (270 training digits per task, about)
    assert curve["samples"][-1] == sum(
        len(t) for t in _split_digits_train(seed=0, order="seed:3", blurry=0.1)
    )
    assert run["metrics"]["anytime_accuracy"] == pytest.approx(curve["area"])
    if pytest.importorskip("matplotlib"):
        assert (out / "anytime_accuracy.png").read_bytes().startswith(b"\x89PNG")


def _split_digits_train(seed: int, order: str, blurry: float) -> list:
    from renate_events.scenarios import split_digits

    tasks = split_digits(seed=seed, class_order=order, blurry=blurry).tasks()
    return [task.train for task in tasks]


def test_a_class_order_list_is_recorded(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    order = "9,8,7,6,5,4,3,2,1,0"
    argv = ["run", "--class-order", order, "--epochs", "1", "--output-dir", str(out), *FAST]
    assert main(argv) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["class_groups"] == [[8, 9], [6, 7], [4, 5], [2, 3], [0, 1]]


def test_a_toml_list_for_a_string_setting_says_how_to_write_it(tmp_path, capsys) -> None:
    config = tmp_path / "c6.toml"
    config.write_text("class_order = [3, 1]\n")
    out = tmp_path / "out"
    argv = ["run", "--config", str(config), "--output-dir", str(out), *FAST]
    one_line_cli_error(
        capsys,
        argv,
        "--class-order must be a non-empty string, got [3, 1]; write a list as one string, "
        f'comma-separated as on the command line: "3,1" (in {config})',
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--blurry", "1.5"], ["--blurry must be a number in [0, 1], got 1.5"]),
        (["--blurry", "-0.1"], ["--blurry must be a number in [0, 1]"]),
        (["--scenario", "permuted-digits", "--blurry", "0.2"], ["class-incremental scenarios"]),
        (["--scenario", "rotated-digits", "--class-order", "seed:1"], ["--class-order is for"]),
        (["--eval-every", "5"], ["--eval-every", "add --online"]),
        (["--online", "--epochs", "5"], ["--online trains one pass", "--epochs 5"]),
        (["--online", "--eval-every", "0"], ["--eval-every must be >= 1, got 0"]),
        (["--class-order", "1,2,3"], ["--class-order 1,2,3", "exactly once"]),
        (["--class-order", "a,b"], ["--class-order a,b: give seed:N"]),
        (["--class-order", "seed:x"], ["seed:N"]),
    ],
)
def test_bad_stream_options_are_one_line_before_training(tmp_path, capsys, argv, words) -> None:
    out = tmp_path / "out"
    one_line_cli_error(capsys, ["run", *argv, "--output-dir", str(out), *FAST], *words)
    assert not out.exists()


def test_missing_tiny_imagenet_files_are_one_line(tmp_path, capsys) -> None:
    pytest.importorskip("PIL")
    out = tmp_path / "out"
    argv = ["run", "--scenario", "seq-tinyimagenet", "--data-dir", str(tmp_path / "none")]
    one_line_cli_error(capsys, [*argv, "--output-dir", str(out)], "tiny-imagenet-200.zip")
    (tmp_path / "data" / "tiny-imagenet-200").mkdir(parents=True)
    argv = ["run", "--scenario", "seq-tinyimagenet", "--data-dir", str(tmp_path / "data")]
    one_line_cli_error(capsys, [*argv, "--output-dir", str(out)], "wnids.txt' is missing")
    assert not out.exists()


def test_every_image_scenario_names_its_files(capsys) -> None:
    assert {"seq-tinyimagenet", "hue-shift-cifar10", "rotated-tinyimagenet"} <= set(IMAGE_SCENARIOS)
    for name in ("seq-tinyimagenet", "hue-shift-cifar100", "permuted-cifar10"):
        one_line_cli_error(capsys, ["run", "--scenario", name], "give --data-dir DIR")


@pytest.mark.slow
def test_seq_tinyimagenet_runs_on_the_folder_layout(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("PIL")
    from tests.renate_events.datasets.test_images_tiny_imagenet import write_tiny_imagenet

    wnids = tuple(f"n{i:03d}" for i in range(40))  # two tasks of twenty classes
    write_tiny_imagenet(tmp_path / "data", per_class=1, val_per_class=1, wnids=wnids)
    out = tmp_path / "out"
    argv = ["run", "--scenario", "seq-tinyimagenet", "--data-dir", str(tmp_path / "data")]
    argv += ["--model", "mlp", "--no-augment", "--online", "--output-dir", str(out), *FAST]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    run = results["runs"][0]
    assert run["class_groups"] == [list(range(20)), list(range(20, 40))]
    manifest = json.loads((out / "state" / "seed-0" / "manifest.json").read_text())
    assert manifest["metadata"]["model"]["transforms"] == "tinyimagenet"
    assert manifest["metadata"]["model"]["inputs"] == [3, 8, 8]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hue-shift", "rotated", "permuted"])
def test_domain_incremental_cifar10_runs(tmp_path: pathlib.Path, kind: str) -> None:
    write_cifar10(tmp_path / "data" / "cifar-10-batches-bin", per_class=3, test_per_class=1)
    out = tmp_path / "out"
    argv = ["run", "--scenario", f"{kind}-cifar10", "--data-dir", str(tmp_path / "data")]
    argv += ["--model", "mlp", "--epochs", "1", "--output-dir", str(out), *FAST]
    assert main(argv) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert len(run["class_groups"]) == 5
    if kind != "hue-shift":  # every task has every class
        assert all(group == list(range(10)) for group in run["class_groups"])


def test_seq_tinyimagenet_with_a_part_of_the_classes_ends_with_a_smaller_task(tmp_path) -> None:
    """A folder of 10 or 50 classes (a part of Tiny-ImageNet) gives tasks of twenty and a last
    task of the rest, with or without a class order; before, the sorted groups named classes
    the data does not have and the scenario refused them ("remove them from class_groups", an
    argument the command line does not have)."""
    pytest.importorskip("PIL")
    from renate_events.scenarios import seq_tinyimagenet
    from tests.renate_events.datasets.test_images_tiny_imagenet import write_tiny_imagenet

    for count, sizes in ((10, [10]), (50, [20, 20, 10])):
        wnids = tuple(f"n{i:03d}" for i in range(count))
        write_tiny_imagenet(tmp_path / str(count), per_class=1, val_per_class=1, wnids=wnids)
        for order in (None, "seed:1"):
            scenario = seq_tinyimagenet(tmp_path / str(count), class_order=order)
            assert [len(task.classes) for task in scenario.tasks()] == sizes


def test_a_scenario_of_one_task_is_one_line_before_training(tmp_path, capsys) -> None:
    """Ten wnids of Tiny-ImageNet make one task of the twenty-class split: the run trained, then
    stopped with a traceback ("forgetting is undefined for 1 task(s)") and no results."""
    pytest.importorskip("PIL")
    from tests.renate_events.datasets.test_images_tiny_imagenet import write_tiny_imagenet

    wnids = tuple(f"n{i:03d}" for i in range(10))
    write_tiny_imagenet(tmp_path / "data", per_class=1, val_per_class=1, wnids=wnids)
    out = tmp_path / "out"
    argv = ["run", "--scenario", "seq-tinyimagenet", "--data-dir", str(tmp_path / "data")]
    argv += [
        "--model",
        "mlp",
        "--no-augment",
        "--class-order",
        "seed:1",
        "--output-dir",
        str(out),
        *FAST,
    ]
    one_line_cli_error(capsys, argv, "gives 1 task", "at least 2")
    assert not out.exists()
