"""A run killed with SIGKILL at a step hypothesis chooses and resumed from its last checkpoint
ends bit for bit where the uninterrupted run ends (model, optimizer, buffer, components)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_same_tree, run_in_fresh_process
from tests.scripts.killable_run import main
from trainer import read_checkpoint


def _run(out, kill_task=-1, kill_step=0):
    """The run in a process of its own (forked from a server that imported torch once)."""
    return run_in_fresh_process(main, str(out), kill_task, kill_step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    assert _run(out) == 0
    return read_checkpoint(out / "final.safetensors")


@pytest.mark.slow
@settings(max_examples=2, deadline=None)
@given(kill_task=st.sampled_from([0, 1]), kill_step=st.integers(1, 11))  # 12 steps per update
@example(kill_task=1, kill_step=5)  # during the second update, between two checkpoints
@example(kill_task=1, kill_step=1)  # before the second update wrote any checkpoint
def test_sigkill_then_resume_is_bit_identical(reference, tmp_path_factory, kill_task, kill_step):
    out = tmp_path_factory.mktemp("killed")
    code = _run(out, kill_task, kill_step)
    assert code == -9  # killed by SIGKILL
    assert not (out / "final.safetensors").exists()
    assert _run(out) == 0  # resume
    resumed = read_checkpoint(out / "final.safetensors")
    for section in ("model", "optimizer", "listeners"):
        assert_same_tree(reference[section], resumed[section], section)
