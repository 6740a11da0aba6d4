"""``renate-events shift``: a two-sample test of new data against a reference, on the raw inputs
or on the features of a state folder's model."""

from __future__ import annotations

from typing import Any

import torch

from renate_events.cli._data_files import shift_inputs
from renate_events.cli._errors import UsageError, one_line
from renate_events.cli._options import ShiftOptions, check_options, load_config_file
from renate_events.cli._updaters import config_updater, updater_from_folder
from renate_events.inference import inference
from renate_events.state_folder import read_manifest

__all__ = ["shift"]


def shift(values: dict[str, Any], from_file: frozenset[str]) -> int:
    """``renate-events shift``: print the test's statistic, p-value and decision."""
    from renate_events import shift as detectors

    options = check_options(ShiftOptions, values)
    if options.state is None and (options.feature_module or options.config_file):
        raise UsageError("--feature-module and --config-file need --state")
    reference = shift_inputs("--reference", options.reference)
    query = shift_inputs("--query", options.query)
    extractor = None if options.state is None else _feature_extractor(options)
    if extractor is not None:
        for flag, data in (("--reference", reference), ("--query", query)):
            _check_extractor(extractor, flag, data)
    detector: detectors.ShiftDetectorWithFeatureExtractor
    if options.detector == "mmd":
        detector = detectors.MMDCovariateShiftDetector(
            feature_extractor=extractor,
            num_permutations=options.num_permutations,
            max_samples=options.max_samples,
            seed=options.seed,
        )
    else:
        detector = detectors.KolmogorovSmirnovCovariateShiftDetector(feature_extractor=extractor)
    detector.fit(reference)
    result = detector.test(query, level=options.level)
    decision = "shift detected" if result.shift else "no shift detected"
    print(
        f"{options.detector}: statistic {result.statistic:.6g}, p-value {result.p_value:.4g} "
        f"({len(reference)} reference and {len(query)} query samples); {decision} at level "
        f"{options.level:g}"
    )
    return 0


def _check_extractor(
    extractor: torch.nn.Module, flag: str, data: torch.utils.data.TensorDataset
) -> None:
    """The state's model on two of the samples: a mismatch is one line, with the shapes."""
    sample = data.tensors[0][:2]
    try:
        with inference(extractor):
            extractor(sample)
    except Exception as exc:
        raise UsageError(
            f"{flag}: the state folder's model does not accept its samples (float32 "
            f"{tuple(sample.shape[1:])}): {type(exc).__name__}: {one_line(exc)}"
        ) from None


class _ModuleOutput(torch.nn.Module):
    """The output of ``model``'s submodule ``name`` when ``model`` runs (a forward hook)."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        super().__init__()
        self.model, self.name = model, name
        self.module = dict(model.named_modules())[name]

    def forward(self, inputs: Any) -> torch.Tensor:
        captured: list[torch.Tensor] = []
        handle = self.module.register_forward_hook(lambda _m, _i, out: captured.append(out))
        try:
            self.model(inputs)
        finally:
            handle.remove()
        return captured[-1]


def _feature_extractor(options: Any) -> torch.nn.Module:
    """The state folder's model, or its submodule ``--feature-module``."""
    state = options.state or ""
    if options.config_file is not None:
        manifest = read_manifest(state)
        config = load_config_file(options.config_file)
        updater = config_updater(
            config,
            {},
            {},
            manifest,
            input_state_folder=state,
            validation_memory=manifest.get("validation_memory", False),
            accept_config_change=options.accept_config_change,
        )
    else:
        updater, _ = updater_from_folder(state)
    model = updater.learner_instance.model
    if options.feature_module is None:
        return model
    names = [name for name, _ in model.named_modules() if name]
    if options.feature_module not in names:
        raise UsageError(
            f"--feature-module {options.feature_module!r}: the model has no such submodule; it "
            f"has {names[:20]}{' ...' if len(names) > 20 else ''}"
        )
    return _ModuleOutput(model, options.feature_module)
