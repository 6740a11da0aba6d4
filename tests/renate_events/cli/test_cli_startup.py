"""Nothing slow is imported before it is needed: importing ``renate_events``, its command line and
``trainer``, building the parser and training an update do not import the optional heavy
packages (matplotlib only when ``run`` writes its heatmap, Optuna only for a search,
TensorBoard, MLflow and W&B only for their listeners, scikit-learn and PIL only for the data
sets that read with them). Each check runs in a fresh interpreter (``sys.modules`` of this one
holds whatever other tests imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT

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


def _imported_heavy(code: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", code + _REPORT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


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
