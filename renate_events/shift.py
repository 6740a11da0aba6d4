"""Covariate-shift detection: does new data differ enough from the reference to warrant an update?

Renate's interface and names: a detector is fitted on a reference dataset (``fit``) and scores a
query dataset (``score``), returning ``1 - p-value`` of a two-sample test, so that a high score
means a shift. Both work on the raw inputs (flattened per sample) or on the features a
``feature_extractor`` module computes from them. :meth:`ShiftDetector.test` returns the
statistic, the p-value and the decision at a significance level.

* :class:`MMDCovariateShiftDetector`: the kernel maximum mean discrepancy test (Gretton et al.,
  "A Kernel Two-Sample Test", JMLR 2012) with a Gaussian kernel whose bandwidth is the median
  distance between the pooled samples (the median heuristic), and a permutation p-value. The
  statistic costs ``O(n^2)`` memory and time in the number of samples, each permutation another
  ``O(n^2)``: at most ``max_samples`` samples of each side are used (a random subset).
* :class:`KolmogorovSmirnovCovariateShiftDetector`: a two-sample Kolmogorov-Smirnov test on every
  feature, combined with a Bonferroni correction as Rabanser et al. ("Failing Loudly: An
  Empirical Study of Methods for Detecting Dataset Shift", NeurIPS 2019) propose and Renate
  does. The p-value of each test is the asymptotic Kolmogorov distribution with Stephens'
  small-sample correction of the effective sample size (as in Press et al., "Numerical Recipes",
  section 14.3). ``O(n log n)`` per feature.

Everything is vectorised in torch; the datasets are read batch by batch.

Example:
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> g = torch.Generator().manual_seed(0)
    >>> reference = TensorDataset(torch.randn(200, 3, generator=g))
    >>> shifted = TensorDataset(torch.randn(200, 3, generator=g) + 0.5)
    >>> detector = KolmogorovSmirnovCovariateShiftDetector()
    >>> detector.fit(reference)
    >>> detector.score(shifted) > 0.99
    True
    >>> result = detector.test(TensorDataset(torch.randn(200, 3, generator=g)), level=0.05)
    >>> result.shift
    False
"""

from __future__ import annotations

import abc
import math
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from renate_events.inference import inference
from trainer import validators
from trainer.data import to_device

__all__ = [
    "MIN_SAMPLES",
    "KolmogorovSmirnovCovariateShiftDetector",
    "MMDCovariateShiftDetector",
    "ShiftDetectionError",
    "ShiftDetector",
    "ShiftDetectorWithFeatureExtractor",
    "ShiftTestResult",
    "ks_test",
    "mmd_test",
]

MIN_SAMPLES = 10
"""The fewest samples on each side that a test accepts."""


class ShiftDetectionError(ValueError):
    """Raised for data a test cannot use: too few samples, other feature shapes, non-finite
    values, a query before ``fit``."""


@attrs.frozen
class ShiftTestResult:
    """The outcome of one two-sample test.

    Attributes:
        statistic: The test statistic (MMD², or the largest per-feature KS distance).
        p_value: Its p-value under the hypothesis that both samples share one distribution.
        level: The significance level of the decision.
        shift: ``p_value < level``.
    """

    statistic: float
    p_value: float
    level: float
    shift: bool


def _check_pair(reference: torch.Tensor, query: torch.Tensor) -> None:
    for name, sample in (("reference", reference), ("query", query)):
        if sample.dim() != 2:
            raise ShiftDetectionError(
                f"the {name} sample must be (samples, features), got shape {tuple(sample.shape)}"
            )
        if len(sample) < MIN_SAMPLES:
            raise ShiftDetectionError(
                f"the {name} sample has {len(sample)} samples; a test needs at least "
                f"{MIN_SAMPLES} on each side"
            )
        if not bool(torch.isfinite(sample).all()):
            raise ShiftDetectionError(f"the {name} sample holds NaN or infinite values")
    if reference.shape[1] != query.shape[1]:
        raise ShiftDetectionError(
            f"the reference samples have {reference.shape[1]} features, the query samples "
            f"{query.shape[1]}; give samples of the same shape"
        )


