"""A user's own model and data through a config file: the command line, ModelUpdater, the
deployable state folder, and the bad inputs of the config-file issue (one line, exit 2, nothing
written or deleted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch
import torch
from torch.utils.data import TensorDataset

from renate_events.cli import main
from renate_events.config import load_config
from renate_events.state_folder import StateFolderError, read_manifest
from renate_events.updater import ModelUpdater, UpdateInputError
from tests.helpers import run_cli

CONFIG = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _chunk(chunk_id, seed, n):
    g = torch.Generator().manual_seed(1000 * chunk_id + seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return TensorDataset(x, y)


def data_fn(chunk_id, seed):
    return _chunk(chunk_id, seed, 48), _chunk(chunk_id, seed + 7, 16)


def test_data_fn(chunk_id, seed):
    return _chunk(chunk_id, seed + 99, 32)


def loss_fn():
    return torch.nn.CrossEntropyLoss(reduction="none")


def optimizer_fn(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.5)


def lr_scheduler_fn(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), "epoch"


def metrics_fn():
    return {"error": lambda outputs, targets: (outputs.argmax(-1) != targets).float()}
"""

LEARNER = ["--learner", "der", "--memory-size", "20", "--memory-batch-size", "8"]
COMMON = ["--batch-size", "16", "--epochs", "2", "--device", "cpu", "--no-progress"]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "my_config.py"
    path.write_text(CONFIG)
    return path


def _cli(*args, cwd=None):
    """The command in a process of its own: (exit status, stdout, stderr)."""
    return run_cli(*args, cwd=cwd)


def _listing(folder):
    return sorted(
        (
            os.path.relpath(os.path.join(root, name), folder),
            os.path.getsize(os.path.join(root, name)),
        )
        for root, _, names in os.walk(folder)
        for name in names
    )


def test_two_updates_in_two_processes_and_evaluate_equal_the_python_api(tmp_path, config):
    s0, s1 = tmp_path / "s0", tmp_path / "s1"
    code, out, err = _cli(
        "update", "--config-file", config, "--output-state", s0, "--alpha", "0.3", *LEARNER, *COMMON
    )
    assert code == 0, err
    assert "on chunk 0" in out
    code, _, err = _cli(
        "update",
        "--config-file",
        config,
        "--input-state",
        s0,
        "--output-state",
        s1,
        "--no-progress",
    )
    assert code == 0, err
    code, printed, err = _cli("evaluate", "--config-file", config, "--state", s1)
    assert code == 0, err

    # The same two updates in this process, through the Python API.
    loaded = load_config(config)
    torch.manual_seed(0)
    updater = ModelUpdater.from_config(
        loaded,
        learner="der",
        learner_kwargs={
            "memory_size": 20,
            "memory_batch_size": 8,
            "batch_size": 16,
            "seed": 0,
            "alpha": 0.3,
        },
        max_epochs=2,
        trainer_kwargs={"device": "cpu", "precision": "32"},
    )
    for chunk in (0, 1):
        updater.update(*loaded.data(chunk, 0), task_id=chunk)
    cli_weights = safetensors.torch.load_file(str(s1 / "model.safetensors"))
    for name, tensor in updater.model.state_dict().items():
        torch.testing.assert_close(cli_weights[name], tensor, rtol=0, atol=0)
    from renate_events import evaluation
    from renate_events.scenarios import Task

    for chunk in (0, 1):
        test = loaded.test_data(chunk, 0)
        accuracy = evaluation.evaluate(updater.model, [Task(chunk, test, test, (0, 1, 2, 3))])[0]
        assert f"chunk {chunk}: accuracy {accuracy:.4f}; error {1 - accuracy:.4f}" in printed

    history = read_manifest(s1)["history"]
    assert [record["task_id"] for record in history] == [0, 1]
    assert history[1]["learner_kwargs"]["alpha"] == 0.3  # kept from the first update
    assert history[0]["functions"]["learning_rate_scheduler"] == "my_config.py:lr_scheduler_fn"
    assert history[0]["optimizer"] == {"function": "my_config.py:optimizer_fn"}
    assert set(history[0]["metrics"]) == {"train_loss", "val_loss", "val_accuracy", "val_error"}


