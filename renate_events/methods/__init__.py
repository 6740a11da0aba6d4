"""Continual-learning methods: one module per method, each registering one spec.

A method is one module of this package: its learner (a preset of
:class:`~renate_events.learners.BaseExperienceReplayLearner`), the components and listeners only it
uses, and its :class:`MethodSpec` (name, learner class, buffers, what it needs from the model, how
it is evaluated), registered with ``SPEC = register(MethodSpec(...))``. This package imports every
module it holds (all but :mod:`~renate_events.methods.registry` and names starting with ``_``),
so adding a method is adding one module; a module that registers no spec, a
spec that is incomplete and a name registered twice are errors at import, naming the method.

:data:`METHODS` holds the specs (sorted by name once every module is imported; a method
registered later follows them), :data:`LEARNERS` maps each name to its learner class, and every
learner class is importable from here.

Example:
    >>> from renate_events.methods import LEARNERS, method
    >>> method("der").learner is LEARNERS["der"]
    True
"""

from __future__ import annotations

import importlib
import pkgutil

from renate_events.methods.registry import (
    BUFFER_KINDS,
    CLASSIFIERS,
    DEFAULT_METHOD,
    FEATURES,
    LEARNER_OBJECTS,
    METHODS,
    MODEL_KINDS,
    MethodSpec,
    MethodSpecError,
    learner_arguments,
    method,
    method_of,
    register,
)

_NOT_METHODS = frozenset({"registry"})  # the registry itself


def _import_method_modules() -> None:
    """Import every method module of this package, in alphabetical order; each must register
    the spec it names ``SPEC``."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if info.name.startswith("_") or info.name in _NOT_METHODS:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        spec = getattr(module, "SPEC", None)
        if not isinstance(spec, MethodSpec) or METHODS.get(spec.name) is not spec:
            raise MethodSpecError(
                f"the method module {module.__name__} registers no method: define "
                "SPEC = register(MethodSpec(name=..., learner=..., summary=...)) in it"
            )
    for name in sorted(METHODS):  # by name, whatever order the modules' imports registered them
        METHODS[name] = METHODS.pop(name)


_import_method_modules()

from renate_events.methods._prompting import PromptModelError  # noqa: E402 - after the methods

LEARNERS = {name: spec.learner for name, spec in METHODS.items()}
"""Learner classes by method name, in the order of :data:`METHODS`. ``"der"`` is
:class:`~renate_events.methods.DarkExperienceReplayLearner` with Renate's defaults (DER++);
pass ``beta=0`` for DER."""

# Every learner class under its own name (``from renate_events.methods import ICaRLLearner``).
globals().update({learner.__name__: learner for learner in LEARNERS.values()})

__all__ = [
    "BUFFER_KINDS",
    "CLASSIFIERS",
    "DEFAULT_METHOD",
    "FEATURES",
    "LEARNERS",
    "LEARNER_OBJECTS",
    "METHODS",
    "MODEL_KINDS",
    "MethodSpec",
    "MethodSpecError",
    "PromptModelError",
    "learner_arguments",
    "method",
    "method_of",
    "register",
]
__all__ += [learner.__name__ for learner in LEARNERS.values()]
__all__.sort()
