"""Recording intermediate representations of any ``nn.Module`` with forward hooks.

Distillation losses such as PODNet's need the outputs of chosen submodules. Renate gets them from
a special model base class; here a recorder attaches to any module instead::

    recorder = IntermediateRepresentations(model, ["layer1", "layer2"])
    logits = model(x)
    features = recorder.representations  # [layer1 output, layer2 output]

The hooks are private objects whose ``__deepcopy__`` yields an inert hook, so
``copy.deepcopy(model)`` neither records nor keeps a reference to the recorder or its tensors;
:func:`copy_without_hooks` additionally strips those inert hooks from the copy.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "IntermediateRepresentations",
    "copy_without_hooks",
    "record_intermediate_representations",
]

ModuleT = TypeVar("ModuleT", bound=nn.Module)

# Dicts of nn.Module that may hold an entry for a forward (pre-)hook id.
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")
_HOOK_SIDE_DICTS = (
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)


class _RecorderHook:
    """Base of the recorder's hooks; a hook with ``recorder is None`` is inert."""

    __slots__ = ("index", "recorder")

    def __init__(self, recorder: IntermediateRepresentations | None, index: int) -> None:
        self.recorder = recorder
        self.index = index

    def __deepcopy__(self, memo: dict[int, Any]) -> _RecorderHook:
        # A copied model must not record into (or keep alive) the original recorder.
        return type(self)(None, self.index)

    def __copy__(self) -> _RecorderHook:
        return type(self)(None, self.index)


class _OutputHook(_RecorderHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.recorder is not None:
            self.recorder._outputs[self.index] = output


class _ResetHook(_RecorderHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.recorder is not None:
            # A new list, so a list handed out earlier stays valid.
            self.recorder._outputs = [None] * len(self.recorder.module_names)


class IntermediateRepresentations:
    """Records the outputs of chosen submodules of any ``nn.Module`` via forward hooks.

    The outputs are kept in the order of ``module_names`` and reset at the start of every forward
    pass of the root ``model``; a module that did not run in the last forward pass has ``None``.
    Outputs are kept as returned (not detached), so losses on them reach the model's parameters.
    If a module runs several times in one forward pass, its last output is kept.

    Args:
        model: The root module whose forward passes are observed.
        module_names: Names of submodules as in ``model.named_modules()`` (``""`` is the root).

    Raises:
        ValueError: If ``module_names`` is empty or names a module ``model`` does not have (the
            message lists the available names).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        >>> with IntermediateRepresentations(model, ["1", "0"]) as recorder:
        ...     _ = model(torch.ones(5, 4))
        ...     [tuple(f.shape) for f in recorder.representations]
        [(5, 3), (5, 3)]
        >>> recorder.removed
        True
    """

    def __init__(self, model: nn.Module, module_names: Sequence[str]) -> None:
        if isinstance(module_names, str):
            raise ValueError(
                f"module_names must be a sequence of module names, got the string "
                f"{module_names!r}; wrap it in a list"
            )
        names = tuple(module_names)
        if not names:
            raise ValueError("module_names must name at least one submodule, got none")
        available = [name for name, _ in model.named_modules(remove_duplicate=False)]
        unknown = [name for name in names if name not in available]
        if unknown:
            raise ValueError(
                f"Unknown module name(s) {unknown} for {type(model).__name__}; available "
                f"names: {available}"
            )
        self.module_names: tuple[str, ...] = names
        self._outputs: list[Any] = [None] * len(names)
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(_ResetHook(self, -1), prepend=True)
        ]
        for index, name in enumerate(names):
            module = model.get_submodule(name)
            self._handles.append(module.register_forward_hook(_OutputHook(self, index)))

    @property
    def representations(self) -> list[Any]:
        """The recorded outputs of the last forward pass, in the order of ``module_names``."""
        return list(self._outputs)

    @property
    def removed(self) -> bool:
        """Whether :meth:`remove` has been called."""
        return not self._handles

    def clear(self) -> None:
        """Drops the recorded outputs (and with them the autograd graph they reference)."""
        self._outputs = [None] * len(self.module_names)

    def remove(self) -> None:
        """Detaches all hooks and drops the recorded outputs; safe to call more than once."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()

    def __enter__(self) -> IntermediateRepresentations:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __len__(self) -> int:
        return len(self.module_names)

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        return f"IntermediateRepresentations(module_names={list(self.module_names)}, {state})"


def record_intermediate_representations(
    model: nn.Module, module_names: Sequence[str]
) -> IntermediateRepresentations:
    """Starts recording the outputs of ``module_names`` of ``model``; see
    :class:`IntermediateRepresentations`.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        >>> recorder = record_intermediate_representations(model, ["0"])
        >>> _ = model(torch.ones(1, 4))
        >>> recorder.representations[0].shape
        torch.Size([1, 3])
        >>> recorder.remove()
    """
    return IntermediateRepresentations(model, module_names)


def copy_without_hooks(model: ModuleT) -> ModuleT:
    """Deep-copies ``model`` without the hooks of any :class:`IntermediateRepresentations`.

    Other forward hooks (for example those of ``torch.nn.utils`` parametrisation helpers) are
    kept, since the model may depend on them. Gradients are not copied.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        >>> recorder = IntermediateRepresentations(model, ["0"])
        >>> twin = copy_without_hooks(model)
        >>> len(twin[0]._forward_hooks), len(model[0]._forward_hooks)
        (0, 1)
    """
    twin = copy.deepcopy(model)
    _strip_recorder_hooks(twin.modules())
    for parameter in twin.parameters():
        parameter.grad = None
    return twin


def _strip_recorder_hooks(modules: Iterable[nn.Module]) -> None:
    """Removes every (live or inert) recorder hook from ``modules``, leaving other hooks."""
    for module in modules:
        for dict_name in _HOOK_DICTS:
            hooks = getattr(module, dict_name, None)
            if not hooks:
                continue
            ours = [key for key, hook in hooks.items() if isinstance(hook, _RecorderHook)]
            for key in ours:
                del hooks[key]
                for side_name in _HOOK_SIDE_DICTS:
                    side = getattr(module, side_name, None)
                    if side is not None:
                        side.pop(key, None)
