"""Scenarios that cut a stream of data: IID chunks, domains given by the data, a sorted feature or
hue."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import torch
from torch.utils.data import TensorDataset

from renate_events.scenarios.base import (
    SPLIT_STREAM,
    TASK_STREAM,
    Pool,
    Scenario,
    Task,
    check_num_tasks_train,
    classes_of,
    materialise,
    random_chunks,
    stratified_split,
    stream_generator,
    take,
    test_counts,
)
from renate_events.scenarios.classes import convert_groups
from trainer import validators

__all__ = [
    "HUE_BINS",
    "DataIncrementalScenario",
    "FeatureSortingScenario",
    "HueShiftScenario",
    "IIDScenario",
    "dominant_hues",
    "soft_sorted_order",
    "sorted_tasks",
]


@attrs.frozen(eq=False)
class IIDScenario(Scenario):
    """Data-incremental: the training pool in random, equally sized chunks, one per task.

    All tasks share the same distribution; every task is tested on the whole test pool (as in
    Renate's ``IIDScenario``). For data that arrives from named sources, one per update, see
    :class:`DataIncrementalScenario`.

    Args:
        dataset: The data (see :class:`Scenario`).
        num_tasks: Number of chunks, at least 1 and at most the size of the training pool.
        test_dataset, test_fraction, seed: See :class:`Scenario`.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.randn(40, 3), torch.arange(40) % 4)
        >>> [len(task.train) for task in IIDScenario(data, num_tasks=2)]  # 28 of 40 train
        [14, 14]
    """

    num_tasks: int = attrs.field(validator=check_num_tasks_train)  # type: ignore[assignment]

    def _build(self, train: Pool, test: Pool) -> list[Task]:
        chunks = random_chunks(
            len(train[1]), self.num_tasks, stream_generator(self.seed, TASK_STREAM)
        )
        classes = self._all_classes(train, test)
        test_data = TensorDataset(*test)
        return [
            Task(
                task_id=i,
                train=TensorDataset(*take(train, chunk)),
                test=test_data,
                classes=classes,
            )
            for i, chunk in enumerate(chunks)
        ]


def _to_domains(value: Any) -> Any:
    if value is None or isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return value  # the validator names what is wrong


def _check_domains(instance: DataIncrementalScenario, attribute: Any, value: Any) -> None:
    data = instance.dataset if attribute.name == "domains" else instance.test_dataset
    name = validators.field_name(instance, attribute)
    if data is None:  # test_domains without test_dataset
        if value is not None:
            raise ValueError(f"{name} labels the samples of test_dataset; give test_dataset too")
        return
    count = len(data)
    valid = (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and len(value) == count
        and not (value.dtype.is_floating_point or value.dtype.is_complex)
        and value.dtype != torch.bool
    )
    if not valid:
        raise ValueError(
            f"{name} must hold one integer domain id per sample ({count}), such as "
            f"torch.tensor([0, 0, 1, ...]), got {_describe_tensor(value)}"
        )
    if bool((value < 0).any()):
        raise ValueError(f"{name}: domain ids must be >= 0, found {int(value.min())}")


def _describe_tensor(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value)


def _to_ids(value: Any) -> Any:
    if value is None or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return value
    return tuple(value)


def _check_groupings(instance: DataIncrementalScenario, attribute: Any, value: Any) -> None:
    if (instance.data_ids is None) == (value is None):
        raise ValueError(
            f"{type(instance).__name__}: give either data_ids (one domain per task) or "
            "groupings (the domains of each task), not both and not neither"
        )
    name = "groupings" if value is not None else "data_ids"
    groups = instance._groups()
    valid = len(groups) > 0 and all(
        isinstance(g, tuple) and g and all(validators.is_int(d) and d >= 0 for d in g)
        for g in groups
    )
    if not valid:
        raise ValueError(
            f"{type(instance).__name__}.{name} must hold int domain ids >= 0, such as "
            f"data_ids=[0, 1, 2] or groupings=[[0, 1], [2]], got {getattr(instance, name)!r}"
        )
    repeated = [g for g in groups if len(set(g)) != len(g)]
    if repeated:
        raise ValueError(
            f"{type(instance).__name__}.{name}: the group {list(repeated[0])} repeats a domain"
        )
    instance._check_domain_samples(groups)


@attrs.frozen(eq=False)
class DataIncrementalScenario(Scenario):
    """Predefined data domains: task ``t`` trains on the domains of ``groupings[t]``.

    As Renate's ``DataIncrementalScenario``: the data of each update comes from named sources
    (domains) rather than from a random cut. ``domains`` gives every sample of ``dataset`` its
    domain id; ``data_ids=(a, b, ...)`` makes one task per domain, in that order, and
    ``groupings=((a, b), (c,), ...)`` merges several domains into one task. Task ``t`` trains on
    the training samples of its domains and is tested on the test samples of the same domains;
    its ``classes`` are those present in either. A domain may come back in a later task.

    Without ``test_dataset`` the test pool holds out ``test_fraction`` of every (domain, class)
    pair, so each domain keeps test samples of each of its classes; with ``test_dataset``,
    ``test_domains`` labels its samples. :meth:`from_datasets` builds the scenario from one data
    set per domain.

    Args:
        dataset: The data (see :class:`Scenario`).
        domains: One domain id per sample of ``dataset``, an integer tensor or sequence ``>= 0``.
        data_ids: The domain of each task, in order (Renate's ``data_ids``).
        groupings: Instead of ``data_ids``: the domains of each task (Renate's ``groupings``).
        test_domains: One domain id per sample of ``test_dataset`` (only with it).
        test_dataset, test_fraction, seed: See :class:`Scenario`.

    Raises:
        ValueError: Neither or both of ``data_ids`` and ``groupings``; domain ids that are not
            ints ``>= 0``, have no training samples, or leave a task without test samples;
            ``domains`` (``test_domains``) not one id per sample.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.randn(60, 3), torch.arange(60) % 2)
        >>> domains = torch.arange(60) // 20  # three domains of 20 samples
        >>> scenario = DataIncrementalScenario(data, domains, groupings=[[2], [0, 1]])
        >>> [(len(task.train), len(task.test)) for task in scenario]
        [(14, 6), (28, 12)]
    """

    domains: torch.Tensor = attrs.field(converter=_to_domains, validator=_check_domains)
    test_domains: torch.Tensor | None = attrs.field(
        default=None, kw_only=True, converter=_to_domains, validator=_check_domains
    )
    data_ids: tuple[int, ...] | None = attrs.field(default=None, kw_only=True, converter=_to_ids)
    groupings: tuple[tuple[int, ...], ...] | None = attrs.field(
        default=None, kw_only=True, converter=convert_groups, validator=_check_groupings
    )

    @classmethod
    def from_datasets(
        cls,
        datasets: Sequence[Any],
        *,
        test_datasets: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> DataIncrementalScenario:
        """Build the scenario from one data set per domain: domain ``i`` is ``datasets[i]``.

        Args:
            datasets: The data of each domain (map-style datasets of ``(inputs, target)``, all
                with inputs of one per-sample shape).
            test_datasets: Optionally a test set per domain, in the same order.
            **kwargs: ``data_ids`` or ``groupings`` (indices into ``datasets``), and
                ``test_fraction`` or ``seed`` (see the class).

        Example:
            >>> import torch
            >>> from torch.utils.data import TensorDataset
            >>> days = [TensorDataset(torch.randn(8, 2), torch.arange(8) % 2) for _ in range(3)]
            >>> scenario = DataIncrementalScenario.from_datasets(days, data_ids=[0, 1, 2])
            >>> scenario.num_tasks, len(scenario.tasks()[0].train)
            (3, 6)
        """
        dataset, domains = _concatenate_domains(datasets, "datasets")
        if test_datasets is None:
            return cls(dataset, domains, **kwargs)
        test_dataset, test_domains = _concatenate_domains(test_datasets, "test_datasets")
        if len(test_datasets) != len(datasets):
            raise ValueError(
                f"test_datasets has {len(test_datasets)} data sets for {len(datasets)} domains; "
                "give one test set per domain"
            )
        return cls(dataset, domains, test_dataset=test_dataset, test_domains=test_domains, **kwargs)

    @property
    def num_tasks(self) -> int:
        """The number of tasks, one per entry of ``data_ids`` or ``groupings``."""
        return len(self._groups())

    def tasks(self) -> list[Task]:
        """Builds the tasks, in order; the same list (equal tensors) on every call.

        Returns:
            One task per group of domains, with ``task_id`` 0, 1, ...
        """
        train, test = self._domain_pools()
        tasks = []
        for task_id, group in enumerate(self._groups()):
            x, y = _in_domains(train, group)
            test_x, test_y = _in_domains(test, group)
            classes = classes_of(y, test_y)
            tasks.append(Task(task_id, TensorDataset(x, y), TensorDataset(test_x, test_y), classes))
        return tasks

    def _groups(self) -> tuple[Any, ...]:
        if self.groupings is not None:
            return self.groupings
        return tuple((d,) for d in self.data_ids or ())

    def _strata(self) -> torch.Tensor:
        """One id per (domain, class) pair, so that the test split keeps both apart."""
        targets = self.dataset.tensors[1]
        return self.domains.to(targets.device) * (int(targets.max()) + 1) + targets

    def _domain_pools(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        inputs, targets = self.dataset.tensors
        every = (inputs, targets, self.domains.to(targets.device))
        if self.test_dataset is not None:
            test_inputs, test_targets = self.test_dataset.tensors
            test_domains = cast(torch.Tensor, self.test_domains).to(test_targets.device)
            return every, (test_inputs, test_targets, test_domains)
        generator = stream_generator(self.seed, SPLIT_STREAM)
        train_idx, test_idx = stratified_split(self._strata(), self._fraction(), generator)
        return take(every, train_idx), take(every, test_idx)

    def _domain_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples per domain id (index) in the training and test pools, without splitting."""
        domains = self.domains.cpu()
        if self.test_dataset is not None:
            test_domains = cast(torch.Tensor, self.test_domains).cpu()
            size = max(int(domains.max()), int(test_domains.max())) + 1
            return torch.bincount(domains, minlength=size), torch.bincount(
                test_domains, minlength=size
            )
        classes = int(self.dataset.tensors[1].max()) + 1
        counts = torch.bincount(self._strata().cpu(), minlength=(int(domains.max()) + 1) * classes)
        test = test_counts(counts, self._fraction())
        return (counts - test).reshape(-1, classes).sum(1), test.reshape(-1, classes).sum(1)

    def _check_domain_samples(self, groups: tuple[tuple[int, ...], ...]) -> None:
        train, test = self._domain_counts()

        def count(counts: torch.Tensor, group: tuple[int, ...]) -> int:
            return sum(int(counts[d]) if d < len(counts) else 0 for d in group)

        missing = sorted({d for g in groups for d in g if count(train, (d,)) == 0})
        if missing:
            present = torch.nonzero(train).flatten().tolist()
            raise ValueError(
                f"{type(self).__name__}: domains {missing} have no training samples (the domain "
                f"ids in domains are {present})"
            )
        for task_id, group in enumerate(groups):
            if count(test, group) == 0:
                raise ValueError(
                    f"{type(self).__name__}: task {task_id} (domains {list(group)}) has no test "
                    "samples; give a test_dataset with these domains or more samples"
                )


def _in_domains(pool: tuple[torch.Tensor, ...], group: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Inputs and targets of the samples of ``pool`` whose domain is in ``group``."""
    inputs, targets, domains = pool
    mask = torch.isin(domains, torch.tensor(group, dtype=domains.dtype, device=domains.device))
    return inputs[mask], targets[mask]


def _concatenate_domains(datasets: Any, name: str) -> tuple[TensorDataset, torch.Tensor]:
    """One ``TensorDataset`` of the samples of all ``datasets`` and the index of each's source."""
    if isinstance(datasets, (str, bytes)) or not isinstance(datasets, Sequence) or not datasets:
        raise TypeError(f"{name} must be a non-empty sequence of data sets, one per domain")
    parts = [materialise(data, f"{name}[{i}]") for i, data in enumerate(datasets)]
    shapes = {tuple(part.tensors[0].shape[1:]) for part in parts}
    if len(shapes) > 1:
        raise ValueError(
            f"{name}: every domain needs inputs of one per-sample shape, got {sorted(shapes)}"
        )
    inputs = torch.cat([part.tensors[0] for part in parts])
    targets = torch.cat([part.tensors[1] for part in parts])
    domains = torch.cat([torch.full((len(p),), i, dtype=torch.int64) for i, p in enumerate(parts)])
    return TensorDataset(inputs, targets), domains


def _check_num_tasks_both(instance: Scenario, attribute: Any, value: Any) -> None:
    validators.int_at_least(1)(instance, attribute, value)
    instance._check_chunks(value, test_too=True)


def _check_feature_idx(instance: FeatureSortingScenario, attribute: Any, value: Any) -> None:
    inputs = instance.dataset.tensors[0]
    validators.int_at_least(0, inputs.shape[1])(instance, attribute, value)


@attrs.frozen(eq=False)
class FeatureSortingScenario(Scenario):
    """Sorted by one input feature: task ``t`` holds the ``t``-th chunk in ascending order.

    The training pool and the test pool are each sorted (stably) by the value of feature
    ``feature_idx`` and cut into ``num_tasks`` chunks whose sizes differ by at most one, so the
    feature drifts upwards from task to task, as in Renate's ``FeatureSortingScenario``. For inputs
    with more than one dimension per sample, ``feature_idx`` indexes the first dimension and the
    rest is averaged (for images: the mean of a colour channel). ``randomness`` softens the order:
    ``int(randomness * n / 2)`` random pairs of positions are swapped before cutting.

    Args:
        dataset: The data (see :class:`Scenario`).
        num_tasks: Number of tasks, at most the size of the training and of the test pool.
        feature_idx: The feature to sort by, in ``[0, inputs.shape[1])``.
        randomness: In [0, 1]; 0 (default) keeps the exact order.
        test_dataset, test_fraction, seed: See :class:`Scenario`.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8) % 2)
        >>> tasks = FeatureSortingScenario(data, num_tasks=2, feature_idx=0).tasks()
        >>> tasks[0].train.tensors[0][:, 0].max() < tasks[1].train.tensors[0][:, 0].min()
        tensor(True)
    """

    num_tasks: int = attrs.field(validator=_check_num_tasks_both)  # type: ignore[assignment]
    feature_idx: int = attrs.field(validator=_check_feature_idx)
    randomness: float = attrs.field(
        default=0.0, kw_only=True, validator=validators.real_in_range(0, 1)
    )

    def _order(self, inputs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        feature = inputs[:, self.feature_idx]
        scores = feature.reshape(feature.shape[0], -1).to(torch.float64).mean(dim=1)
        return soft_sorted_order(scores, self.randomness, generator)

    def _build(self, train: Pool, test: Pool) -> list[Task]:
        return sorted_tasks(train, test, self.num_tasks, self._order, self.seed)


def soft_sorted_order(
    scores: torch.Tensor, randomness: float, generator: torch.Generator
) -> torch.Tensor:
    """The indices that sort ``scores`` (stably), then ``int(randomness * n / 2)`` random pairs of
    positions swapped one after another (Renate's soft sorting)."""
    order = torch.sort(scores.cpu(), stable=True).indices
    swaps = int(randomness * len(order) / 2)
    if swaps:
        positions = order.tolist()
        for i, j in torch.randint(len(order), (swaps, 2), generator=generator).tolist():
            positions[i], positions[j] = positions[j], positions[i]
        order = torch.tensor(positions, dtype=torch.int64)
    return order


def sorted_tasks(
    train: Pool,
    test: Pool,
    num_tasks: int,
    order: Callable[[torch.Tensor, torch.Generator], torch.Tensor],
    seed: int,
) -> list[Task]:
    """Tasks made of consecutive chunks of the training and the test pool, each put in the order
    ``order(inputs, generator)`` returns."""
    generator = stream_generator(seed, TASK_STREAM)
    train_chunks = torch.tensor_split(order(train[0], generator), num_tasks)
    test_chunks = torch.tensor_split(order(test[0], generator), num_tasks)
    tasks = []
    for task_id, (train_idx, test_idx) in enumerate(zip(train_chunks, test_chunks)):
        x, y = take(train, train_idx)
        test_x, test_y = take(test, test_idx)
        tasks.append(
            Task(
                task_id=task_id,
                train=TensorDataset(x, y),
                test=TensorDataset(test_x, test_y),
                classes=classes_of(y, test_y),
            )
        )
    return tasks


HUE_BINS = 100
"""Bins of the hue histogram whose fullest bin is an image's dominant hue (Renate's number)."""
_HUE_CHUNK = 1024  # images per histogram pass: the per-pixel hues of a chunk stay small


def dominant_hues(images: torch.Tensor) -> torch.Tensor:
    """The dominant hue of each RGB image: the left edge of the fullest of :data:`HUE_BINS` equal
    bins of its pixels' hues in [0, 1).

    Hue as in the HSV model (and Pillow's ``convert("HSV")``): 0 red, 1/3 green, 2/3 blue, 0 for
    grey pixels (equal channels). Scale does not matter (``uint8`` and ``[0, 1]`` floats give the
    same hues). Whole-batch tensor operations, a chunk of images at a time.

    Args:
        images: ``(N, 3, H, W)`` RGB images, integer or floating point.

    Returns:
        ``float64`` tensor ``(N,)`` of values ``k / HUE_BINS``.

    Example:
        >>> import torch
        >>> red, blue = torch.zeros(1, 3, 2, 2), torch.zeros(1, 3, 2, 2)
        >>> red[:, 0], blue[:, 2] = 1.0, 1.0
        >>> dominant_hues(torch.cat([red, blue])).tolist()
        [0.0, 0.66]
    """
    parts = []
    for chunk in torch.split(images, _HUE_CHUNK):
        hue = _hues(chunk.to(torch.float32))
        bins = (hue.flatten(1) * HUE_BINS).long().clamp_(0, HUE_BINS - 1)
        counts = torch.zeros(len(chunk), HUE_BINS, dtype=torch.int64, device=chunk.device)
        counts.scatter_add_(1, bins, torch.ones_like(bins))
        parts.append(counts.argmax(dim=1).to(torch.float64) / HUE_BINS)
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat(parts).cpu()


def _hues(rgb: torch.Tensor) -> torch.Tensor:
    """Per-pixel hue in [0, 1) of ``(N, 3, H, W)`` floats (0 where the channels are equal)."""
    r, g, b = rgb.unbind(1)
    high, low = rgb.max(dim=1).values, rgb.min(dim=1).values
    delta = high - low
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    hue = torch.where(
        high == r,
        torch.remainder((g - b) / safe, 6.0),
        torch.where(high == g, (b - r) / safe + 2.0, (r - g) / safe + 4.0),
    )
    return torch.where(delta > 0, hue / 6.0, torch.zeros_like(hue))


def _check_rgb(instance: HueShiftScenario, attribute: Any, value: Any) -> None:
    validators.int_at_least(1)(instance, attribute, value)
    instance._check_chunks(value, test_too=True)
    for name, data in (("dataset", instance.dataset), ("test_dataset", instance.test_dataset)):
        shape = () if data is None else tuple(data.tensors[0].shape[1:])
        if data is not None and (len(shape) != 3 or shape[0] != 3):
            kind = "grayscale images have no hue" if len(shape) == 2 or shape[:1] == (1,) else ""
            raise ValueError(
                f"HueShiftScenario: {name} must hold RGB images (N, 3, H, W), got per-sample "
                f"shape {shape}{'; ' + kind if kind else ''}; use RotationScenario or "
                "PermutationScenario for other images"
            )


@attrs.frozen(eq=False)
class HueShiftScenario(Scenario):
    """Sorted by colour: task ``t`` holds the ``t``-th chunk of the images in order of hue.

    Renate's ``HueShiftScenario``: every image's dominant hue (:func:`dominant_hues`, the fullest
    of 100 hue bins) is its score; the training pool and the test pool are each sorted by it and
    cut into ``num_tasks`` chunks whose sizes differ by at most one, so the colours drift from red
    through green and blue from task to task. ``randomness`` softens the order as in
    :class:`FeatureSortingScenario`. One difference from Renate: the bins span the whole hue
    circle [0, 1), where Renate's ``numpy.histogram`` spans each image's own range of hues, so
    scores here are comparable between images.

    Args:
        dataset: RGB images ``(N, 3, H, W)`` (see :class:`Scenario`), any dtype; grayscale
            images are refused.
        num_tasks: Number of tasks, at most the size of the training and of the test pool.
        randomness: In [0, 1]; 0 (default) keeps the exact order.
        test_dataset, test_fraction, seed: See :class:`Scenario`.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> images = torch.rand(12, 3, 4, 4)
        >>> tasks = HueShiftScenario(TensorDataset(images, torch.arange(12) % 2), 2).tasks()
        >>> len(tasks), len(tasks[0].train) + len(tasks[1].train)
        (2, 8)
    """

    num_tasks: int = attrs.field(validator=_check_rgb)  # type: ignore[assignment]
    randomness: float = attrs.field(
        default=0.0, kw_only=True, validator=validators.real_in_range(0, 1)
    )

    def _order(self, inputs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return soft_sorted_order(dominant_hues(inputs), self.randomness, generator)

    def _build(self, train: Pool, test: Pool) -> list[Task]:
        return sorted_tasks(train, test, self.num_tasks, self._order, self.seed)
