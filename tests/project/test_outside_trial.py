"""The outside trial: bad inputs as a new user makes them, across ``run``, ``update``,
``evaluate``, ``predict``, ``info`` and the Python API, each refused as the guarantees say: one
line on standard error and exit status 2 (from Python: the documented exception), before anything
is written, changed or deleted (every file of the trial's folder compared by name, size, mtime and
SHA-256 before and after; from Python, the model's parameters too).

The cases share one folder of config files, data files and state folders (``world``), made once;
each case runs in-process (``renate_events.cli.main``) with that folder as the working
directory, and ``{w}`` in an argument stands for it.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.cli import main
from renate_events.config import ConfigError
from renate_events.learners import BaseExperienceReplayLearner
from renate_events.state_folder import StateFolderError, StateFolderOverwriteError
from renate_events.updater import ModelUpdater, UpdateInputError
from tests.helpers import parameters_of
from trainer import NonFiniteLossError

pytestmark = pytest.mark.hostile

BASE = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _chunk(chunk_id, seed, samples):
    generator = torch.Generator().manual_seed(1000 * chunk_id + seed)
    inputs = torch.randn(samples, 8, generator=generator)
    return TensorDataset(inputs, (inputs[:, 0] > 0).long() + 2 * (inputs[:, 1] > 0).long())


def data_fn(chunk_id, seed):
    return _chunk(chunk_id, seed, 64), _chunk(chunk_id, seed + 1, 16)


def test_data_fn(chunk_id, seed):
    return _chunk(chunk_id, seed + 2, 24)
"""

_SPOILED_TEST = """

def test_data_fn(chunk_id, seed):  # noqa: F811
    data = _chunk(chunk_id, seed + 2, 24)
    {change}
    return data
"""

_SPOILED_DATA = """

def data_fn(chunk_id, seed):  # noqa: F811
    train, val = _chunk(chunk_id, seed, 64), _chunk(chunk_id, seed + 1, 16)
    {change}
    return train, val
"""

_UINT8 = """

def data_fn(chunk_id, seed):  # noqa: F811
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 256, (32, 8), dtype=torch.uint8, generator=g)
    return TensorDataset(inputs, torch.randint(0, 4, (32,), generator=g))
"""

CONFIGS = {
    "good.py": BASE,
    "with_optimizer.py": BASE
    + "\n\ndef optimizer_fn(params):\n    return torch.optim.SGD(params, lr=0.1)\n",
    "syntax.py": BASE + "\ndef broken(:\n",
    "raises.py": BASE.replace(
        "return _chunk(chunk_id, seed, 64),", "raise RuntimeError('no data'); return 0,"
    ),
    "renate_names.py": BASE.replace("def data_fn", "def data_module_fn"),
    "outputs_3d.py": BASE.replace(
        "Linear(16, 4))", "Linear(16, 4), torch.nn.Unflatten(1, (4, 1)))"
    ),
    "wider.py": BASE.replace("Linear(16, 4))", "Linear(16, 4), torch.nn.Linear(4, 4))"),
    "features.py": BASE.replace("Linear(8, 16)", "Linear(7, 16)"),
    "test_nan.py": BASE + _SPOILED_TEST.format(change="data.tensors[0][3, 1] = float('nan')"),
    "test_label.py": BASE + _SPOILED_TEST.format(change="data.tensors[1][5] = 9"),
    "test_negative.py": BASE + _SPOILED_TEST.format(change="data.tensors[1][0] = -1"),
    "test_rows.py": BASE + "\n\ndef test_transform():\n    return lambda x: torch.cat([x, x])\n",
    "test_kind.py": BASE + "\n\ndef test_transform():\n    return lambda x: x.tolist()\n",
    "val_label.py": BASE + _SPOILED_DATA.format(change="val.tensors[1][2] = 9"),
    "val_nan.py": BASE + _SPOILED_DATA.format(change="val.tensors[0][1, 0] = float('nan')"),
    "train_label.py": BASE + _SPOILED_DATA.format(change="train.tensors[1][7] = 4"),
    "train_nan.py": BASE + _SPOILED_DATA.format(change="train.tensors[0][:] = float('nan')"),
    "uint8.py": BASE + _UINT8,
    "uint8_train_only.py": BASE
    + _UINT8
    + "\n\ndef train_transform():\n    return lambda x: x.float() / 255\n",
    "train_rows.py": BASE + "\n\ndef train_transform():\n    return lambda x: x[:0]\n",
    "host_read.py": BASE.replace(
        "def model_fn():",
        "class Gate(torch.nn.Module):\n"
        "    def forward(self, x):  # reads a value back to the host: cannot be captured\n"
        "        return x if float(x.abs().max()) < 1e9 else x * 0\n\n\n"
        "def model_fn():",
    ).replace("Linear(16, 4))", "Linear(16, 4), Gate())"),
    "bad_loss.py": BASE
    + "\n\ndef loss_fn():\n    return lambda outputs, targets: outputs.sum(dim=5)\n",
}


