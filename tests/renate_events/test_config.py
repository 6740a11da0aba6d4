"""The config-file contract: every function of it, and every bad config file a user can write."""

from __future__ import annotations

import pickle
import re
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.config import CONFIG_FUNCTIONS, ConfigError, load_config

FULL = """
import numpy as np
import torch

def model_fn():
    return torch.nn.Linear(4, 3)

def data_fn(chunk_id, seed):
    g = torch.Generator().manual_seed(seed * 100 + chunk_id)
    train = torch.utils.data.TensorDataset(torch.randn(12, 4, generator=g),
                                           torch.randint(0, 3, (12,), generator=g))
    return train, (np.zeros((4, 4), "float32"), np.zeros(4, "int64"))

def test_data_fn(chunk_id, seed):
    return torch.randn(6, 4), torch.zeros(6, dtype=torch.long)

def loss_fn():
    return torch.nn.CrossEntropyLoss(reduction="none")

def optimizer_fn(params):
    return torch.optim.SGD(params, lr=0.05)

def lr_scheduler_fn(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1), "step"

class Seen:
    def on_batch_end(self):
        pass

def listeners():
    return [Seen()]

def metrics_fn():
    return {"mean_logit": lambda outputs, targets: outputs.mean()}

def collate_fn(batch):
    return torch.utils.data.default_collate(batch)

def train_transform():
    return lambda x: x + 1

def buffer_transform():
    return lambda x: x * 2

def _helper():
    return 1
"""


