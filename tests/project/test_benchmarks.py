"""The benchmark scripts run end to end (tiny settings) and write the pages the docs include.

They are not timing tests: the numbers of such short runs mean nothing. They catch a script broken
by a change of the code it measures.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def _run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_compare_measures_every_variant_and_writes_its_page(tmp_path):
    page = tmp_path / "compare.md"
    out = _run(
        "compare.py", "--rounds", "1", "--steps", "6", "--replay-steps", "6",
        "--markdown", str(page),
    )  # fmt: skip
    text = page.read_text(encoding="utf-8")
    for row in (
        "bare loop, DataLoader",
        "Trainer, TensorLoader, 10 listeners",
        "bare replay + reservoir update",
        "ExperienceReplayLearner, TensorLoader",
    ):
        assert f"| {row} |" in text
    assert "$ python benchmarks/compare.py --rounds 1" in text
    # Peers that are not installed are skipped with the reason, never an error.
    for peer in ("PyTorch Lightning", "Ignite", "Avalanche"):
        assert peer in out


@pytest.mark.slow
def test_checkpoint_io_writes_its_page(tmp_path):
    page = tmp_path / "checkpoint_io.md"
    _run("checkpoint_io.py", "--repeats", "1", "--dir", str(tmp_path), "--markdown", str(page))
    text = page.read_text(encoding="utf-8")
    assert "| Trainer.save_checkpoint |" in text and "| Trainer.load_checkpoint |" in text
    assert "ratios against torch.save" in text


@pytest.mark.slow
def test_der_forms_runs_every_variant():
    out = _run("der_forms.py", "--seeds", "0", "--epochs", "1")
    for variant in ("Avalanche's DER, bare", "DER++ here, averaged (default)", "two passes"):
        assert variant in out
    assert "Traceback" not in out


def test_gpu_check_dry_run_runs_every_section():
    """No session has had a GPU to run ``gpu_check.py`` on: its CPU dry run keeps the script's
    code paths (loops, replay, sync census) from breaking unnoticed."""
    out = _run("gpu_check.py", "--cpu-dry-run", "--steps", "4", "--rounds", "1")
    for line in (
        "(1) training loop",
        "precision bf16-mixed",
        "(2) replay step",
        "ExperienceReplayLearner, GPU buffer",
        "(3) sync check",
        "canary: Trainer with the default nonfinite_loss='raise'",
        "DarkExperienceReplayLearner, GPU buffer",
        "DER++ image step, resnet18(nf=4), uint8 GPU buffer, CIFAR preset, bf16-mixed",
        "the sync census is skipped",
        "(4) DER++ image step",
        "(5) precision rows: DER++ image step, resnet18(nf=4)",
        "learner bf16-mixed, tf32=True, channels_last=True",
        "(6) run timing: renate-events run --scenario seq-cifar10 --epochs 1 --device cpu",
        "training steps (Trainer.fit)",
        "evaluation + start-up:",
    ):
        assert line in out, line
    assert "Traceback" not in out


def test_shift_detection_writes_its_page(tmp_path):
    page = tmp_path / "shift_detection.md"
    _run(
        "shift_detection.py", "--trials", "10", "--permutations", "20", "--largest", "250",
        "--markdown", str(page),
    )  # fmt: skip
    text = page.read_text(encoding="utf-8")
    for heading in ("## Calibration", "## Power", "## Cost"):
        assert heading in text
    assert "| class-proportion shift | 0.9 |" in text and "| 250 |" in text


def test_search_benchmark_writes_its_page(tmp_path):
    pytest.importorskip("optuna")
    pytest.importorskip("sklearn")
    page = tmp_path / "search.md"
    _run("search.py", "--seeds", "0", "--trials", "1", "--markdown", str(page))
    text = page.read_text(encoding="utf-8")
    assert "| defaults |" in text and "| search, 1 trials, no pruner |" in text


@pytest.mark.slow
def test_replay_step_resnet_checks_the_losses_and_writes_its_page(tmp_path):
    """A narrow ResNet (nf=2) keeps it to seconds; the timing itself is not checked."""
    page = tmp_path / "replay_step_resnet.md"
    out = _run(
        "replay_step_resnet.py", "--quick", "--nf", "2", "--check-steps", "2",
        "--markdown", str(page),
    )  # fmt: skip
    text = page.read_text(encoding="utf-8")
    for row in ("bare DER++ loop", "DarkExperienceReplayLearner + Trainer", "cpu"):
        assert f"| {row} |" in text, row
    assert "losses agree over 2 steps" in out
    assert re.search(r"library / bare: \d+\.\d{3}x \(target <= 1\.10x: (met|NOT met)\)", out)
    assert "$ python benchmarks/replay_step_resnet.py --quick --nf 2" in text


@pytest.mark.slow
def test_prompt_step_measures_every_prompt_method_and_writes_its_page(tmp_path):
    page = tmp_path / "prompt_step.md"
    _run(
        "prompt_step.py", "--quick", "--dim", "32", "--depth", "5", "--heads", "4",
        "--batch", "4", "--markdown", str(page),
    )  # fmt: skip
    text = page.read_text(encoding="utf-8")
    for row in ("fine-tuning", "l2p", "dualprompt", "coda-prompt"):
        assert f"| {row} |" in text, row
    assert "| fine-tuning | " in text and "1.00x" in text


@pytest.mark.slow
def test_resume_kills_counts_bit_identical_reruns():
    out = _run("resume_kills.py", "--kills", "2", "--seed", "3")
    count = re.search(r"(\d+) of (\d+) killed updates resumed bit-identical", out)
    assert count is not None, out
    assert count.group(1) == count.group(2), out


@pytest.mark.slow
def test_mmap_buffer_measures_steps_and_state_folders(tmp_path):
    out = _run("mmap_buffer.py", "--slots", "600", "--steps", "20", "--folder", str(tmp_path))
    assert "mapped" in out and "memory" in out, out
    # the state folders of a filled buffer are read back by the next update (refused once: the
    # buffer was filled behind the updater's back, more samples seen than the updates trained on)
    out = _run("mmap_buffer.py", "--state-folder", "--slots", "600", "--folder", str(tmp_path))
    for storage in ("memory", "mapped"):
        assert f"{storage}: update (1 epoch, 256 samples)" in out, out
