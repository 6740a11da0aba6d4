"""Random number generators of components (their own, independent of torch's global one), seeded,
saved and restored through checkpoints."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from trainer import validators

__all__ = ["SEED_LIMIT", "check_seed", "new_generator", "restore_generator"]

#: Seeds accepted by ``torch.Generator.manual_seed`` (non-negative part).
SEED_LIMIT = 2**64


def check_seed(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """attrs validator of a component's seed: an int in ``[0, SEED_LIMIT)``.

    Raises:
        WrongTypeError: ``value`` is not an int.
        ValueError: ``value`` is out of range.
    """
    name = f"{validators.field_name(instance, attribute)} (an integer seed)"
    validators.check_int(name, value, 0, SEED_LIMIT)


def new_generator(seed: int) -> torch.Generator:
    """Returns a CPU generator seeded with ``seed``, independent of the global RNG."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def restore_generator(generator: torch.Generator, state: Any, owner: str) -> None:
    """Sets ``generator`` to a state saved with ``generator.get_state()``."""
    if not isinstance(state, torch.Tensor):
        raise ValueError(
            f"{owner}: checkpoint['generator_state'] must be the uint8 tensor returned by "
            f"torch.Generator.get_state(), got {type(state).__name__}"
        )
    generator.set_state(state.detach().to(device="cpu", dtype=torch.uint8).contiguous())
