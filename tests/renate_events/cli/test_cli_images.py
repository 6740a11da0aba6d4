"""The command line on images: ``run --scenario seq-cifar10/100 --data-dir --model``, the state
folder of a zoo model through ``update`` and ``evaluate``, and every bad input as one line."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import safetensors.torch
import torch

from renate_events.cli import main
from renate_events.cli._options import RunOptions, check_options
from renate_events.cli._parser import parse
from renate_events.cli._zoo import IMAGE_DATA, resolved_model
from renate_events.scenarios import IMAGE_SCENARIOS
from tests.helpers import one_line_cli_error
from tests.renate_events.datasets.test_readers_cifar import write_cifar10, write_cifar100

SLOW = pytest.mark.slow  # one ResNet-18 run (about 5 s on a shared CPU), shared by these tests
FAST = ["--epochs", "1", "--no-progress", "--device", "cpu", "--learner", "er"]
FAST += ["--memory-size", "20", "--batch-size", "8", "--memory-batch-size", "8"]


@pytest.fixture(scope="module")
def cifar10(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("cifar10")
    write_cifar10(root / "cifar-10-batches-bin", per_class=2, test_per_class=1)
    return root


@pytest.fixture(scope="module")
def resnet_run(cifar10, tmp_path_factory) -> pathlib.Path:
    """One run of a ResNet-18 of width 4 on Seq-CIFAR-10, its model chosen in a TOML file."""
    out = tmp_path_factory.mktemp("run") / "out"
    toml = out.parent / "experiment.toml"
    toml.write_text('scenario = "seq-cifar10"\nmodel = "resnet18"\nmodel-args = {nf = 4}\n')
    argv = ["run", "--config", str(toml), "--data-dir", str(cifar10), "--output-dir", str(out)]
    assert main([*argv, *FAST]) == 0
    return out


@SLOW
def test_run_seq_cifar10_with_a_zoo_model(resnet_run):
    results = json.loads((resnet_run / "results.json").read_text())
    assert results["config"]["model"] == "resnet18"
    assert results["config"]["model_args"] == {"nf": 4}
    assert results["config"]["hidden"] is None
    rows = results["runs"][0]["class_incremental"]["rows"]
    assert len(rows) == 5 and all(len(row) == 5 for row in rows)
    assert all(0.0 <= value <= 1.0 for row in rows for value in row)
    manifest = json.loads((resnet_run / "state" / "seed-0" / "manifest.json").read_text())
    assert manifest["metadata"]["model"] == {
        "kind": "zoo",
        "name": "resnet18",
        "args": {"nf": 4, "num_classes": 10, "in_channels": 3},
        "inputs": [3, 32, 32],
        "classes": 10,
        "transforms": "cifar10",
        "augment": True,
    }
    assert manifest["architecture"] == "resnet18(nf=4)"
    functions = manifest["history"][-1]["functions"]
    assert {"train_transform", "buffer_transform", "test_transform"} <= set(functions)
    # the buffer holds the raw uint8 images; the transforms make floats per batch
    checkpoint = safetensors.torch.load_file(str(resnet_run / "state/seed-0/learner.safetensors"))
    stored = [t for name, t in checkpoint.items() if "buffer" in name and t.dim() == 4]
    assert stored and all(t.dtype == torch.uint8 and t.shape[1:] == (3, 32, 32) for t in stored)


def _images_file(path: pathlib.Path, inputs: torch.Tensor) -> pathlib.Path:
    targets = torch.arange(len(inputs)) % 10
    safetensors.torch.save_file({"inputs": inputs, "targets": targets}, str(path))
    return path


@pytest.mark.gpu
def test_a_run_on_a_gpu_evaluates_there_from_the_untrained_model_on(cifar10, tmp_path, monkeypatch):
    from renate_events import evaluation
    from renate_events.inference import model_device

    seen = []
    for name in ("evaluate", "evaluate_row"):
        original = getattr(evaluation, name)

        def spy(model, tasks, *args, _original=original, **kwargs):
            places = {t.device.type for task in tasks for t in task.test.tensors}
            seen.append((model_device(model).type, sorted(places)))
            return _original(model, tasks, *args, **kwargs)

        monkeypatch.setattr(evaluation, name, spy)
    argv = ["run", "--scenario", "seq-cifar10", "--data-dir", str(cifar10), "--model", "resnet18"]
    argv += ["--model-args", "{nf = 4}", "--output-dir", str(tmp_path / "out")]
    assert main([*argv, *FAST, "--device", "cuda"]) == 0  # the last --device counts
    # the model on the GPU before the untrained model's evaluation, the test sets kept there
    assert seen == [("cuda", ["cuda"])] * 6


@SLOW
def test_update_and_evaluate_keep_the_zoo_model(resnet_run, cifar10, tmp_path, capsys):
    state = resnet_run / "state" / "seed-0"
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    data = _images_file(tmp_path / "new.safetensors", images)
    toml = tmp_path / "update.toml"
    toml.write_text('model = "resnet18"\nmodel-args = {nf = 4}\n')  # a check, not a search
    argv = ["update", "--input-state", str(state), "--data", str(data), "--config", str(toml)]
    assert main([*argv, "--output-state", str(tmp_path / "next"), "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "next" / "manifest.json").read_text())
    assert manifest["updates"] == 6 and manifest["metadata"]["model"]["name"] == "resnet18"
    capsys.readouterr()
    assert main(["evaluate", "--state", str(tmp_path / "next"), "--data", str(data)]) == 0
    assert "task 0: accuracy" in capsys.readouterr().out

    argv = ["evaluate", "--state", str(tmp_path / "next"), "--scenario", "seq-cifar10"]
    assert main([*argv, "--data-dir", str(cifar10)]) == 0
    printed = capsys.readouterr().out
    assert "task 4: accuracy" in printed and "(2 samples)" in printed
    one_line_cli_error(capsys, argv, "give --data-dir DIR")
    one_line_cli_error(capsys, [*argv[:4], "split-digits"], "the samples have the shape (64,)")
    argv = ["evaluate", "--state", str(tmp_path / "next"), "--data", str(data)]
    one_line_cli_error(capsys, [*argv, "--data-dir", str(cifar10)], "--scenario is not given")
    floats = tmp_path / "floats.npz"  # the dtype the file stores is the one the message names
    np.savez(floats, inputs=images.float().numpy(), targets=np.zeros(8, dtype=np.int64))
    one_line_cli_error(capsys, [*argv[:-1], str(floats)], "got torch.float32 values")


@SLOW
def test_evaluate_refuses_a_scenario_whose_later_tasks_exceed_the_models_classes(
    resnet_run, tmp_path, capsys
):
    write_cifar100(tmp_path / "cifar-100-binary", per_class=1)  # task 0: labels 0..9, then more
    argv = ["evaluate", "--state", str(resnet_run / "state" / "seed-0"), "--scenario"]
    argv += ["seq-cifar100", "--data-dir", str(tmp_path)]
    one_line_cli_error(capsys, argv, "the labels range over [10, 19]", "has 10 classes")


def test_run_seq_cifar100_with_the_zoo_mlp(tmp_path):
    write_cifar100(tmp_path / "c100" / "cifar-100-binary", per_class=1)
    out = tmp_path / "out"
    argv = ["run", "--scenario", "seq-cifar100", "--data-dir", str(tmp_path / "c100")]
    argv += ["--model", "mlp", "--hidden", "8", "--no-augment", "--output-dir", str(out)]
    assert main([*argv, *FAST]) == 0
    rows = json.loads((out / "results.json").read_text())["runs"][0]["class_incremental"]["rows"]
    assert len(rows) == 10 and all(len(row) == 10 for row in rows)
    spec = json.loads((out / "state/seed-0/manifest.json").read_text())["metadata"]["model"]
    assert spec["args"] == {"inputs": 3072, "num_classes": 100, "hidden": [8]}
    assert spec["transforms"] == "cifar100" and spec["augment"] is False


def test_every_image_scenario_has_its_files_described():
    assert set(IMAGE_DATA) == set(IMAGE_SCENARIOS)


def test_the_default_models():
    def resolved(*argv):
        _, values, _ = parse(["run", *argv])
        options = resolved_model(check_options(RunOptions, values))
        return options.model, options.model_args, options.hidden

    assert resolved() == ("mlp", {}, [256])  # as before zoo models: nothing changes
    assert resolved("--scenario", "seq-cifar10", "--data-dir", "d") == (
        "resnet18",
        {"nf": 20},
        None,
    )
    assert resolved("--scenario", "seq-cifar100", "--data-dir", "d", "--model", "resnet32") == (
        "resnet32",
        {},
        None,
    )


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--scenario", "seq-cifar10"], ["give --data-dir", "data_batch_1.bin", "kriz/cifar.html"]),
        (["--scenario", "seq-cifar100"], ["give --data-dir", "cifar-100-binary/train.bin"]),
        (["--data-dir", "somewhere"], ["--data-dir is for the image scenarios"]),
        (["--model", "resnet18"], ["--model resnet18 takes images", "--model mlp"]),
        (["--model", "resnet50"], ["argument --model: invalid choice: 'resnet50'"]),
        (["--model-args", "nf"], ["--model-args must be a table", "{nf = 20}"]),
        (["--hidden", "8", "--model-args", "{hidden = [8]}"], ["give them with --hidden"]),
    ],
)
def test_bad_model_and_scenario_options(capsys, tmp_path, extra, words):
    one_line_cli_error(capsys, ["run", *extra, "--output-dir", str(tmp_path / "o")], *words)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--model", "resnet32", "--model-args", '{"nf": 4}'], ["does not take ['nf']"]),
        (["--model-args", "{num_classes = 3}"], ["['num_classes'] come from the scenario"]),
        (["--model-args", "{nf = 0}"], ["--model-args: resnet18: nf"]),
        (["--model", "vit", "--model-args", "{depth = 1000}"], ["--model-args depth must be"]),
        (["--model-args", '{nf = "wide"}'], ["--model-args nf must be an int"]),
        (["--model", "vit", "--hidden", "8"], ["--hidden sizes --model mlp"]),
    ],
)
def test_bad_model_arguments_on_images(capsys, cifar10, tmp_path, extra, words):
    argv = ["run", "--scenario", "seq-cifar10", "--data-dir", str(cifar10), *extra]
    one_line_cli_error(capsys, [*argv, "--output-dir", str(tmp_path / "o")], *words)
    assert not (tmp_path / "o").exists()


def test_missing_or_corrupt_cifar_files(capsys, tmp_path):
    run = ["run", "--scenario", "seq-cifar10", "--output-dir", str(tmp_path / "o")]
    one_line_cli_error(capsys, [*run, "--data-dir", str(tmp_path / "none")], "does not exist")
    write_cifar100(tmp_path / "c100", per_class=1)  # CIFAR-100 files where CIFAR-10 ones belong
    one_line_cli_error(
        capsys,
        [*run, "--data-dir", str(tmp_path / "c100")],
        "'data_batch_1.bin' not found",
        "kriz/cifar.html",
    )
    write_cifar10(tmp_path / "c10", per_class=1, test_per_class=1)
    (tmp_path / "c10" / "data_batch_3.bin").write_bytes(bytes(3073 * 2 + 5))
    one_line_cli_error(
        capsys,
        [*run, "--data-dir", str(tmp_path / "c10")],
        "data_batch_3.bin",
        "not a positive multiple of the CIFAR-10 record size",
    )
    assert not (tmp_path / "o").exists()


@SLOW
def test_a_later_update_keeps_the_architecture(resnet_run, tmp_path, capsys):
    state = resnet_run / "state" / "seed-0"
    data = _images_file(tmp_path / "d.safetensors", torch.zeros(4, 3, 32, 32, dtype=torch.uint8))
    update = ["update", "--input-state", str(state), "--data", str(data)]
    update += ["--output-state", str(tmp_path / "next"), "--no-progress"]
    one_line_cli_error(capsys, [*update, "--model", "vit"], "--model vit", "holds a resnet18 model")
    one_line_cli_error(capsys, [*update, "--model-args", "{nf = 8}"], "nf = 8", "with nf = 4")
    floats = _images_file(tmp_path / "f.safetensors", torch.rand(4, 3, 32, 32))
    one_line_cli_error(
        capsys,
        [*update[:3], "--data", str(floats), *update[5:]],
        "must be raw images, integers 0..255",
    )
    flat = _images_file(tmp_path / "flat.safetensors", torch.zeros(4, 64, dtype=torch.uint8))
    one_line_cli_error(capsys, [*update[:3], "--data", str(flat), *update[5:]], "shape (64,)")
    assert not (tmp_path / "next").exists()


@pytest.mark.hostile
@SLOW
@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"args": {"nf": 4096, "num_classes": 10, "in_channels": 3}}, "larger than the checkpoint"),
        ({"name": "vit", "args": {"depth": 10**6, "num_classes": 10}}, "args' depth must be"),
        ({"name": "resnet50"}, "metadata.model.name' must be one of"),
        ({"transforms": "imagenet"}, "metadata.model.transforms' must be one of"),
        ({"classes": 11}, "num_classes' must equal its key 'classes'"),
        ({"inputs": [1, 32, 32]}, "args.in_channels' does not fit its key 'inputs'"),
    ],
)
def test_a_tampered_model_description_is_refused(resnet_run, tmp_path, capsys, change, words):
    import shutil

    state = tmp_path / "state"
    shutil.copytree(resnet_run / "state" / "seed-0", state)
    manifest = json.loads((state / "manifest.json").read_text())
    manifest["metadata"]["model"].update(change)  # nf 4096 would be terabytes, were it built
    (state / "manifest.json").write_text(json.dumps(manifest))
    data = _images_file(tmp_path / "d.safetensors", torch.zeros(2, 3, 32, 32, dtype=torch.uint8))
    one_line_cli_error(capsys, ["evaluate", "--state", str(state), "--data", str(data)], words)


def test_a_data_file_whose_inputs_and_targets_differ_in_length_is_one_line(tmp_path, capsys):
    data = tmp_path / "data.safetensors"
    inputs = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    safetensors.torch.save_file({"inputs": inputs, "targets": torch.arange(5)}, str(data))
    argv = ["evaluate", "--state", str(tmp_path / "state"), "--data", str(data)]
    one_line_cli_error(capsys, argv, "same length", "6 and 5")
