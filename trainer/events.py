"""The event vocabulary of :class:`trainer.Trainer`, declared once, and its ordered dispatch.

One ``fit`` publishes, in this order::

    train_start
      ( epoch_start
          ( batch_start  [step(batch), backward, optimizer step]  batch_end )*
        epoch_end
        [ validation_start  [val_step(batch) for every validation batch]  validation_end ] )*
    train_end

plus ``save_checkpoint`` / ``load_checkpoint`` whenever the trainer writes or reads state, and
``exception`` when a run fails (then the error propagates).

Every event is a :class:`blinker.Signal` owned by one trainer (``trainer.events.batch_end``), so two
trainers never see each other's events. Receivers are called with keyword arguments only, and each
receives just the keywords its signature names (see :data:`EVENTS` for what each event offers).
Receivers run in a deterministic order: higher ``priority`` first, then in the order they were
connected. The trainer holds strong references to them.

Why the dispatch is not blinker's own: blinker keeps receivers in a set-backed mapping, holds weak
references and passes every receiver the whole payload. Here each receiver gets only the keywords
it declares, in a fixed order, strongly referenced. So :class:`Events` keeps the one subscription
registry (a :class:`Subscription` per listener or function, with its receivers per event), and
each :class:`EventSignal` holds a cache of its receivers in dispatch order, recomputed from that
registry whenever it changes. blinker still supplies the public surface users know
(``connect``, ``disconnect``, ``connected_to``, ``connect_via``, ``send``, ``has_receivers_for``,
``receivers_for``); its internal ``receivers`` mapping stays empty.
"""

from __future__ import annotations

import difflib
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import blinker

from trainer.distributed import RUNS_ON
from trainer.exceptions import ListenerError, SubscriptionError
from trainer.validators import NAME_PATTERN, snake_case

__all__ = ["EVENTS", "HOOK_ALIASES", "EventSignal", "EventSpec", "Events", "Subscription"]

_COMMON = ("sender", "trainer", "model", "optimizer", "state", "rank", "world_size")


@attrs.frozen
class EventSpec:
    """What one event is: its name, the keywords it offers and when it fires.

    Attributes:
        name: The event's name; a listener method ``on_<name>`` receives it.
        payload: The keywords a receiver may declare.
        doc: When the event fires and what its own keywords hold.
        scoped: Keywords whose value is made per listener (the ``checkpoint`` namespace).
    """

    name: str
    payload: frozenset[str]
    doc: str
    scoped: frozenset[str] = frozenset()


def _spec(name: str, extra: tuple[str, ...], doc: str, scoped: tuple[str, ...] = ()) -> EventSpec:
    return EventSpec(name, frozenset(_COMMON + extra), doc, frozenset(scoped))


EVENTS: dict[str, EventSpec] = {
    spec.name: spec
    for spec in (
        _spec(
            "train_start",
            ("train_loader", "scheduler"),
            "Once per fit, after the model is on its device, before the first epoch. When "
            "resuming, the checkpoint is restored right after this event (``load_checkpoint``).",
        ),
        _spec("epoch_start", (), "At the start of every epoch; ``state.epoch`` is its index."),
        _spec(
            "batch_start",
            ("batch",),
            "Before ``step(batch)``; ``batch`` is already on the device, ``state.batch_idx`` is "
            "its index in the epoch.",
        ),
        _spec(
            "batch_end",
            ("batch", "outputs", "loss"),
            "After the backward pass and, when one was due, the optimizer step. ``outputs`` is the "
            'mapping ``step`` returned (``{"loss": loss}`` for a bare tensor), ``loss`` the loss '
            "tensor, still on the device. ``state.global_step`` counts this batch.",
        ),
        _spec("epoch_end", (), "After the last batch of an epoch, before its validation."),
        _spec(
            "validation_start",
            ("val_loader",),
            "Before a validation pass, in eval mode under ``torch.no_grad()``.",
        ),
        _spec(
            "validation_end",
            ("metrics",),
            "After a validation pass; ``metrics`` maps names to Python floats (batch-size "
            "weighted means of what ``val_step`` returned). The model is back in train mode after.",
        ),
        _spec("train_end", ("result",), "Once per fit that finished; ``result`` is the FitResult."),
        _spec(
            "save_checkpoint",
            ("checkpoint", "path"),
            "While a checkpoint is being assembled, before anything is written. ``checkpoint`` is "
            "this listener's own writable namespace (a ListenerState).",
            scoped=("checkpoint",),
        ),
        _spec(
            "load_checkpoint",
            ("checkpoint", "path"),
            "After a checkpoint was read and checked against the model and optimizer. "
            "``checkpoint`` is this listener's own read-only namespace.",
            scoped=("checkpoint",),
        ),
        _spec(
            "exception",
            ("exception", "event", "listener"),
            "When a fit fails, before the error propagates. ``event`` and ``listener`` name where "
            "a listener failed (``None`` when the failure came from elsewhere).",
        ),
    )
}
"""Every event by name. The common keywords of all events are ``sender`` and ``trainer`` (the
trainer), ``model``, ``optimizer``, ``state`` (the :class:`~trainer.TrainState`), ``rank`` and
``world_size`` (this process's rank and the number of processes: 0 and 1 when not distributed)."""

