"""A failed update leaves no trace (issue 26.4): after an update that fails at its first step, in
the middle or at its end, a retry with good data on the same ``ModelUpdater`` (or learner)
writes exactly what a fresh update with that data writes, bit for bit on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.methods import method
from renate_events.updater import ModelUpdater
from tests.helpers import assert_same_state_folder, assert_same_tree
from trainer import Trainer, read_checkpoint

pytestmark = pytest.mark.all_or_nothing

# Where an update fails: a NaN in every sample (the loss of step 0), a listener raising at the
# start of step 0, at the end of step 3 (after its optimizer step and buffer update) or at
# train_end (after the last step, once an end-of-update fill or herding ran).
FAILURES = ["nan", ("batch_start", 0), ("batch_end", 3), "train_end"]


class _Fail:
    """Raises where ``at`` says (None: never); it holds no state of its own."""

    def __init__(self) -> None:
        self.at: object = None

    def on_batch_start(self, state) -> None:
        if self.at == ("batch_start", state.global_step):
            raise RuntimeError("failed on purpose")

    def on_batch_end(self, state) -> None:
        if self.at == ("batch_end", state.global_step):
            raise RuntimeError("failed on purpose")

    def on_train_end(self) -> None:
        if self.at == "train_end":
            raise RuntimeError("failed on purpose")


def _data(seed: int, nan: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 4, generator=g)
    if nan:
        x[:] = float("nan")
    return TensorDataset(x, torch.randint(0, 3, (48,), generator=g))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _updater(learner, storage, fail, **folders) -> ModelUpdater:
    return ModelUpdater(
        _model(),
        learner=learner,
        learner_kwargs={
            "memory_size": 20,
            "memory_batch_size": 4,
            "batch_size": 8,
            "seed": 3,
            **({"feature_modules": ["1"]} if learner == "icarl" else {}),  # the hidden layer
        },
        max_epochs=2,
        trainer_kwargs={"device": "cpu"},
        buffer_storage=storage,
        listeners=[fail],
        **folders,
    )


def _fail_once(updater: ModelUpdater, fail: _Fail, where) -> None:
    fail.at = None if where == "nan" else where
    with pytest.raises(Exception, match=r"nan|failed on purpose"):
        updater.update(_data(1, nan=where == "nan"), task_id="bad")
    fail.at = None


@pytest.mark.parametrize("where", FAILURES)
@pytest.mark.parametrize(
    ("learner", "storage", "from_input"),
    [
        ("er", "memory", True),
        ("er", "memory", False),
        ("der", "memory", True),
        ("cls-er", "memory", True),
        ("cls-er", "memory", False),
        ("icarl", "memory", True),
        ("er", "mapped", True),
        ("der", "mapped", False),
    ],
)
def test_a_retry_after_a_failed_update_equals_a_fresh_update(
    tmp_path, learner, storage, from_input, where
):
    first = tmp_path / "first"
    start = {}
    if from_input:
        _updater(learner, storage, _Fail(), output_state_folder=first).update(_data(0), task_id="a")
        start = {"input_state_folder": first}
    fail = _Fail()
    retried = _updater(learner, storage, fail, output_state_folder=tmp_path / "retry", **start)
    _fail_once(retried, fail, where)
    assert not (tmp_path / "retry").exists()
    retried.update(_data(2), task_id="good")
    fresh = _updater(learner, storage, _Fail(), output_state_folder=tmp_path / "fresh", **start)
    fresh.update(_data(2), task_id="good")
    assert_same_state_folder(tmp_path / "retry", tmp_path / "fresh")


def test_a_failure_while_writing_leaves_the_update_undone(tmp_path, monkeypatch):
    fail = _Fail()
    retried = _updater("der", "memory", fail, output_state_folder=tmp_path / "retry")
    retried.update(_data(0), task_id="a")
    before = {k: v.clone() for k, v in retried.model.state_dict().items()}
    history = retried.history
    monkeypatch.setattr(ModelUpdater, "_manifest_now", _broken(ModelUpdater._manifest_now))
    with pytest.raises(RuntimeError, match="disk on fire"):
        retried.update(_data(1), task_id="b")
    monkeypatch.undo()
    assert retried.history == history
    assert all(torch.equal(before[k], v) for k, v in retried.model.state_dict().items())
    retried.update(_data(2), task_id="c")
    fresh = _updater("der", "memory", _Fail(), output_state_folder=tmp_path / "fresh")
    fresh.update(_data(0), task_id="a")
    fresh.update(_data(2), task_id="c")
    assert_same_state_folder(tmp_path / "retry", tmp_path / "fresh")


def _broken(manifest_now):
    """``_manifest_now`` failing on its second call in an update: once trained, while writing."""
    calls = []

    def broken(self):
        calls.append(1)
        if len(calls) == 3:  # _expected_output and the record call it first
            raise RuntimeError("disk on fire")
        return manifest_now(self)

    return broken


def _learner(name: str, fail: _Fail):
    trainer = Trainer(max_epochs=2, device="cpu")
    trainer.subscribe(fail, name="fail")
    kwargs = {"memory_size": 20, "memory_batch_size": 4} if method(name).uses_memory else {}
    return method(name).learner(model=_model(), batch_size=8, seed=3, trainer=trainer, **kwargs)


def _tree(learner, path) -> dict:
    learner.save_checkpoint(path)
    return read_checkpoint(path)


@pytest.mark.parametrize("where", FAILURES)
@pytest.mark.parametrize("name", ["er", "der", "cls-er", "ewc", "lwf"])
def test_a_learner_fit_that_failed_leaves_no_trace(tmp_path, name, where):
    fail = _Fail()
    retried = _learner(name, fail)
    retried.fit(_data(0))
    before = _tree(retried, tmp_path / "before.safetensors")
    fail.at = None if where == "nan" else where
    with pytest.raises(Exception, match=r"nan|failed on purpose"):
        retried.fit(_data(1, nan=where == "nan"))
    fail.at = None
    assert_same_tree(before, _tree(retried, tmp_path / "after.safetensors"))
    retried.fit(_data(2))
    fresh = _learner(name, _Fail())
    fresh.fit(_data(0))
    fresh.fit(_data(2))
    assert_same_tree(
        _tree(fresh, tmp_path / "a.safetensors"), _tree(retried, tmp_path / "b.safetensors")
    )


def test_an_output_folder_that_cannot_be_written_is_refused_before_training(tmp_path, monkeypatch):
    from renate_events.state_folder import StateFolderError

    fits = []
    monkeypatch.setattr(Trainer, "fit", lambda *args, **kwargs: fits.append(1))
    (tmp_path / "afile").write_text("mine")
    updater = _updater("er", "memory", _Fail(), output_state_folder=tmp_path / "afile" / "s")
    before = {k: v.clone() for k, v in updater.model.state_dict().items()}
    with pytest.raises(StateFolderError, match=r"afile is not a folder; nothing was written"):
        updater.update(_data(0), task_id="a")
    assert fits == [] and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    assert all(torch.equal(before[k], v) for k, v in updater.model.state_dict().items())