def _subset(sample: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    if len(sample) <= size:
        return sample
    chosen = torch.randperm(len(sample), generator=generator)[:size]
    return sample[chosen.to(sample.device)]


def mmd_test(
    reference: torch.Tensor,
    query: torch.Tensor,
    *,
    num_permutations: int = 1000,
    max_samples: int = 2000,
    seed: int = 0,
    level: float = 0.05,
) -> ShiftTestResult:
    """The kernel MMD two-sample test on ``(samples, features)`` tensors.

    The biased estimate ``MMD² = w^T K w`` with ``w = 1/n`` on the reference and ``-1/m`` on the
    query; the Gaussian kernel's bandwidth is the median pairwise distance of the pooled samples.
    The p-value is ``(1 + #{permuted MMD² >= observed}) / (1 + num_permutations)``, all
    permutations evaluated as one matrix product in chunks.
    """
    validators.check_int("mmd_test: num_permutations", num_permutations, 1)
    validators.check_int("mmd_test: max_samples", max_samples, MIN_SAMPLES)
    _check_pair(reference, query)
    generator = torch.Generator().manual_seed(seed)
    x = _subset(reference.double(), max_samples, generator)
    y = _subset(query.double(), max_samples, generator)
    pooled = torch.cat([x, y])
    squared = torch.cdist(pooled, pooled).pow(2)
    off_diagonal = squared[~torch.eye(len(pooled), dtype=torch.bool, device=pooled.device)]
    positive = off_diagonal[off_diagonal > 0]
    median = float(positive.median()) if len(positive) else 1.0
    kernel = torch.exp(-squared / median)
    n, m = len(x), len(y)
    observed = torch.cat([x.new_full((n,), 1.0 / n), x.new_full((m,), -1.0 / m)])
    statistic = float(observed @ kernel @ observed)
    exceed = 0
    for start in range(0, num_permutations, 256):  # chunks bound the (P, n + m) weight matrix
        count = min(256, num_permutations - start)
        order = torch.rand(count, n + m, generator=generator).argsort(dim=1).to(pooled.device)
        weights = observed[order]
        permuted = ((weights @ kernel) * weights).sum(dim=1)
        exceed += int((permuted >= statistic - 1e-12).sum())
    p_value = (1 + exceed) / (1 + num_permutations)
    return ShiftTestResult(statistic, p_value, level, p_value < level)


def _kolmogorov_survival(lam: torch.Tensor) -> torch.Tensor:
    """``Q(lam) = 2 sum_k (-1)^(k-1) exp(-2 k^2 lam^2)``, the Kolmogorov distribution's tail."""
    k = torch.arange(1, 101, dtype=lam.dtype, device=lam.device)
    terms = 2 * (-1) ** (k - 1) * torch.exp(-2 * k**2 * lam.unsqueeze(-1) ** 2)
    q = terms.sum(dim=-1).clamp(0.0, 1.0)
    return torch.where(lam < 1e-3, torch.ones_like(q), q)  # the series converges slowly at 0


def ks_test(
    reference: torch.Tensor, query: torch.Tensor, *, level: float = 0.05
) -> ShiftTestResult:
    """A two-sample Kolmogorov-Smirnov test per feature, Bonferroni-combined.

    Returns the largest per-feature distance as the statistic and ``min(1, d * min_i p_i)`` as
    the p-value (``d`` features).
    """
    _check_pair(reference, query)
    x = reference.double().T.sort(dim=1).values  # (features, n)
    y = query.double().T.sort(dim=1).values
    pooled = torch.cat([x, y], dim=1)
    n, m = x.shape[1], y.shape[1]
    cdf_x = torch.searchsorted(x.contiguous(), pooled.contiguous(), right=True).double() / n
    cdf_y = torch.searchsorted(y.contiguous(), pooled.contiguous(), right=True).double() / m
    distances = (cdf_x - cdf_y).abs().max(dim=1).values
    effective = math.sqrt(n * m / (n + m))
    p_values = _kolmogorov_survival((effective + 0.12 + 0.11 / effective) * distances)
    p_value = min(1.0, float(p_values.min()) * len(distances))
    return ShiftTestResult(float(distances.max()), p_value, level, p_value < level)


@attrs.define(eq=False)
class ShiftDetector(abc.ABC):
    """Fit on a reference dataset, score query datasets (Renate's interface).

    Args:
        batch_size: Samples per batch when reading a dataset.
        num_preprocessing_workers: ``DataLoader`` workers for datasets that are not tensors.
        device: Where features are computed and the test runs.
    """

    batch_size: int = attrs.field(default=32, validator=validators.int_at_least(1))
    num_preprocessing_workers: int = attrs.field(default=0, validator=validators.int_at_least(0))
    device: str = attrs.field(default="cpu", validator=validators.non_empty_string("a device"))
    _reference: torch.Tensor | None = attrs.field(init=False, default=None, repr=False)

    def fit(self, dataset: Dataset[Any]) -> None:
        """Keep the reference sample (its features)."""
        self._reference = self._features(dataset, "reference")

    def score(self, dataset: Dataset[Any]) -> float:
        """``1 - p-value`` of the test against the reference: high means a shift."""
        return 1.0 - self.test(dataset).p_value

    def test(self, dataset: Dataset[Any], level: float = 0.05) -> ShiftTestResult:
        """The statistic, the p-value and the decision at ``level``."""
        if not (validators.is_real(level) and 0 < level < 1):
            raise ShiftDetectionError(f"level must be a number in (0, 1), got {level!r}")
        if self._reference is None:
            raise ShiftDetectionError(f"{type(self).__name__}.score before fit: fit a reference")
        return self._test(self._reference, self._features(dataset, "query"), level)

    @abc.abstractmethod
    def _test(self, reference: torch.Tensor, query: torch.Tensor, level: float) -> ShiftTestResult:
        """The two-sample test on feature tensors."""

    def _features(self, dataset: Dataset[Any], name: str) -> torch.Tensor:
        parts = [self._extract(_inputs_of(batch)) for batch in self._batches(dataset)]
        if not parts:
            raise ShiftDetectionError(f"the {name} dataset is empty")
        return torch.cat(parts)

    def _batches(self, dataset: Dataset[Any]) -> Any:
        tensors = getattr(dataset, "tensors", None)
        if isinstance(dataset, TensorDataset) and tensors:
            for start in range(0, len(tensors[0]), self.batch_size):
                yield tensors[0][start : start + self.batch_size]
            return
        yield from DataLoader(
            dataset, batch_size=self.batch_size, num_workers=self.num_preprocessing_workers
        )

    def _extract(self, inputs: Any) -> torch.Tensor:
        inputs = to_device(inputs, torch.device(self.device))
        if not isinstance(inputs, torch.Tensor):
            raise ShiftDetectionError(
                f"samples must be tensors (or (inputs, target) pairs), got {type(inputs).__name__}"
            )
        return inputs.reshape(len(inputs), -1).double()


def _inputs_of(batch: Any) -> Any:
    """The inputs of a batch of ``(inputs, target)`` pairs, or the batch itself."""
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


@attrs.define(eq=False)
class ShiftDetectorWithFeatureExtractor(ShiftDetector):
    """A detector on the features ``feature_extractor(inputs)`` (flattened per sample), or on the
    raw inputs when it is None. The extractor runs in eval mode without gradients.

    Args:
        feature_extractor: A module mapping a batch of inputs to features.
    """

    feature_extractor: nn.Module | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(attrs.validators.instance_of(nn.Module)),
    )

    def _extract(self, inputs: Any) -> torch.Tensor:
        if self.feature_extractor is None:
            return super()._extract(inputs)
        with inference(self.feature_extractor):
            features = self.feature_extractor(to_device(inputs, torch.device(self.device)))
        return features.reshape(len(features), -1).double()


