"""Every example config file through the command line as a user runs it: `update` twice, in two
processes, then `evaluate`; the same numbers as the same steps through the Python API."""

from __future__ import annotations

import os
import re

import pytest
import safetensors.torch
import torch

from renate_events import evaluation
from renate_events.cli._evaluate import ChunkTask, for_evaluation
from renate_events.config import load_config
from renate_events.state_folder import read_manifest
from renate_events.updater import ModelUpdater, dataset_tensors
from tests.helpers import ROOT, run_cli
from tests.renate_events.datasets.test_readers_cifar import write_cifar10

CONFIGS = ROOT / "examples" / "configs"
SETTINGS = ["--learner", "er", "--memory-size", "40", "--memory-batch-size", "8"]
SETTINGS += ["--batch-size", "16", "--epochs", "1", "--device", "cpu", "--no-progress"]


def _cli(*args, env=None):
    """The command in a process of its own, with one thread as this process has
    (tests/conftest.py): convolutions sum in another order with another thread count, so the
    weights would differ in the last bits."""
    code, stdout, stderr = run_cli(*args, env=env, timeout=600)
    assert code == 0, stderr[-2000:]
    return stdout


def _python_api(config_path, env, chunks):
    """The same two updates in this process; the model after them."""
    old = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        config = load_config(config_path)
        torch.manual_seed(0)
        updater = ModelUpdater.from_config(
            config,
            learner="er",
            learner_kwargs={"memory_size": 40, "memory_batch_size": 8, "batch_size": 16, "seed": 0},
            max_epochs=1,
            trainer_kwargs={"device": "cpu", "precision": "32"},
        )
        for chunk in chunks:
            updater.update(*config.data(chunk, 0), task_id=chunk)
        tests = [config.test_data(chunk, 0) or config.data(chunk, 0)[1] for chunk in chunks]
        return updater.model, config, tests
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_example(config_path, tmp_path, env=None):
    """Two updates in two processes and an evaluation, compared with the Python API."""
    env = env or {}
    s0, s1 = tmp_path / "s0", tmp_path / "s1"
    _cli("update", "--config-file", config_path, "--output-state", s0, *SETTINGS, env=env)
    _cli("update", "--config-file", config_path, "--input-state", s0, "--output-state", s1,
         "--no-progress", env=env)  # fmt: skip
    printed = _cli("evaluate", "--config-file", config_path, "--state", s1, env=env)
    model, config, tests = _python_api(config_path, env, (0, 1))
    saved = safetensors.torch.load_file(str(s1 / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0, msg=name)
    evaluated = for_evaluation(model, config)  # with the config's test transform, if any
    for chunk, test in enumerate(tests):
        data = torch.utils.data.TensorDataset(*dataset_tensors(test, config.collate(), "test"))
        accuracy = evaluation.evaluate(evaluated, [evaluation_task(chunk, data)])[0]
        shown = re.search(rf"chunk {chunk}: accuracy ([0-9.]+)", printed).group(1)
        assert shown == f"{accuracy:.4f}"
    assert read_manifest(s1)["updates"] == 2


def evaluation_task(chunk, data):
    classes = tuple(sorted(set(data.tensors[1].tolist())))
    return ChunkTask(chunk, None, None, data, classes)


# quick_config.py's path through the command line is the one
# tests/renate_events/test_config_workflow.py checks in detail (with a config of the same kind),
# and the docs run it through the Python API.


def test_digits_cnn(tmp_path):
    pytest.importorskip("sklearn")
    run_example(CONFIGS / "digits_cnn.py", tmp_path)


def test_tabular_csv_on_a_file_of_ones_own(tmp_path):
    rows = ["f1,f2,f3,label"]
    g = torch.Generator().manual_seed(5)
    values = torch.randn(240, 3, generator=g)
    for row in values.tolist():
        rows.append(",".join(f"{v:.5f}" for v in row) + f",{int(row[0] > 0) + int(row[1] > 0)}")
    (tmp_path / "mine.csv").write_text("\n".join(rows) + "\n")
    run_example(
        CONFIGS / "tabular_csv.py", tmp_path, {"RENATE_EVENTS_CSV": str(tmp_path / "mine.csv")}
    )


@pytest.mark.slow
def test_cifar10_binary_files(tmp_path):
    write_cifar10(tmp_path / "data" / "cifar-10-batches-bin", per_class=12, test_per_class=3)
    run_example(CONFIGS / "cifar10.py", tmp_path, {"RENATE_EVENTS_CIFAR10": str(tmp_path / "data")})


def test_images_uint8_with_its_three_transforms(tmp_path, capsys):
    from renate_events.cli import main

    run_example(CONFIGS / "images_uint8.py", tmp_path)
    text = (CONFIGS / "images_uint8.py").read_text()
    for name in ("buffer_transform", "test_transform"):  # each one is needed, and said so
        spoiled = tmp_path / f"without_{name}.py"
        spoiled.write_text(text.replace(f"def {name}():", f"def _unused_{name}():"))
        argv = ["update", "--config-file", str(spoiled), "--output-state", str(tmp_path / name)]
        assert main([*argv, *SETTINGS]) == 2
        err = capsys.readouterr().err
        assert f"define {name}" in err and "x.float() / 255" in err, err
        assert not (tmp_path / name).exists()