HOOK_ALIASES: dict[str, str] = {"on_train_batch_end": "batch_end"}
"""Method names kept from Renate's component hooks, mapped to the event they receive."""


class _Receiver:
    """One connected callable with what it needs from the payload."""

    __slots__ = ("call", "key", "live", "names", "priority", "rank_zero", "seq", "takes_all")

    def __init__(self, call: Callable[..., Any], key: str, priority: int, seq: int) -> None:
        self.call = call
        self.key = key
        self.priority = priority
        self.seq = seq
        self.live = True
        self.names: tuple[str, ...] = ()
        self.takes_all = False
        self.rank_zero = False


@attrs.define(eq=False)
class Subscription:
    """A subscribed listener or connected function and its receivers."""

    target: Any
    key: str
    priority: int
    seq: int
    receivers: dict[str, _Receiver] = attrs.field(factory=dict)
    runs_on: str = "all"
    """``"all"``, ``"rank_zero"`` or ``"collective"`` (see :data:`trainer.distributed.RUNS_ON`)."""

    @property
    def events(self) -> frozenset[str]:
        """The events this subscription receives."""
        return frozenset(self.receivers)


class EventSignal(blinker.Signal):
    """A blinker signal whose receivers run in a fixed order and get only the keywords they name.

    Plain blinker calls receivers in the iteration order of a ``set`` and holds weak references;
    this subclass keeps strong references and calls receivers by descending ``priority`` and then
    connection order. It is created by :class:`Events`; use ``trainer.events.<name>``.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer()
        >>> def report(state):
        ...     print(state.epoch)
        >>> _ = trainer.events.epoch_end.connect(report)
    """

    def __init__(self, spec: EventSpec, registry: Events) -> None:
        super().__init__(spec.doc)
        self.name = spec.name
        self.spec = spec
        self._registry = registry
        self._ordered: tuple[_Receiver, ...] = ()
        self.active = False
        """True while at least one receiver is connected; check it before building a payload."""

    def connect(  # type: ignore[override]
        self,
        receiver: Callable[..., Any],
        sender: Any = blinker.ANY,
        weak: bool = False,
        *,
        priority: int = 0,
        name: str | None = None,
    ) -> Callable[..., Any]:
        """Connect a function to this event.

        Args:
            receiver: A callable whose parameters are keywords of this event's payload.
            sender: Only ``blinker.ANY`` or the owning trainer (the signal belongs to one trainer).
            weak: Must stay False: the trainer keeps receivers alive.
            priority: Higher runs earlier; ties run in connection order.
            name: Key of the function's checkpoint namespace; derived from its name if omitted.

        Returns:
            ``receiver``, so that this works as a decorator through :meth:`connect_via`.

        Raises:
            SubscriptionError: When the receiver's parameters do not fit this event's payload.
        """
        if weak:
            raise SubscriptionError(
                "trainer signals hold strong references so that listeners are not garbage "
                "collected mid-run; connect without weak=True"
            )
        if sender is not blinker.ANY and sender is not self._registry.owner:
            raise SubscriptionError(
                f"event {self.name!r} belongs to one trainer and is only sent by it; connect with "
                f"the default sender, not {sender!r}"
            )
        self._registry.connect_function(self.name, receiver, priority=priority, name=name)
        return receiver

    def disconnect(self, receiver: Callable[..., Any], sender: Any = blinker.ANY) -> None:
        """Disconnect a function connected with :meth:`connect`."""
        self._registry.disconnect_function(self.name, receiver)

    def has_receivers_for(self, sender: Any) -> bool:
        """Whether any receiver is connected (every receiver takes events from the owner)."""
        return self.active

    def receivers_for(self, sender: Any) -> Iterator[Callable[..., Any]]:  # type: ignore[override]
        """The connected callables, in dispatch order."""
        return iter([r.call for r in self._ordered])

    @property
    def ordered_receivers(self) -> list[tuple[str, Callable[..., Any]]]:
        """``(key, callable)`` of every receiver, in the order they are called."""
        return [(r.key, r.call) for r in self._ordered]

    def send(self, sender: Any = None, /, **payload: Any) -> list[tuple[Callable[..., Any], Any]]:
        """Call every receiver in order with the keywords it declared.

        Returns:
            ``(receiver, return value)`` pairs, as blinker's ``send`` does.

        Raises:
            ListenerError: When a receiver raises; the original error is chained.
        """
        registry = self._registry
        registry.depth += 1
        try:
            results = self._dispatch(payload)
        except BaseException:
            registry.depth -= 1
            if registry.depth == 0:
                registry.deferred.clear()  # the run failed: drop what waited for this event
            raise
        registry.depth -= 1
        if registry.depth == 0 and registry.deferred:
            registry.run_deferred()
        return results

    def _dispatch(self, payload: dict[str, Any]) -> list[tuple[Callable[..., Any], Any]]:
        results = []
        scoped = self.spec.scoped
        skip_rank_zero_only = self._registry.rank != 0
        for receiver in self._ordered:
            if not receiver.live:  # unsubscribed by an earlier receiver of this same event
                continue
            if receiver.rank_zero and skip_rank_zero_only:
                continue
            names = receiver.names
            if receiver.takes_all:
                kwargs = payload
            elif names:
                kwargs = {name: payload[name] for name in names}
            else:
                kwargs = _NO_KEYWORDS
            if scoped:
                scoped_kwargs = self._scope(kwargs, receiver.key)
                if scoped_kwargs is None:
                    continue  # nothing for this receiver (its state is absent from the file)
                kwargs = scoped_kwargs
            try:
                value = receiver.call(**kwargs)
            except Exception as exc:
                raise ListenerError(
                    f"listener {receiver.key!r} raised {type(exc).__name__} in event "
                    f"{self.name!r}: {exc}",
                    event=self.name,
                    listener=receiver.key,
                ) from exc
            results.append((receiver.call, value))
        return results

    def _scope(self, kwargs: dict[str, Any], key: str) -> dict[str, Any] | None:
        """Replace per-listener payload values by this listener's part (None: skip it)."""
        kwargs = dict(kwargs)
        for name in self.spec.scoped:
            if name in kwargs:
                kwargs[name] = kwargs[name].for_listener(key)
                if kwargs[name] is None:
                    return None
        return kwargs


