"""Components that re-initialise the model when training on new data starts."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, MutableMapping
from typing import Any

import attrs
import torch
from torch import nn

from renate_events.components.component import Component, real_from
from renate_events.components.generators import check_seed, new_generator, restore_generator
from trainer import validators as v


@attrs.define(eq=False)
class ReinitializationComponent(Component):
    """Re-initialises the model at ``on_train_start`` ("cold start").

    Calls ``reset_parameters()`` of every submodule (the model included) that has one, i.e. each
    layer's own default initialisation; layers draw from the global torch RNG as usual.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> _ = torch.nn.init.zeros_(model.weight)
        >>> ReinitializationComponent().on_train_start(model=model)
        >>> bool(model.weight.abs().sum() > 0)
        True
    """

    def on_train_start(self, model: nn.Module) -> None:
        """Resets the parameters of all submodules that define ``reset_parameters()``."""
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


@attrs.define(eq=False)
class ShrinkAndPerturbReinitializationComponent(Component):
    """Shrinks the parameters and adds Gaussian noise at ``on_train_start``.

    Ash and Adams, "On Warm-Starting Neural Network Training", NeurIPS 2020. Every parameter
    becomes ``shrink_factor * p + sigma * noise`` with standard normal noise. The noise is drawn
    from the component's own CPU generator (seeded with ``seed``, saved in checkpoints): one
    float32 vector for all parameters in ``model.parameters()`` order, so the result does not
    depend on the device.

    Args:
        shrink_factor: Factor the parameters are multiplied with, > 0.
        sigma: Standard deviation of the added noise, >= 0.
        seed: Seed of the component's generator (fixed after construction).
        weight: Unused (the component adds no loss); kept for the :class:`Component` interface.
        sample_new_memory_batch: Unused; kept for the :class:`Component` interface.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> _ = torch.nn.init.ones_(model.weight)
        >>> ShrinkAndPerturbReinitializationComponent(0.5, 0.0).on_train_start(model=model)
        >>> model.weight
        Parameter containing:
        tensor([[0.5000, 0.5000]], requires_grad=True)
    """

    shrink_factor: float = attrs.field(validator=real_from(0.0, low_open=True))
    sigma: float = attrs.field(validator=real_from(0.0))
    seed: int = attrs.field(
        default=0,
        validator=check_seed,
        on_setattr=attrs.setters.frozen,
    )
    weight: float = attrs.field(default=0.0, validator=real_from(0.0))
    sample_new_memory_batch: bool = attrs.field(default=False, validator=v.boolean)
    _generator: torch.Generator = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        self._generator = new_generator(self.seed)

    @torch.no_grad()
    def on_train_start(self, model: nn.Module) -> None:
        """Applies ``p = shrink_factor * p + sigma * noise`` to all parameters of ``model``."""
        params: list[torch.Tensor] = list(model.parameters())
        if not params:
            return
        noise = None
        if self.sigma != 0:
            total = sum(p.numel() for p in params)
            noise = torch.randn(total, generator=self._generator, dtype=torch.float32)
        # Group by (device, dtype): one transfer of the noise and fused updates per group.
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
        for index, p in enumerate(params):
            groups[(p.device, p.dtype)].append(index)
        chunks = noise.split([p.numel() for p in params]) if noise is not None else None
        for (device, dtype), indices in groups.items():
            members = [params[i] for i in indices]
            if self.shrink_factor != 1:
                torch._foreach_mul_(members, self.shrink_factor)
            if chunks is not None:
                flat = torch.cat([chunks[i] for i in indices]).to(device=device, dtype=dtype)
                parts = flat.split([p.numel() for p in members])
                torch._foreach_add_(
                    members, [part.view_as(p) for part, p in zip(parts, members)], alpha=self.sigma
                )

    def on_save_checkpoint(self, checkpoint: MutableMapping[str, Any]) -> None:
        """Saves the generator state, so the next perturbation continues the sequence."""
        checkpoint["generator_state"] = self._generator.get_state()

    def on_load_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:
        """Restores the generator state saved by :meth:`on_save_checkpoint`."""
        name = type(self).__name__
        if "generator_state" not in checkpoint:
            raise ValueError(
                f"{name}: checkpoint lacks 'generator_state'; keys: {sorted(checkpoint)}"
            )
        restore_generator(self._generator, checkpoint["generator_state"], name)
