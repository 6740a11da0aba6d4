"""The listener half of :class:`~trainer.Trainer`'s public API, over its ``events``.

:class:`ListenerAPI` is a base of the trainer: subscribing listeners, connecting plain functions
to one event, and listing what is subscribed. The subscriptions themselves, their order and the
dispatch live in :mod:`trainer.events`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from trainer.events import EVENTS, Events
from trainer.exceptions import SubscriptionError

__all__ = ["ListenerAPI"]


class ListenerAPI:
    """Subscribe listeners to ``self.events``; :class:`~trainer.Trainer` inherits these methods.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer(device="cpu")
        >>> class Counter:
        ...     steps = 0
        ...     def on_batch_end(self):
        ...         Counter.steps += 1
        >>> trainer.subscribe(Counter())
        'counter_0'
    """

    __slots__ = ()
    events: Events

    def subscribe(
        self,
        listener: Any,
        priority: int = 0,
        *,
        name: str | None = None,
        runs_on: str | None = None,
    ) -> str:
        """Connect every ``on_<event>`` method of ``listener`` to this trainer's events.

        Hooks are checked now: a method name that matches no event, or a parameter that the
        event's payload does not provide, raises. ``on_train_batch_end`` is an alias of
        ``on_batch_end``. The trainer keeps a strong reference until :meth:`unsubscribe`.

        Args:
            listener: Any object with ``on_<event>`` methods, typically an attrs class.
            priority: Higher runs earlier; equal priorities run in subscription order.
            name: Key of the listener's checkpoint namespace; derived from its class name and a
                counter (``my_logger_0``, ``my_logger_1``) when omitted.
            runs_on: Where it runs in a distributed fit: ``"all"`` ranks, ``"rank_zero"`` only,
                or ``"collective"`` (every rank at the same point; checked at ``train_start``).
                Default: the listener's ``runs_on`` attribute, else ``"all"``.

        Returns:
            The listener's key.

        Raises:
            SubscriptionError: When a hook does not fit, or the listener or name is taken.
        """
        return self.events.subscribe(listener, priority=priority, name=name, runs_on=runs_on)

    def unsubscribe(self, listener: Any) -> None:
        """Disconnect a listener (or a connected function) from every event."""
        self.events.unsubscribe(listener)

    @contextlib.contextmanager
    def subscribed(
        self, listener: Any, priority: int = 0, *, name: str | None = None
    ) -> Iterator[Any]:
        """Subscribe ``listener`` for the duration of a ``with`` block."""
        self.subscribe(listener, priority, name=name)
        try:
            yield listener
        finally:
            if self.events.subscription_of(listener) is not None:
                self.unsubscribe(listener)

    def connect(
        self,
        event: str,
        function: Callable[..., Any],
        priority: int = 0,
        *,
        name: str | None = None,
    ) -> Callable[..., Any]:
        """Connect a plain function to one event (same as ``trainer.events.<event>.connect``)."""
        if event not in EVENTS:
            raise SubscriptionError(f"unknown event {event!r}; events are {sorted(EVENTS)}")
        return self.events.signals[event].connect(function, priority=priority, name=name)

    @property
    def listeners(self) -> list[tuple[str, Any]]:
        """``(key, listener)`` for every subscription, in dispatch order."""
        return [(s.key, s.target) for s in self.events.subscriptions()]