_NO_KEYWORDS: dict[str, Any] = {}


class Events:
    """The signals of one trainer, one attribute per event, and the subscription registry."""

    train_start: EventSignal
    epoch_start: EventSignal
    batch_start: EventSignal
    batch_end: EventSignal
    epoch_end: EventSignal
    validation_start: EventSignal
    validation_end: EventSignal
    train_end: EventSignal
    save_checkpoint: EventSignal
    load_checkpoint: EventSignal
    exception: EventSignal

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.rank = 0
        """This process's rank; listeners that run on rank zero only are skipped elsewhere."""
        self.depth = 0
        """How many events are being dispatched right now (nested sends count)."""
        self.deferred: list[Callable[[], Any]] = []
        self._counter = itertools.count()
        self._subscriptions: dict[int, Subscription] = {}
        """The one registry: every subscription by the id of its target, in subscription order."""
        self.signals: dict[str, EventSignal] = {
            name: EventSignal(spec, self) for name, spec in EVENTS.items()
        }
        for name, signal in self.signals.items():
            setattr(self, name, signal)

    def __iter__(self) -> Iterator[EventSignal]:
        return iter(self.signals.values())

    @property
    def dispatching(self) -> bool:
        """True while a receiver of some event is running."""
        return self.depth > 0

    def defer(self, action: Callable[[], Any]) -> None:
        """Run ``action`` once the event being dispatched has reached every receiver.

        Dropped if a receiver of that event raises.
        """
        self.deferred.append(action)

    def run_deferred(self) -> None:
        actions, self.deferred = self.deferred, []
        for action in actions:
            action()

    # -- subscriptions -------------------------------------------------------------------------

    def subscriptions(self) -> list[Subscription]:
        """Every subscription in dispatch order (descending priority, then subscription order)."""
        return sorted(self._subscriptions.values(), key=lambda s: (-s.priority, s.seq))

    def subscription_of(self, target: Any) -> Subscription | None:
        """The subscription of a listener or function, or None."""
        subscription = self._subscriptions.get(id(target))
        return subscription if subscription is not None and subscription.target is target else None

    def subscribe(
        self,
        listener: Any,
        *,
        priority: int = 0,
        name: str | None = None,
        runs_on: str | None = None,
    ) -> str:
        """Connect every ``on_<event>`` method of ``listener``; return its checkpoint key.

        ``runs_on`` (default: the listener's ``runs_on`` attribute, else ``"all"``) says where it
        runs in a distributed fit: ``"all"`` ranks, ``"rank_zero"`` only, or ``"collective"``.
        """
        hooks = _find_hooks(listener)
        if not hooks:
            raise SubscriptionError(
                f"{type(listener).__qualname__} defines no hook methods; name them on_<event> "
                f"with an event from {sorted(EVENTS)}"
            )
        if runs_on is None:
            runs_on = getattr(listener, "runs_on", "all")
        if runs_on not in RUNS_ON:
            raise SubscriptionError(
                f"{type(listener).__qualname__} has runs_on={runs_on!r}; a listener runs on "
                f"{list(RUNS_ON)} (every rank, rank zero only, or every rank at the same point "
                "because it calls collectives)"
            )
        return self._add(listener, hooks, priority, name, runs_on)

    def connect_function(
        self, event: str, function: Callable[..., Any], *, priority: int, name: str | None
    ) -> str:
        """Connect one callable to one event; return its checkpoint key.

        The same function may be connected to several events; it keeps one key.
        """
        if not callable(function):
            raise SubscriptionError(f"can only connect callables to {event!r}, got {function!r}")
        existing = self.subscription_of(function)
        if existing is None:
            return self._add(function, {event: function}, priority, name)
        if event in existing.receivers:
            raise SubscriptionError(f"{_describe(function)} is already connected to {event!r}")
        if name is not None and name != existing.key:
            raise SubscriptionError(
                f"{_describe(function)} is already connected as {existing.key!r}; "
                f"it cannot take a second name {name!r}"
            )
        receiver = self._make_receiver(function, event, existing.key, priority)
        existing.receivers[event] = receiver
        self._refresh([event])
        return existing.key

    def disconnect_function(self, event: str, function: Callable[..., Any]) -> None:
        """Disconnect ``function`` from one event."""
        subscription = self.subscription_of(function)
        if subscription is None or event not in subscription.receivers:
            raise SubscriptionError(f"{_describe(function)} is not connected to {event!r}")
        if len(subscription.receivers) == 1:
            self.unsubscribe(function)
            return
        subscription.receivers.pop(event).live = False
        self._refresh([event])

    def unsubscribe(self, target: Any) -> None:
        """Disconnect every receiver of a listener or function; it receives nothing more."""
        subscription = self.subscription_of(target)
        if subscription is None:
            raise SubscriptionError(f"{_describe(target)} is not subscribed to this trainer")
        del self._subscriptions[id(target)]
        for receiver in subscription.receivers.values():
            receiver.live = False  # an event being dispatched right now skips it
        self._refresh(subscription.receivers)

    def _add(
        self,
        target: Any,
        hooks: dict[str, Callable[..., Any]],
        priority: int,
        name: str | None,
        runs_on: str = "all",
    ) -> str:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise SubscriptionError(f"priority must be an int, got {priority!r}")
        existing = self.subscription_of(target)
        if existing is not None:
            raise SubscriptionError(
                f"{_describe(target)} is already subscribed as {existing.key!r}; unsubscribe it "
                "first to change its priority or name"
            )
        key = self._key_for(target, name)
        seq = next(self._counter)
        subscription = Subscription(target, key, priority, seq, runs_on=runs_on)
        # Check every hook before connecting any, so that a failed subscribe changes nothing.
        for event, call in hooks.items():
            receiver = self._make_receiver(call, event, key, priority, seq)
            receiver.rank_zero = runs_on == "rank_zero"
            subscription.receivers[event] = receiver
        self._subscriptions[id(target)] = subscription
        self._refresh(subscription.receivers)
        return key

    def _refresh(self, events: Iterable[str]) -> None:
        """Recompute the dispatch order of ``events`` from the registry."""
        for event in events:
            receivers = [
                s.receivers[event] for s in self._subscriptions.values() if event in s.receivers
            ]
            signal = self.signals[event]
            signal._ordered = tuple(sorted(receivers, key=lambda r: (-r.priority, r.seq)))
            signal.active = bool(signal._ordered)

    def _by_key(self, key: str) -> Subscription | None:
        return next((s for s in self._subscriptions.values() if s.key == key), None)

    def _key_for(self, target: Any, name: str | None) -> str:
        if name is not None:
            if not isinstance(name, str) or not NAME_PATTERN.match(name):
                raise SubscriptionError(
                    f"listener name {name!r} is not valid: use letters, digits, '_' and '-', "
                    "starting with a letter or '_' (no dots: they separate checkpoint keys)"
                )
            taken = self._by_key(name)
            if taken is not None:
                raise SubscriptionError(
                    f"the name {name!r} is already taken by "
                    f"{_describe(taken.target)}; give each listener a distinct name"
                )
            return name
        if _is_listener_object(target):
            base = type(target).__name__
        else:
            base = getattr(target, "__name__", None) or type(target).__name__
        base = snake_case(base)
        for i in itertools.count():  # pragma: no branch - always returns
            key = f"{base}_{i}"
            if self._by_key(key) is None:
                return key
        raise AssertionError("unreachable")  # pragma: no cover

    def _make_receiver(
        self,
        call: Callable[..., Any],
        event: str,
        key: str,
        priority: int,
        seq: int | None = None,
    ) -> _Receiver:
        receiver = _Receiver(call, key, priority, next(self._counter) if seq is None else seq)
        receiver.names, receiver.takes_all = _accepted(call, EVENTS[event], key)
        return receiver