def test_the_model_alone_loads_without_this_library(tmp_path, config):
    assert main(["update", "--config-file", str(config), "--output-state", str(tmp_path / "s"),
                 *LEARNER, *COMMON]) == 0  # fmt: skip
    script = textwrap.dedent(
        f"""
        import sys, json, torch, safetensors.torch
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        weights = safetensors.torch.load_file({str(tmp_path / "s" / "model.safetensors")!r})
        model.load_state_dict(weights)
        assert not any(name.startswith(("renate_events", "trainer")) for name in sys.modules)
        card = json.load(open({str(tmp_path / "s" / "model.json")!r}))
        print(card["architecture"], len(card["updates"]), card["config_sha256"][:8])
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Sequential", "1", load_config(config).sha256[:8]]


def test_toml_sets_learner_hyperparameters_and_flags_override_it(tmp_path, config):
    options = tmp_path / "options.toml"
    options.write_text('learner = "der"\nalpha = 0.25\nbeta = 0.75\nfeature_modules = []\n')
    folder = tmp_path / "s"
    args = ["update", "--config", options, "--config-file", config, "--output-state", folder]
    assert main([*map(str, args), "--beta", "0.5", *COMMON]) == 0
    kwargs = read_manifest(folder)["learner_kwargs"]
    assert (kwargs["alpha"], kwargs["beta"]) == (0.25, 0.5)


def test_run_over_a_config_files_chunks(tmp_path, config, capsys):
    out = tmp_path / "out"
    args = ["run", "--config-file", config, "--chunks", "2", "--output-dir", out, "--seeds", "0"]
    assert main([*map(str, args), *LEARNER, *COMMON, "--metric", "val_loss"]) == 0
    assert "der on my_config.py (2 chunks), 1 seed(s)" in capsys.readouterr().out
    rows = json.loads((out / "results.json").read_text())["runs"][0]["class_incremental"]["rows"]
    assert len(rows) == 2 and len(rows[0]) == 2
    best = read_manifest(out / "state" / "seed-0")["history"][1]["best"]
    assert best["metric"] == "val_loss" and best["mode"] == "min"


# -- ModelUpdater: best model, early stopping, validation memory, old folders ----------------------


class _Recorder:
    """Records the validation loss and the weights after every validation."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def on_validation_end(self, metrics):
        weights = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.seen.append((metrics["val_loss"], weights))


def _data(n=32, seed=0, features=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _updater(model, **kwargs):
    return ModelUpdater(
        model,
        learner="er",
        learner_kwargs={"memory_size": 16, "memory_batch_size": 4, "batch_size": 8},
        optimizer={"name": "sgd", "lr": 2.0},  # large enough for the loss to go up and down
        max_epochs=6,
        trainer_kwargs={"device": "cpu"},
        **kwargs,
    )


def test_the_output_holds_the_best_validations_weights(tmp_path):
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 2)
    recorder = _Recorder(model)
    # "max" of a loss that falls: the best validation is an early one, not the last
    updater = _updater(model, listeners=[recorder], metric="val_loss", mode="max",
                       output_state_folder=tmp_path / "s")  # fmt: skip
    updater.update(_data(), _data(seed=1))
    losses = [loss for loss, _ in recorder.seen]
    best = max(range(len(losses)), key=losses.__getitem__)
    assert best != len(losses) - 1, "the test needs a run whose last epoch is not its best"
    saved = safetensors.torch.load_file(str(tmp_path / "s" / "model.safetensors"))
    for name, tensor in recorder.seen[best][1].items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0)
    assert read_manifest(tmp_path / "s")["history"][0]["best"]["epoch"] == best


def test_early_stopping_ends_an_update_that_stops_improving():
    model = torch.nn.Linear(4, 2)
    updater = ModelUpdater(
        model,
        learner="er",
        learner_kwargs={"memory_size": 16, "memory_batch_size": 4, "batch_size": 8},
        optimizer={"name": "sgd", "lr": 0.0},  # the loss never improves after the first epoch
        max_epochs=10,
        trainer_kwargs={"device": "cpu"},
        metric="val_loss",
        early_stopping_enabled=True,
        early_stopping_patience=2,
    )
    result = updater.update(_data(), _data(seed=1))
    assert result.stopped_early and result.epochs == 3