@attrs.define(eq=False)
class MMDCovariateShiftDetector(ShiftDetectorWithFeatureExtractor):
    """The kernel MMD test (see :func:`mmd_test`).

    Args:
        num_permutations: Permutations of the p-value (its smallest value is
            ``1 / (1 + num_permutations)``).
        max_samples: At most this many samples of each side enter the test (the cost is
            quadratic in it).
        seed: Seeds the permutations and the subsets.
    """

    num_permutations: int = attrs.field(
        default=1000, kw_only=True, validator=validators.int_at_least(1)
    )
    max_samples: int = attrs.field(
        default=2000, kw_only=True, validator=validators.int_at_least(MIN_SAMPLES)
    )
    seed: int = attrs.field(default=0, kw_only=True, validator=validators.int_at_least(0))

    def _test(self, reference: torch.Tensor, query: torch.Tensor, level: float) -> ShiftTestResult:
        return mmd_test(
            reference,
            query,
            num_permutations=self.num_permutations,
            max_samples=self.max_samples,
            seed=self.seed,
            level=level,
        )


@attrs.define(eq=False)
class KolmogorovSmirnovCovariateShiftDetector(ShiftDetectorWithFeatureExtractor):
    """A Kolmogorov-Smirnov test per feature with a Bonferroni correction (see
    :func:`ks_test`)."""

    def _test(self, reference: torch.Tensor, query: torch.Tensor, level: float) -> ShiftTestResult:
        return ks_test(reference, query, level=level)
