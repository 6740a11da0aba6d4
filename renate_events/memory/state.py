"""The layout of a replay buffer's state dict, and the checks of one read back.

:meth:`~renate_events.memory.DataBuffer.state_dict` writes the keys of :data:`STATE_KEYS`;
:func:`parse_state` checks all of them (types, counts, shapes, generator states, the buffer's
type and size arguments) before the buffer changes, and hands back a :class:`ParsedState` that
can be committed without further checks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from renate_events.memory import structure
from renate_events.memory.checks import shape
from trainer import validators

__all__ = [
    "STATE_FORMAT_VERSION",
    "STATE_KEYS",
    "Expect",
    "ParsedState",
    "check_generator_state",
    "check_stored",
    "parse_state",
]

MAX_NUM_SEEN = 2**62
"""Above this a count of samples seen is no count (and near int64's end, where sampling
arithmetic overflows): refused on load."""

STATE_FORMAT_VERSION = 1
"""Version of the layout written by :meth:`DataBuffer.state_dict`."""

STATE_KEYS = (
    "format_version",
    "buffer_type",
    "config",
    "num_seen",
    "length",
    "generator_state",
    "sample_generator_state",
    "inputs_structure",
    "inputs",
    "targets",
    "metadata",
    "extra",
)
"""The keys of a buffer's state dict, all required."""


@attrs.define(eq=False)
class ParsedState:
    """A fully validated state dict, ready to be committed without further checks."""

    seed: int
    num_seen: int
    length: int
    generator_state: torch.Tensor
    sample_generator_state: torch.Tensor
    spec: dict[str, Any] | None
    inputs: list[torch.Tensor]
    targets: torch.Tensor | None
    metadata: dict[str, torch.Tensor]
    extra: Any


Expect = Callable[[ParsedState], None]
"""A check of a parsed state against the buffer's owner (:func:`check_stored`), run by
:func:`parse_state` last, before anything is committed."""


def check_generator_state(value: Any, where: str) -> torch.Tensor:
    """``value`` as a CPU copy of a valid ``torch.Generator`` state (a 1-D uint8 tensor)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        got = (
            f"a {value.dtype} tensor of shape {shape(value)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise ValueError(
            f"{where}: expected a 1-D uint8 tensor from torch.Generator.get_state(), got {got}"
        )
    value = value.detach().cpu().contiguous()
    try:
        torch.Generator().set_state(value)
    except RuntimeError as exc:
        raise ValueError(f"{where}: not a valid CPU generator state ({exc})") from exc
    return value


def _check_state_tensor(value: Any, where: str, length: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}: expected a tensor, got {type(value).__name__}")
    if value.layout is not torch.strided or value.dim() == 0 or value.shape[0] != length:
        raise ValueError(
            f"{where}: expected a dense tensor with {length} rows (state['length']), got shape "
            f"{shape(value)} and layout {value.layout}"
        )
    return value


def parse_state(
    state: Any,
    buffer_type: str,
    config: dict[str, Any],
    bound: int | None,
    check_targets: Callable[[torch.Tensor, str], None],
    parse_extra: Callable[[Any, torch.Tensor | None, int], Any],
    expect: Expect | None = None,
) -> ParsedState:
    """Check a state dict read back for a buffer, and parse it.

    Args:
        state: What :meth:`DataBuffer.state_dict` returned (or anything else).
        buffer_type: The class name of the buffer that loads it.
        config: That buffer's size arguments, which the state's must equal.
        bound: That buffer's ``max_size`` (``None``: unbounded).
        check_targets: The buffer's extra checks of its targets (``(targets, where)``).
        parse_extra: The buffer's parser of ``state['extra']`` (``(extra, targets, length)``).
        expect: The owner's check of the parsed state (:func:`check_stored`), or None.

    Raises:
        ValueError: When ``state`` is malformed, was written by another kind of buffer or one
            with another ``max_size``; the message names the offending key.
        TypeError: When ``state`` is not a mapping.
    """
    _check_state_header(state, buffer_type)
    seed = _parse_config(state["config"], config)
    num_seen, length = _parse_counts(state["num_seen"], state["length"], bound)
    generator_state = check_generator_state(state["generator_state"], "state['generator_state']")
    sample_generator_state = check_generator_state(
        state["sample_generator_state"], "state['sample_generator_state']"
    )
    spec, inputs, targets, metadata = _parse_storage(state, length, check_targets)
    extra = parse_extra(state["extra"], targets, length)
    parsed = ParsedState(
        seed, num_seen, length, generator_state, sample_generator_state, spec, inputs,
        targets, metadata, extra,
    )  # fmt: skip
    if expect is not None:
        expect(parsed)
    return parsed


def _check_state_header(state: Any, buffer_type: str) -> None:
    """The keys, the format version and the buffer type of a state dict."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping from state_dict(), got {type(state).__name__}")
    for key in STATE_KEYS:
        if key not in state:
            raise ValueError(f"state[{key!r}]: missing (not a {buffer_type} state?)")
    unknown = sorted(set(state) - set(STATE_KEYS))
    if unknown:
        raise ValueError(f"state[{unknown[0]!r}]: unexpected key; expected {list(STATE_KEYS)}")
    if state["format_version"] != STATE_FORMAT_VERSION:
        raise ValueError(
            f"state['format_version']: expected {STATE_FORMAT_VERSION}, "
            f"got {state['format_version']!r}"
        )
    if state["buffer_type"] != buffer_type:
        raise ValueError(
            f"state['buffer_type']: this is a {buffer_type}, the state was written "
            f"by {state['buffer_type']!r}"
        )


