"""CLS-ER's consistency loss with a plastic and a stable exponential-moving-average model."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from renate_events.components.component import BatchMemory, real_from
from renate_events.components.features import copy_without_hooks
from renate_events.components.generators import check_seed, new_generator, restore_generator
from renate_events.components.losses import WeightedLossComponent
from renate_events.inference import call_model
from trainer import validators as v

_CHECKPOINT_MODELS = ("plastic_model", "stable_model")


@attrs.define(eq=False)
class WeightedCLSLossComponent(WeightedLossComponent):
    """Consistency loss towards a plastic and a stable semantic memory (CLS-ER).

    Arani, Sarfraz and Zonooz, "Learning Fast, Learning Slow: A General Continual Learning Method
    based on Complementary Learning System", ICLR 2022.

    At ``on_train_start`` two frozen copies of the model are made (without feature-recorder hooks,
    ``requires_grad=False``, eval mode); they persist across later ``on_train_start`` calls. After
    every optimizer step each copy is, with its update probability, moved towards the model by an
    exponential moving average ``copy = a * copy + (1 - a) * model`` with
    ``a = min(1 - 1 / (t + 1), update_weight)`` at step ``t`` (t counts from 1), as in Renate and
    the reference implementation. Floating-point buffers (e.g. batch-norm statistics) are averaged
    the same way and other buffers copied, so that eval-mode copies do not keep stale statistics.

    The loss runs both copies on the memory inputs and, per sample, takes the logits of the copy
    that gives the true class the higher softmax probability (the plastic one on ties); it is the
    mean squared error between the current logits and these selected logits.

    Random draws use the component's own CPU ``torch.Generator`` seeded with ``seed``; the step
    counter, the generator state and both copies are saved in checkpoints. The copies follow the
    model's device and dtype.

    Memory inputs are passed to the copies as ``copy(x)`` for a tensor, ``copy(*x)`` for a
    tuple/list and ``copy(**x)`` for a dict, as in Renate.

    Defaults are Renate's CLS-ER defaults (``renate/defaults.py``). In Renate and in the paper the
    update weight is the EMA decay, and the stable model is the slow one, hence the constraints
    ``plastic_model_update_weight <= stable_model_update_weight`` and
    ``stable_model_update_probability <= plastic_model_update_probability``.

    Args:
        weight: Non-negative scale of the loss (CLS-ER's ``beta``; Renate's default 0.1).
        sample_new_memory_batch: Whether the loop should draw a fresh memory batch for this loss.
        stable_model_update_weight: EMA decay of the stable model, in (0, 1).
        plastic_model_update_weight: EMA decay of the plastic model, in (0, 1).
        stable_model_update_probability: Probability of updating the stable model after a step,
            in (0, 1].
        plastic_model_update_probability: Probability of updating the plastic model after a
            step, in (0, 1].
        seed: Seed of the component's generator (fixed after construction).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(3, 2)
        >>> cls = WeightedCLSLossComponent(weight=0.1, plastic_model_update_probability=1.0)
        >>> cls.on_train_start(model=model)
        >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> batch = ((x, y), {"idx": torch.arange(4)})
        >>> cls.loss(model(x), batch, None).item()  # the copies still equal the model
        0.0
        >>> cls.on_train_batch_end(model=model)
        >>> cls.iteration
        1
    """

    weight: float = attrs.field(default=0.1, validator=real_from(0.0))
    sample_new_memory_batch: bool = attrs.field(default=False, validator=v.boolean)
    stable_model_update_weight: float = attrs.field(
        default=0.999,
        validator=[
            v.real_in_range(0.0, 1.0, low_open=True, high_open=True),
            v.at_least_field("plastic_model_update_weight", "the stable model is the slower EMA"),
        ],
    )
    plastic_model_update_weight: float = attrs.field(
        default=0.999,
        validator=[
            v.real_in_range(0.0, 1.0, low_open=True, high_open=True),
            v.at_most_field("stable_model_update_weight", "the stable model is the slower EMA"),
        ],
    )
    stable_model_update_probability: float = attrs.field(
        default=0.7,
        validator=[
            v.real_in_range(0.0, 1.0, low_open=True),
            v.at_most_field(
                "plastic_model_update_probability", "the stable model is updated less often"
            ),
        ],
    )
    plastic_model_update_probability: float = attrs.field(
        default=0.9,
        validator=[
            v.real_in_range(0.0, 1.0, low_open=True),
            v.at_least_field(
                "stable_model_update_probability", "the stable model is updated less often"
            ),
        ],
    )
    seed: int = attrs.field(
        default=0,
        validator=check_seed,
        on_setattr=attrs.setters.frozen,
    )
    _iteration: int = attrs.field(init=False, default=0, repr=False)
    _generator: torch.Generator = attrs.field(init=False, default=None, repr=False)
    _plastic_model: nn.Module | None = attrs.field(init=False, default=None, repr=False)
    _stable_model: nn.Module | None = attrs.field(init=False, default=None, repr=False)
    _pending_state: dict[str, Mapping[str, Any]] | None = attrs.field(
        init=False, default=None, repr=False
    )

    @property
    def calls_model(self) -> bool:
        """The stable and plastic copies run on every memory batch (with ``weight > 0``)."""
        return self.weight > 0

    def __attrs_post_init__(self) -> None:
        self._generator = new_generator(self.seed)

    @property
    def iteration(self) -> int:
        """Number of ``on_train_batch_end`` calls so far (restored from checkpoints)."""
        return self._iteration

    @property
    def plastic_model(self) -> nn.Module | None:
        """The plastic (fast) EMA copy, or ``None`` before ``on_train_start``."""
        return self._plastic_model

    @property
    def stable_model(self) -> nn.Module | None:
        """The stable (slow) EMA copy, or ``None`` before ``on_train_start``."""
        return self._stable_model

    def on_train_start(self, model: nn.Module) -> None:
        """Creates the two copies of ``model`` unless they exist, and moves them to its device
        and dtype."""
        self._follow(self._ensure_copies(model), model)

    def on_train_batch_end(self, model: nn.Module) -> None:
        """Counts the step and updates each copy with its probability (making the copies first
        if ``on_train_start`` was not called)."""
        plastic, stable = copies = self._ensure_copies(model)
        self._follow(copies, model)
        self._iteration += 1
        # One draw per copy from the private CPU generator: no device sync, global RNG untouched.
        draw_plastic, draw_stable = torch.rand(2, generator=self._generator).tolist()
        if draw_plastic < self.plastic_model_update_probability:
            self._ema_update(plastic, model, self.plastic_model_update_weight)
        if draw_stable < self.stable_model_update_probability:
            self._ema_update(stable, model, self.stable_model_update_weight)

    def on_save_checkpoint(self, checkpoint: MutableMapping[str, Any]) -> None:
        """Saves the step counter, the generator state and, once created, both copies."""
        checkpoint["iteration"] = self._iteration
        checkpoint["generator_state"] = self._generator.get_state()
        for key, state in self._model_states().items():
            checkpoint[key] = {name: t.detach().clone() for name, t in state.items()}

    def on_load_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:
        """Restores what :meth:`on_save_checkpoint` saved. If the copies do not exist yet, their
        states are applied when they are created at ``on_train_start``."""
        name = type(self).__name__
        missing = [k for k in ("iteration", "generator_state") if k not in checkpoint]
        if missing:
            raise ValueError(f"{name}: checkpoint lacks {missing}; keys: {sorted(checkpoint)}")
        states = {k: checkpoint[k] for k in _CHECKPOINT_MODELS if k in checkpoint}
        if states and len(states) != len(_CHECKPOINT_MODELS):
            raise ValueError(
                f"{name}: checkpoint has only {sorted(states)} of {list(_CHECKPOINT_MODELS)}"
            )
        restore_generator(self._generator, checkpoint["generator_state"], name)
        self._iteration = int(checkpoint["iteration"])
        if not states:
            return
        if self._plastic_model is None or self._stable_model is None:
            self._pending_state = states
        else:
            _load_copies((self._plastic_model, self._stable_model), states)

    def _component_loss(
        self,
        outputs_memory: torch.Tensor,
        batch_memory: BatchMemory,
        intermediate_representation_memory: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        if self._plastic_model is None or self._stable_model is None:
            raise RuntimeError(
                f"{type(self).__name__}.loss was called before on_train_start(model=...) created "
                "the plastic and stable model copies"
            )
        plastic, stable = self._plastic_model, self._stable_model
        (inputs_memory, targets_memory), _ = batch_memory
        for twin in (plastic, stable):
            first = next(twin.parameters(), None)
            if first is not None and first.device != outputs_memory.device:
                twin.to(outputs_memory.device)
        with torch.no_grad():
            outputs_plastic = call_model(plastic, inputs_memory)
            outputs_stable = call_model(stable, inputs_memory)
            targets = targets_memory.to(device=outputs_memory.device, dtype=torch.long)[:, None]
            score_plastic = F.softmax(outputs_plastic, dim=-1).gather(-1, targets)
            score_stable = F.softmax(outputs_stable, dim=-1).gather(-1, targets)
            selected = torch.where(score_stable > score_plastic, outputs_stable, outputs_plastic)
        return F.mse_loss(outputs_memory, selected.to(outputs_memory.dtype))

    def _ensure_copies(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """Returns (plastic, stable), creating them from ``model`` (plus any loaded state)."""
        if self._plastic_model is None or self._stable_model is None:
            copies = []
            for _ in _CHECKPOINT_MODELS:
                twin = copy_without_hooks(model)
                twin.requires_grad_(False)
                twin.eval()
                copies.append(twin)
            self._plastic_model, self._stable_model = copies
            if self._pending_state is not None:
                states, self._pending_state = self._pending_state, None
                _load_copies((self._plastic_model, self._stable_model), states)
        return self._plastic_model, self._stable_model

    def _model_states(self) -> dict[str, Mapping[str, Any]]:
        if self._plastic_model is not None and self._stable_model is not None:
            return {
                "plastic_model": self._plastic_model.state_dict(),
                "stable_model": self._stable_model.state_dict(),
            }
        return dict(self._pending_state or {})

    @staticmethod
    def _follow(copies: tuple[nn.Module, nn.Module], model: nn.Module) -> None:
        """Moves copy tensors whose device or dtype differs from the model's counterpart."""
        for twin in copies:
            for mine, theirs in _paired_tensors(twin, model):
                if mine.shape != theirs.shape:
                    raise ValueError(
                        "WeightedCLSLossComponent: the model no longer matches the copies made "
                        f"at on_train_start (a tensor of shape {tuple(theirs.shape)} where the "
                        f"copies have {tuple(mine.shape)})"
                    )
                if mine.device != theirs.device or mine.dtype != theirs.dtype:
                    mine.data = mine.data.to(device=theirs.device, dtype=theirs.dtype)

    @torch.no_grad()
    def _ema_update(self, twin: nn.Module, model: nn.Module, update_weight: float) -> None:
        decay = min(1.0 - 1.0 / (self._iteration + 1), update_weight)
        averaged, targets, copied, sources = [], [], [], []
        for mine, theirs in _paired_tensors(twin, model):
            if mine.is_floating_point() or mine.is_complex():
                averaged.append(mine)
                targets.append(theirs.detach())
            else:
                copied.append(mine)
                sources.append(theirs)
        if averaged:
            # lerp(copy, model, 1 - decay) == decay * copy + (1 - decay) * model
            torch._foreach_lerp_(averaged, targets, 1.0 - decay)
        for mine, theirs in zip(copied, sources):
            mine.copy_(theirs)


def _load_copies(
    copies: tuple[nn.Module, nn.Module], states: Mapping[str, Mapping[str, Any]]
) -> None:
    for twin, key in zip(copies, _CHECKPOINT_MODELS):
        twin.load_state_dict(states[key])


def _paired_tensors(
    twin: nn.Module, model: nn.Module
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields (copy tensor, model tensor) for all parameters and buffers, checking the count."""
    mine = [*twin.parameters(), *twin.buffers()]
    theirs = [*model.parameters(), *model.buffers()]
    if len(mine) != len(theirs):
        raise ValueError(
            "WeightedCLSLossComponent: the model's parameters/buffers no longer match the copies "
            f"made at on_train_start ({len(theirs)} vs {len(mine)} tensors)"
        )
    return zip(mine, theirs)
