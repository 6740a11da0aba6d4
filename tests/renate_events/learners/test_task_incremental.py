"""Issue 17, item 5: task ids carried by the data, stored in the buffer, routed to the heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from renate_events.evaluation import evaluate
from renate_events.methods import (
    CLSExperienceReplayLearner,
    DarkExperienceReplayLearner,
    ElasticWeightConsolidationLearner,
    ExperienceReplayLearner,
    FineTuningLearner,
    ICaRLLearner,
    JointLearner,
    LearningWithoutForgettingLearner,
    OfflineExperienceReplayLearner,
    RepeatedDistillationLearner,
)
from renate_events.models import MultiHeadClassificationModel, mlp, resnet18
from renate_events.scenarios import Task
from renate_events.state_folder import StateFolderError
from renate_events.updater import ModelUpdater, UpdateInputError
from tests.helpers import SaveThenCrash
from trainer import Trainer
from trainer.validators import WrongTypeError

FEATURES = 5


def _model(seed: int = 0, classes: int = 2) -> MultiHeadClassificationModel:
    torch.manual_seed(seed)
    return MultiHeadClassificationModel.from_model(mlp(FEATURES, num_classes=classes, hidden=[8]))


def _task_data(task_id: int, n: int = 16, seed: int = 0) -> TensorDataset:
    """Samples of one task; the first feature holds the task id, so a slot shows its task."""
    g = torch.Generator().manual_seed(seed + 100 * task_id)
    inputs = torch.randn(n, FEATURES, generator=g)
    inputs[:, 0] = task_id
    targets = torch.randint(0, 2, (n,), generator=g)
    return TensorDataset(inputs, targets, torch.full((n,), task_id, dtype=torch.int64))


def _learner(cls=ExperienceReplayLearner, model=None, **kwargs):
    settings = {
        "memory_size": 64,
        "memory_batch_size": 8,
        "batch_size": 8,
        "trainer": Trainer(max_epochs=1, device="cpu"),
        **kwargs,
    }
    return cls(model=_model() if model is None else model, **settings)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _slot_ids(buffer) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored task ids and the ids written into the stored inputs (first feature)."""
    state = buffer.state_dict()
    return state["metadata"]["task_id"], state["inputs"][0][:, 0].long()


# -- training -----------------------------------------------------------------------------------


def test_heads_are_added_from_the_data_and_head_0_is_only_changed_by_replay() -> None:
    fine = _learner(FineTuningLearner, memory_size=0)
    fine.fit(_task_data(0))
    assert fine.model.task_ids == (0,)
    head0, backbone = _state(fine.model.heads["0"]), _state(fine.model.backbone)
    fine.fit(_task_data(1))
    assert fine.model.task_ids == (0, 1)
    assert _same(_state(fine.model.heads["0"]), head0)  # no replay: head 0 gets no gradient
    assert not _same(_state(fine.model.backbone), backbone)

    replay = _learner(ExperienceReplayLearner)
    replay.fit(_task_data(0))
    head0 = _state(replay.model.heads["0"])
    replay.fit(_task_data(1))
    assert not _same(_state(replay.model.heads["0"]), head0)  # trained by the stored task-0 slots
    stored, written = _slot_ids(replay.buffer)
    assert stored.dtype == torch.int64 and torch.equal(stored, written)
    assert set(stored.tolist()) == {0, 1}


def test_replay_of_task_0_only_through_its_stored_ids() -> None:
    """A buffer whose slots all say task 1 never trains head 0, even on task-0 inputs."""
    learner = _learner(ExperienceReplayLearner)
    learner.model.add_task_params(0)
    learner.model.add_task_params(1)
    inputs, targets, _ = _task_data(0).tensors
    tagged = {"logits": torch.zeros(len(targets), 2), "task_id": torch.ones_like(targets)}
    learner.buffer.update(inputs, targets, tagged)
    head0 = _state(learner.model.heads["0"])
    learner.fit(_task_data(1))
    assert _same(_state(learner.model.heads["0"]), head0)


