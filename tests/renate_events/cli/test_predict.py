"""renate-events predict: the labels of a state folder's classifier (the method's own: NME for a
method whose spec names it), written as .npz or .csv, and one line for each bad input."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")

from renate_events.cli import main
from renate_events.cli._updaters import updater_from_folder
from renate_events.methods import METHODS

NME = next(name for name, spec in METHODS.items() if spec.classifier == "nme")


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    out = tmp_path_factory.mktemp("predict") / "out"
    args = ["run", "--epochs", "1", "--output-dir", str(out), "--no-progress", "--hidden", "16"]
    assert main([*args, "--learner", NME, "--memory-size", "40"]) == 0
    return out / "state" / "seed-0"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.rand(30, 64, generator=generator) * 16
    targets = torch.randint(0, 10, (30,), generator=generator)
    path = tmp_path_factory.mktemp("data") / "new.npz"
    np.savez(path, inputs=inputs.numpy(), targets=targets.numpy())
    return path, inputs, targets


def test_labels_are_the_nme_classifiers_and_evaluates(state, data, tmp_path, capsys):
    path, inputs, targets = data
    output = tmp_path / "labels.npz"
    args = ["predict", "--state", str(state), "--data", str(path), "--output", str(output)]
    assert main([*args, "--probabilities"]) == 0
    printed = capsys.readouterr().out
    assert "30 samples, nme classifier" in printed and f"written to {output}" in printed
    with np.load(output) as saved:
        labels, probabilities = saved["labels"], saved["probabilities"]
    updater, _ = updater_from_folder(str(state))
    classifier = updater.learner_instance.nme_classifier()
    with torch.no_grad():
        expected = classifier(inputs.float()).argmax(dim=1)
    assert labels.tolist() == expected.tolist()
    assert probabilities.shape == (30, 10) and np.allclose(probabilities.sum(axis=1), 1)
    evaluate = ["evaluate", "--state", str(state), "--data", str(path), "--classifier", "nme"]
    assert main(evaluate) == 0
    accuracy = float((torch.from_numpy(labels) == targets).double().mean())
    assert f"task 0: accuracy {accuracy:.4f}" in capsys.readouterr().out


def test_csv_has_a_header_and_a_row_per_sample(state, data, tmp_path):
    output = tmp_path / "labels.csv"
    args = ["predict", "--state", str(state), "--data", str(data[0]), "--output", str(output)]
    assert main(args) == 0
    rows = output.read_text().splitlines()
    assert rows[0] == "label" and len(rows) == 31
    with_probabilities = tmp_path / "p.csv"
    assert main([*args[:-1], str(with_probabilities), "--probabilities"]) == 0
    rows = with_probabilities.read_text().splitlines()
    assert rows[0] == "label," + ",".join(f"p{k}" for k in range(10))
    assert [row.split(",")[0] for row in rows[1:]] == output.read_text().splitlines()[1:]


def _bad(tmp_path, capsys, *args: str) -> str:
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["predict", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    return captured.err


def test_bad_inputs_are_one_line_and_write_nothing(state, data, tmp_path, capsys):
    path = str(data[0])
    output = str(tmp_path / "out.npz")
    err = _bad(tmp_path, capsys, "--state", str(tmp_path / "none"), "--data", path)
    assert "is not a state folder" in err
    damaged = tmp_path / "damaged"
    shutil.copytree(state, damaged)
    with open(damaged / "learner.safetensors", "r+b") as handle:
        handle.truncate(100)
    err = _bad(tmp_path, capsys, "--state", str(damaged), "--data", path, "--output", output)
    assert "learner.safetensors" in err
    shutil.rmtree(damaged)
    np.savez(tmp_path / "wide.npz", inputs=np.zeros((4, 5), dtype=np.float32))
    err = _bad(tmp_path, capsys, "--state", str(state), "--data", str(tmp_path / "wide.npz"))
    assert "5 features" in err
    np.savez(tmp_path / "text.npz", inputs=np.array([["a"] * 64] * 2))
    err = _bad(tmp_path, capsys, "--state", str(state), "--data", str(tmp_path / "text.npz"))
    assert "it must hold numbers" in err
    (tmp_path / "taken.csv").write_text("mine\n")
    taken = str(tmp_path / "taken.csv")
    err = _bad(tmp_path, capsys, "--state", str(state), "--data", path, "--output", taken)
    assert "exists" in err and (tmp_path / "taken.csv").read_text() == "mine\n"
    nowhere = str(tmp_path / "missing" / "out.npz")
    err = _bad(tmp_path, capsys, "--state", str(state), "--data", path, "--output", nowhere)
    assert "no folder" in err
    err = _bad(tmp_path, capsys, "--state", str(state), "--data", path, "--output", "x.json")
    assert "expected a .npz or .csv file" in err
    config = tmp_path / "config.py"
    config.write_text("")
    err = _bad(tmp_path, capsys, "--state", str(state), "--config-file", str(config))
    assert "--config-file needs --chunk-id" in err
    err = _bad(tmp_path, capsys, "--state", str(state), "--data", path, "--chunk-id", "1")
    assert "--chunk-id needs --config-file" in err


def test_probabilities_without_an_output_file_are_refused_not_ignored(
    state, data, tmp_path, capsys
):
    err = _bad(tmp_path, capsys, "--state", str(state), "--data", str(data[0]), "--probabilities")
    assert "--probabilities needs --output" in err


CONFIG = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _chunk(chunk_id, seed, samples):
    if chunk_id > 1:
        raise ValueError(f"there is no chunk {chunk_id}")
    generator = torch.Generator().manual_seed(1000 * chunk_id + seed)
    inputs = torch.randn(samples, 8, generator=generator)
    return TensorDataset(inputs, (inputs[:, 0] > 0).long() + 2 * (inputs[:, 1] > 0).long())


def data_fn(chunk_id, seed):
    return _chunk(chunk_id, seed, 64), _chunk(chunk_id, seed + 1, 16)


def test_data_fn(chunk_id, seed):
    return _chunk(chunk_id, seed + 2, 24)
"""


