"""The method registry: one :class:`MethodSpec` per continual-learning method, declared in the
method's own module and registered once.

Everything that needs a fact about a method (the command line, :class:`ModelUpdater`, the
hyperparameter schema, search and evaluation) reads its spec; no other module names a method.

Example:
    >>> from renate_events.methods import method
    >>> spec = method("icarl")
    >>> spec.default_buffer, spec.classifier, spec.uses_memory
    ('herding', 'nme', True)
"""

from __future__ import annotations

from typing import Any

import attrs

from trainer import validators

__all__ = [
    "BUFFER_KINDS",
    "CLASSIFIERS",
    "DEFAULT_METHOD",
    "FEATURES",
    "LEARNER_OBJECTS",
    "METHODS",
    "MODEL_KINDS",
    "MethodSpec",
    "MethodSpecError",
    "learner_arguments",
    "method",
    "method_of",
    "register",
]

DEFAULT_METHOD = "der"
"""The method ``ModelUpdater`` and the command line use when none is named: DER++ (Buzzega et al.,
NeurIPS 2020) with Renate's defaults."""

BUFFER_KINDS = ("reservoir", "sliding-window", "greedy-class-balancing", "herding")
"""Every buffer name a spec may list (the keys of ``renate_events.choices.BUFFERS``)."""
_SHARED_BUFFERS = ("reservoir", "sliding-window", "greedy-class-balancing")

FEATURES = ("none", "hidden", "last-hidden")
"""What a method takes from the model's hidden layers: nothing; every hidden layer's output
(distillation of intermediate features, so ``feature_modules`` must be known); the last hidden
layer's output when the model has one (an embedding, such as iCaRL's)."""

MODEL_KINDS = ("any", "vit")
"""What model a method can train: any model, or a Vision Transformer whose backbone is a
:class:`~renate_events.vision_transformer.ViTBackbone` (the prompt methods)."""

CLASSIFIERS = ("logits", "nme")
"""How a method's model is evaluated: its own outputs, or the nearest mean of exemplars."""

LEARNER_OBJECTS = frozenset(
    (
        "model",
        "optimizer",
        "trainer",
        "buffer",
        "metrics",
        "components",
        "learning_rate_scheduler",
        "learning_rate_scheduler_interval",
        "loss_fn",
        "collate_fn",
        "train_transform",
        "train_target_transform",
        "buffer_transform",
        "buffer_target_transform",
        "test_transform",
    )
)
"""Learner arguments that are objects (or follow from them), which ``ModelUpdater`` builds from
its own arguments; every other argument is a JSON-able ``learner_kwargs`` key."""


class MethodSpecError(ValueError):
    """Raised when a method spec is incomplete or inconsistent, or a name is registered twice."""


def _name(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value or value != value.strip().lower():
        raise MethodSpecError(f"a method's name must be a lower-case string, got {value!r}")


def _learner(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, type) or not attrs.has(value):
        raise MethodSpecError(
            f"method {instance.name!r}: learner must be an attrs learner class, got {value!r}"
        )


def _summary(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise MethodSpecError(
            f"method {instance.name!r}: summary must say what it is and cite its paper"
        )


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise MethodSpecError(
                f"method {instance.name!r}: {attribute.name} must be one of {list(choices)}, "
                f"got {value!r}"
            )

    return check


def _buffers(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not value or any(kind not in BUFFER_KINDS for kind in value):
        raise MethodSpecError(
            f"method {instance.name!r}: buffers must be a non-empty tuple of {list(BUFFER_KINDS)}, "
            f"got {value!r}"
        )


@attrs.frozen
class MethodSpec:
    """What the rest of the library needs to know about one method.

    Attributes:
        name: The name users type (``--learner der``, ``ModelUpdater(learner="der")``), stored in
            state folders' manifests.
        learner: The learner class (a :class:`BaseExperienceReplayLearner` subclass).
        summary: One line: what the method does and its paper (author, title, venue, year).
        buffers: The buffer kinds the method can work with.
        default_buffer: The buffer it gets when none is named (one of ``buffers``).
        uses_memory: False for memory-free methods, which keep no replay memory unless a
            ``memory_size`` is given.
        features: What it takes from the model's hidden layers (:data:`FEATURES`).
        classifier: How its model is evaluated by default (:data:`CLASSIFIERS`).
        own_buffer: True for a method that makes its own store of past data (joint training's
            store of everything), so that ``ModelUpdater`` builds no buffer for it.
        model: What model it can train (:data:`MODEL_KINDS`): ``"vit"`` for a method that
            prompts a frozen Vision Transformer.
    """

    name: str = attrs.field(validator=_name)
    # None by default, so that a spec without them is refused naming the method (not a TypeError).
    learner: type = attrs.field(default=None, validator=_learner)
    summary: str = attrs.field(default=None, validator=_summary)
    buffers: tuple[str, ...] = attrs.field(
        default=_SHARED_BUFFERS, converter=tuple, validator=_buffers
    )
    default_buffer: str = attrs.field(default="reservoir")
    uses_memory: bool = attrs.field(default=True, validator=validators.boolean)
    features: str = attrs.field(default="none", validator=_one_of(FEATURES))
    classifier: str = attrs.field(default="logits", validator=_one_of(CLASSIFIERS))
    own_buffer: bool = attrs.field(default=False, validator=validators.boolean)
    model: str = attrs.field(default="any", validator=_one_of(MODEL_KINDS))

    @default_buffer.validator
    def _default_buffer(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in self.buffers:
            raise MethodSpecError(
                f"method {self.name!r}: default_buffer {value!r} is not one of its buffers "
                f"{list(self.buffers)}"
            )

    def arguments(self) -> frozenset[str]:
        """The learner's ``learner_kwargs`` keys (:func:`learner_arguments`)."""
        return learner_arguments(self.learner)


def learner_arguments(learner: type) -> frozenset[str]:
    """The arguments of ``learner`` a user gives as JSON-able ``learner_kwargs`` (all its
    ``__init__`` arguments but :data:`LEARNER_OBJECTS`)."""
    init = {field.alias for field in attrs.fields(learner) if field.init}
    return frozenset(init - LEARNER_OBJECTS)


METHODS: dict[str, MethodSpec] = {}
"""Every registered method by name: the package's methods sorted by name, then any registered
later in registration order."""


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` to :data:`METHODS` and return it.

    Raises:
        MethodSpecError: ``spec`` is not a :class:`MethodSpec`, or its name or learner class is
            registered already.
    """
    if not isinstance(spec, MethodSpec):
        raise MethodSpecError(f"register takes a MethodSpec, got {type(spec).__name__}")
    if spec.name in METHODS:
        raise MethodSpecError(f"method {spec.name!r} is registered twice")
    for other in METHODS.values():
        if other.learner is spec.learner:
            raise MethodSpecError(
                f"method {spec.name!r}: its learner {spec.learner.__name__} is method "
                f"{other.name!r}'s already"
            )
    METHODS[spec.name] = spec
    return spec


def method(name: str) -> MethodSpec:
    """The spec of the method called ``name``.

    Raises:
        ValueError: No method has that name (the message lists the names).
    """
    validators.check_one_of("learner", name, sorted(METHODS))
    return METHODS[name]


def method_of(learner: Any) -> MethodSpec | None:
    """The spec whose learner class ``learner`` is an instance of (exactly); None for a learner
    class no method registers (a user's own subclass)."""
    for spec in METHODS.values():
        if type(learner) is spec.learner:
            return spec
    return None