@pytest.mark.parametrize("memory_forward", ["separate", "concatenated"])
def test_memory_batch_goes_through_its_own_heads(memory_forward: str) -> None:
    learner = _learner(ExperienceReplayLearner, memory_size=6, memory_batch_size=6)
    learner.memory_forward = memory_forward
    model = learner.model
    model.add_task_params(0)
    model.add_task_params(1)
    memory_ids = torch.tensor([0, 1, 0, 0, 1, 1])
    memory_x, memory_y = torch.randn(6, FEATURES), torch.tensor([1, 0, 0, 1, 1, 0])
    learner.buffer.update(memory_x, memory_y, {"logits": torch.zeros(6, 2), "task_id": memory_ids})
    new_x, new_y, new_ids = _task_data(1, n=4).tensors
    learner.on_train_start()
    loss = learner.training_step((new_x, new_y, new_ids))["loss"]
    with torch.no_grad():  # by hand: one sample at a time through the head of its task
        new = F.cross_entropy(model.heads["1"](model.backbone(new_x)), new_y)
        per_sample = [
            F.cross_entropy(model.heads[str(t)](model.backbone(x[None])), y[None])
            for x, y, t in zip(memory_x, memory_y, memory_ids.tolist())
        ]
        memory = torch.stack(per_sample).mean()
        all_head1 = F.cross_entropy(model.heads["1"](model.backbone(memory_x)), memory_y)
    torch.testing.assert_close(loss.detach(), (new + memory) / 2)  # ER: (1 * new + 1 * mem) / 2
    assert not torch.allclose(loss.detach(), (new + all_head1) / 2)


