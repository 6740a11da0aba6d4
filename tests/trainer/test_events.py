"""Subscription, dispatch order and payload filtering of trainer.events."""

from __future__ import annotations

import gc
import weakref

import attrs
import blinker
import pytest
import torch

from tests.helpers import Recorder, classification_step, make_data, make_loader, make_model
from trainer import EVENTS, ListenerError, SubscriptionError, Trainer


def _fit(trainer: Trainer, epochs: int = 1) -> None:
    model = make_model()
    loader = make_loader(make_data(n=16), batch_size=8)
    trainer.max_epochs = epochs
    trainer.fit(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader, classification_step(model)
    )


def test_every_event_is_a_blinker_signal_scoped_to_its_trainer():
    a, b = Trainer(device="cpu"), Trainer(device="cpu")
    for name in EVENTS:
        assert isinstance(getattr(a.events, name), blinker.Signal)
        assert getattr(a.events, name) is not getattr(b.events, name)
    log: list = []
    a.subscribe(Recorder(log, "a"))
    b.subscribe(Recorder(log, "b"))
    _fit(a)
    assert {tag for _, tag in log} == {"a"}
    log.clear()
    _fit(b)
    assert {tag for _, tag in log} == {"b"}


def test_unreferenced_listener_survives_garbage_collection():
    trainer = Trainer(device="cpu")
    log: list = []
    listener = Recorder(log)
    ref = weakref.ref(listener)
    trainer.subscribe(listener)
    del listener
    gc.collect()
    assert ref() is not None
    _fit(trainer)
    assert ("batch_end", None) in log


def test_unreferenced_function_survives_garbage_collection():
    trainer = Trainer(device="cpu")
    seen = []
    trainer.connect("epoch_end", lambda state: seen.append(state.epoch))
    gc.collect()
    _fit(trainer, epochs=2)
    assert seen == [0, 1]


def test_dispatch_order_is_priority_then_subscription():
    trainer = Trainer(device="cpu")
    log: list = []
    trainer.subscribe(Recorder(log, "first"))
    trainer.subscribe(Recorder(log, "high"), priority=5)
    trainer.subscribe(Recorder(log, "second"))
    trainer.subscribe(Recorder(log, "low"), priority=-1)
    _fit(trainer)
    per_event = [tag for event, tag in log if event == "train_start"]
    assert per_event == ["high", "first", "second", "low"]
    assert [tag for event, tag in log if event == "batch_end"][:4] == per_event


def test_listener_receives_only_declared_keywords():
    received = {}

    class Partial:
        def on_train_start(self, model):
            received["train_start"] = model

        def on_batch_end(self, state, outputs):
            received["batch_end"] = (state.global_step, sorted(outputs))

        def on_epoch_end(self, **payload):
            received["epoch_end"] = sorted(payload)

        def on_train_end(self):
            received["train_end"] = True

    trainer = Trainer(device="cpu")
    trainer.subscribe(Partial())
    _fit(trainer)
    assert isinstance(received["train_start"], torch.nn.Module)
    assert received["batch_end"] == (2, ["logits", "loss"])
    assert received["epoch_end"] == sorted(EVENTS["epoch_end"].payload)
    assert received["train_end"] is True


def test_renate_hook_names_work_unchanged():
    calls = []

    @attrs.define(eq=False)
    class RenateStyle:
        def on_train_start(self, model):
            calls.append("start")

        def on_train_batch_end(self, model):
            calls.append("batch")

        def on_save_checkpoint(self, checkpoint):
            checkpoint["x"] = 1

        def on_load_checkpoint(self, checkpoint):
            calls.append(("load", checkpoint["x"]))

    trainer = Trainer(device="cpu")
    trainer.subscribe(RenateStyle())
    _fit(trainer)
    assert calls == ["start", "batch", "batch"]


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("on_train_batch_ended", "did you mean 'on_train_batch_end'"),
        ("on_epoch_finish", "matches no event"),
    ],
)
def test_misspelt_hook_is_rejected_at_subscribe(method, message):
    listener_class = type("Typo", (), {method: lambda self: None})
    trainer = Trainer(device="cpu")
    with pytest.raises(SubscriptionError, match=message):
        trainer.subscribe(listener_class())
    assert trainer.listeners == []


def test_unknown_parameter_is_rejected_at_subscribe_and_nothing_is_connected():
    class Unknown:
        def on_train_start(self, model):
            pass

        def on_batch_end(self, state, logits):
            pass

    trainer = Trainer(device="cpu")
    with pytest.raises(SubscriptionError, match="'logits' that event 'batch_end' does not provide"):
        trainer.subscribe(Unknown())
    assert not trainer.events.train_start.active
    assert trainer.listeners == []


def test_parameter_the_event_does_not_provide_is_rejected_even_with_a_default():
    class Misspelt:
        def on_batch_end(self, los=None):
            pass

    with pytest.raises(SubscriptionError, match="'los' \\(did you mean 'loss'\\?\\)"):
        Trainer(device="cpu").subscribe(Misspelt())


def test_subclass_override_of_an_aliased_hook_wins_over_the_inherited_name():
    calls = []

    class Base:
        def on_train_batch_end(self, model):
            calls.append("base")

    class Child(Base):
        def on_batch_end(self, state):
            calls.append("child")

    trainer = Trainer(device="cpu")
    trainer.subscribe(Child())
    _fit(trainer)
    assert calls == ["child", "child"]


