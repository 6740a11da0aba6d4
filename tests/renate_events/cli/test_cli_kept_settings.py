"""A later ``renate-events update`` keeps the input state's learner, buffer and memory size: a
change is said as such (the folder's and the update's values), even where the new learner could
not take the stored buffer or the new memory size the memory batch size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from renate_events.cli import main
from renate_events.methods import METHODS
from tests.helpers import one_line_cli_error

NME = next(name for name, spec in METHODS.items() if spec.classifier == "nme")
OTHER = next(
    name
    for name, spec in METHODS.items()
    if spec.uses_memory and METHODS[NME].default_buffer not in spec.buffers
)


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    out = tmp_path_factory.mktemp("kept") / "out"
    args = ["run", "--epochs", "1", "--output-dir", str(out), "--no-progress", "--hidden", "16"]
    assert main([*args, "--learner", NME, "--memory-size", "40"]) == 0
    return out / "state" / "seed-0"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    generator = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("data") / "new.npz"
    inputs = torch.rand(30, 64, generator=generator) * 16
    np.savez(path, inputs=inputs.numpy(), targets=np.arange(30) % 10)
    return path


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--learner", OTHER], [f"learner: the folder has {NME!r}, this updater {OTHER!r}"]),
        (["--memory-size", "10"], ["learner_kwargs['memory_size']: the folder has 40"]),
    ],
)
def test_a_changed_learner_or_memory_size_is_said_as_such(
    state, data, tmp_path, capsys, extra, words
):
    out = tmp_path / "next"
    argv = ["update", "--input-state", str(state), "--data", str(data), "--no-progress"]
    err = one_line_cli_error(
        capsys,
        [*argv, "--output-state", str(out), *extra],
        "written by a different configuration",
        *words,
    )
    assert "manifest is refused" not in err
    assert not out.exists()