def test_validation_memory_keeps_earlier_updates_validation_data(tmp_path):
    first = _updater(torch.nn.Linear(4, 2), output_state_folder=tmp_path / "s0")
    first.update(_data(), _data(n=10, seed=1))
    second = _updater(torch.nn.Linear(4, 2), input_state_folder=tmp_path / "s0",
                      output_state_folder=tmp_path / "s1")  # fmt: skip
    recorder = _Recorder(second.model)
    second.learner_instance.trainer.subscribe(recorder)
    second.update(_data(seed=2), _data(n=6, seed=3))
    from renate_events.inference import forward

    both = TensorDataset(*(torch.cat(p) for p in zip(_data(10, 1).tensors, _data(6, 3).tensors)))
    # the last validation ran on the weights after the last epoch, on old and new data together
    model = torch.nn.Linear(4, 2)
    model.load_state_dict(recorder.seen[-1][1])
    expected = torch.nn.functional.cross_entropy(forward(model, both.tensors[0]), both.tensors[1])
    assert recorder.seen[-1][0] == pytest.approx(float(expected.detach()), rel=1e-5)
    third = _updater(torch.nn.Linear(4, 2), input_state_folder=tmp_path / "s1")
    third.learner_instance  # noqa: B018 - loads the folder
    assert len(third._memory.buffer) == 16