def _data_file(path: pathlib.Path, inputs: Any, targets: Any) -> None:
    np.savez(path, inputs=inputs, targets=targets)


def _digits(n: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(seed)
    inputs = (generator.random((n, 64)) * 16).astype(np.float32)
    return inputs, generator.integers(0, 10, n)


@pytest.fixture(scope="module")
def world(tmp_path_factory: Any) -> pathlib.Path:
    """Config files, data files and state folders of two lineages, made once."""
    w = tmp_path_factory.mktemp("outside")
    for name, text in CONFIGS.items():
        (w / name).write_text(text)
    inputs, targets = _digits()
    _data_file(w / "digits.npz", inputs, targets)
    _data_file(w / "nan.npz", np.where(np.arange(64) == 3, np.nan, inputs), targets)
    _data_file(w / "labels.npz", inputs, np.full(12, 12))
    _data_file(w / "negative.npz", inputs, np.full(12, -1))
    _data_file(w / "features.npz", inputs[:, :60], targets)
    _data_file(w / "short.npz", inputs, targets[:5])
    _data_file(w / "soft.npz", inputs, targets + 0.5)
    np.savez(w / "no_targets.npz", inputs=inputs)
    np.savez(w / "strings.npz", inputs=np.array(["a"] * 12), targets=targets)
    (w / "text.npz").write_text("not a zip archive")
    (w / "data.csv").write_text("a,b\n1,2\n")
    (w / "bad.toml").write_text("epochs = \n")
    (w / "unknown.toml").write_text("epoch = 3\n")
    (w / "space.toml").write_text("epochs = {low = 1, high = 2}\n")
    (w / "bool_choice.toml").write_text("capture = true\n")
    (w / "not_a_state").mkdir()
    (w / "not_a_state" / "notes.txt").write_text("hello")
    (w / "earlier_run").mkdir()
    (w / "earlier_run" / "results.json").write_text("{}")
    run = ["run", "--epochs", "1", "--hidden", "16", "--no-progress", "--seeds", "0"]
    assert main([*run, "--output-dir", str(w / "digits_run"), "--memory-size", "40"]) == 0
    update = ["update", "--config-file", str(w / "good.py"), "--epochs", "1", "--no-progress"]
    assert main([*update, "--output-state", str(w / "state")]) == 0
    with_optimizer = ["--config-file", str(w / "with_optimizer.py")]
    assert main([*update, *with_optimizer, "--output-state", str(w / "sgd_state")]) == 0
    (w / "predicted.npz").write_bytes(b"an earlier prediction")
    return w


def _snapshot(folder: pathlib.Path) -> dict[str, tuple[int, int, str]]:
    """Every file and folder below ``folder``: size, mtime and SHA-256 (folders: "")."""
    seen = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            stat = os.lstat(path)
            digest = ""
            if os.path.isfile(path) and not os.path.islink(path):
                digest = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
            seen[os.path.relpath(path, folder)] = (stat.st_size, stat.st_mtime_ns, digest)
    return seen


STATE = "{w}/digits_run/state/seed-0"
CFG_STATE = "{w}/state"
UPDATE = ["update", "--epochs", "1", "--no-progress"]
CONFIG_UPDATE = [*UPDATE, "--output-state", "{w}/new"]


def _config_update(config: str, *extra: str) -> list[str]:
    return [*CONFIG_UPDATE, "--config-file", f"{{w}}/{config}", *extra]


def _config_run(config: str, *extra: str) -> list[str]:
    argv = ["run", "--epochs", "1", "--no-progress", "--output-dir", "{w}/new_run"]
    return [*argv, "--config-file", f"{{w}}/{config}", "--chunks", "2", *extra]


RUN = ["run", "--epochs", "1", "--no-progress", "--output-dir", "{w}/new_run"]

CLI_CASES = [
    # run
    ([*RUN[:-1], "{w}/earlier_run"], ["earlier run's results.json", "--overwrite"]),
    ([*RUN[:-1], "{w}/digits_run"], ["earlier run's", "state/seed-0", "--overwrite"]),
    ([*RUN, "--epochs", "0"], ["--epochs must be >= 1"]),
    ([*RUN, "--memory-size", "-1"], ["--memory-size must be >= 0, got -1"]),
    ([*RUN, "--memory-size", "2", "--memory-batch-size", "32"], ["--memory-batch-size 32"]),
    ([*RUN, "--learner", "nope"], ["invalid choice: 'nope'"]),
    ([*RUN, "--lr", "nan"], ["--lr"]),
    ([*RUN, "--model-args", '{"bogus": 1}'], ["--model-args", "--hidden"]),
    ([*RUN, "--config", "{w}/bad.toml"], ["bad.toml"]),
    ([*RUN, "--config", "{w}/unknown.toml"], ["epoch"]),
    ([*RUN, "--config", "{w}/missing.toml"], ["missing.toml"]),
    ([*RUN, "--config", "{w}/bool_choice.toml"], ["--capture must be a name, got bool True"]),
    ([*RUN, "--config-file", "{w}/good.py"], ["--config-file needs --chunks"]),
    ([*RUN, "--config-file", "{w}/good.py", "--chunks", "1"], ["--chunks must be an int in [2,"]),
    (_config_run("missing.py"), ["missing.py"]),
    (_config_run("syntax.py"), ["syntax.py", "line"]),
    (_config_run("renate_names.py"), ["data_module_fn", "data_fn"]),
    (_config_run("outputs_3d.py"), ["outputs have the shape (1, 4, 1)", "Flatten"]),
    (
        _config_run("host_read.py", "--capture", "compile"),
        ["cannot be captured", "host_read.py", "in forward", "--capture 'off'"],
    ),
    (_config_run("test_nan.py"), ["chunk 0", "test inputs hold NaN"]),
    (_config_run("test_label.py"), ["chunk 0", "test labels range over [0, 9]"]),
    (_config_run("test_negative.py"), ["test labels range over [-1, 3]"]),
    (_config_run("test_rows.py"), ["chunk 0", "test_transform", "batch size"]),
    (_config_run("test_kind.py"), ["test_transform"]),
    (_config_run("val_label.py"), ["validation labels range over [0, 9]"]),
    # update
    (
        _config_update("good.py", "--output-state", "{w}/sgd_state"),
        ["another lineage", "--overwrite"],
    ),
    (_config_update("raises.py"), ["data_fn", "no data"]),
    (_config_update("val_nan.py"), ["validation inputs hold NaN"]),
    (_config_update("train_label.py"), ["training labels range over [0, 4]"]),
    (_config_update("train_nan.py"), ["--nonfinite-loss skip"]),
    (_config_update("uint8.py"), ["train_transform", "x.float() / 255"]),
    (_config_update("uint8_train_only.py"), ["buffer_transform", "x.float() / 255"]),
    (_config_update("train_rows.py"), ["train_transform"]),
    (_config_update("bad_loss.py"), ["loss"]),
    (_config_update("good.py", "--lr", "-1"), ["--lr"]),
    (_config_update("good.py", "--model", "mlp"), ["--model", "leave it out"]),
    (_config_update("good.py", "--data", "{w}/digits.npz"), ["--data and --config-file"]),
    (_config_update("good.py", "--search", "2", "--config", "{w}/space.toml"), ["--epochs 1"]),
    (_config_update("features.py", "--input-state", CFG_STATE), ["another config file"]),
    (
        _config_update("wider.py", "--input-state", CFG_STATE, "--accept-config-change"),
        ["the model has parameter '3.weight'"],
    ),
    ([*UPDATE, "--input-state", "{w}/missing", "--data", "{w}/digits.npz"], ["--output-state"]),
    ([*UPDATE, "--input-state", STATE, "--data", "{w}/digits.npz", "--output-state", STATE], []),
    (
        [*UPDATE, "--input-state", STATE, "--data", "{w}/nan.npz", "--output-state", "{w}/n"],
        ["NaN"],
    ),
    ([*UPDATE, "--input-state", STATE, "--data", "{w}/labels.npz", "--output-state", "{w}/n"], []),
    (
        [*UPDATE, "--input-state", STATE, "--data", "{w}/negative.npz", "--output-state", "{w}/n"],
        [],
    ),
    (
        [*UPDATE, "--input-state", STATE, "--data", "{w}/features.npz", "--output-state", "{w}/n"],
        [],
    ),
    ([*UPDATE, "--input-state", STATE, "--data", "{w}/short.npz", "--output-state", "{w}/n"], []),
    ([*UPDATE, "--input-state", STATE, "--data", "{w}/soft.npz", "--output-state", "{w}/n"], []),
    ([*UPDATE, "--input-state", STATE, "--data", "{w}/text.npz", "--output-state", "{w}/n"], []),
    ([*UPDATE, "--input-state", STATE, "--data", "{w}/data.csv", "--output-state", "{w}/n"], []),
    (
        [
            *UPDATE,
            "--input-state",
            "{w}/not_a_state",
            "--data",
            "{w}/digits.npz",
            "--output-state",
            "{w}/n",
        ],
        [],
    ),
    ([*UPDATE, "--data", "{w}/digits.npz", "--output-state", "{w}/n"], ["--input-state"]),
    # evaluate
    (["evaluate", "--state", "{w}/missing", "--data", "{w}/digits.npz"], ["missing"]),
    (["evaluate", "--state", "{w}/not_a_state", "--data", "{w}/digits.npz"], ["not_a_state"]),
    (["evaluate", "--state", STATE, "--data", "{w}/features.npz"], ["60 features"]),
    (["evaluate", "--state", STATE, "--data", "{w}/no_targets.npz"], ["targets"]),
    (["evaluate", "--state", STATE, "--data", "{w}/strings.npz"], ["numbers"]),
    (["evaluate", "--state", STATE, "--data", "{w}/labels.npz"], ["labels range over [12, 12]"]),
    (["evaluate", "--state", STATE], ["--data"]),
    (["evaluate", "--state", CFG_STATE, "--config-file", "{w}/test_nan.py"], ["another config"]),
    (
        [
            "evaluate",
            "--state",
            CFG_STATE,
            "--config-file",
            "{w}/test_nan.py",
            "--accept-config-change",
        ],
        ["chunk 0", "test inputs hold NaN"],
    ),
    (
        [
            "evaluate",
            "--state",
            "{w}/sgd_state",
            "--config-file",
            "{w}/wider.py",
            "--accept-config-change",
        ],
        ["the model has parameter '3.weight'"],
    ),
    # predict
    (["predict", "--state", STATE, "--data", "{w}/missing.npz"], ["no such file"]),
    (
        ["predict", "--state", STATE, "--data", "{w}/digits.npz", "--output", "{w}/predicted.npz"],
        ["exists"],
    ),
    (["predict", "--state", STATE, "--data", "{w}/digits.npz", "--output", "{w}/p.txt"], [".txt"]),
    (["predict", "--state", STATE, "--data", "{w}/features.npz"], ["60 features"]),
    (["predict", "--state", STATE, "--data", "{w}/nan.npz"], ["NaN"]),
    (["predict", "--state", CFG_STATE, "--config-file", "{w}/good.py"], ["--chunk-id"]),
    (
        ["predict", "--state", CFG_STATE, "--config-file", "{w}/test_nan.py", "--chunk-id", "0"],
        ["another config file"],
    ),
    (
        [
            *("predict", "--state", CFG_STATE, "--config-file", "{w}/test_nan.py"),
            *("--chunk-id", "0", "--accept-config-change"),
        ],
        ["chunk 0: the test inputs hold NaN"],
    ),
    (
        [*("evaluate", "--state", CFG_STATE, "--config-file", "{w}/good.py"), "--chunk-ids", "-1"],
        ["--chunk-ids"],
    ),
    (["predict", "--state", "{w}/not_a_state", "--data", "{w}/digits.npz"], ["not_a_state"]),
    # info
    (["info", "--state", "{w}/missing"], ["missing"]),
    (["info", "--state", "{w}/not_a_state"], ["not_a_state"]),
    (["info", "--state", "{w}/digits.npz"], ["digits.npz"]),
    (["info"], ["--state"]),
]


@pytest.mark.parametrize(("argv", "words"), CLI_CASES, ids=[" ".join(c[0])[:60] for c in CLI_CASES])
def test_a_bad_command_line_is_one_line_and_changes_nothing(
    world, argv, words, capsys, monkeypatch
):
    monkeypatch.chdir(world)
    argv = [a.replace("{w}", str(world)) for a in argv]
    before = _snapshot(world)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, (code, captured.out, err)
    assert captured.out == "", captured.out  # refused before anything was printed
    lines = [line for line in err.splitlines() if not line.startswith("usage:")]
    lines = [line for line in lines if line.strip() and not line.startswith(" ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word.replace("{w}", str(world)) in err, err
    assert _snapshot(world) == before


# -- the Python API -------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _data(n: int = 32, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, 8, generator=generator)
    return TensorDataset(inputs, torch.randint(0, 4, (n,), generator=generator))


def _spoiled(change: Callable[[TensorDataset], None]) -> TensorDataset:
    data = _data(seed=1)
    change(data)
    return data


def _updater(world: pathlib.Path, model: torch.nn.Module, **kwargs: Any) -> ModelUpdater:
    kwargs.setdefault("max_epochs", 1)
    kwargs.setdefault("trainer_kwargs", {"device": "cpu"})
    return ModelUpdater(model, learner="er", learner_kwargs={"memory_size": 40}, **kwargs)


def _label_nine(data: TensorDataset) -> None:
    data.tensors[1][3] = 9


def _nan(data: TensorDataset) -> None:
    data.tensors[0][2, 2] = float("nan")


def _learner(model: torch.nn.Module) -> BaseExperienceReplayLearner:
    return BaseExperienceReplayLearner(model=model, memory_size=40)


PYTHON_CASES = [
    (
        "learner: samples, bad label",
        lambda w, m: _learner(m).fit([(torch.zeros(8), 7)] * 4),
        ValueError,
        r"training labels range over \[7, 7\]",
    ),
    (
        "learner: val NaN",
        lambda w, m: _learner(m).fit(_data(), _spoiled(_nan)),
        ValueError,
        "validation inputs hold NaN",
    ),
    (
        "learner: uint8, no transform",
        lambda w, m: _learner(m).fit(
            TensorDataset(torch.zeros(8, 8, dtype=torch.uint8), torch.zeros(8).long())
        ),
        ValueError,
        "define train_transform",
    ),
    (
        "val labels",
        lambda w, m: _updater(w, m).update(_data(), _spoiled(_label_nine)),
        UpdateInputError,
        "validation labels",
    ),
    (
        "val NaN",
        lambda w, m: _updater(w, m).update(_data(), _spoiled(_nan)),
        UpdateInputError,
        "validation inputs",
    ),
    (
        "train labels",
        lambda w, m: _updater(w, m).update(_spoiled(_label_nine)),
        UpdateInputError,
        "training labels",
    ),
    (
        "train NaN",
        lambda w, m: _updater(w, m).update(_spoiled(lambda d: d.tensors[0].fill_(float("nan")))),
        NonFiniteLossError,
        "nonfinite_loss",
    ),
    (
        "uint8, no transform",
        lambda w, m: _updater(w, m).update(
            TensorDataset(torch.zeros(8, 8, dtype=torch.uint8), torch.zeros(8).long())
        ),
        UpdateInputError,
        "train_transform",
    ),
    (
        "empty",
        lambda w, m: _updater(w, m).update(TensorDataset(torch.zeros(0, 8), torch.zeros(0).long())),
        ValueError,
        "empty",
    ),
    (
        "list of samples, bad label",
        lambda w, m: _updater(w, m).update([(torch.zeros(8), 7)] * 4),
        UpdateInputError,
        "labels",
    ),
    (
        "missing input state",
        lambda w, m: _updater(w, m, input_state_folder=str(w / "missing")).learner_instance,
        StateFolderError,
        "missing",
    ),
    (
        "not a state folder",
        lambda w, m: _updater(w, m, input_state_folder=str(w / "not_a_state")).learner_instance,
        StateFolderError,
        "not_a_state",
    ),
    (
        "other lineage",
        lambda w, m: _updater(w, m, output_state_folder=str(w / "state")).update(_data()),
        StateFolderOverwriteError,
        "overwrite",
    ),
    (
        "another model's state",
        lambda w, m: (
            _updater(
                w, m, input_state_folder=str(w / "digits_run" / "state" / "seed-0")
            ).learner_instance
        ),
        StateFolderError,
        "seed-0",
    ),
    (
        "int32 labels",
        lambda w, m: _updater(w, m).update(
            TensorDataset(_data().tensors[0], _data().tensors[1].int())
        ),
        UpdateInputError,
        "targets int32",
    ),
    (
        "float64 inputs",
        lambda w, m: _updater(w, m).update(
            TensorDataset(_data().tensors[0].double(), _data().tensors[1])
        ),
        UpdateInputError,
        "float64",
    ),
    (
        "numpy arrays",
        lambda w, m: _updater(w, m).update(tuple(t.numpy() for t in _data().tensors)),
        TypeError,
        "ndarray",
    ),
    (
        "misspelt transform",
        lambda w, m: _updater(w, m, transforms={"train_transfrom": abs}),
        ValueError,
        "train_transfrom",
    ),
    (
        "transform not callable",
        lambda w, m: _updater(w, m, transforms={"test_transform": 5}),
        TypeError,
        "callable",
    ),
    (
        "task id a list",
        lambda w, m: _updater(w, m).update(_data(), task_id=[1]),
        TypeError,
        "task_id",
    ),
    (
        "samples of two kinds",
        lambda w, m: _updater(w, m).update([(torch.zeros(8), 1), (torch.zeros(8),)] * 4),
        UpdateInputError,
        "cannot be made a batch",
    ),
    (
        "learner: validation samples of two kinds",
        lambda w, m: _learner(m).fit(_data(), [(torch.zeros(8), 1), (torch.zeros(8),)] * 4),
        ValueError,
        "validation data: its first two samples cannot be made a batch",
    ),
    ("unknown learner", lambda w, m: ModelUpdater(m, learner="nope"), ValueError, "nope"),
    (
        "epochs 0",
        lambda w, m: _updater(w, m, max_epochs=0).learner_instance,
        ValueError,
        "max_epochs",
    ),
    (
        "config file missing",
        lambda w, m: ModelUpdater.from_config(str(w / "missing.py")),
        ConfigError,
        "missing.py",
    ),
    (
        "config file syntax",
        lambda w, m: ModelUpdater.from_config(str(w / "syntax.py")),
        ConfigError,
        "syntax.py",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "words"), [c[1:] for c in PYTHON_CASES], ids=[c[0] for c in PYTHON_CASES]
)
def test_bad_python_input_raises_the_documented_error_and_changes_nothing(
    world, call, error, words, monkeypatch
):
    monkeypatch.chdir(world)
    before = _snapshot(world)
    model = _model()
    parameters = parameters_of(model)
    with pytest.raises(error, match=words):
        call(world, model)
    assert _snapshot(world) == before
    after = parameters_of(model)
    assert all(torch.equal(parameters[key], after[key]) for key in parameters)


def test_the_table_holds_at_least_40_cases():
    assert len(CLI_CASES) + len(PYTHON_CASES) >= 40