def _parse_config(config: Any, own_config: dict[str, Any]) -> int:
    """The seed of ``state['config']``, whose size arguments must be ``own_config``'s."""
    own = {"seed": None, **own_config}
    if not isinstance(config, Mapping) or set(config) != set(own):
        raise ValueError(
            f"state['config']: expected a dict with keys {sorted(own)}, got {config!r}"
        )
    seed = config["seed"]
    validators.check_int("state['config']['seed']", seed, 0, 2**64)  # a ValueError either way
    for key, value in own_config.items():
        if config[key] != value:
            raise ValueError(
                f"state['config'][{key!r}]: the state was written by a buffer with "
                f"{key}={config[key]!r}, this buffer has {key}={value!r}"
            )
    return seed


def _parse_counts(num_seen: Any, length: Any, bound: int | None) -> tuple[int, int]:
    for key, value in (("num_seen", num_seen), ("length", length)):
        if not validators.is_int(value) or not 0 <= value <= MAX_NUM_SEEN:
            raise ValueError(
                f"state[{key!r}]: expected an int in [0, {MAX_NUM_SEEN}], got {value!r}"
            )
    expected_length = num_seen if bound is None else min(bound, num_seen)
    if length != expected_length:
        raise ValueError(
            f"state['length']: expected {expected_length} for num_seen={num_seen} "
            f"(max_size={bound}), got {length}"
        )
    return num_seen, length


def _parse_storage(
    state: Mapping[str, Any], length: int, check_targets: Callable[[torch.Tensor, str], None]
) -> tuple[dict[str, Any] | None, list[torch.Tensor], torch.Tensor | None, dict[str, torch.Tensor]]:
    """The inputs structure and the stored tensors, ``length`` rows each."""
    raw_spec, inputs, targets, metadata = (
        state["inputs_structure"],
        state["inputs"],
        state["targets"],
        state["metadata"],
    )
    if not isinstance(inputs, (list, tuple)):
        raise ValueError(f"state['inputs']: expected a list of tensors, got {inputs!r}")
    if not isinstance(metadata, Mapping):
        raise ValueError(f"state['metadata']: expected a dict of tensors, got {metadata!r}")
    if raw_spec is None:
        if length != 0 or inputs or targets is not None or metadata:
            raise ValueError(
                "state['inputs_structure']: None (nothing stored yet) requires length 0, "
                "no inputs, targets None and no metadata"
            )
        return None, [], None, {}
    spec = structure.validate_spec(raw_spec, "state['inputs_structure']")
    names = structure.leaf_names(spec, "inputs")
    if len(inputs) != len(names):
        raise ValueError(
            f"state['inputs']: the structure has {len(names)} tensors, got {len(inputs)}"
        )
    inputs = [
        _check_state_tensor(t, f"state['inputs'][{i}] ({name})", length)
        for i, (t, name) in enumerate(zip(inputs, names))
    ]
    targets = _check_state_tensor(targets, "state['targets']", length)
    check_targets(targets, "state['targets']")
    parsed_meta = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or key == "idx":
            raise ValueError(f"state['metadata']: invalid key {key!r}")
        parsed_meta[key] = _check_state_tensor(value, f"state['metadata'][{key!r}]", length)
    for i, (tensor, name) in enumerate(zip(inputs, names)):
        _check_finite(tensor, f"state['inputs'][{i}] ({name})")
    _check_finite(targets, "state['targets']")
    for key, tensor in parsed_meta.items():
        _check_finite(tensor, f"state['metadata'][{key!r}]")
    return spec, inputs, targets, parsed_meta