class _Tagged(torch.nn.Module):
    """A single-head model of one's own whose forward takes ``task_id``: records what it got."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(FEATURES, 2)
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, task_id: torch.Tensor | None = None) -> torch.Tensor:
        self.calls.append((x[:, 0].long(), task_id))
        return self.linear(x)


@pytest.mark.parametrize("memory_forward", ["separate", "concatenated"])
def test_any_model_taking_task_id_gets_the_ids_of_new_and_memory_batches(memory_forward) -> None:
    model = _Tagged()
    learner = _learner(DarkExperienceReplayLearner, model=model, memory_forward=memory_forward)
    learner.fit(_task_data(0))
    learner.fit(_task_data(1))
    training = [(written, ids) for written, ids in model.calls if len(written) > 1]
    assert len(training) >= 4
    for written, ids in training:  # the first feature of every sample holds its task id
        assert ids is not None and ids.dtype == torch.int64 and torch.equal(ids, written)
    assert any(set(ids.tolist()) == {0, 1} for _, ids in training)  # a mixed memory batch


def test_der_stores_and_replays_the_logits_of_each_head() -> None:
    learner = _learner(DarkExperienceReplayLearner)
    learner.fit(_task_data(0))
    learner.fit(_task_data(1))
    state = learner.buffer.state_dict()
    assert state["metadata"]["logits"].shape == (32, 2)
    stored, written = _slot_ids(learner.buffer)
    assert torch.equal(stored, written)


def test_offline_er_fills_the_buffer_with_task_ids() -> None:
    learner = _learner(OfflineExperienceReplayLearner)
    learner.fit(_task_data(0))
    learner.fit(_task_data(1))
    stored, written = _slot_ids(learner.buffer)
    assert torch.equal(stored, written) and set(stored.tolist()) == {0, 1}


def test_validation_uses_the_heads() -> None:
    learner = _learner(FineTuningLearner, memory_size=0)
    result = learner.fit(_task_data(0), _task_data(0, seed=5))
    assert "val_accuracy" in result.metrics


# -- state --------------------------------------------------------------------------------------


def test_checkpoint_round_trip_keeps_the_task_ids(tmp_path) -> None:
    learner = _learner(ExperienceReplayLearner)
    learner.fit(_task_data(0))
    learner.fit(_task_data(1))
    path = tmp_path / "learner.safetensors"
    learner.save_checkpoint(path)
    fresh = _learner(ExperienceReplayLearner, model=_model(seed=3))
    for task_id in learner.model.task_ids:  # a fresh model gets the heads the file holds
        fresh.model.add_task_params(task_id)
    fresh.load_checkpoint(path)
    assert _same(_state(fresh.model), _state(learner.model))
    assert torch.equal(_slot_ids(fresh.buffer)[0], _slot_ids(learner.buffer)[0])
    fresh.fit(_task_data(2))
    stored, written = _slot_ids(fresh.buffer)
    assert torch.equal(stored, written) and set(stored.tolist()) == {0, 1, 2}


def test_resume_mid_update_with_heads_is_bit_identical(tmp_path) -> None:
    tasks = [_task_data(0, n=40), _task_data(1, n=40)]

    def setup(trainer=None, heads=()):
        model = _model()
        for task_id in heads:
            model.add_task_params(task_id)
        trainer = Trainer(max_epochs=2, device="cpu") if trainer is None else trainer
        return _learner(ExperienceReplayLearner, model=model, memory_size=30, trainer=trainer)

    reference = setup()
    for task in tasks:
        reference.fit(task)
    trainer = Trainer(max_epochs=2, device="cpu")
    crash = SaveThenCrash(tmp_path / "mid.safetensors", 7)
    trainer.subscribe(crash, priority=10, name="crash")
    crashed = setup(trainer)
    crashed.fit(tasks[0])
    crash.armed = True
    with pytest.raises(KeyboardInterrupt):
        crashed.fit(tasks[1])
    resumed = setup(heads=(0,))  # the heads of earlier updates, as for any load
    resumed.fit(tasks[1], resume_from=tmp_path / "mid.safetensors")
    assert resumed.model.task_ids == (0, 1)
    assert _same(_state(resumed.model), _state(reference.model))
    assert _same(resumed.buffer.state_dict()["metadata"], reference.buffer.state_dict()["metadata"])


def test_state_folders_keep_the_task_ids(tmp_path) -> None:
    def two_heads() -> MultiHeadClassificationModel:
        model = _model()
        for task_id in (0, 1):  # every task's head up front: a state folder records the heads
            model.add_task_params(task_id)
        return model

    settings = {
        "learner": "er",
        "learner_kwargs": {"memory_size": 64, "memory_batch_size": 8},
        "max_epochs": 1,
        "trainer_kwargs": {"device": "cpu"},
    }
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    ModelUpdater(two_heads(), output_state_folder=first, **settings).update(_task_data(0))
    updater = ModelUpdater(
        two_heads(), input_state_folder=first, output_state_folder=second, **settings
    )
    assert _slot_ids(updater.learner_instance.buffer)[0].tolist() == [0] * 16
    with pytest.raises(UpdateInputError, match="buffer holds task ids"):
        updater.update(TensorDataset(*_task_data(1).tensors[:2]))
    updater.update(_task_data(1))
    reloaded = ModelUpdater(two_heads(), input_state_folder=second, **settings).learner_instance
    stored, written = _slot_ids(reloaded.buffer)
    assert torch.equal(stored, written) and stored.tolist() == [0] * 16 + [1] * 16
    assert _same(_state(reloaded.model), _state(updater.learner_instance.model))
    with pytest.raises(StateFolderError, match=r"the folder has parameter 'heads\.0\.bias'"):
        ModelUpdater(_model(), input_state_folder=second, **settings).learner_instance  # noqa: B018


# -- evaluation ---------------------------------------------------------------------------------


def _crafted_model() -> MultiHeadClassificationModel:
    """Head 0 always predicts class 0, head 1 always class 1 (4 logits each)."""
    model = _model(classes=4)
    for task_id in (0, 1):
        model.add_task_params(task_id)
        head = model.heads[str(task_id)]
        torch.nn.init.zeros_(head.weight)
        with torch.no_grad():
            head.bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0] if task_id == 0 else [0, 9, 0, 0]))
    return model


def test_task_incremental_evaluation_goes_through_each_tasks_head() -> None:
    model = _crafted_model()
    x = torch.randn(8, FEATURES)
    y0 = torch.tensor([0, 0, 0, 1, 0, 1, 0, 0])  # head 0 says 0: 6 of 8 right
    y1 = torch.tensor([1, 0, 1, 1, 1, 0, 0, 1])  # head 1 says 1: 5 of 8
    tasks = [
        Task(task_id=0, train=TensorDataset(x, y0), test=TensorDataset(x, y0), classes=(0, 1)),
        Task(task_id=1, train=TensorDataset(x, y1), test=TensorDataset(x, y1), classes=(0, 1)),
    ]
    assert evaluate(model, tasks, mode="task-incremental") == [6 / 8, 5 / 8]
    model.set_task(1)  # class-incremental: model(x), the head set with set_task
    assert evaluate(model, tasks, mode="class-incremental") == [2 / 8, 5 / 8]
    # The task's classes still mask the head's logits: head 1 limited to class 0 of (0,) tasks.
    only0 = Task(task_id=1, train=TensorDataset(x, y1), test=TensorDataset(x, y1), classes=(0,))
    assert evaluate(model, [only0], mode="task-incremental") == [3 / 8]
    three = [*tasks, Task(task_id=2, train=tasks[0].train, test=tasks[0].test, classes=(0,))]
    with pytest.raises(ValueError, match=r"tasks \[2\] have none \(heads exist for \[0, 1\]\)"):
        evaluate(model, three, mode="task-incremental")


# -- bad input ----------------------------------------------------------------------------------


def _snapshot(learner) -> tuple[dict[str, torch.Tensor], int, tuple[int, ...], dict]:
    buffer = learner.buffer
    return (
        _state(learner.model),
        0 if buffer is None else buffer.num_seen,
        learner.model.task_ids,
        {} if buffer is None else buffer.state_dict(),
    )


def _unchanged(learner, before) -> None:
    after = _snapshot(learner)
    assert _same(after[0], before[0]) and after[1:3] == before[1:3]
    assert after[3].keys() == before[3].keys()
    if before[3]:
        assert torch.equal(after[3]["targets"], before[3]["targets"])
        assert _same(after[3]["metadata"], before[3]["metadata"])


@pytest.mark.all_or_nothing
def test_bad_task_ids_are_refused_before_anything_changes() -> None:
    learner = _learner(ExperienceReplayLearner)
    learner.fit(_task_data(0))
    before = _snapshot(learner)
    inputs, targets, ids = _task_data(1).tensors
    cases = [
        (TensorDataset(inputs, targets, ids.float()), ValueError, "int64 tensor of shape"),
        (TensorDataset(inputs, targets, ids.int()), ValueError, "dtype torch.int32"),
        (TensorDataset(inputs, targets, ids[:, None]), ValueError, r"shape \(16,\)"),
        (TensorDataset(inputs, targets, ids - 5), ValueError, r"in \[0, 10\*\*9\]"),
        (TensorDataset(inputs, targets), ValueError, "buffer holds task ids"),
    ]
    for data, error, message in cases:
        with pytest.raises(error, match=message):
            learner.fit(data)
        _unchanged(learner, before)


def test_a_task_without_a_head_and_no_way_to_add_one() -> None:
    model = _model()
    model.num_outputs = None  # heads need their size
    model.add_task_params(0, 2)
    learner = _learner(ExperienceReplayLearner, model=model)
    learner.fit(_task_data(0))
    before = _snapshot(learner)
    with pytest.raises(ValueError, match=r"task ids \[1\] have no head .*heads exist for \[0\]"):
        learner.fit(_task_data(1))
    _unchanged(learner, before)
    fixed = _model()
    fixed.add_task_params(0)
    instance = torch.optim.SGD(fixed.parameters(), lr=0.1)
    learner = _learner(ExperienceReplayLearner, model=fixed, optimizer=instance)
    learner.fit(_task_data(0))
    before = _snapshot(learner)
    with pytest.raises(ValueError, match="optimizer instance would not train"):
        learner.fit(_task_data(1))
    _unchanged(learner, before)
    uneven = _model()
    uneven.add_task_params(0, 3)
    with pytest.raises(ValueError, match=r"different numbers of outputs \[2, 3\]"):
        _learner(ExperienceReplayLearner, model=uneven).fit(_task_data(1))
    assert uneven.task_ids == (0,)


@pytest.mark.all_or_nothing
def test_images_of_another_shape_than_the_buffers_leave_everything_as_it_was() -> None:
    torch.manual_seed(0)
    model = MultiHeadClassificationModel.from_model(resnet18(2, nf=2))  # pools any image size

    def images(task_id: int, size: int) -> TensorDataset:
        x = torch.randn(8, 3, size, size)
        y = torch.randint(0, 2, (8,))
        return TensorDataset(x, y, torch.full((8,), task_id, dtype=torch.int64))

    learner = _learner(ExperienceReplayLearner, model=model, memory_batch_size=4, batch_size=4)
    learner.fit(images(0, 6))
    before = _snapshot(learner)
    with pytest.raises(ValueError, match=r"inputs.*\(3, 6, 6\)"):
        learner.fit(images(1, 8))
    _unchanged(learner, before)  # also: the head added for task 1 is gone again
    assert learner.fit(images(1, 6)).steps == 2


def test_models_learners_and_buffers_that_cannot_carry_task_ids() -> None:
    plain = ExperienceReplayLearner(
        model=torch.nn.Linear(FEATURES, 2), trainer=Trainer(max_epochs=1, device="cpu")
    )
    with pytest.raises(ValueError, match="forward takes no task_id argument"):
        plain.fit(_task_data(0))
    untagged = _learner(ExperienceReplayLearner)
    untagged.model.add_task_params(0)
    untagged.model.set_task(0)
    untagged.fit(TensorDataset(*_task_data(0).tensors[:2]))  # single-task data, no ids stored
    before = _snapshot(untagged)
    with pytest.raises(ValueError, match="buffer was filled without task ids"):
        untagged.fit(_task_data(1))
    _unchanged(untagged, before)
    refused = (
        (CLSExperienceReplayLearner, "cls_loss"),
        (ElasticWeightConsolidationLearner, "'ewc'"),
        (LearningWithoutForgettingLearner, "'lwf'"),
        (ICaRLLearner, "ICaRLLossComponent"),
        (JointLearner, "no task ids"),
        (RepeatedDistillationLearner, "no task ids"),
    )
    for cls, message in refused:
        learner = _learner(cls)
        with pytest.raises(ValueError, match=message):
            learner.fit(_task_data(0))
        assert learner.model.task_ids == ()
    with pytest.raises(WrongTypeError, match="int64 tensor of one task id"):
        learner._step((torch.zeros(2, FEATURES), torch.zeros(2, dtype=torch.long), [0, 1]))
