"""Helpers the loop calls: devices, batch moves, precision (autocast, TF32), RNG states and
state-dict encoding."""

from __future__ import annotations

import contextlib
import math
import random
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainer.exceptions import CheckpointFormatError

PRECISIONS = ("32", "bf16-mixed", "16-mixed")


def autocast_factory(precision: str, device: torch.device) -> Callable[[], Any]:
    """A zero-argument factory of the context manager that the step runs under."""
    if precision == "32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def set_tf32(enabled: bool | None) -> Callable[[], None]:
    """Allow (True) or forbid (False) TensorFloat-32 in CUDA matmuls and cuDNN convolutions;
    return the function that puts back the process's previous settings (None: change nothing).

    These are process-wide switches of torch, which the trainer sets for one fit only. They act
    on CUDA devices of the Ampere generation and later; CPU matmuls and convolutions ignore them.
    torch reports an error when a setting is read through one of its two APIs after it was
    written through the other (``allow_tf32`` and ``set_float32_matmul_precision``, or the
    ``fp32_precision`` strings of torch 2.9 and later), so the switch writes and restores through
    the API the process used so far: the legacy one unless reading it fails.
    """
    if enabled is None:
        return _nothing
    cudnn = torch.backends.cudnn
    try:
        saved_legacy = (torch.get_float32_matmul_precision(), cudnn.allow_tf32)
    except RuntimeError:  # written with the fp32_precision strings: read and write those
        matmul, conv = torch.backends.cuda.matmul, cudnn.conv  # type: ignore[attr-defined]
        saved = (matmul.fp32_precision, conv.fp32_precision)
        matmul.fp32_precision = conv.fp32_precision = "tf32" if enabled else "ieee"

        def restore_strings() -> None:
            matmul.fp32_precision, conv.fp32_precision = saved

        return restore_strings
    _set_legacy_tf32("high" if enabled else "highest", enabled)
    return lambda: _set_legacy_tf32(*saved_legacy)


def _set_legacy_tf32(matmul_precision: str, conv: bool) -> None:
    torch.set_float32_matmul_precision(matmul_precision)
    torch.backends.cudnn.allow_tf32 = conv


def _nothing() -> None:
    pass


def is_finite(loss: torch.Tensor) -> bool:
    """Whether every element of ``loss`` is finite (one read from the device).

    A one-element loss is read with ``item()``, a fraction of a microsecond on the CPU; a larger
    one is reduced on its device first.
    """
    if loss.numel() == 1:
        return math.isfinite(loss.item())
    return bool(torch.isfinite(loss).all())


