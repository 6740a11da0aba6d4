"""Nothing slow is imported before it is needed: importing ``renate_events``, its command line and
``trainer``, building the parser, training an update and a ``run`` until its first fit do not
import the optional heavy packages (matplotlib only when ``run`` writes its heatmap, Optuna only
for a search, TensorBoard, MLflow and W&B only for their listeners, scikit-learn and PIL only for
the data sets that read with them). Each check runs in a fresh interpreter (``sys.modules`` of
this one holds whatever other tests imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT
from tests.renate_events.datasets.test_readers_cifar import write_cifar10

HEAVY = (
    "matplotlib",
    "optuna",
    "tensorboard",
    "torch.utils.tensorboard",
    "sklearn",
    "PIL",
    "mlflow",
    "wandb",
    "transformers",
    "pandas",
    "scipy",
    "torchvision",
)

_REPORT = f"""
import json, sys
print(json.dumps(sorted(name for name in {HEAVY!r} if name in sys.modules)))
"""

_CONFIG = """
import torch
from torch.utils.data import TensorDataset


def model_fn():
    return torch.nn.Linear(4, 2)


def data_fn(chunk_id, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
    return TensorDataset(x, y), None
"""


# Trainer.fit noting the heavy packages imported when the first training starts.
_AT_FIRST_FIT = f"""
import json, sys
import trainer
at_fit = []
original_fit = trainer.Trainer.fit
def noting_fit(self, *args, **kwargs):
    if not at_fit:
        at_fit.append(sorted(name for name in {HEAVY!r} if name in sys.modules))
    return original_fit(self, *args, **kwargs)
trainer.Trainer.fit = noting_fit
"""


def _imported_heavy(code: str) -> list[str]:
    return json.loads(_output(code + _REPORT).splitlines()[-1])


def _output(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def test_importing_the_packages_and_building_the_parser_imports_nothing_heavy():
    code = (
        "import renate_events, renate_events.cli, trainer, trainer.listeners\n"
        "from renate_events.cli._parser import build_parser\n"
        "build_parser()\n"
    )
    assert _imported_heavy(code) == []


def test_an_update_from_the_command_line_imports_nothing_heavy(tmp_path):
    (tmp_path / "c.py").write_text(_CONFIG)
    argv = ["update", "--config-file", str(tmp_path / "c.py"), "--device", "cpu"]
    argv += ["--no-progress", "--output-state", str(tmp_path / "state")]
    code = f"from renate_events.cli import main\nassert main({argv!r}) == 0\n"
    assert _imported_heavy(code) == []
    assert (tmp_path / "state" / "manifest.json").exists()


def test_a_run_imports_nothing_heavy_before_training_and_matplotlib_only_for_its_plot(tmp_path):
    write_cifar10(tmp_path / "cifar-10-batches-bin", per_class=2, test_per_class=1)
    argv = ["run", "--scenario", "seq-cifar10", "--data-dir", str(tmp_path), "--model"]
    argv += ["resnet18", "--model-args", "{nf = 4}", "--epochs", "1", "--device", "cpu"]
    argv += ["--no-progress", "--output-dir", str(tmp_path / "out")]
    code = f"from renate_events.cli import main\nassert main({argv!r}) == 0\n"
    code += "print(json.dumps(at_fit[0]))\n"
    lines = _output(_AT_FIRST_FIT + code + _REPORT).splitlines()
    at_fit, at_end = json.loads(lines[-2]), json.loads(lines[-1])
    assert at_fit == []
    assert set(at_end) <= {"matplotlib", "PIL"}  # the heatmap, written at the end (Pillow: its PNG)
    assert ("matplotlib" in at_end) == (tmp_path / "out" / "accuracy_matrix.png").exists()


def test_importing_the_command_line_does_not_import_torch_dynamo():
    """``trainer.capture.eager`` makes its ``torch.compiler.disable`` wrappers only when a
    capture is set up: torch._dynamo costs about as long to import as torch itself."""
    code = "import sys, renate_events.cli\nprint('torch._dynamo' in sys.modules)\n"
    assert _output(code).splitlines()[-1] == "False"
