"""The renate-events command: run, update, evaluate, configuration and errors."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

pytest.importorskip("sklearn")

from renate_events.cli import main
from tests.helpers import one_line_cli_error


def test_run_writes_results_and_state(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "run",
            "--epochs",
            "2",
            "--seeds",
            "0",
            "1",
            "--output-dir",
            str(out),
            "--no-progress",
            "--learner",
            "er",
            "--memory-size",
            "50",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "er on split-digits, 2 seed(s)" in printed and "average_accuracy" in printed
    results = json.loads((out / "results.json").read_text())
    assert [run["seed"] for run in results["runs"]] == [0, 1]
    rows = results["runs"][0]["class_incremental"]["rows"]
    assert len(rows) == 5 and all(len(row) == 5 for row in rows)
    assert (out / "metrics.csv").read_text().startswith("seed,metric,value")
    assert (out / "state" / "seed-1" / "manifest.json").exists()
    pytest.importorskip("matplotlib")
    assert (out / "accuracy_matrix.png").stat().st_size > 1000


def test_config_file_and_flags_override_it(tmp_path, capsys):
    config = tmp_path / "exp.toml"
    config.write_text(
        f'learner = "fine-tuning"\nepochs = 1\nhidden = [32]\noutput-dir = "{tmp_path / "cfg"}"\n'
    )
    assert main(["run", "--config", str(config), "--epochs", "2", "--no-progress"]) == 0
    results = json.loads((tmp_path / "cfg" / "results.json").read_text())
    assert results["config"]["learner"] == "fine-tuning"
    assert results["config"]["epochs"] == 2 and results["config"]["hidden"] == [32]
    config.write_text("learning_rate = 0.1\n")
    assert main(["run", "--config", str(config)]) == 2
    assert "unknown options ['learning_rate']" in capsys.readouterr().err


def test_update_and_evaluate_through_state_folders(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", "--epochs", "1", "--output-dir", str(out), "--no-progress"]) == 0
    data = tmp_path / "new.safetensors"
    import safetensors.torch

    safetensors.torch.save_file(
        {"inputs": torch.rand(40, 64), "targets": torch.randint(0, 10, (40,))}, str(data)
    )
    state = out / "state" / "seed-0"
    assert (
        main(
            [
                "update",
                "--input-state",
                str(state),
                "--data",
                str(data),
                "--output-state",
                str(tmp_path / "next"),
                "--no-progress",
            ]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "next" / "manifest.json").read_text())
    assert manifest["updates"] == 6
    capsys.readouterr()
    assert main(["evaluate", "--state", str(tmp_path / "next"), "--data", str(data)]) == 0
    assert "average accuracy" in capsys.readouterr().out
    assert main(["evaluate", "--state", str(tmp_path / "next"), "--scenario", "split-digits"]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--epochs", "0"], "--epochs must be >= 1"),
        (  # optional in update (None: the input state's), worded as in run
            [
                *("update", "--input-state", "x", "--data", "d.npz", "--output-state", "y"),
                "--epochs",
                "0",
            ],
            "--epochs must be >= 1, got 0",
        ),
        (["run", "--scenario", "imagenet"], "unknown --scenario 'imagenet'"),
        (
            ["evaluate", "--state", "/nonexistent", "--scenario", "split-digits"],
            "is not a state folder",
        ),
        (
            ["update", "--input-state", "x", "--data", "missing.npz", "--output-state", "y"],
            "--data missing.npz: no such file",
        ),
        (["run", "--buffer-filling", "epoch"], "--buffer-filling must be one of ['step', 'end']"),
        (["run", "--buffer-filling", "end", "--memory-size", "0"], "memory_size >= 1 or"),
        (["run", "--learner", "repeated-distill", "--memory-size", "0"], "must be an int >= 1"),
        (["run", "--learner", "repeated-distill", "--buffer-filling", "end"], "must be 'step'"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_code_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_data_file_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    out = tmp_path / "out"
    main(["run", "--epochs", "1", "--output-dir", str(out), "--no-progress"])
    capsys.readouterr()
    code = main(
        [
            "update",
            "--input-state",
            str(out / "state" / "seed-0"),
            "--data",
            str(bad),
            "--output-state",
            str(tmp_path / "n"),
        ]
    )
    assert code == 2 and "is not a readable .npz file" in capsys.readouterr().err


def test_console_script_help_for_every_subcommand(capsys):
    done = subprocess.run(  # the module as a console script, once
        [sys.executable, "-m", "renate_events.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "usage: renate-events" in done.stdout
    assert "example" in done.stdout.lower()
    for command in (["run"], ["update"], ["evaluate"], ["shift"]):
        with pytest.raises(SystemExit) as exited:
            main([*command, "--help"])
        out = capsys.readouterr().out
        assert exited.value.code == 0 and "usage: renate-events" in out, command
        assert "example" in out.lower(), command


def test_run_reports_flip_rates_consistent_with_the_accuracy_matrix(tmp_path):
    out = tmp_path / "out"
    args = ["run", "--epochs", "1", "--learner", "er", "--memory-size", "50", "--hidden", "32"]
    assert main([*args, "--output-dir", str(out), "--no-progress"]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    rows = run["class_incremental"]["rows"]
    from renate_events.scenarios import split_digits

    sizes = [len(task.test) for task in split_digits(seed=0).tasks()]
    micro = [sum(a * n for a, n in zip(row, sizes)) / sum(sizes) for row in rows]
    assert [flip["update"] for flip in run["regression"]] == [1, 2, 3, 4]
    for flip, before, after in zip(run["regression"], micro, micro[1:]):
        # what the new version gains on all test sets = its positive minus its negative flips
        assert flip["pfr"] - flip["nfr"] == pytest.approx(after - before, abs=1e-9)
    assert run["metrics"]["negative_flip_rate"] == pytest.approx(
        sum(flip["nfr"] for flip in run["regression"]) / 4
    )


def test_run_evaluates_each_update_in_one_pass_over_the_test_sets(tmp_path, monkeypatch):
    from renate_events import evaluation

    calls = []
    for name in ("evaluate", "evaluate_row"):
        original = getattr(evaluation, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(evaluation, name, spy)
    args = ["run", "--epochs", "1", "--learner", "er", "--memory-size", "50", "--no-progress"]
    assert main([*args, "--output-dir", str(tmp_path / "out")]) == 0
    # the untrained model (for forward transfer), then both rows and the flips of each update
    assert calls == ["evaluate"] + ["evaluate_row"] * 5


def _edit_checkpoint_tree(state: Any, edit: Any) -> None:
    """Rewrite ``state``'s learner.safetensors with ``edit(tree)`` applied, its checksums and the
    manifest's made to match (a hand-crafted folder that every checksum vouches for)."""
    path = state / "learner.safetensors"
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    tree = json.loads(metadata["tree"])
    edit(tree)
    metadata["tree"] = json.dumps(tree, separators=(",", ":"))
    fields = [metadata[key] for key in ("format", "format_version", "tree")]
    checksums = json.loads(metadata["checksums"])
    checksums["tree"] = hashlib.sha256(
        json.dumps(fields, separators=(",", ":")).encode()
    ).hexdigest()
    metadata["checksums"] = json.dumps(checksums, separators=(",", ":"))
    save_file(tensors, str(path), metadata=metadata)
    manifest = json.loads((state / "manifest.json").read_text())
    manifest["files"]["learner.safetensors"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (state / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.hostile
def test_a_component_refusing_the_state_folders_checkpoint_is_one_line(
    tmp_path: Any, capsys: Any
) -> None:
    # A listener refusing its state on load came out as the trainer's ListenerError: a
    # traceback on the command line instead of an error naming the folder's file.
    run = ["run", "--learner", "lwf", "--epochs", "1", "--no-progress"]
    assert main([*run, "--output-dir", str(tmp_path / "run")]) == 0
    state = tmp_path / "run" / "state" / "seed-0"
    _edit_checkpoint_tree(state, lambda tree: tree["listeners"]["lwf"].update(updates=-1))
    x = np.random.default_rng(0).random((16, 64), dtype=np.float32)
    np.savez(tmp_path / "new.npz", inputs=x, targets=np.arange(16) % 2)
    capsys.readouterr()
    for argv in (
        ["update", "--input-state", str(state), "--output-state", str(tmp_path / "out")],
        ["evaluate", "--state", str(state)],
    ):
        assert main([*argv, "--data", str(tmp_path / "new.npz")]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert str(state / "learner.safetensors") in line and "'updates' must be" in line
    assert not (tmp_path / "out").exists()


_SMALL_CONFIG = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Linear(4, 2)


def data_fn(chunk_id, seed):
    g = torch.Generator().manual_seed(100 * chunk_id + seed)
    x = torch.randn(32, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())
"""


def test_update_replaces_another_lineages_state_only_with_overwrite(tmp_path, capsys):
    (tmp_path / "c.py").write_text(_SMALL_CONFIG)

    def update(out, *extra):
        args = ["update", "--config-file", tmp_path / "c.py", "--output-state", tmp_path / out]
        return main([*map(str, args), "--device", "cpu", "--no-progress", *map(str, extra)])

    assert update("a") == 0 and update("b", "--seed", 1) == 0  # two lineages
    assert update("c", "--input-state", tmp_path / "a") == 0
    assert update("c", "--input-state", tmp_path / "a") == 0  # a rerun: c continues a
    before = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
    capsys.readouterr()
    assert update("b", "--input-state", tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert "holds a state folder of another lineage" in err and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()} == before
    assert update("b", "--input-state", tmp_path / "a", "--overwrite") == 0
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["updates"] == 2


def test_run_replaces_an_earlier_run_only_with_overwrite(tmp_path, capsys):
    test_data = "\n\ndef test_data_fn(chunk_id, seed):\n    return data_fn(chunk_id, seed + 1)\n"
    (tmp_path / "c.py").write_text(_SMALL_CONFIG + test_data)
    out = tmp_path / "out"
    args = ["run", "--config-file", tmp_path / "c.py", "--chunks", "2", "--output-dir", out]
    args = [*map(str, args), "--device", "cpu", "--no-progress", "--epochs", "1"]
    assert main(args) == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    capsys.readouterr()
    assert main([*args, "--seeds", "0", "1"]) == 2  # seed 0's state folder would be replaced
    err = capsys.readouterr().err
    assert "holds an earlier run's" in err and "state/seed-0" in err and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    assert main([*args, "--overwrite"]) == 0
    assert (out / "results.json").stat().st_mtime_ns > before[out / "results.json"]


def test_evaluate_and_predict_read_a_state_without_its_optimizer_fn(tmp_path, capsys):
    test_data = "\n\ndef test_data_fn(chunk_id, seed):\n    return data_fn(chunk_id, seed + 1)\n"
    plain = _SMALL_CONFIG + test_data
    sgd = plain + "\n\ndef optimizer_fn(params):\n    return torch.optim.SGD(params, lr=0.1)\n"
    (tmp_path / "plain.py").write_text(plain)
    (tmp_path / "sgd.py").write_text(sgd)
    (tmp_path / "wider.py").write_text(plain.replace("Linear(4, 2)", "Linear(4, 3)"))
    state = str(tmp_path / "s")
    update = ["update", "--config-file", str(tmp_path / "sgd.py"), "--output-state", state]
    assert main([*update, "--device", "cpu", "--no-progress", "--epochs", "1"]) == 0
    read = ["--state", state, "--accept-config-change", "--config-file"]
    capsys.readouterr()
    assert main(["evaluate", *read, str(tmp_path / "plain.py")]) == 0  # it never trains
    assert "chunk 0: accuracy" in capsys.readouterr().out
    assert main(["predict", *read, str(tmp_path / "plain.py"), "--chunk-id", "0"]) == 0
    assert "32 samples" in capsys.readouterr().out
    wider = ["evaluate", *read, str(tmp_path / "wider.py")]  # the mismatch itself is said
    one_line_cli_error(capsys, wider, "'weight' is float32 (2, 4) in the folder, float32 (3, 4)")


_NAN_CONFIG = _SMALL_CONFIG.replace(
    "def model_fn():\n    return torch.nn.Linear(4, 2)",
    '''class _NanLater(torch.nn.Linear):
    """A model whose outputs turn NaN from its second training forward on."""

    calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
        out = super().forward(x)
        return out * float("nan") if self.calls > 1 else out


def model_fn():
    return _NanLater(4, 2)''',
)


def test_nonfinite_loss_is_a_flag_and_its_error_names_it(tmp_path, capsys):
    (tmp_path / "c.py").write_text(_NAN_CONFIG)
    args = ["update", "--config-file", str(tmp_path / "c.py"), "--device", "cpu", "--no-progress"]
    assert main([*args, "--output-state", str(tmp_path / "a"), "--epochs", "3"]) == 2
    err = capsys.readouterr().err
    assert "the loss is nan" in err and "pass --nonfinite-loss skip to skip" in err
    assert "Trainer(" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists()
    out = ["--output-state", str(tmp_path / "a"), "--epochs", "3"]
    assert main([*args, *out, "--nonfinite-loss", "skip"]) == 0
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["trainer"]["nonfinite_loss"] == "skip"
    assert manifest["history"][0]["steps"] == 3  # one batch an epoch; two of them skipped
    capsys.readouterr()
    assert main(["update", "--nonfinite-loss", "off"]) == 2
    assert "--nonfinite-loss: invalid choice: 'off'" in capsys.readouterr().err


def test_capture_is_a_flag_kept_in_the_state_and_graph_needs_cuda(tmp_path, capsys, monkeypatch):
    (tmp_path / "c.py").write_text(_SMALL_CONFIG)
    args = ["update", "--config-file", str(tmp_path / "c.py"), "--device", "cpu", "--no-progress"]
    out = ["--output-state", str(tmp_path / "a"), "--epochs", "2"]
    one_line_cli_error(
        capsys,
        [*args, *out, "--capture", "graph"],
        "--capture graph records CUDA graphs and needs a CUDA device, got --device 'cpu'",
        "use --capture compile",
    )
    assert not (tmp_path / "a").exists()
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda function, **kw: compiled.append(kw) or function)
    assert main([*args, *out, "--capture", "compile"]) == 0
    assert compiled == [{}, {}, {}]  # step, val_step, optimizer step: torch.compile's default mode
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["trainer"]["capture"] == "compile"
    capsys.readouterr()
    assert main(["update", "--capture", "cudagraph"]) == 2
    assert "--capture: invalid choice: 'cudagraph'" in capsys.readouterr().err
