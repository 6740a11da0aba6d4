"""Shift detection: the tests' statistics against hand computations, calibration under no shift,
power under a shift, feature extractors, bad input, and the `renate-events shift` command."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.cli import main
from renate_events.shift import (
    KolmogorovSmirnovCovariateShiftDetector,
    MMDCovariateShiftDetector,
    ShiftDetectionError,
    ks_test,
    mmd_test,
)


def _sample(n, features=3, shift=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g) + shift


def test_ks_statistic_is_the_largest_ecdf_gap_of_any_feature():
    x, y = _sample(15, 2, seed=1), _sample(12, 2, 0.4, seed=2)
    gaps = []
    for j in range(2):
        points = sorted(x[:, j].tolist() + y[:, j].tolist())
        gaps.append(
            max(
                abs(
                    sum(v <= t for v in x[:, j].tolist()) / 15
                    - sum(v <= t for v in y[:, j].tolist()) / 12
                )
                for t in points
            )
        )
    assert ks_test(x, y).statistic == pytest.approx(max(gaps), abs=1e-12)


def test_ks_p_value_is_close_to_scipys():
    stats = pytest.importorskip("scipy.stats")
    x, y = _sample(80, 1, seed=3), _sample(70, 1, 0.3, seed=4)
    expected = stats.ks_2samp(x[:, 0].numpy(), y[:, 0].numpy()).pvalue
    assert ks_test(x, y).p_value == pytest.approx(expected, rel=0.1)


def test_ks_p_value_is_bonferroni_corrected():
    x, y = _sample(60, 4, seed=5), _sample(60, 4, seed=6)
    single = [ks_test(x[:, [j]], y[:, [j]]).p_value for j in range(4)]
    assert ks_test(x, y).p_value == pytest.approx(min(1.0, 4 * min(single)))


def test_mmd_statistic_equals_the_kernel_sums_with_the_median_bandwidth():
    x, y = _sample(10, 2, seed=7).double(), _sample(12, 2, 1.0, seed=8).double()
    pooled = torch.cat([x, y])
    d2 = [[float(((a - b) ** 2).sum()) for b in pooled] for a in pooled]
    off = [d2[i][j] for i in range(22) for j in range(22) if i != j]
    bandwidth = float(np.median(off))
    k = lambda i, j: math.exp(-d2[i][j] / bandwidth)  # noqa: E731
    xx = sum(k(i, j) for i in range(10) for j in range(10)) / 100
    yy = sum(k(i, j) for i in range(10, 22) for j in range(10, 22)) / 144
    xy = sum(k(i, j) for i in range(10) for j in range(10, 22)) / 120
    result = mmd_test(x, y, num_permutations=99)
    assert result.statistic == pytest.approx(xx + yy - 2 * xy, rel=1e-9)
    assert result.p_value == pytest.approx(0.01)  # no permutation exceeds a shift this large


def _binomial_interval(trials, p, z=2.58):
    spread = z * math.sqrt(p * (1 - p) / trials)
    return p - spread, p + spread


@pytest.mark.parametrize("name", ["ks", "mmd"])
def test_the_rejection_rate_without_shift_is_the_level(name):
    trials, rejected = 200, 0
    for trial in range(trials):
        x, y = _sample(40, 2, seed=2 * trial), _sample(40, 2, seed=2 * trial + 1)
        if name == "ks":
            rejected += ks_test(x, y, level=0.05).shift
        else:
            rejected += mmd_test(x, y, num_permutations=100, seed=trial, level=0.05).shift
    low, high = _binomial_interval(trials, 0.05)
    assert low <= rejected / trials <= high


@pytest.mark.parametrize(
    "detector", [KolmogorovSmirnovCovariateShiftDetector, MMDCovariateShiftDetector]
)
def test_a_mean_shift_is_detected_and_its_absence_is_not(detector):
    found = detector()
    found.fit(TensorDataset(_sample(200, seed=9), torch.zeros(200)))  # (inputs, target) pairs
    assert found.score(TensorDataset(_sample(200, shift=0.5, seed=10))) > 0.99
    assert not found.test(TensorDataset(_sample(200, seed=11))).shift


def test_a_feature_extractor_tests_the_features_only():
    keep_first = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        keep_first.weight.copy_(torch.tensor([[1.0, 0.0, 0.0]]))
    detector = KolmogorovSmirnovCovariateShiftDetector(feature_extractor=keep_first)
    detector.fit(TensorDataset(_sample(200, seed=12)))
    moved = _sample(200, seed=13)
    moved[:, 1:] += 2.0  # features the extractor drops
    assert not detector.test(TensorDataset(moved)).shift
    assert keep_first.training  # its mode is put back


@pytest.mark.parametrize(
    ("reference", "query", "message"),
    [
        (
            _sample(50, 3),
            _sample(50, 2),
            "the reference samples have 3 features, the query samples 2",
        ),
        (_sample(50), _sample(5), "the query sample has 5 samples; a test needs at least 10"),
        (_sample(50), torch.full((20, 3), float("nan")), "the query sample holds NaN"),
    ],
)
def test_bad_samples_are_refused(reference, query, message):
    for test in (ks_test, mmd_test):
        with pytest.raises(ShiftDetectionError, match=message):
            test(reference, query)


def test_scoring_before_fit_and_a_bad_level_are_refused():
    detector = MMDCovariateShiftDetector()
    with pytest.raises(ShiftDetectionError, match="before fit"):
        detector.score(TensorDataset(_sample(20)))
    detector.fit(TensorDataset(_sample(20)))
    with pytest.raises(ShiftDetectionError, match=r"level must be a number in \(0, 1\)"):
        detector.test(TensorDataset(_sample(20)), level=1.5)
    with pytest.raises(ValueError, match="num_permutations"):
        MMDCovariateShiftDetector(num_permutations=0)


def test_the_shift_command_prints_the_decision(tmp_path, capsys):
    np.savez(tmp_path / "ref.npz", inputs=_sample(200, seed=14).numpy())
    np.savez(tmp_path / "new.npz", inputs=_sample(200, shift=0.5, seed=15).numpy())
    np.savez(tmp_path / "narrow.npz", inputs=_sample(200, 2, seed=16).numpy())
    args = ["shift", "--reference", str(tmp_path / "ref.npz")]
    assert main([*args, "--query", str(tmp_path / "new.npz"), "--detector", "ks"]) == 0
    assert "shift detected at level 0.05" in capsys.readouterr().out
    assert main([*args, "--query", str(tmp_path / "narrow.npz")]) == 2
    err = capsys.readouterr().err
    assert "3 features, the query samples 2" in err and err.count("\n") == 1
    assert main([*args, "--query", str(tmp_path / "new.npz"), "--feature-module", "x"]) == 2
    assert "--feature-module and --config-file need --state" in capsys.readouterr().err