def batch_size_of(batch: Any) -> int:
    """Leading dimension of the first tensor in a nested batch (1 when there is none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size_of(item)
            if size:
                return size
    return 1


# -- RNG -----------------------------------------------------------------------------------------


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a DataLoader's sampling draws from, if it was given any.

    A ``DataLoader(..., generator=g)`` (or a sampler with its own generator) does not use the
    global RNG, so its state must be saved for a mid-epoch resume too.
    """
    found: dict[int, torch.Generator] = {}
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, sampler, getattr(batch_sampler, "sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator):
            found.setdefault(id(generator), generator)
    return list(found.values())


def get_rng_state(loader: Any = None) -> dict[str, Any]:
    """Torch (CPU and every CUDA device), Python ``random`` and, if imported, NumPy's global RNG;
    with ``loader``, also the state of the generators its sampling uses."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(internal), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {
            "name": name,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if loader is not None:
        state["loader"] = [generator.get_state() for generator in loader_generators(loader)]
    return state


def set_rng_state(state: Mapping[str, Any], loader: Any = None) -> None:
    """Restore what :func:`get_rng_state` returned (with ``loader``, its generators too)."""
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if loader is not None and state.get("loader"):
        generators = loader_generators(loader)
        if len(generators) != len(state["loader"]):
            raise CheckpointFormatError(
                f"the checkpoint saved the state of {len(state['loader'])} data-loader "
                f"generator(s), the train_loader has {len(generators)}; resume with the same "
                "kind of loader"
            )
        for generator, saved in zip(generators, state["loader"]):
            generator.set_state(saved)
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        saved = state["numpy"]
        numpy.random.set_state(
            (
                saved["name"],
                saved["keys"].numpy().astype("uint32"),
                saved["pos"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )


def seed_everything(seed: int) -> None:
    """Seed torch (all devices), Python ``random`` and, if imported, NumPy."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


# -- optimizer state dicts -----------------------------------------------------------------------


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of ``optimizer``, group by group, in its state dict's order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_to_tree(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Optimizer ``state_dict()`` with its integer parameter ids as string keys (JSON needs str)."""
    return {
        "state": {str(index): dict(value) for index, value in state_dict["state"].items()},
        "param_groups": [dict(group) for group in state_dict["param_groups"]],
    }


def optimizer_state_from_tree(tree: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Inverse of :func:`optimizer_state_to_tree`."""
    try:
        return {
            "state": {int(index): dict(value) for index, value in tree["state"].items()},
            "param_groups": [dict(group) for group in tree["param_groups"]],
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointFormatError(f"{path}: the optimizer section is malformed ({exc})") from exc


def _plain_loading(model: torch.nn.Module) -> bool:
    """Whether ``load_state_dict`` on ``model`` would only copy tensors: no module overrides how
    it loads (batch-norm's own override only concerns files of older torch versions) or keeps
    extra state, and no loading or state-dict hooks are registered."""
    plain = (
        torch.nn.Module._load_from_state_dict,
        torch.nn.modules.batchnorm._NormBase._load_from_state_dict,
    )
    for module in model.modules():
        if type(module)._load_from_state_dict not in plain:
            return False
        if type(module).get_extra_state is not torch.nn.Module.get_extra_state:
            return False
        hooks = (
            "_load_state_dict_pre_hooks",
            "_load_state_dict_post_hooks",
            "_state_dict_hooks",
            "_state_dict_pre_hooks",
        )
        if any(getattr(module, name, None) for name in hooks):
            return False
    return True


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def swap_plan(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """What :func:`swap_in_module_state` would do: (live tensor, loaded tensor) pairs, one per
    distinct parameter or buffer, or None when ``model`` must be loaded with ``load_state_dict``:
    custom loading code, extra state or hooks, tensors that share or do not own their storage, or
    another dtype or shape than the loaded tensors'. Reads metadata only; changes nothing.

    ``state`` must have been checked against the model (same keys, shapes and dtypes).
    """
    if not _plain_loading(model):
        return None
    live = model.state_dict(keep_vars=True)
    if live.keys() != state.keys():
        return None
    # Memory that something else in the model aliases (a non-persistent buffer viewing a
    # parameter, say) or that other processes share must be written in place.
    live_ids = {id(t) for t in live.values()}
    aliased = {
        b.untyped_storage().data_ptr()
        for b in model.buffers()
        if id(b) not in live_ids and b.numel()
    }
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    storages: set[int] = set()
    for key, tensor in live.items():
        if id(tensor) in seen:  # a tied parameter under a second name
            continue
        seen.add(id(tensor))
        new = state[key]
        if (
            not isinstance(new, torch.Tensor)
            or new.dtype != tensor.dtype
            or new.shape != tensor.shape
            or not _owns_its_storage(tensor)
            or tensor.is_shared()
        ):
            return None
        pointer = tensor.untyped_storage().data_ptr()
        if tensor.numel() and (pointer in storages or pointer in aliased):
            return None
        storages.add(pointer)
        plan.append((tensor, new))
    return plan


def swap_in_module_state(plan: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    """Make the model's parameters and buffers of a :func:`swap_plan` hold the loaded tensors;
    return the undo.

    Where ``load_state_dict`` copies into the current tensors (and a rollback needs a copy of them
    first), this points each parameter and buffer at the loaded tensor (moved to its device) and
    keeps the old one for the undo: no copy on the CPU, and no fresh memory to fault in for the
    rollback copy. The loaded tensors become the model's, so the caller must not use them
    afterwards. A view of a parameter's old memory taken outside the model
    (``w = param.data[0]``) keeps the old values; the parameter objects themselves are unchanged.
    Everything is moved to its device before the first swap, so a failing move changes nothing.

    Returns:
        A function that puts the old tensors back.
    """
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []
    used: set[int] = set()
    for tensor, new in plan:
        new = new.detach().to(tensor.device)
        if not _owns_its_storage(new) or (
            new.numel() and new.untyped_storage().data_ptr() in used
        ):  # a view, or memory another entry takes already (tied in the file, not in the model)
            new = new.clone()
        used.add(new.untyped_storage().data_ptr())
        moved.append((tensor, new))
    old = [(tensor, tensor.data) for tensor, _ in moved]
    with torch.no_grad():
        for tensor, new in moved:
            tensor.data = new

    def undo() -> None:
        with torch.no_grad():
            for tensor, data in old:
                tensor.data = data

    return undo
