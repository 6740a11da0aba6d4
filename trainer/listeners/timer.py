"""Host wall time spent in the listeners of each event."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import attrs

from trainer.events import EVENTS

__all__ = ["Timer"]


class _TimerBracket:
    """Receives every event at one end of the dispatch order and tells its :class:`Timer`."""

    __slots__ = ("opening", "timer")

    def __init__(self, timer: Timer, opening: bool) -> None:
        self.timer = timer
        self.opening = opening


def _bracket_hook(event: str) -> Callable[[_TimerBracket], None]:
    def hook(self: _TimerBracket) -> None:
        self.timer._mark(event, self.opening)

    hook.__name__ = hook.__qualname__ = f"on_{event}"
    return hook


_TIMED = tuple(event for event in EVENTS if event != "load_checkpoint")
"""The events a :class:`Timer` measures. Not ``load_checkpoint``: the trainer takes any receiver of
it for a stateful listener whose state a checkpoint must hold, so resuming would fail."""

for _event in _TIMED:  # one hook per event, so that a new event is timed without a change here
    setattr(_TimerBracket, f"on_{_event}", _bracket_hook(_event))
del _event


@attrs.define(eq=False)
class Timer:
    """Host wall time spent in the listeners of each event, to find the slow ones.

    :meth:`attach` subscribes two small receivers to every event of a trainer, one with the
    highest priority (it runs first) and one with the lowest (it runs last): the time between
    them is the time all other listeners of that event took, whatever their priorities.
    :meth:`summary` lists it per event with the keys of the listeners that receive the event, so
    a slow event points at its listeners; the fit's total wall time puts the listeners' share in
    proportion. Only the trainer's public subscription API is used.

    ``trainer.subscribe(timer)`` works too: a subscription has one priority and the timer needs
    two, so the subscribed timer attaches itself at the first ``train_start`` it receives. The
    receivers attached then miss that ``train_start``, so its listeners are not timed in that first
    fit (the fit's wall time is); call :meth:`attach` before the fit to time them as well.
    :meth:`detach` stops the timer either way, and unsubscribes a subscribed one.

    ``load_checkpoint`` is not timed: a receiver of it would make the trainer expect state for
    the timer in every checkpoint it resumes from.

    Times are host wall-clock: CUDA work is asynchronous, so a listener shows the time it waits
    for the device only when it synchronises (``.item()``, ``float(tensor)``). A checkpoint that
    a listener requests is written after its event, so its cost shows in the ``save_checkpoint``
    event (the state gathering) and in the fit total, not in the event that asked for it.

    Args:
        clock: The clock to read, in seconds (default ``time.perf_counter``).

    Example:
        >>> from trainer import Trainer
        >>> timer = Timer().attach(Trainer())
        >>> sorted(timer.summary())[:2]
        ['batch_end', 'batch_start']
        >>> Trainer().subscribe(Timer())  # attaches at the first train_start
        'timer_0'
    """

    FIRST = sys.maxsize
    """The priority of the opening receiver (listeners with the same priority run before it)."""
    LAST = -sys.maxsize
    """The priority of the closing receiver."""

    clock: Callable[[], float] = time.perf_counter
    _trainer: Any = attrs.field(init=False, default=None, repr=False)
    _brackets: tuple[_TimerBracket, ...] = attrs.field(init=False, default=(), repr=False)
    _started: dict[str, float] = attrs.field(init=False, factory=dict, repr=False)
    _calls: dict[str, int] = attrs.field(init=False, factory=dict, repr=False)
    _total: dict[str, float] = attrs.field(init=False, factory=dict, repr=False)
    _max: dict[str, float] = attrs.field(init=False, factory=dict, repr=False)
    _fit_started: float | None = attrs.field(init=False, default=None, repr=False)
    _fit_seconds: float = attrs.field(init=False, default=0.0, repr=False)

    def attach(self, trainer: Any) -> Timer:
        """Start timing the events of ``trainer``; returns the timer.

        Raises:
            RuntimeError: When the timer is attached already.
        """
        if self._trainer is not None:
            raise RuntimeError("this Timer is attached to a trainer already; detach() it first")
        opening, closing = _TimerBracket(self, True), _TimerBracket(self, False)
        trainer.subscribe(opening, priority=self.FIRST)
        try:
            trainer.subscribe(closing, priority=self.LAST)
        except BaseException:
            trainer.unsubscribe(opening)
            raise
        self._trainer, self._brackets = trainer, (opening, closing)
        return self

    def detach(self) -> None:
        """Stop timing, and unsubscribe the timer if it was subscribed; what was measured stays."""
        trainer = self._trainer
        if trainer is not None:
            for bracket in self._brackets:
                trainer.unsubscribe(bracket)
            if trainer.events.subscription_of(self) is not None:
                trainer.unsubscribe(self)
        self._trainer, self._brackets = None, ()
        self._started.clear()

    def on_train_start(self, trainer: Any) -> None:
        """Attach to ``trainer`` when subscribed to it (a no-op once attached to it)."""
        if self._trainer is trainer:
            return
        self.attach(trainer)
        self._fit_started = self.clock()  # the opening receiver attached now misses this event

    def reset(self) -> None:
        """Forget what was measured."""
        self._started.clear()
        self._calls.clear()
        self._total.clear()
        self._max.clear()
        self._fit_started, self._fit_seconds = None, 0.0

    @property
    def fit_seconds(self) -> float:
        """Wall time from ``train_start`` to ``train_end`` (or the failure), summed over fits."""
        return self._fit_seconds

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per event: ``calls``, ``total_s``, ``mean_s``, ``max_s`` and ``listeners`` (keys).

        Every event but ``load_checkpoint`` is listed, in the order of :data:`trainer.EVENTS`,
        with zeros for events that did not fire; ``listeners`` are those subscribed now, in
        dispatch order.
        """
        own: set[str] = set()
        signals = {}
        if self._trainer is not None:
            events = self._trainer.events
            mine = (*self._brackets, self)
            subscriptions = [events.subscription_of(receiver) for receiver in mine]
            own = {s.key for s in subscriptions if s is not None}
            signals = events.signals
        table = {}
        for event in _TIMED:
            calls, total = self._calls.get(event, 0), self._total.get(event, 0.0)
            receivers = signals[event].ordered_receivers if event in signals else []
            table[event] = {
                "calls": calls,
                "total_s": total,
                "mean_s": total / calls if calls else 0.0,
                "max_s": self._max.get(event, 0.0),
                "listeners": [key for key, _ in receivers if key not in own],
            }
        return table

    def report(self) -> str:
        """:meth:`summary` as a text table, slowest event first, with the listeners' share."""
        rows = sorted(self.summary().items(), key=lambda item: -item[1]["total_s"])
        lines = [
            f"{'event':<18}{'calls':>8}{'total ms':>12}{'mean ms':>11}{'max ms':>11}  listeners"
        ]
        for event, row in rows:
            lines.append(
                f"{event:<18}{row['calls']:>8}{row['total_s'] * 1e3:>12.2f}"
                f"{row['mean_s'] * 1e3:>11.3f}{row['max_s'] * 1e3:>11.3f}  "
                + (", ".join(row["listeners"]) or "-")
            )
        spent = sum(row["total_s"] for _, row in rows)
        share = f" ({100 * spent / self._fit_seconds:.1f}%)" if self._fit_seconds > 0 else ""
        lines.append(f"listeners: {spent:.3f} s of {self._fit_seconds:.3f} s in fit{share}")
        return "\n".join(lines)

    def _mark(self, event: str, opening: bool) -> None:
        now = self.clock()
        if opening:
            if event == "exception":
                self._started.clear()  # the event that failed never reached its closing receiver
            if event == "train_start":
                self._fit_started = now
            self._started[event] = now
            return
        started = self._started.pop(event, None)
        if started is not None:
            elapsed = now - started
            self._calls[event] = self._calls.get(event, 0) + 1
            self._total[event] = self._total.get(event, 0.0) + elapsed
            self._max[event] = max(self._max.get(event, 0.0), elapsed)
        if event in ("train_end", "exception") and self._fit_started is not None:
            self._fit_seconds += now - self._fit_started
            self._fit_started = None
