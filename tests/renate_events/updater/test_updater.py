"""ModelUpdater: state folders, separate processes, configuration checks."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.state_folder import StateFolderError, StateFolderOverwriteError, read_manifest
from renate_events.updater import ModelUpdater
from tests.helpers import run_in_fresh_process, small_mlp, two_class_task
from trainer import read_checkpoint


def _updates(learner, first, last, input_folder, output_folder):
    """Updates ``first..last-1`` in this process, from ``input_folder`` (None: the first)."""
    torch.set_num_threads(1)
    torch.manual_seed(123)  # the model's initial weights (replaced by the input folder's)
    model = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    updater = ModelUpdater(
        model,
        learner=learner,
        learner_kwargs={"memory_size": 24, "memory_batch_size": 8, "batch_size": 8, "seed": 5},
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        max_epochs=2,
        trainer_kwargs={"device": "cpu"},
        input_state_folder=input_folder,
        output_state_folder=output_folder,
    )
    for task in range(first, last):
        g = torch.Generator().manual_seed(task)
        x = torch.randn(40, 5, generator=g)
        y = torch.randint(2 * task, 2 * task + 2, (40,), generator=g)
        updater.update(TensorDataset(x, y), task_id=f"task-{task}")


def _run(learner, first, last, input_folder, output_folder):
    """The updates in a process of their own, which shares nothing with the others."""
    code = run_in_fresh_process(_updates, learner, first, last, input_folder, output_folder)
    assert code == 0


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}.{key}")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _flat(value, f"{prefix}.{i}")
    else:
        yield prefix, tree


@pytest.mark.slow
@pytest.mark.parametrize("learner", ["der", "cls-er"])
def test_k_updates_in_k_processes_equal_one_process(tmp_path, learner):
    _run(learner, 0, 3, None, tmp_path / "single")
    _run(learner, 0, 1, None, tmp_path / "s1")
    _run(learner, 1, 2, tmp_path / "s1", tmp_path / "s2")
    _run(learner, 2, 3, tmp_path / "s2", tmp_path / "s3")
    single = read_checkpoint(tmp_path / "single" / "learner.safetensors")
    chained = read_checkpoint(tmp_path / "s3" / "learner.safetensors")
    for section in ("model", "listeners"):
        a, b = dict(_flat(single[section])), dict(_flat(chained[section]))
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key
    assert len(single["listeners"]["learner"]["buffer"]["targets"]) == 24
    manifest = read_manifest(tmp_path / "s3")
    assert manifest["updates"] == 3
    assert manifest["task_ids"] == ["task-0", "task-1", "task-2"]


def _updater(model, **kwargs):
    return ModelUpdater(
        model,
        learner=kwargs.pop("learner", "er"),
        learner_kwargs=kwargs.pop(
            "learner_kwargs", {"memory_size": 10, "memory_batch_size": 4, "batch_size": 8}
        ),
        max_epochs=kwargs.pop("max_epochs", 1),
        trainer_kwargs={"device": "cpu"},
        **kwargs,
    )


def _task():
    return TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))


def test_folder_from_another_learner_or_model_is_refused_naming_the_difference(tmp_path):
    _updater(torch.nn.Linear(4, 2), output_state_folder=tmp_path / "s").update(_task())
    other = _updater(torch.nn.Linear(4, 3), learner="der", input_state_folder=tmp_path / "s")
    with pytest.raises(StateFolderError) as info:
        other.update(_task())
    message = str(info.value)
    assert "learner: the folder has 'er', this updater 'der'" in message
    assert "'weight' is float32 (2, 4) in the folder, float32 (3, 4) in the model" in message


@pytest.mark.hostile
def test_damaged_or_missing_folders_are_clear_errors(tmp_path):
    with pytest.raises(StateFolderError, match="not a state folder"):
        _updater(torch.nn.Linear(4, 2), input_state_folder=tmp_path).update(_task())
    _updater(torch.nn.Linear(4, 2), output_state_folder=tmp_path / "s").update(_task())
    checkpoint = tmp_path / "s" / "learner.safetensors"
    data = bytearray(checkpoint.read_bytes())
    data[-1] ^= 0xFF
    checkpoint.write_bytes(bytes(data))
    with pytest.raises(StateFolderError, match="does not match the checksum"):
        read_manifest(tmp_path / "s")


def test_rewriting_a_folder_replaces_it_whole(tmp_path):
    updater = _updater(torch.nn.Linear(4, 2), output_state_folder=tmp_path / "s")
    updater.update(_task(), task_id=1)
    updater.update(_task(), task_id=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".s.lock", "s"]  # the lock file stays
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["task_ids"] == [1, 2] and manifest["updates"] == 2


def test_every_file_of_a_state_folder_has_the_usual_mode(tmp_path):
    # model.safetensors is the file a model server reads, maybe as another user: not 0600.
    umask = os.umask(0o022)
    try:
        _updater(torch.nn.Linear(4, 2), output_state_folder=tmp_path / "s").update(_task())
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "s").iterdir()}
    assert modes["model.safetensors"] == 0o644
    assert set(modes.values()) == {0o644}, modes


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_state_folder_of_another_lineage_is_replaced_only_with_overwrite(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _updater(torch.nn.Linear(4, 2), output_state_folder=a).update(_task(), task_id=0)
    _updater(torch.nn.Linear(4, 2), output_state_folder=b).update(_task(), task_id="b0")
    before = _files(b)
    for input_folder in (None, a):  # a first update, or a's next one, over b (another model)
        other = _updater(
            torch.nn.Linear(4, 2), input_state_folder=input_folder, output_state_folder=b
        )
        with pytest.raises(StateFolderOverwriteError, match=r"b holds a state folder of another "
                           r"lineage \(updates \['b0'\]\).*pass overwrite=True"):  # fmt: skip
            other.update(_task(), task_id=1)
        assert _files(b) == before and [r["task_id"] for r in other.history] == (
            [] if input_folder is None else [0]
        )
    _updater(
        torch.nn.Linear(4, 2), input_state_folder=a, output_state_folder=b, overwrite=True
    ).update(_task(), task_id=1)
    assert read_manifest(b)["task_ids"] == [0, 1]


def test_a_state_folder_of_the_same_lineage_is_replaced(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _updater(torch.nn.Linear(4, 2), output_state_folder=a).update(_task(), task_id=0)
    for _ in range(2):  # the second time, b (a continuation of a) is replaced: a rerun
        _updater(torch.nn.Linear(4, 2), input_state_folder=a, output_state_folder=b).update(
            _task(), task_id=1
        )
    # b's continuation over a (whose history is b's first part)
    _updater(torch.nn.Linear(4, 2), input_state_folder=b, output_state_folder=a).update(
        _task(), task_id=2
    )
    assert read_manifest(a)["task_ids"] == [0, 1, 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"learner": "gem"}, r"ModelUpdater.learner must be one of \[.*\], got 'gem'"),
        ({"optimizer": {"name": "lbfgs"}}, "'name' in"),
        ({"optimizer": {"name": "adam", "lr": "x"}}, "torch.optim refuses {'lr': 'x'}"),
        ({"optimizer": {"name": "sgd", "lr": -1.0}}, "Invalid learning rate"),
        ({"learner_kwargs": {"loss_fn": print}}, "must be JSON-able"),
        ({"learner_kwargs": {"alpha": float("nan")}}, "must be JSON-able"),
        ({"learner_kwargs": {1: 2}}, "must be a dict with string keys"),
        ({"learner_kwargs": {"memroy_size": 5}}, r"unknown arguments \['memroy_size'\]"),
        ({"learner_kwargs": {"buffer": "x"}}, r"unknown arguments \['buffer'\]"),
        ({"trainer_kwargs": {"epochs": 2}}, r"trainer_kwargs has unknown arguments \['epochs'\]"),
        (
            {"trainer_kwargs": {"capture": "graph", "device": "cpu"}},
            r"trainer_kwargs\['capture'\]='graph' records CUDA graphs and needs a CUDA device",
        ),
        ({"metadata": []}, "must be a dict"),
        ({"in_place": "yes"}, "ModelUpdater.in_place must be a bool"),
        ({"lock_timeout": -1}, "ModelUpdater.lock_timeout must be"),
        ({"output_state_folder": 3}, "must be a path or None"),
    ],
)
def test_invalid_configuration(kwargs, message):
    with pytest.raises(ValueError, match=message):  # WrongTypeError is a ValueError too
        ModelUpdater(torch.nn.Linear(2, 2), **kwargs)


def test_a_bad_task_id_or_memory_size_is_refused_before_training(tmp_path):
    updater = _updater(torch.nn.Linear(4, 2), output_state_folder=tmp_path / "s")
    with pytest.raises(TypeError, match="task_id must be a str, an int or None"):
        updater.update(_task(), task_id=1.5)
    assert not (tmp_path / "s").exists()
    bad = _updater(torch.nn.Linear(4, 2), learner_kwargs={"memory_size": "10"})
    with pytest.raises(ValueError, match=r"learner_kwargs\['memory_size'\] must be an int"):
        bad.learner_instance  # noqa: B018


def test_an_interrupted_folder_swap_is_repaired_on_read(tmp_path):
    updater = _updater(torch.nn.Linear(4, 2), output_state_folder=tmp_path / "s")
    updater.update(_task(), task_id="kept")
    # the crash: the old folder moved aside (as StagedStateFolder.commit names it), the new not in
    (tmp_path / "s").rename(tmp_path / ".s.old.0123456789abcdef")
    assert read_manifest(tmp_path / "s")["task_ids"] == ["kept"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".s.lock", "s"]


def test_the_updaters_loss_probe_sees_the_train_target_transforms_labels():
    shift = lambda t: t - 10  # noqa: E731
    updater = ModelUpdater(
        torch.nn.Linear(4, 4),
        learner="er",
        learner_kwargs={"memory_size": 8, "memory_batch_size": 4, "batch_size": 4},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        transforms={"train_target_transform": shift, "buffer_target_transform": shift},
    )
    assert updater.update(TensorDataset(torch.randn(8, 4), torch.arange(8) % 4 + 10)).steps == 2


@pytest.mark.parametrize("learner", ["gdumb", "icarl"])
def test_model_updater_builds_the_buffer_the_learner_needs_when_none_is_named(learner: str) -> None:
    # ModelUpdater's default buffer was always the reservoir, which GDumb and iCaRL refuse: a
    # user had to know to name their buffer (the command line already picked it).
    kwargs = {"memory_size": 8, "memory_batch_size": 4}
    if learner == "icarl":
        kwargs["feature_modules"] = ["1"]
    updater = ModelUpdater(
        model=small_mlp(),
        learner=learner,
        learner_kwargs=kwargs,
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
    )
    assert updater.update(two_class_task(0)).steps > 0


@pytest.mark.parametrize("learner", ["er", "offline-er", "der"])
def test_the_herding_buffer_is_refused_for_learners_that_do_not_herd(learner: str) -> None:
    # A HerdingBuffer's update only fills free slots: with any learner but iCaRL the memory
    # froze after its first memory_size samples, silently.
    with pytest.raises(ValueError, match="herding"):
        ModelUpdater(model=small_mlp(), learner=learner, buffer="herding")
