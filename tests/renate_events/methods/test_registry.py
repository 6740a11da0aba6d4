"""The method registry: one spec per method module, found by the package, refused when incomplete
or registered twice (naming the method), every learner exported."""

from __future__ import annotations

import sys

import attrs
import pytest

import renate_events
from renate_events import methods
from renate_events.learners import BaseExperienceReplayLearner
from renate_events.methods import (
    LEARNERS,
    METHODS,
    ExperienceReplayLearner,
    MethodSpec,
    MethodSpecError,
    method,
    register,
)


@attrs.define(eq=False)
class _OwnLearner(BaseExperienceReplayLearner):
    """A learner no method registers."""


def test_a_name_registered_twice_is_an_error_naming_the_method():
    before = dict(METHODS)
    with pytest.raises(MethodSpecError, match="method 'er' is registered twice"):
        register(MethodSpec("er", _OwnLearner, "a second 'er'"))
    with pytest.raises(MethodSpecError, match="method 'er' is registered twice"):
        register(method("er"))
    assert before == METHODS


def test_a_learner_registered_under_a_second_name_is_an_error_naming_both():
    with pytest.raises(MethodSpecError, match=r"method 'er-again'.*method 'er''s already"):
        register(MethodSpec("er-again", ExperienceReplayLearner, "ER once more"))
    assert "er-again" not in METHODS


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "method 'my-method': learner must be an attrs learner class, got None"),
        ({"learner": _OwnLearner}, "method 'my-method': summary must say what it is"),
        ({"learner": _OwnLearner, "summary": " "}, "method 'my-method': summary must say"),
        ({"learner": object, "summary": "x"}, "method 'my-method': learner must be an attrs"),
        (
            {"learner": _OwnLearner, "summary": "x", "default_buffer": "herding"},
            "method 'my-method': default_buffer 'herding' is not one of its buffers",
        ),
        (
            {"learner": _OwnLearner, "summary": "x", "features": "all"},
            "method 'my-method': features must be one of",
        ),
    ],
)
def test_an_incomplete_or_inconsistent_spec_is_an_error_naming_the_method(arguments, message):
    with pytest.raises(MethodSpecError, match=message):
        MethodSpec("my-method", **arguments)


def _discover_in(monkeypatch, folder, module):
    """Run the package's discovery of method modules over ``folder`` as well; ``module`` (the
    name of the one module there) is forgotten afterwards."""
    monkeypatch.setattr(methods, "__path__", [*methods.__path__, str(folder)])
    monkeypatch.delitem(sys.modules, f"renate_events.methods.{module}", raising=False)
    monkeypatch.delattr(methods, module, raising=False)
    try:
        methods._import_method_modules()
    finally:
        sys.modules.pop(f"renate_events.methods.{module}", None)
        if hasattr(methods, module):
            delattr(methods, module)


def test_a_method_module_that_registers_no_spec_is_an_error_naming_it(tmp_path, monkeypatch):
    (tmp_path / "extra_unregistered.py").write_text('"""A module that forgot its spec."""\n')
    with pytest.raises(MethodSpecError, match=r"renate_events\.methods\.extra_unregistered"):
        _discover_in(monkeypatch, tmp_path, "extra_unregistered")


def test_a_new_method_is_one_module(tmp_path, monkeypatch):
    (tmp_path / "extra_mine.py").write_text(
        "import attrs\n"
        "from renate_events.learners import BaseExperienceReplayLearner\n"
        "from renate_events.methods.registry import MethodSpec, register\n"
        "@attrs.define(eq=False)\n"
        "class MineLearner(BaseExperienceReplayLearner):\n"
        "    pass\n"
        "SPEC = register(MethodSpec('mine', MineLearner, 'mine: a test method (nobody, 2026)'))\n"
    )
    try:
        _discover_in(monkeypatch, tmp_path, "extra_mine")
        assert method("mine").learner.__name__ == "MineLearner"
        assert list(METHODS) == sorted(METHODS)
    finally:
        METHODS.pop("mine", None)


def test_methods_are_sorted_by_name_and_every_learner_is_exported():
    assert list(METHODS) == sorted(METHODS)
    assert list(LEARNERS) == list(METHODS)
    for learner in LEARNERS.values():
        assert getattr(methods, learner.__name__) is learner
        assert getattr(renate_events, learner.__name__) is learner
        assert learner.__name__ in methods.__all__ and learner.__name__ in renate_events.__all__
    assert renate_events.__all__ == sorted(renate_events.__all__)
    assert methods.__all__ == sorted(methods.__all__)


def test_every_method_module_names_its_spec_and_cites_a_paper_or_its_source():
    for name, spec in METHODS.items():
        module = sys.modules[spec.learner.__module__]
        assert module.SPEC is spec, name
        assert module.__name__ == f"renate_events.methods.{name.replace('-', '_')}", name
        assert len(spec.summary) > 40, name