def _check_finite(tensor: torch.Tensor, where: str) -> None:
    """No NaN or infinity in a stored float tensor (one reduction per tensor per load): a
    buffer holding one would make every later update's loss NaN."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{where}: holds NaN or infinite values")


def check_stored(
    parsed: ParsedState,
    *,
    signature: Any = None,
    source: str = "the recorded sample signature",
    classes: int | None = None,
    rows: Mapping[str, tuple[int, torch.dtype]] | None = None,
    max_seen: int | None = None,
) -> None:
    """Check a parsed state against what its owner expects, before it is committed.

    Args:
        parsed: What :func:`parse_state` returned.
        signature: ``{"inputs": [shape, dtype], ...}`` of one sample (the manifest's record of
            the updates' data), or None; the stored inputs (one tensor) must have it.
        source: Where ``signature`` comes from, for the message.
        classes: The model's number of outputs, or None; integer class targets must lie in
            ``[0, classes)``.
        rows: Per metadata key, the width and dtype of its rows (a model's logits), for the
            keys the state holds.
        max_seen: The most samples the buffer can have seen, or None.

    Raises:
        ValueError: Naming the key of the first content that does not fit.
    """
    if max_seen is not None and parsed.num_seen > max_seen:
        raise ValueError(
            f"state['num_seen']: {parsed.num_seen} samples seen, more than the {max_seen} the "
            "updates so far trained on"
        )
    _check_signature(parsed, signature, source)
    targets = parsed.targets
    if classes is not None and targets is not None and _are_labels(targets) and len(targets):
        low, high = int(targets.min()), int(targets.max())  # one reduction each per load
        if low < 0 or high >= classes:
            bad = low if low < 0 else high
            raise ValueError(
                f"state['targets']: holds the class {bad}, outside the model's {classes} "
                f"outputs [0, {classes})"
            )
    for key, (width, dtype) in (rows or {}).items():
        tensor = parsed.metadata.get(key)
        if tensor is not None and (
            tensor.dim() != 2 or tensor.shape[1] != width or tensor.dtype != dtype
        ):
            raise ValueError(
                f"state['metadata'][{key!r}]: rows of {tensor.dtype} {list(tensor.shape[1:])}, "
                f"expected {dtype} [{width}] (the model's outputs)"
            )


def _are_labels(targets: torch.Tensor) -> bool:
    return targets.dim() == 1 and not targets.is_floating_point() and targets.dtype != torch.bool


def _check_signature(parsed: ParsedState, signature: Any, source: str) -> None:
    expected = None if not isinstance(signature, Mapping) else signature.get("inputs")
    if not isinstance(expected, list) or len(parsed.inputs) != 1:
        return  # inputs that are not one tensor: their structure was checked by parse_state
    shape_, dtype = expected
    tensor = parsed.inputs[0]
    stored = [list(tensor.shape[1:]), str(tensor.dtype).replace("torch.", "")]
    if stored != [list(shape_), dtype]:
        raise ValueError(
            f"state['inputs'][0]: samples of {stored[1]} {tuple(stored[0])}, but {source} "
            f"says the updates trained on samples of {dtype} {tuple(shape_)}"
        )