def config_state(folder: pathlib.Path) -> tuple[pathlib.Path, str]:
    """``CONFIG`` written to ``folder`` and the state folder of one update with it."""
    config = folder / "config.py"
    config.write_text(CONFIG)
    state = str(folder / "s0")
    update = ["update", "--config-file", str(config), "--output-state", state, "--epochs", "1"]
    assert main([*update, "--no-progress"]) == 0
    return config, state


def config_model(state: str) -> torch.nn.Module:
    """``CONFIG``'s model with the weights of ``state``."""
    from safetensors.torch import load_file

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.load_state_dict(load_file(f"{state}/model.safetensors"))
    return model


def test_a_config_files_chunk_and_a_chunk_it_lacks(tmp_path, capsys):
    config, state = config_state(tmp_path)
    output = tmp_path / "chunk1.npz"
    args = ["predict", "--state", state, "--config-file", str(config)]
    assert main([*args, "--chunk-id", "1", "--output", str(output)]) == 0
    assert "24 samples, logits classifier" in capsys.readouterr().out
    model = config_model(state)
    generator = torch.Generator().manual_seed(1000 + 2)
    with torch.no_grad():
        expected = model(torch.randn(24, 8, generator=generator)).argmax(dim=1)
    with np.load(output) as saved:
        assert saved["labels"].tolist() == expected.tolist()
    missing = str(tmp_path / "chunk5.npz")
    err = _bad(tmp_path, capsys, *args[1:], "--chunk-id", "5", "--output", missing)
    assert "there is no chunk 5" in err


def _device_of_the_evaluated_model(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Patches the forward passes of evaluate and predict to note the model's device."""
    from renate_events import evaluation
    from renate_events.cli import _predict
    from renate_events.inference import model_device

    devices: list[torch.device] = []
    evaluate, outputs = evaluation.evaluate, _predict._outputs

    def noting_evaluate(model, *args, **kwargs):
        devices.append(model_device(model))
        return evaluate(model, *args, **kwargs)

    def noting_outputs(model, *args):
        devices.append(model_device(model))
        return outputs(model, *args)

    monkeypatch.setattr(evaluation, "evaluate", noting_evaluate)
    monkeypatch.setattr(_predict, "_outputs", noting_outputs)
    return devices


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.gpu),
        pytest.param("auto", marks=pytest.mark.gpu),
    ],
)
def test_device_says_where_evaluate_and_predict_run_the_model(
    state, data, device, monkeypatch, capsys
):
    devices = _device_of_the_evaluated_model(monkeypatch)
    path = str(data[0])
    assert main(["predict", "--state", str(state), "--data", path, "--device", device]) == 0
    evaluate = ["evaluate", "--state", str(state), "--data", path, "--classifier", "nme"]
    assert main([*evaluate, "--device", device]) == 0
    assert [d.type for d in devices] == ["cpu" if device == "cpu" else "cuda"] * 2


def test_an_unknown_device_is_one_line(state, data, tmp_path, capsys):
    err = _bad(tmp_path, capsys, "--state", str(state), "--data", str(data[0]), "--device", "tpu")
    assert "--device" in err


def test_a_config_files_state_predicts_on_a_data_file(tmp_path, capsys):
    config, state = config_state(tmp_path)
    capsys.readouterr()
    inputs = torch.randn(12, 8, generator=torch.Generator().manual_seed(5))
    np.savez(tmp_path / "new.npz", inputs=inputs.numpy())
    plain = ["predict", "--state", state, "--data", str(tmp_path / "new.npz")]
    err = _bad(tmp_path, capsys, *plain[1:])  # the model is the config file's: it is needed
    assert "pass it as --config-file" in err
    output = tmp_path / "labels.npz"
    argv = [*plain, "--config-file", str(config), "--output", str(output)]
    assert main(argv) == 0
    assert "12 samples, logits classifier" in capsys.readouterr().out
    model = config_model(state)
    with torch.no_grad(), np.load(output) as saved:
        assert saved["labels"].tolist() == model(inputs).argmax(dim=1).tolist()


def test_a_config_files_state_refuses_data_its_model_cannot_take(tmp_path, capsys):
    config, state = config_state(tmp_path)
    capsys.readouterr()
    np.savez(tmp_path / "wide.npz", inputs=np.zeros((4, 5), dtype=np.float32))
    np.savez(tmp_path / "doubles.npz", inputs=np.zeros((4, 8)))  # numpy's default: float64
    args = ["--state", state, "--config-file", str(config)]
    err = _bad(tmp_path, capsys, *args, "--data", str(tmp_path / "wide.npz"))
    assert f"--data {tmp_path / 'wide.npz'}: the test data: the model fails" in err
    assert "float32 (1, 5)" in err
    assert err.strip().endswith(  # what to do, after the model's own error
        "; the model rejected samples of the shape (5,): give inputs of the shape it takes (as "
        "the config file's data_fn gives them), or reshape them in test_transform"
    )
    err = _bad(tmp_path, capsys, *args, "--data", str(tmp_path / "doubles.npz"))
    assert "float64" in err
    assert err.strip().endswith("; save the inputs as float32 or convert them in test_transform")
    err = _bad(tmp_path, capsys, *args, "--data", str(tmp_path / "wide.npz"), "--chunk-id", "0")
    assert "--chunk-id 0 and --data" in err and "not both" in err
    err = _bad(tmp_path, capsys, "--state", state)
    assert "one of the arguments --data --config-file is required" in err