def test_a_format_1_folder_is_read_and_rewritten_as_format_2(tmp_path):
    folder = tmp_path / "s"
    _updater(torch.nn.Linear(4, 2), output_state_folder=folder, validation_memory=False).update(
        _data()
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    for key in ("architecture", "history", "config", "validation_memory"):
        del manifest[key]
    manifest["format_version"] = 1
    manifest["files"] = {"learner.safetensors": manifest["files"]["learner.safetensors"]}
    (folder / "model.safetensors").unlink()
    (folder / "model.json").unlink()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert read_manifest(folder)["format_version"] == 1
    _updater(torch.nn.Linear(4, 2), input_state_folder=folder, output_state_folder=folder,
             in_place=True).update(_data(seed=4))  # fmt: skip
    upgraded = read_manifest(folder)
    assert upgraded["format_version"] == 2 and upgraded["updates"] == 2
    assert (folder / "model.safetensors").exists()


def test_a_later_update_may_change_hyperparameters_but_not_the_buffers_size(tmp_path):
    _updater(torch.nn.Linear(4, 2), output_state_folder=tmp_path / "s").update(_data())
    changed = ModelUpdater(
        torch.nn.Linear(4, 2),
        learner="er",
        learner_kwargs={"memory_size": 16, "memory_batch_size": 8, "batch_size": 4, "alpha": 0.2},
        optimizer={"name": "sgd", "lr": 0.5, "momentum": 0.9},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        input_state_folder=tmp_path / "s",
    )
    changed.update(_data(seed=2))
    resized = ModelUpdater(
        torch.nn.Linear(4, 2),
        learner="er",
        learner_kwargs={"memory_size": 32},
        input_state_folder=tmp_path / "s",
    )
    with pytest.raises(
        StateFolderError, match=r"learner_kwargs\['memory_size'\]: the folder"
    ) as info:
        resized.update(_data(seed=3))
    assert "optimizer: the folder has 'sgd', this updater 'adam'" in str(info.value)


def test_updater_bad_inputs_raise_before_training(tmp_path):
    updater = _updater(torch.nn.Linear(5, 2), output_state_folder=tmp_path / "s")
    with pytest.raises(UpdateInputError, match=r"float32 \(4,\)\) \(its first layer is Linear"):
        updater.update(_data())
    with pytest.raises(UpdateInputError, match="needs validation data"):
        _updater(torch.nn.Linear(4, 2), metric="val_loss").update(_data())
    with pytest.raises(ValueError, match="early_stopping_enabled needs a metric"):
        _updater(torch.nn.Linear(4, 2), early_stopping_enabled=True)
    assert not (tmp_path / "s").exists()


# -- the command line's bad inputs: one line, exit 2, nothing written or deleted -----------------

BAD_CONFIGS = {
    "syntax": ("def model_fn(:\n", "syntax error at line 1"),
    "raises": (
        "import torch\ndef model_fn():\n    return torch.nn.Linear(6, 4)\n"
        "def data_fn(chunk_id, seed):\n    return 1 / 0\n",
        "data_fn raised ZeroDivisionError: division by zero (bad.py, line 5: return 1 / 0)",
    ),
    "wrong type": (
        "def model_fn():\n    return 'a model'\ndef data_fn(chunk_id, seed):\n    return None\n",
        "model_fn must return a torch.nn.Module, got str",
    ),
    "wrong parameters": (
        "def model_fn(size):\n    pass\ndef data_fn(chunk_id, seed):\n    pass\n",
        "model_fn has the parameters (size), but it is called as model_fn()",
    ),
    "misspelt": (
        "def model_fn():\n    pass\ndef data_module_fn(chunk_id, seed):\n    pass\n",
        "it lacks data_fn; it defines 'data_module_fn' (call it 'data_fn')",
    ),
    "model and data": (
        "import torch\ndef model_fn():\n    return torch.nn.Linear(10, 4)\n"
        "def data_fn(chunk_id, seed):\n    return torch.randn(8, 6), torch.zeros(8).long()\n",
        "the model does not accept its samples (float32 (6,)) (its first layer is Linear(10 -> 4))",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_files_are_one_line_and_write_nothing(tmp_path, capsys, case):
    text, message = BAD_CONFIGS[case]
    (tmp_path / "bad.py").write_text(text)
    out = tmp_path / "out"
    args = ["update", "--config-file", tmp_path / "bad.py", "--output-state", out, *COMMON]
    assert main(list(map(str, args))) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.fixture
def state(tmp_path, config):
    folder = tmp_path / "s0"
    args = ["update", "--config-file", config, "--output-state", folder, *LEARNER, *COMMON]
    assert main(list(map(str, args))) == 0
    return folder


BAD_OPTIONS = [
    (["--alpha", "abc"], "--alpha must be a number, got 'abc'"),
    (["--alpha", "-1"], "--alpha must be a number >= 0, got -1.0"),
    (["--feature-modules", "x"], "--feature-modules must be a list of strings"),
    (["--learner", "er", "--beta", "1"], "--beta: the learner 'er' has no hyperparameter 'beta'"),
    (["--gamma", "1"], "unrecognized arguments: --gamma 1; no option or learner hyperparameter"),
    (["--lr", "0.1"], "defines optimizer_fn, which sets the learning rate"),
    (["--metric", "val_f1"], "'val_f1' is not reported by validation; it reports ['val_loss'"),
    (["--early-stopping", "2"], "--early-stopping watches --metric"),
    (["--data", "x.npz"], "--data and --config-file: choose one"),
    (["--memory-size", "30"], "learner_kwargs['memory_size']: the folder has 20, this updater 30"),
    (["--learner", "er"], "learner: the folder has 'der', this updater 'er'"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_OPTIONS, ids=[m for _, m in BAD_OPTIONS])
def test_bad_options_on_a_later_update_change_nothing(
    tmp_path, config, state, capsys, extra, message
):
    before = _listing(state)
    out = tmp_path / "s1"
    args = ["update", "--config-file", config, "--input-state", state, "--output-state", out]
    assert main([*map(str, args), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and _listing(state) == before


def test_another_config_file_is_refused_naming_the_line_unless_accepted(
    tmp_path, config, state, capsys
):
    config.write_text(CONFIG.replace("lr=0.1", "lr=0.2"))
    args = ["update", "--config-file", config, "--input-state", state]
    assert main([*map(str, args), "--output-state", str(tmp_path / "s1"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "written with another config file (my_config.py" in err
    assert "'return torch.optim.SGD(params, lr=0.1, momentum=0.5)' became" in err
    assert not (tmp_path / "s1").exists()
    args += ["--output-state", tmp_path / "s1", "--accept-config-change", "--no-progress"]
    assert main(list(map(str, args))) == 0
    history = read_manifest(tmp_path / "s1")["history"]
    assert history[0]["config_sha256"] != history[1]["config_sha256"]


def test_a_chunk_of_another_shape_is_refused_before_training(tmp_path, capsys):
    text = CONFIG.replace(
        "def data_fn(chunk_id, seed):\n    return",
        "def data_fn(chunk_id, seed):\n"
        "    if chunk_id == 1:\n        return torch.randn(8, 6).double(), torch.zeros(8).long()\n"
        "    return",
    )
    (tmp_path / "c.py").write_text(text)
    first = ["update", "--config-file", tmp_path / "c.py", "--output-state", tmp_path / "s0"]
    assert main([*map(str, first), *LEARNER, *COMMON]) == 0
    later = ["update", "--config-file", tmp_path / "c.py", "--input-state", tmp_path / "s0"]
    assert main([*map(str, later), "--output-state", str(tmp_path / "s1"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "its samples are float64 (6,), but the state was trained on samples of float32" in err
    assert not (tmp_path / "s1").exists()


def test_a_config_state_folder_needs_its_config_file(tmp_path, state, capsys):
    args = ["evaluate", "--state", state, "--scenario", "split-digits"]
    pytest.importorskip("sklearn")
    assert main(list(map(str, args))) == 2
    assert "was written from the config file my_config.py; pass it as --config-file" in (
        capsys.readouterr().err
    )


LISTENER_CONFIG = '''
import torch


class Pairs(torch.utils.data.Dataset):
    """Samples as (list of floats, int): only collate_fn turns them into tensors."""

    def __init__(self, chunk_id, n):
        g = torch.Generator().manual_seed(chunk_id)
        self.x = torch.randn(n, 3, generator=g).tolist()
        self.y = [int(row[0] > 0) for row in self.x]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def collate_fn(batch):
    return torch.tensor([x for x, _ in batch]), torch.tensor([y for _, y in batch])


class CountBatches:
    def __init__(self):
        self.seen = 0

    def on_batch_end(self):
        self.seen += 1

    def on_save_checkpoint(self, checkpoint):
        checkpoint["seen"] = self.seen

    def on_load_checkpoint(self, checkpoint):
        self.seen = int(checkpoint["seen"])


def listeners():
    return [CountBatches()]


def model_fn():
    return torch.nn.Linear(3, 2)


def data_fn(chunk_id, seed):
    return Pairs(chunk_id, 20), Pairs(chunk_id + 100, 8)
'''


def test_listeners_keep_their_state_across_processes_and_collate_fn_batches_datasets(tmp_path):
    config = tmp_path / "listening.py"
    config.write_text(LISTENER_CONFIG)
    first = ["update", "--config-file", config, "--output-state", tmp_path / "s0"]
    small = ["--memory-size", "8", "--memory-batch-size", "4", "--batch-size", "5", "--epochs", "1"]
    code, _, err = _cli(*first, "--learner", "er", *small, "--device", "cpu", "--no-progress")
    assert code == 0, err
    second = ["--input-state", tmp_path / "s0", "--output-state", tmp_path / "s1", "--no-progress"]
    code, _, err = _cli("update", "--config-file", config, *second)
    assert code == 0, err
    updater = ModelUpdater.from_config(
        config,
        learner="er",
        learner_kwargs={"memory_size": 8, "memory_batch_size": 4, "batch_size": 5, "seed": 0},
        max_epochs=1,
        trainer_kwargs={"device": "cpu", "precision": "32"},
        input_state_folder=tmp_path / "s1",
    )
    (counter,) = updater.listeners
    updater.learner_instance  # noqa: B018 - loads the folder, the listener's state with it
    assert counter.seen == 8  # 4 batches of 5 in each of the two updates
    record = read_manifest(tmp_path / "s1")["history"][1]
    assert record["functions"]["listeners"] == ["CountBatches"]
    assert record["functions"]["collate_fn"] == "config.collate_fn"
    assert record["data"] == {"inputs": [[3], "float32"], "targets": [[], "int64"]}


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (
            "\n\ndef data_fn(chunk_id, seed):\n    x, y = _chunk(chunk_id, seed, 16).tensors\n"
            "    return TensorDataset(x, y.float())\n",
            "the loss (loss_fn) fails on the model's outputs float32 (2, 4) and targets float32",
        ),
        (
            "\n\ndef metrics_fn():\n    return {'broken': lambda o, t: 1 / 0}\n",
            "the metric 'broken' (broken) fails on the model's outputs float32 (2, 4)",
        ),
    ],
)
def test_a_loss_or_metric_that_fails_on_the_outputs_is_one_line(tmp_path, capsys, tail, message):
    (tmp_path / "c.py").write_text(CONFIG + tail)
    args = ["update", "--config-file", tmp_path / "c.py", "--output-state", tmp_path / "s"]
    assert main([*map(str, args), *COMMON]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "s").exists()


def test_evaluate_and_shift_accept_a_changed_config_when_told(tmp_path, config, state, capsys):
    config.write_text(CONFIG.replace("seed + 99", "seed + 98"))  # other test data
    args = ["evaluate", "--config-file", str(config), "--state", str(state)]
    assert main(args) == 2
    assert "written with another config file" in capsys.readouterr().err
    assert main([*args, "--accept-config-change"]) == 0
    import numpy as np

    np.savez(tmp_path / "a.npz", inputs=np.random.default_rng(0).normal(size=(20, 7)))
    shift = ["shift", "--reference", str(tmp_path / "a.npz"), "--query", str(tmp_path / "a.npz")]
    shift += ["--state", str(state), "--config-file", str(config), "--accept-config-change"]
    assert main(shift) == 2
    err = capsys.readouterr().err
    assert "--reference: the state folder's model does not accept its samples (float32 (7,))" in err
    assert err.count("\n") == 1


def test_the_mode_follows_the_metric_unless_given():
    model = torch.nn.Linear(4, 2)
    assert ModelUpdater(model, metric="val_accuracy").mode == "max"
    assert ModelUpdater(model, metric="val_loss").mode == "min"
    assert ModelUpdater(model, metric="val_accuracy", mode="min").mode == "min"
    with pytest.raises(ValueError, match=r"ModelUpdater\.metrics must be a mapping"):
        ModelUpdater(model, metrics=[1, 2])


def test_update_takes_an_inputs_and_targets_pair():
    updater = _updater(torch.nn.Linear(4, 2))
    inputs, targets = _data().tensors
    assert updater.update((inputs, targets)).steps == 4 * 6


TRANSFORM_CONFIG = """
import torch
from torch.utils.data import TensorDataset

from renate_events import transforms

SEEN = []


def model_fn():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))


def _chunk(chunk_id, seed, n):
    g = torch.Generator().manual_seed(10 * chunk_id + seed)
    x = torch.randint(0, 256, (n, 3, 4, 4), generator=g, dtype=torch.uint8)
    return TensorDataset(x, (x[:, 0, 0, 0] > 127).long())


def data_fn(chunk_id, seed):
    return _chunk(chunk_id, seed, 32), _chunk(chunk_id, seed + 1, 8)


def _recording(transform, name):
    def apply(batch):
        SEEN.append((name, batch.dtype))
        return transform(batch)

    return apply


def train_transform():
    return _recording(transforms.ToFloat(), "train")


def buffer_transform():
    return _recording(transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToFloat()]),
                      "buffer")


def test_transform():
    return _recording(transforms.ToFloat(), "test")
"""


def test_a_config_files_transforms_make_the_float_input_from_uint8_data(tmp_path, capsys):
    config = tmp_path / "images.py"
    config.write_text(TRANSFORM_CONFIG)
    first = ["update", "--config-file", config, "--output-state", tmp_path / "s0"]
    assert main([*map(str, first), *LEARNER, *COMMON]) == 0
    later = ["update", "--config-file", config, "--input-state", tmp_path / "s0"]
    assert main([*map(str, later), "--output-state", str(tmp_path / "s1"), "--no-progress"]) == 0
    assert main(["evaluate", "--config-file", str(config), "--state", str(tmp_path / "s1")]) == 0
    assert "chunk 1: accuracy" in capsys.readouterr().out
    functions = read_manifest(tmp_path / "s1")["history"][1]["functions"]
    assert set(functions) >= {"train_transform", "buffer_transform", "test_transform"}
    updater = ModelUpdater.from_config(
        config,
        learner="der",
        learner_kwargs={"memory_size": 20, "memory_batch_size": 8, "batch_size": 16, "seed": 0},
        max_epochs=1,
        trainer_kwargs={"device": "cpu", "precision": "32"},
        input_state_folder=tmp_path / "s1",
    )
    buffer = updater.learner_instance.buffer
    assert buffer.state_dict()["inputs"][0].dtype == torch.uint8  # the raw sample is stored
    seen = updater.config_file.functions["model_fn"].__globals__["SEEN"]
    updater.update(*updater.config_file.data(2, 0))
    # every transform got the raw uint8 batches: new data, memory batches, validation
    assert {name for name, dtype in seen if dtype == torch.uint8} == {"train", "buffer", "test"}
    assert all(dtype == torch.uint8 for _, dtype in seen)
