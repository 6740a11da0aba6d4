"""A learner's random streams: a seed per stream, re-initialisation from a seed, and probes that
draw nothing from the run's RNG."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["derived_seed", "reset_parameters", "rng_kept"]


def derived_seed(seed: int, stream: int) -> int:
    """A distinct seed per random stream of one learner (buffer 0, CLS 1, shrink-perturb 2,
    an expert 3, a re-initialised model 4), so that its generators never draw the same sequence."""
    return (seed * 1_000_003 + stream * 7_919) % 2**63


def reset_parameters(model: nn.Module) -> None:
    """Re-initialise every submodule that has ``reset_parameters`` (Renate's
    ``reinitialize_model_parameters``), drawing from torch's global RNG."""
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def rng_kept(like: Any) -> Any:
    """A context in which torch's global RNG (CPU, and ``like``'s CUDA device) is put back
    afterwards: a probe of a transform draws nothing from the run's random stream."""
    device = like.device if isinstance(like, torch.Tensor) else torch.device("cpu")
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)
