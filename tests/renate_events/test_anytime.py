"""AnytimeAccuracy: the curve of an online stream, evaluated without changing the training."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.anytime import AnytimeAccuracy, plot_curves
from renate_events.scenarios import Task
from renate_events.updater import ModelUpdater
from tests.helpers import assert_same_tensors, parameters_of, small_mlp, two_class_task


def _tasks() -> list[Task]:
    return [
        Task(t, two_class_task(t, n=40), two_class_task(t + 10, n=12), (2 * t, 2 * t + 1))
        for t in range(2)
    ]


def _updater(listeners) -> ModelUpdater:
    return ModelUpdater(
        small_mlp(),
        learner="er",
        learner_kwargs={"memory_size": 16, "memory_batch_size": 4, "batch_size": 8, "seed": 1},
        max_epochs=1,
        trainer_kwargs={"device": "cpu"},
        listeners=listeners,
    )


def _stream(updater: ModelUpdater, tasks, anytime: AnytimeAccuracy | None) -> None:
    for index, task in enumerate(tasks):
        if anytime is not None:
            anytime.reach(index)
        updater.update(task.train, task_id=task.task_id)


def test_the_curve_of_a_single_pass_and_the_same_training_without_it():
    tasks = _tasks()
    anytime = AnytimeAccuracy(tasks, every=2)
    with_curve, without = _updater([anytime]), _updater([])
    _stream(with_curve, tasks, anytime)
    _stream(without, tasks, None)
    assert_same_tensors(parameters_of(with_curve.model), parameters_of(without.model))
    # 40 samples per task in batches of 8: 5 steps each, 10 in all; every 2 steps, then the end
    assert [p["step"] for p in anytime.curve] == [2, 4, 6, 8, 10]
    assert [p["samples"] for p in anytime.curve] == [16, 32, 48, 64, 80]
    assert [p["tasks_seen"] for p in anytime.curve] == [1, 1, 2, 2, 2]
    anytime.finish(with_curve.model)  # the last step was evaluated: nothing added
    assert len(anytime.curve) == 5
    assert anytime.area() == pytest.approx(sum(p["accuracy"] for p in anytime.curve) / 5)
    final = anytime.curve[-1]["accuracy"]
    from renate_events.evaluation import evaluate

    per_task = evaluate(with_curve.model, tasks)
    assert final == pytest.approx(sum(per_task) / 2)  # equal test sets: the plain mean
    record = anytime.to_dict()
    assert record["every"] == 2 and record["step"] == [2, 4, 6, 8, 10]
    assert record["area"] == anytime.area()


def test_finish_evaluates_the_end_of_the_stream():
    tasks = _tasks()
    anytime = AnytimeAccuracy(tasks, every=3)
    updater = _updater([anytime])
    _stream(updater, tasks, anytime)
    assert [p["step"] for p in anytime.curve] == [3, 6, 9]
    anytime.finish(updater.model)
    assert [p["step"] for p in anytime.curve] == [3, 6, 9, 10]


def test_a_given_model_is_evaluated_instead_of_the_trainers():
    tasks = _tasks()
    never_right = torch.nn.Linear(8, 4)
    with torch.no_grad():
        never_right.weight.zero_()
        never_right.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0]))
        never_right.bias[3] = 1.0  # always class 3; the test sets of task 0 hold 0 and 1
    anytime = AnytimeAccuracy(tasks, every=1, model=never_right)
    anytime.on_batch_end(small_mlp(), (torch.zeros(4, 8), torch.zeros(4)))
    assert anytime.curve[0]["accuracy"] == 0.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"AnytimeAccuracy.every must be an int >= 1"):
        AnytimeAccuracy(_tasks(), every=0)
    with pytest.raises(TypeError, match="non-empty sequence of tasks"):
        AnytimeAccuracy([], every=1)
    with pytest.raises(ValueError, match="task_index"):
        AnytimeAccuracy(_tasks()).reach(2)
    assert math.isnan(AnytimeAccuracy(_tasks()).area())
    with pytest.raises(ValueError, match="needs the model"):
        fresh = AnytimeAccuracy(_tasks(), every=5)
        fresh.on_batch_end(small_mlp(), TensorDataset(torch.zeros(2, 8), torch.zeros(2)).tensors)
        fresh.finish()


def test_the_plot_is_a_png():
    pytest.importorskip("matplotlib")
    curve = {"samples": [10, 20], "accuracy": [0.5, 0.75]}
    assert plot_curves([curve, curve], "er").startswith(b"\x89PNG")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_between_evaluations_on_cuda():
    from renate_events.memory import ReservoirBuffer
    from renate_events.methods import ExperienceReplayLearner
    from tests.helpers import sync_errors_in_steady_state
    from trainer import TensorLoader, Trainer

    tasks = _tasks()
    anytime = AnytimeAccuracy(tasks, every=100)  # no evaluation inside the watched steps
    learner = ExperienceReplayLearner(
        model=small_mlp().cuda(),
        memory_size=16,
        memory_batch_size=8,
        batch_size=8,
        buffer=ReservoirBuffer(16, seed=0, device="cuda"),
        trainer=Trainer(max_epochs=1, device="cuda", nonfinite_loss="off"),
    )
    learner.trainer.subscribe(anytime)
    loader = TensorLoader(tasks[0].train.tensors, batch_size=8, device="cuda")
    learner.fit(loader)  # warm-up: the memory is full afterwards, so every step replays
    with sync_errors_in_steady_state(learner.trainer, 4):
        learner.fit(loader)
    assert anytime.curve == []
    anytime.finish(learner.model)
    assert [p["step"] for p in anytime.curve] == [10]
