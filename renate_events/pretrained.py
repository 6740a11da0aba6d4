"""Pretrained Vision Transformers from files the user has: a Hugging Face ``ViTModel`` (or
``ViTForImageClassification``) saved in a local folder, or its ``safetensors`` weights file,
loaded into the project's :class:`~renate_events.vision_transformer.ViTBackbone`.

Nothing is downloaded: a folder is read by ``transformers`` with ``local_files_only=True`` (the
optional extra ``transformers``), a file by ``safetensors`` alone. The weights of either naming
of ``transformers`` (``encoder.layer.N.attention.attention.query`` before version 5,
``layers.N.attention.q_proj`` since) are mapped onto the backbone's blocks; the architecture
(width, depth, patch and image size, MLP width) comes from the folder's ``config.json``, or, for
a file, from the tensors' shapes (heads: ``dim // 64`` unless given, as every ViT size of
Dosovitskiy et al. has). A path that does not exist, a file that is not a ViT's weights, a
tensor missing or of another shape: one :class:`PretrainedModelError` naming the path and the
key, before any model is returned.

Example:
    >>> import os, tempfile
    >>> try:
    ...     pretrained_vit(os.path.join(tempfile.gettempdir(), "no-such-vit"), num_classes=10)
    ... except PretrainedModelError as error:
    ...     print(str(error).split(":")[-1].strip())
    no such file or folder
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from renate_events.models import ClassificationModel, vit
from trainer.checkpoint import json_too_deep

__all__ = ["PretrainedModelError", "backbone_state", "pretrained_vit"]

HEAD_DIM = 64
"""The width of an attention head in every ViT size of Dosovitskiy et al. (Ti, S, B, L, H)."""

# A block's tensors under both namings of transformers, by the backbone's name for them.
_BLOCK_NAMES = {
    "norm1": ("layernorm_before",),
    "norm2": ("layernorm_after",),
    "query": ("attention.attention.query", "attention.q_proj"),
    "key": ("attention.attention.key", "attention.k_proj"),
    "value": ("attention.attention.value", "attention.v_proj"),
    "self_attn.out_proj": ("attention.output.dense", "attention.o_proj"),
    "linear1": ("intermediate.dense", "mlp.fc1"),
    "linear2": ("output.dense", "mlp.fc2"),
}
_BLOCK_PREFIXES = ("encoder.layer.{}.", "layers.{}.", "encoder.layers.{}.")
_LAYER = re.compile(r"^(?:encoder\.layers?|layers)\.(\d+)\.")
_MAX_CONFIG_DEPTH = 32  # a ViT's config.json is 2 or 3 levels deep


class PretrainedModelError(ValueError):
    """Raised when a pretrained ViT's path does not exist or its weights do not fit."""


def _fail(path: str, message: str) -> PretrainedModelError:
    return PretrainedModelError(f"pretrained ViT {path}: {message}")