def test_listener_without_hooks_or_with_alias_clash_is_rejected():
    trainer = Trainer(device="cpu")
    with pytest.raises(SubscriptionError, match="no hook methods"):
        trainer.subscribe(object())

    class Both:
        def on_batch_end(self):
            pass

        def on_train_batch_end(self):
            pass

    with pytest.raises(SubscriptionError, match="both"):
        trainer.subscribe(Both())


def test_keys_are_distinct_deterministic_and_names_unique():
    trainer = Trainer(device="cpu")
    log: list = []
    first, second = Recorder(log), Recorder(log)
    assert trainer.subscribe(first) == "recorder_0"
    assert trainer.subscribe(second) == "recorder_1"
    assert trainer.subscribe(Recorder(log), name="custom") == "custom"
    with pytest.raises(SubscriptionError, match="already taken"):
        trainer.subscribe(Recorder(log), name="custom")
    with pytest.raises(SubscriptionError, match="already subscribed"):
        trainer.subscribe(first)
    with pytest.raises(SubscriptionError, match="not valid"):
        trainer.subscribe(Recorder(log), name="has.dot")
    trainer.unsubscribe(first)
    assert trainer.subscribe(Recorder(log)) == "recorder_0"


def test_unsubscribed_listener_receives_nothing_more_even_mid_event():
    trainer = Trainer(device="cpu")
    log: list = []
    victim = Recorder(log, "victim")

    class Remover:
        done = False

        def on_batch_end(self, trainer):
            if not self.done:
                trainer.unsubscribe(victim)
                self.done = True

    trainer.subscribe(Remover())
    trainer.subscribe(victim)
    _fit(trainer)
    assert [e for e, tag in log if tag == "victim"] == ["train_start", "epoch_start", "batch_start"]


def test_subscribed_context_manager():
    trainer = Trainer(device="cpu")
    log: list = []
    with trainer.subscribed(Recorder(log, "ctx")) as listener:
        assert trainer.listeners == [("recorder_0", listener)]
    assert trainer.listeners == []
    _fit(trainer)
    assert log == []


def test_plain_function_connect_blinker_api_and_errors():
    trainer = Trainer(device="cpu")
    seen = []

    def on_epoch(state):
        seen.append(("epoch", state.epoch))

    def at_end(result):
        seen.append(("end", result.steps))

    trainer.events.epoch_end.connect(on_epoch)
    trainer.connect("train_end", at_end)
    trainer.connect("epoch_start", on_epoch)  # the same function on a second event
    with trainer.events.batch_end.connected_to(lambda loss: seen.append("batch")):
        _fit(trainer)
    assert seen.count("batch") == 2
    assert ("end", 2) in seen
    assert seen.count(("epoch", 0)) == 2
    with pytest.raises(SubscriptionError, match="strong references"):
        trainer.events.batch_end.connect(print, weak=True)
    with pytest.raises(SubscriptionError, match="belongs to one trainer"):
        trainer.events.batch_end.connect(on_epoch, sender=object())
    with pytest.raises(SubscriptionError, match="unknown event"):
        trainer.connect("batch_ended", on_epoch)
    with pytest.raises(SubscriptionError, match="does not provide"):
        trainer.connect("train_start", lambda outputs: None)
    trainer.events.epoch_end.disconnect(on_epoch)
    assert trainer.events.epoch_start.active


def test_listener_error_names_listener_and_event_and_fires_exception_event():
    failures = []

    class Boom:
        def on_batch_end(self, state):
            if state.global_step == 2:
                raise RuntimeError("kaput")

    class Watch:
        def on_exception(self, exception, event, listener):
            failures.append((type(exception).__name__, event, listener))

    trainer = Trainer(device="cpu")
    trainer.subscribe(Watch())
    trainer.subscribe(Boom(), name="boom")
    with pytest.raises(
        ListenerError, match="listener 'boom' raised RuntimeError in event 'batch_end': kaput"
    ) as info:
        _fit(trainer)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert failures == [("ListenerError", "batch_end", "boom")]


def test_error_in_step_fires_exception_event_and_propagates_unchanged():
    failures = []
    trainer = Trainer(device="cpu")
    trainer.connect("exception", lambda exception, event: failures.append((exception, event)))
    model = make_model()

    def step(batch):
        raise KeyError("bad batch")

    with pytest.raises(KeyError, match="bad batch"):
        trainer.fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader(make_data(n=8)), step
        )
    assert isinstance(failures[0][0], KeyError)
    assert failures[0][1] is None


def test_failing_exception_listener_keeps_the_original_error():
    trainer = Trainer(device="cpu")

    def broken(exception):
        raise ValueError("listener of exception broke too")

    trainer.connect("exception", broken)
    model = make_model()

    def step(batch):
        raise KeyError("original")

    with pytest.raises(KeyError, match="original") as info:
        trainer.fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader(make_data(n=8)), step
        )
    assert any("listener of exception broke too" in n for n in getattr(info.value, "__notes__", []))


def test_event_without_receivers_builds_no_payload(monkeypatch):
    trainer = Trainer(device="cpu")
    sent = []
    for signal in trainer.events:
        original = signal.send
        monkeypatch.setattr(
            signal,
            "send",
            lambda *a, _o=original, _n=signal.name, **k: (sent.append(_n), _o(*a, **k))[1],
        )
    trainer.connect("epoch_end", lambda: None)
    _fit(trainer)
    assert sent == ["epoch_end"]