def _write(tmp_path, text: str, name: str = "my_config.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_every_function_of_the_contract(tmp_path):
    config = load_config(_write(tmp_path, FULL))
    assert set(config.functions) == set(CONFIG_FUNCTIONS) - {
        "train_target_transform",
        "buffer_target_transform",
        "test_transform",
    }
    model = config.model()
    assert isinstance(model, torch.nn.Linear)
    train, validation = config.data(chunk_id=1, seed=2)
    again, _ = config.data(chunk_id=1, seed=2)
    assert torch.equal(train.tensors[0], again.tensors[0])  # seeded by the file
    assert isinstance(validation, TensorDataset) and len(validation) == 4
    assert len(config.test_data(0, 0)) == 6
    assert config.loss().reduction == "none"
    optimizer = config.optimizer(model.parameters())
    scheduler, interval = config.scheduler(optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and interval == "step"
    assert type(config.listeners()[0]).__name__ == "Seen"
    assert set(config.metrics()) == {"mean_logit"}
    assert config.collate()([(torch.ones(2), 1)])[0].shape == (1, 2)
    assert torch.equal(config.transform("train_transform")(torch.zeros(1)), torch.ones(1))
    assert config.transform("test_transform") is None
    assert len(config.sha256) == 64


def test_only_model_and_data_are_required_and_defaults_are_none(tmp_path):
    config = load_config(
        _write(
            tmp_path,
            """
            import torch
            def model_fn():
                return torch.nn.Linear(2, 2)
            def data_fn(chunk_id, seed):
                return [[0.0, 1.0], [1.0, 0.0]], [0, 1]
            """,
        )
    )
    train, validation = config.data(0, 0)
    assert len(train) == 2 and validation is None
    assert config.loss() is None and config.optimizer([]) is None
    assert config.scheduler(None) is None and config.listeners() == [] and config.metrics() == {}
    assert config.test_data(0, 0) is None and config.collate() is None


def test_arrays_from_numpy_become_a_tensor_dataset(tmp_path):
    config = load_config(
        _write(
            tmp_path,
            """
            import numpy as np, torch
            def model_fn():
                return torch.nn.Linear(3, 2)
            def data_fn(chunk_id, seed):
                return (np.ones((5, 3), "float32"), np.zeros(5, "int64")), (np.ones((2, 3)),
                        np.zeros(2))
            """,
        )
    )
    train, validation = config.data(0, 0)
    assert train.tensors[0].dtype == torch.float32 and len(validation) == 2
    assert np.asarray(train.tensors[1]).dtype == np.int64


BAD = {
    "missing file": (None, "does not exist"),
    "syntax error": ("def model_fn(:\n", "syntax error at line 1"),
    "raises at load": ("import torch\nraise RuntimeError('no GPU here')\n", "no GPU here"),
    "no data_fn": (
        "import torch\ndef model_fn():\n    return torch.nn.Linear(1, 1)\n",
        "lacks data_fn",
    ),
    "renate name": (
        "def model_fn():\n    pass\ndef data_fn(chunk_id, seed):\n    pass\n"
        "def data_module_fn(data_path, chunk_id, seed):\n    pass\n",
        "'data_module_fn' (call it 'data_fn')",
    ),
    "misspelt": (
        "def model_fn():\n    pass\ndef data_fn(chunk_id, seed):\n    pass\n"
        "def optimiser_fn(params):\n    pass\n",
        "'optimiser_fn' (did you mean 'optimizer_fn'?)",
    ),
    "wrong parameters": (
        "def model_fn(model_state_url):\n    pass\ndef data_fn(chunk_id, seed):\n    pass\n",
        "called as model_fn()",
    ),
    "not a function": (
        "model_fn = 3\ndef data_fn(chunk_id, seed):\n    pass\n",
        "must be a function",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_files_are_one_clear_error(tmp_path, case):
    text, message = BAD[case]
    path = tmp_path / "nowhere.py" if text is None else _write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path)


def _config(tmp_path, body: str):
    return load_config(
        _write(
            tmp_path,
            "import torch\n"
            "def model_fn():\n    return torch.nn.Linear(2, 2)\n"
            "def data_fn(chunk_id, seed):\n    return torch.zeros(2, 2), torch.zeros(2)\n" + body,
        )
    )


def test_an_exception_inside_a_function_names_the_config_line(tmp_path):
    config = _config(tmp_path, "def loss_fn():\n    return 1 / 0\n")
    with pytest.raises(
        ConfigError, match=r"loss_fn raised ZeroDivisionError.*line 7: return 1 / 0"
    ):
        config.loss()


def test_a_statement_over_several_lines_is_shown_as_such(tmp_path):
    body = 'def loss_fn():\n    raise ValueError(\n        "no loss here"\n    )\n'
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, body).loss()
    assert "line 7: raise ValueError( ...)" in str(info.value), info.value


def test_a_statement_over_several_lines_is_said_without_a_tracebacks_end_line(
    tmp_path, monkeypatch
):
    """Python 3.10's tracebacks do not say where a statement ends: the file's syntax tree does."""
    import traceback
    import types

    real = traceback.extract_tb

    def without_end_lines(tb):  # frames as Python 3.10 describes them
        return [
            types.SimpleNamespace(filename=f.filename, lineno=f.lineno, name=f.name, line=f.line)
            for f in real(tb)
        ]

    monkeypatch.setattr(traceback, "extract_tb", without_end_lines)
    body = 'def loss_fn():\n    raise ValueError(\n        "no loss here"\n    )\n'
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, body).loss()
    assert "line 7: raise ValueError( ...)" in str(info.value), info.value
    (tmp_path / "one").mkdir()
    with pytest.raises(ConfigError, match=r"line 7: return 1 / 0\)"):  # one line: no "..."
        _config(tmp_path / "one", "def loss_fn():\n    return 1 / 0\n").loss()


@pytest.mark.parametrize(
    ("body", "call", "message"),
    [
        ("def optimizer_fn(params):\n    return 0.1\n", "optimizer", "must return a torch.optim"),
        ("def lr_scheduler_fn(optimizer):\n    return 'x', 'day'\n", "scheduler", "(scheduler"),
        ("def listeners():\n    return object()\n", "listeners", "must return a list"),
        ("def metrics_fn():\n    return ['acc']\n", "metrics", "must return {name"),
        ("def loss_fn():\n    return 'ce'\n", "loss", "must return a callable"),
    ],
)
def test_wrong_return_values_are_refused(tmp_path, body, call, message):
    config = _config(tmp_path, body)
    argument = {"optimizer": [torch.zeros(1, requires_grad=True)], "scheduler": None}
    with pytest.raises(ConfigError, match=re.escape(message)):
        method = getattr(config, call)
        method(argument[call]) if call in argument else method()


def test_data_of_mismatched_lengths_or_kinds_is_refused(tmp_path):
    config = load_config(
        _write(
            tmp_path,
            """
            import torch
            def model_fn():
                return torch.nn.Linear(2, 2)
            def data_fn(chunk_id, seed):
                return (torch.zeros(3, 2), torch.zeros(2)) if chunk_id == 0 else "data.csv"
            """,
        )
    )
    with pytest.raises(ConfigError, match="3 inputs and 2 targets"):
        config.data(0, 0)
    with pytest.raises(ConfigError, match="must return a torch Dataset"):
        config.data(1, 0)


def test_a_model_fn_returning_something_else_is_refused(tmp_path):
    config = load_config(
        _write(
            tmp_path,
            "def model_fn():\n    return 'resnet'\ndef data_fn(chunk_id, seed):\n    return None\n",
        )
    )
    with pytest.raises(ConfigError, match=r"must return a torch\.nn\.Module, got str"):
        config.model()
    with pytest.raises(ConfigError, match="must return a torch Dataset"):
        config.data(0, 0)


def test_helpers_of_the_config_can_be_imported_from_its_folder(tmp_path):
    (tmp_path / "my_models.py").write_text(
        "import torch\ndef small():\n    return torch.nn.Linear(2, 2)\n"
    )
    config = load_config(
        _write(
            tmp_path,
            "from my_models import small\nimport torch\n"
            "def model_fn():\n    return small()\n"
            "def data_fn(chunk_id, seed):\n    return torch.zeros(2, 2), torch.zeros(2)\n",
        )
    )
    assert isinstance(config.model(), torch.nn.Linear)


OWN_MODEL = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.linear(x))

def model_fn():
    return Net()

def data_fn(chunk_id, seed):
    return torch.zeros(2, 4), torch.zeros(2)
"""


def test_a_model_class_of_the_config_file_is_found_by_its_module(tmp_path):
    """torch.compile (``--capture compile``) looks the forward's globals up through the class's
    ``__module__``: a config file is registered as the module it is (it was not: dynamo stopped
    with ``ModuleNotFoundError: No module named '_renate_events_config_...'``)."""
    config = load_config(_write(tmp_path, OWN_MODEL))
    model = config.model()
    assert sys.modules[type(model).__module__].Net is type(model)
    assert type(pickle.loads(pickle.dumps(model))) is type(model)
    x = torch.randn(5, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), model(x))


def test_a_config_file_that_does_not_load_leaves_no_module_behind(tmp_path):
    before = set(sys.modules)
    with pytest.raises(ConfigError, match="loading the file raised ZeroDivisionError"):
        load_config(_write(tmp_path, "x = 1 / 0\n"))
    with pytest.raises(ConfigError, match="syntax error"):
        load_config(_write(tmp_path, "def (:\n", name="broken.py"))
    assert set(sys.modules) == before