def _stripped(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``ViTModel`` keys: a classification model's ``vit.`` prefix dropped, its head and
    the pooler left out."""
    return {
        (key[4:] if key.startswith("vit.") else key): value
        for key, value in state.items()
        if not key.startswith(("classifier.", "pooler.", "vit.pooler."))
    }


def _tensor(path: str, state: Mapping[str, torch.Tensor], *names: str) -> torch.Tensor:
    for name in names:
        if name in state:
            return state[name]
    raise _fail(path, f"key {names[0]!r} is missing: not the weights of a ViTModel")


def _block(path: str, state: Mapping[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """Block ``layer``'s tensors under the backbone's names (query, key and value stacked into
    ``self_attn.in_proj_*``; a missing query/key/value bias is zero)."""
    out: dict[str, torch.Tensor] = {}
    prefixes = [prefix.format(layer) for prefix in _BLOCK_PREFIXES]
    for ours, theirs in _BLOCK_NAMES.items():
        for kind in ("weight", "bias"):
            names = [f"{p}{t}.{kind}" for t in theirs for p in prefixes]
            qkv_bias = kind == "bias" and ours in ("query", "key", "value")
            if qkv_bias and not any(name in state for name in names):  # qkv_bias=False
                weight = out[f"{ours}.weight"]
                out[f"{ours}.bias"] = weight.new_zeros(weight.shape[0])
                continue
            out[f"{ours}.{kind}"] = _tensor(path, state, *names)
    block = {k: v for k, v in out.items() if not k.startswith(("query", "key", "value"))}
    for kind in ("weight", "bias"):
        parts = [out[f"{name}.{kind}"] for name in ("query", "key", "value")]
        block[f"self_attn.in_proj_{kind}"] = torch.cat(parts)
    return block


def backbone_state(path: str, state: Mapping[str, torch.Tensor], depth: int) -> dict[str, Any]:
    """A Hugging Face ViT's weights as a backbone's state dict (``depth`` blocks).

    Raises:
        PretrainedModelError: A tensor is missing (the message names its key).
    """
    state = _stripped(state)
    ours = {
        "cls": _tensor(path, state, "embeddings.cls_token"),
        "position": _tensor(path, state, "embeddings.position_embeddings"),
        "patch.weight": _tensor(path, state, "embeddings.patch_embeddings.projection.weight"),
        "patch.bias": _tensor(path, state, "embeddings.patch_embeddings.projection.bias"),
        "norm.weight": _tensor(path, state, "layernorm.weight"),
        "norm.bias": _tensor(path, state, "layernorm.bias"),
    }
    for layer in range(depth):
        for key, value in _block(path, state, layer).items():
            ours[f"blocks.{layer}.{key}"] = value
    return ours


def _architecture_of_tensors(
    path: str, state: Mapping[str, torch.Tensor], heads: int | None
) -> dict[str, Any]:
    """The backbone's arguments read off a Hugging Face ViT's tensors."""
    state = _stripped(state)
    projection = _tensor(path, state, "embeddings.patch_embeddings.projection.weight")
    dim, channels, patch = projection.shape[0], projection.shape[1], projection.shape[-1]
    patches = _tensor(path, state, "embeddings.position_embeddings").shape[1] - 1
    side = math.isqrt(patches)
    if side * side != patches:
        raise _fail(path, f"{patches} position embeddings of patches are not a square grid")
    layers = {int(m.group(1)) for key in state if (m := _LAYER.match(key))}
    if not layers:
        raise _fail(path, "no encoder layers: not the weights of a ViTModel")
    first = [prefix.format(0) for prefix in _BLOCK_PREFIXES]
    mlp = _tensor(path, state, *(f"{p}{n}.weight" for n in _BLOCK_NAMES["linear1"] for p in first))
    heads = max(1, dim // HEAD_DIM) if heads is None else heads
    return {
        "image_size": side * patch,
        "patch_size": patch,
        "in_channels": channels,
        "dim": dim,
        "depth": max(layers) + 1,
        "heads": heads,
        "mlp_dim": mlp.shape[0],
        "eps": 1e-12,
    }


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bar and only errors from transformers while a folder is read (a command's
    error is then its one line), its settings put back after."""
    from transformers.utils import logging as hf_logging

    bar, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def _from_folder(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A ``save_pretrained`` folder read by transformers (no download): the backbone's arguments
    and the model's weights."""
    try:
        from transformers import ViTConfig, ViTModel
    except ImportError:
        raise _fail(
            path,
            "reading a Hugging Face folder needs transformers: pip install transformers "
            "(or give its model.safetensors file, read without it)",
        ) from None
    with _quiet_transformers():
        try:
            config = ViTConfig.from_pretrained(path, local_files_only=True)
            model, info = ViTModel.from_pretrained(
                path,
                local_files_only=True,
                add_pooling_layer=False,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported below, naming the key
            )
        except Exception as exc:  # transformers and safetensors raise types of their own
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise _fail(path, f"not a Hugging Face ViT folder ({first})") from None
    _check_loading_info(path, info)
    if config.hidden_act != "gelu":
        raise _fail(path, f"key 'hidden_act' is {config.hidden_act!r}; the backbone uses 'gelu'")
    architecture = {
        "image_size": config.image_size,
        "patch_size": config.patch_size,
        "in_channels": config.num_channels,
        "dim": config.hidden_size,
        "depth": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "mlp_dim": config.intermediate_size,
        "eps": config.layer_norm_eps,
    }
    return architecture, model.state_dict()


def _check_loading_info(path: str, info: Mapping[str, Any]) -> None:
    """Refuse what transformers only warns about: a tensor of the config's architecture that
    the weights lack (it would start at random) or hold in another shape."""
    missing, mismatched = list(info.get("missing_keys", ())), info.get("mismatched_keys", ())
    if missing:
        raise _fail(path, f"key {missing[0]!r} is missing from the weights of its config's ViT")
    for key, given, needed in mismatched:  # the first one
        raise _fail(
            path,
            f"tensor {key!r} has shape {tuple(given)}, its config.json's architecture needs "
            f"{tuple(needed)}",
        )


# config.json's keys by the backbone's argument they give.
_CONFIG_KEYS = {
    "image_size": "image_size",
    "patch_size": "patch_size",
    "in_channels": "num_channels",
    "dim": "hidden_size",
    "depth": "num_hidden_layers",
    "mlp_dim": "intermediate_size",
}


def _config_beside(path: str) -> dict[str, Any]:
    """The ``config.json`` beside a weights file (empty when there is none)."""
    config = os.path.join(os.path.dirname(path), "config.json")
    if not os.path.isfile(config):
        return {}
    try:
        with open(config, encoding="utf-8") as handle:
            text = handle.read()
        # counted before parsing: json's own limit is the interpreter's and varies by version
        if json_too_deep(text, _MAX_CONFIG_DEPTH):
            raise ValueError(f"it nests deeper than {_MAX_CONFIG_DEPTH} levels")
        values = json.loads(text)
    except (OSError, ValueError) as exc:
        raise _fail(
            path,
            f"{config} beside it is not JSON ({exc})",
        ) from None
    if not isinstance(values, dict):
        raise _fail(path, f"{config} beside it is not a JSON object")
    return values


def _check_against_config(path: str, architecture: Mapping[str, Any], config: Mapping) -> None:
    """A file read beside its config.json: the tensors' architecture must be the config's (a
    truncated file is not silently a shallower model)."""
    for ours, theirs in _CONFIG_KEYS.items():
        if theirs in config and config[theirs] != architecture[ours]:
            raise _fail(
                path,
                f"the weights give {theirs} = {architecture[ours]!r}, the config.json beside "
                f"them says {config[theirs]!r}",
            )


def _from_file(path: str, heads: int | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    import safetensors.torch

    try:
        state = safetensors.torch.load_file(path)
    except Exception as exc:  # safetensors raises its own error types for a corrupt file
        raise _fail(path, f"not a safetensors file ({str(exc).splitlines()[0]})") from None
    config = _config_beside(path)  # a save_pretrained folder's file
    if heads is None:
        heads = config.get("num_attention_heads")
    architecture = _architecture_of_tensors(path, state, heads)
    _check_against_config(path, architecture, config)
    return architecture, state


def pretrained_vit(
    path: str | os.PathLike[str], num_classes: int, heads: int | None = None
) -> ClassificationModel:
    """The zoo's :func:`~renate_events.models.vit` of a Hugging Face ViT's architecture, its
    backbone holding that ViT's pretrained weights and a fresh linear ``head``.

    Args:
        path: A folder written by ``save_pretrained`` (read with ``transformers``, never
            downloaded) or a ``.safetensors`` file of such a model's weights.
        num_classes: Outputs of the new head.
        heads: Attention heads, for a file without a ``config.json`` beside it (default
            ``dim // 64``).

    Raises:
        PretrainedModelError: ``path`` does not exist, is not a ViT's weights, or a tensor is
            missing or of another shape than the architecture needs.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        architecture, state = _from_folder(path)
    elif os.path.isfile(path):
        architecture, state = _from_file(path, heads)
    else:
        raise _fail(path, "no such file or folder")
    dim, given = architecture["dim"], architecture["heads"]
    if not isinstance(given, int) or given < 1 or dim % given:
        raise _fail(path, f"{given!r} heads do not divide the width {dim}")
    eps = float(architecture.pop("eps"))
    model = vit(num_classes, **architecture, layer_norm_eps=eps)
    backbone = model.backbone
    weights = backbone_state(path, state, architecture["depth"])
    expected = backbone.state_dict()
    for key, value in weights.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise _fail(
                path,
                f"tensor for {key!r} has shape {tuple(value.shape)}, the architecture needs "
                f"{tuple(expected[key].shape)}",
            )
    backbone.load_state_dict({k: v.to(expected[k].dtype) for k, v in weights.items()})
    return model