def _is_listener_object(target: Any) -> bool:
    return not (inspect.isfunction(target) or inspect.ismethod(target) or inspect.isbuiltin(target))


def _describe(target: Any) -> str:
    if _is_listener_object(target):
        return f"listener {type(target).__qualname__} at {id(target):#x}"
    return f"function {getattr(target, '__qualname__', target)!r}"


def _find_hooks(listener: Any) -> dict[str, Callable[..., Any]]:
    """Map event name to bound method for every ``on_*`` method; reject unknown names."""
    hooks: dict[str, Callable[..., Any]] = {}
    sources: dict[str, str] = {}
    for attribute in dir(listener):
        if not attribute.startswith("on_"):
            continue
        method = getattr(listener, attribute, None)
        if not callable(method):
            continue
        event = HOOK_ALIASES.get(attribute, attribute[3:])
        if event not in EVENTS:
            known = [f"on_{e}" for e in EVENTS] + list(HOOK_ALIASES)
            close = difflib.get_close_matches(attribute, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SubscriptionError(
                f"{type(listener).__qualname__}.{attribute} matches no event{hint}. "
                f"Hook methods are on_<event> for the events {sorted(EVENTS)}, plus "
                f"{sorted(HOOK_ALIASES)}"
            )
        if event in hooks:
            # An override in a subclass wins over the other name inherited from a base class
            # (a Component subclass may define on_batch_end next to the inherited no-op
            # on_train_batch_end); two names defined at the same level are ambiguous.
            mine, theirs = _defined_at(listener, attribute), _defined_at(listener, sources[event])
            if mine == theirs:
                raise SubscriptionError(
                    f"{type(listener).__qualname__} defines both {sources[event]} and "
                    f"{attribute}, which receive the same event {event!r}; keep one"
                )
            if mine > theirs:
                continue
        hooks[event] = method
        sources[event] = attribute
    return hooks


def _defined_at(listener: Any, attribute: str) -> int:
    """Position in the MRO of the class that defines ``attribute`` (0: the listener's own)."""
    for depth, cls in enumerate(type(listener).__mro__):
        if attribute in vars(cls):
            return depth
    return -1  # set on the instance itself


def _accepted(call: Callable[..., Any], spec: EventSpec, key: str) -> tuple[tuple[str, ...], bool]:
    """The payload keywords ``call`` declares, and whether it takes ``**kwargs``."""
    try:
        signature = inspect.signature(call)
    except (TypeError, ValueError) as exc:
        raise SubscriptionError(
            f"cannot read the signature of {call!r} ({key!r}) for event {spec.name!r}: {exc}"
        ) from exc
    names: list[str] = []
    takes_all = False
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            takes_all = True
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        elif parameter.name in spec.payload:
            if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
                raise SubscriptionError(
                    f"{_qualname(call)} ({key!r}) takes {parameter.name!r} positional-only; "
                    "events pass their payload by keyword"
                )
            names.append(parameter.name)
        else:
            close = difflib.get_close_matches(
                parameter.name, sorted(spec.payload), n=1, cutoff=0.75
            )
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SubscriptionError(
                f"{_qualname(call)} ({key!r}) has a parameter {parameter.name!r}{hint} that event "
                f"{spec.name!r} does not provide; it provides {sorted(spec.payload)}. Keep other "
                "values as attributes of the listener"
            )
    return tuple(names), takes_all


def _qualname(call: Callable[..., Any]) -> str:
    return getattr(call, "__qualname__", repr(call))
