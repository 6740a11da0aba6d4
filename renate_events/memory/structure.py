"""Flattening of nested inputs (a tensor, or tuples/lists/dicts nesting tensors) into leaves.

A buffer stores every leaf of the inputs in its own preallocated tensor. The *structure* of the
inputs is described by a JSON-able "spec" so that it can be written into a state dict:

* ``{"kind": "tensor"}`` for a tensor leaf,
* ``{"kind": "tuple", "items": [spec, ...]}`` and ``{"kind": "list", "items": [spec, ...]}``,
* ``{"kind": "dict", "keys": [str, ...], "items": [spec, ...]}``.

Leaves are named like Python accessors (``inputs``, ``inputs[1]``, ``inputs['image'][0]``) so that
error messages can point at the offending one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["flatten_like", "flatten_new", "leaf_names", "unflatten", "validate_spec"]

Spec = dict[str, Any]


def flatten_new(value: Any, name: str) -> tuple[Spec, list[torch.Tensor], list[str]]:
    """Flatten ``value`` and describe its structure.

    Args:
        value: A tensor, or tuples/lists/dicts (string keys) nesting tensors.
        name: How to name ``value`` itself in error messages and leaf names.

    Returns:
        ``(spec, leaves, names)``: the structure, the tensors in order and their names.

    Raises:
        TypeError: When something in ``value`` is neither a tensor nor a supported container.
    """
    leaves: list[torch.Tensor] = []
    names: list[str] = []
    spec = _flatten_new(value, name, leaves, names)
    return spec, leaves, names


def _flatten_new(value: Any, name: str, leaves: list[torch.Tensor], names: list[str]) -> Spec:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        names.append(name)
        return {"kind": "tensor"}
    if isinstance(value, (tuple, list)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        if not value:
            raise ValueError(f"{name}: an empty {kind} holds no tensor to store")
        items = [_flatten_new(v, f"{name}[{i}]", leaves, names) for i, v in enumerate(value)]
        return {"kind": kind, "items": items}
    if isinstance(value, Mapping):
        if not value:
            raise ValueError(f"{name}: an empty dict holds no tensor to store")
        keys = list(value.keys())
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(
                    f"{name}: dict keys must be str (they are written into the state dict), "
                    f"got key {key!r} of type {type(key).__name__}"
                )
        items = [_flatten_new(value[k], f"{name}[{k!r}]", leaves, names) for k in keys]
        return {"kind": "dict", "keys": keys, "items": items}
    raise TypeError(
        f"{name}: expected a tensor or a tuple/list/dict of tensors, got {type(value).__name__}"
    )


def flatten_like(value: Any, spec: Spec, name: str) -> list[torch.Tensor]:
    """Flatten ``value``, which must have the structure ``spec``.

    Dict keys may come in any order; leaves follow the order of ``spec``.

    Raises:
        ValueError: When the structure differs; the message names where.
        TypeError: When a leaf is not a tensor.
    """
    leaves: list[torch.Tensor] = []
    _flatten_like(value, spec, name, leaves)
    return leaves


def _describe(spec: Spec) -> str:
    kind = spec["kind"]
    if kind == "tensor":
        return "a tensor"
    if kind == "dict":
        return f"a dict with keys {sorted(spec['keys'])}"
    return f"a {kind} of length {len(spec['items'])}"


def _flatten_like(value: Any, spec: Spec, name: str, leaves: list[torch.Tensor]) -> None:
    kind = spec["kind"]
    if kind == "tensor":
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{name}: expected a tensor (structure fixed by the first batch), "
                f"got {type(value).__name__}"
            )
        leaves.append(value)
        return
    if kind in ("tuple", "list"):
        ok = isinstance(value, (tuple, list)) and len(value) == len(spec["items"])
        ok = ok and (isinstance(value, tuple) == (kind == "tuple"))
        if not ok:
            got = (
                f"a {type(value).__name__} of length {len(value)}"
                if isinstance(value, (tuple, list))
                else type(value).__name__
            )
            raise ValueError(
                f"{name}: expected {_describe(spec)} (structure fixed by the first batch), "
                f"got {got}"
            )
        for i, (item, sub) in enumerate(zip(value, spec["items"])):
            _flatten_like(item, sub, f"{name}[{i}]", leaves)
        return
    # dict
    if not isinstance(value, Mapping) or set(value.keys()) != set(spec["keys"]):
        got = (
            f"a dict with keys {sorted(map(str, value.keys()))}"
            if isinstance(value, Mapping)
            else type(value).__name__
        )
        raise ValueError(
            f"{name}: expected {_describe(spec)} (structure fixed by the first batch), got {got}"
        )
    for key, sub in zip(spec["keys"], spec["items"]):
        _flatten_like(value[key], sub, f"{name}[{key!r}]", leaves)


def unflatten(spec: Spec, leaves: list[torch.Tensor]) -> Any:
    """Rebuild the nested value described by ``spec`` from ``leaves`` (the inverse of flatten)."""
    it = iter(leaves)
    return _unflatten(spec, it)


def _unflatten(spec: Spec, it: Any) -> Any:
    kind = spec["kind"]
    if kind == "tensor":
        return next(it)
    if kind == "tuple":
        return tuple(_unflatten(s, it) for s in spec["items"])
    if kind == "list":
        return [_unflatten(s, it) for s in spec["items"]]
    return {k: _unflatten(s, it) for k, s in zip(spec["keys"], spec["items"])}


def leaf_names(spec: Spec, name: str) -> list[str]:
    """The names of the leaves of ``spec`` in flattening order."""
    names: list[str] = []

    def walk(s: Spec, n: str) -> None:
        if s["kind"] == "tensor":
            names.append(n)
        elif s["kind"] == "dict":
            for k, sub in zip(s["keys"], s["items"]):
                walk(sub, f"{n}[{k!r}]")
        else:
            for i, sub in enumerate(s["items"]):
                walk(sub, f"{n}[{i}]")

    walk(spec, name)
    return names


def validate_spec(spec: Any, where: str) -> Spec:
    """Check that ``spec`` (e.g. read back from a state dict) is a well-formed structure spec.

    Lists stand in for tuples where a JSON round trip turned them into lists.

    Returns:
        A normalised copy of ``spec``.

    Raises:
        ValueError: When it is malformed; the message names ``where`` and the offending part.
    """
    if not isinstance(spec, Mapping) or not isinstance(spec.get("kind"), str):
        raise ValueError(f"{where}: expected a structure spec dict with a 'kind', got {spec!r}")
    kind = spec["kind"]
    if kind == "tensor":
        if set(spec) != {"kind"}:
            raise ValueError(f"{where}: a tensor spec has only 'kind', got keys {sorted(spec)}")
        return {"kind": "tensor"}
    if kind not in ("tuple", "list", "dict"):
        raise ValueError(
            f"{where}: 'kind' must be one of 'tensor', 'tuple', 'list', 'dict', got {kind!r}"
        )
    items = spec.get("items")
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{where}: 'items' must be a non-empty list, got {items!r}")
    out_items = [validate_spec(s, f"{where}.items[{i}]") for i, s in enumerate(items)]
    if kind == "dict":
        keys = spec.get("keys")
        if (
            not isinstance(keys, (list, tuple))
            or len(keys) != len(items)
            or not all(isinstance(k, str) for k in keys)
            or len(set(keys)) != len(keys)
        ):
            raise ValueError(
                f"{where}: 'keys' must be a list of {len(items)} distinct str, got {keys!r}"
            )
        if set(spec) != {"kind", "keys", "items"}:
            raise ValueError(f"{where}: unexpected keys {sorted(spec)} in a dict spec")
        return {"kind": "dict", "keys": list(keys), "items": out_items}
    if set(spec) != {"kind", "items"}:
        raise ValueError(f"{where}: unexpected keys {sorted(spec)} in a {kind} spec")
    return {"kind": kind, "items": out_items}
