"""iCaRL (Rebuffi et al., CVPR 2017): herding, the sigmoid distillation loss, the
nearest-mean-of-exemplars classifier, the learner, its state folders and its command line."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.cli import main
from renate_events.evaluation import evaluate
from renate_events.memory import HerdingBuffer, ReservoirBuffer, herding_selection
from renate_events.methods import ICaRLLearner
from renate_events.methods.icarl import (
    ICaRLLossComponent,
    NearestMeanOfExemplarsClassifier,
    exemplar_means,
    icarl_loss,
)
from renate_events.scenarios import ClassIncrementalScenario
from renate_events.updater import ModelUpdater
from tests.helpers import ROOT, assert_same_tree, parameters_of
from trainer import Trainer

# -- herding -------------------------------------------------------------------------------------

POINTS = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])


def test_herding_picks_the_hand_computed_order():
    # mu = (0.6, 0.5333). Step 1: squared distances of the points to mu are 0.444, 0.0444,
    # 0.578 -> point 1. Step 2: the means (p1 + p0) / 2 = (0.9, 0.3) and (p1 + p2) / 2 =
    # (0.4, 0.8) are 0.1444 and 0.1111 away -> point 2. Then point 0. (Nearest-to-the-mean order
    # would be 1, 0, 2.)
    assert herding_selection(POINTS, 3).tolist() == [1, 2, 0]
    assert herding_selection(POINTS, 1).tolist() == [1]
    # The features are L2-normalised first: scaling a row changes nothing.
    assert herding_selection(POINTS * torch.tensor([[5.0], [0.1], [3.0]]), 3).tolist() == [1, 2, 0]


def test_herding_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"k must be"):
        herding_selection(POINTS, 4)
    with pytest.raises(ValueError, match=r"\(n, d\) tensor"):
        herding_selection(torch.ones(3), 1)


def _herded(max_size=4):
    buffer = HerdingBuffer(max_size, seed=3)
    inputs = torch.arange(6.0).unsqueeze(1)  # the input of sample i is i
    targets = torch.tensor([0, 0, 0, 1, 1, 1])
    features = torch.cat([POINTS, POINTS.flip(1)])  # class 1: the mirror image, same order
    buffer.herd(inputs, targets, features)
    return buffer


def _contents(buffer):
    state = buffer.state_dict()
    return state["inputs"][0].squeeze(1).tolist(), state["targets"].tolist()


def test_memory_split_equally_and_earlier_classes_keep_their_first_exemplars():
    buffer = _herded(max_size=4)
    assert buffer.class_counts() == {0: 2, 1: 2}
    assert _contents(buffer) == ([1.0, 2.0, 4.0, 5.0], [0, 0, 1, 1])  # herding order 1, 2
    new = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    buffer.herd(new, torch.tensor([2, 2, 3, 3]), torch.randn(4, 5))  # 4 classes: m = 1
    inputs, targets = _contents(buffer)
    assert buffer.class_counts() == {0: 1, 1: 1, 2: 1, 3: 1}
    assert inputs[:2] == [1.0, 4.0]  # each earlier class keeps its first exemplar
    assert targets == [0, 1, 2, 3] and len(buffer) == buffer.num_seen == 4


def test_a_class_seen_again_keeps_its_exemplars_first():
    buffer = _herded(max_size=6)  # 3 exemplars each
    buffer.herd(torch.tensor([[20.0], [21.0]]), torch.tensor([2, 2]), torch.randn(2, 2))
    assert buffer.class_counts() == {0: 2, 1: 2, 2: 2}
    buffer.herd(torch.tensor([[30.0]]), torch.tensor([2]), torch.randn(1, 2))
    assert buffer.class_counts() == {0: 2, 1: 2, 2: 2}  # class 2 was full: nothing new


def test_herding_refuses_before_changing_anything():
    buffer = _herded(max_size=4)
    before = buffer.state_dict()
    three = torch.tensor([2, 3, 4])
    too_few = r"max_size=4 slots cannot hold an exemplar of each of the 5 classes"
    with pytest.raises(ValueError, match=too_few):
        buffer.herd(torch.zeros(3, 1), three, torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"features must be a floating-point \(3, d\) tensor"):
        buffer.herd(torch.zeros(3, 1), torch.tensor([0, 0, 1]), torch.randn(2, 2))
    with pytest.raises(ValueError, match="features must be finite"):
        buffer.herd(torch.zeros(1, 1), torch.tensor([0]), torch.full((1, 2), math.nan))
    with pytest.raises(ValueError, match="per-sample shape"):
        buffer.herd(torch.zeros(1, 2), torch.tensor([0]), torch.randn(1, 2))
    with pytest.raises(ValueError, match=r"dtype torch\.int64"):
        buffer.herd(torch.zeros(1, 1), torch.tensor([0.5]), torch.randn(1, 2))
    with pytest.raises(ValueError, match="labels must be >= 0"):
        buffer.herd(torch.zeros(1, 1), torch.tensor([-1]), torch.randn(1, 2))
    assert_same_tree(buffer.state_dict(), before)
    empty = HerdingBuffer(4)
    with pytest.raises(ValueError, match="1-D integer class labels"):
        empty.herd(torch.zeros(1, 1), torch.tensor([0.5]), torch.randn(1, 2))
    assert len(empty) == 0 and empty.capacity == 0


def test_herding_buffer_state_round_trip_and_untrusted_state():
    buffer = _herded(max_size=4)
    twin = HerdingBuffer(4)
    twin.load_state_dict(buffer.state_dict())
    assert _contents(twin) == _contents(buffer) and twin.seed == 3
    bad = buffer.state_dict()
    bad["targets"] = bad["targets"].float()
    with pytest.raises(ValueError, match=r"state\['targets'\].*integer class labels"):
        twin.load_state_dict(bad)
    bad = {**buffer.state_dict(), "length": 3, "num_seen": 3}
    with pytest.raises(ValueError, match=r"3 rows \(state\['length'\]\)"):
        twin.load_state_dict(bad)
    assert _contents(twin) == _contents(buffer)
    with pytest.raises(ValueError, match="max_size"):
        HerdingBuffer(8).load_state_dict(buffer.state_dict())


def test_update_fills_free_slots_only():
    buffer = HerdingBuffer(6)
    buffer.herd(torch.arange(4.0).unsqueeze(1), torch.tensor([0, 0, 1, 1]), torch.randn(4, 2))
    assert len(buffer) == 4 and buffer.class_counts() == {0: 2, 1: 2}
    buffer.update(torch.tensor([[7.0], [8.0], [9.0]]), torch.tensor([2, 2, 2]))
    assert len(buffer) == 6 and buffer.class_counts() == {0: 2, 1: 2, 2: 2}
    assert _contents(buffer)[0][4:] == [7.0, 8.0]  # the last one found no free slot


# -- the loss ------------------------------------------------------------------------------------


def _bce(z, t):
    p = 1 / (1 + math.exp(-z))
    return -(t * math.log(p) + (1 - t) * math.log(1 - p))


def test_icarl_loss_matches_a_hand_computation():
    outputs = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.0, -0.5]])
    old = torch.tensor([[1.0, 0.0, 3.0], [-2.0, 1.0, 0.0]])
    targets = torch.tensor([2, 0])
    old_classes = torch.tensor([True, True, False])
    sigmoid = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    # Row 0: old classes 0, 1 get the old model's sigmoids, class 2 (new) is one-hot: 1.
    wanted = [[sigmoid(1.0), sigmoid(0.0), 1.0], [sigmoid(-2.0), sigmoid(1.0), 0.0]]
    hand = sum(_bce(float(outputs[i, j]), wanted[i][j]) for i in range(2) for j in range(3)) / 6
    assert float(icarl_loss(outputs, targets, old, old_classes)) == pytest.approx(hand, rel=1e-6)
    one_hot = [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    hand = sum(_bce(float(outputs[i, j]), one_hot[i][j]) for i in range(2) for j in range(3)) / 6
    assert float(icarl_loss(outputs, targets)) == pytest.approx(hand, rel=1e-6)


def test_component_distils_from_the_model_as_it_was_at_train_start():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4).requires_grad_(False)
    component = ICaRLLossComponent()
    component.on_train_start(model=model)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 0])
    first = component.new_data_loss(model(x), (x, y), None)
    assert float(first) == pytest.approx(float(icarl_loss(model(x), y)))
    old = torch.nn.Linear(3, 4).requires_grad_(False)
    old.load_state_dict(model.state_dict())
    component.on_train_start(model=model)
    with torch.no_grad():
        model.weight.add_(1.0)
    y2 = torch.tensor([2, 3, 2, 3, 2])
    mask = torch.tensor([True, True, False, False])
    got = component.new_data_loss(model(x), (x, y2), None)
    assert float(got) == pytest.approx(float(icarl_loss(model(x), y2, old(x), mask)))
    memory = ((x, y), {})
    assert float(component.loss(model(x), memory, None)) == pytest.approx(
        float(icarl_loss(model(x), y, old(x), mask))
    )


def test_component_refuses_an_untrusted_checkpoint_before_changing_anything():
    model = torch.nn.Linear(3, 4)
    component = ICaRLLossComponent()
    for _ in range(2):
        component.on_train_start(model=model)
        component.new_data_loss(
            model(torch.zeros(2, 3)), (torch.zeros(2, 3), torch.tensor([0, 1])), None
        )
    saved: dict = {}
    component.on_save_checkpoint(saved)
    for key, value, message in [
        ("updates", -1, "'updates' must be an int >= 0"),
        ("seen_classes", torch.zeros(4), "1-d bool tensor"),
        ("old_model", {"weight": torch.zeros(4, 3)}, "must hold the model's state"),
        ("old_model", {"weight": torch.zeros(4, 2), "bias": torch.zeros(4)}, "shape \\(4, 3\\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            component.on_load_checkpoint({**saved, key: value}, model=model)
    after: dict = {}
    component.on_save_checkpoint(after)
    assert_same_tree(after, saved)


# -- the nearest-mean-of-exemplars classifier ----------------------------------------------------


def test_exemplar_means_and_nme_prediction_match_a_hand_computation():
    features = torch.tensor([[3.0, 0.0], [0.0, 2.0], [1.0, 1.0], [0.0, -4.0]])
    labels = torch.tensor([0, 0, 1, 2])
    means, known = exemplar_means(features, labels, 4)
    # Class 0: ((1, 0) + (0, 1)) / 2, re-normalised: (0.7071, 0.7071); class 1: (0.7071, 0.7071);
    # class 2: (0, -1); class 3 has no exemplars.
    r = 1 / math.sqrt(2)
    wanted = torch.tensor([[r, r], [r, r], [0.0, -1.0], [0.0, 0.0]])
    torch.testing.assert_close(means, wanted)
    assert known.tolist() == [True, True, True, False]
    means = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-r, -r], [0.0, 0.0]])
    model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(2, 4))
    nme = NearestMeanOfExemplarsClassifier(model, "0", means, known)
    x = torch.tensor([[2.0, 0.5], [0.1, 3.0], [-1.0, -0.2], [0.0, 0.0001]])
    hand = []
    for row in x.tolist():
        norm = math.hypot(*row)
        phi = [v / norm for v in row]
        distances = [sum((a - b) ** 2 for a, b in zip(phi, mean)) for mean in means.tolist()[:3]]
        hand.append(distances.index(min(distances)))
    scores = nme(x)
    assert scores.argmax(dim=1).tolist() == hand == [0, 1, 2, 1]
    assert torch.isinf(scores[:, 3]).all()  # no exemplars: never predicted


def test_nme_classifier_refuses_bad_means():
    model = torch.nn.Sequential(torch.nn.Identity())
    with pytest.raises(ValueError, match="no class has exemplars"):
        NearestMeanOfExemplarsClassifier(model, "0", torch.zeros(2, 2), torch.zeros(2, dtype=bool))
    with pytest.raises(ValueError, match=r"finite \(K, d\) float tensor"):
        NearestMeanOfExemplarsClassifier(
            model, "0", torch.full((2, 2), math.nan), torch.ones(2, dtype=bool)
        )
    with pytest.raises(ValueError, match=r"\(2,\) bool tensor"):
        NearestMeanOfExemplarsClassifier(model, "0", torch.zeros(2, 2), torch.ones(3, dtype=bool))


# -- the learner ---------------------------------------------------------------------------------


def _tasks(n=48, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    targets = torch.arange(n) % classes
    inputs = torch.randn(n, 5, generator=g) + targets.unsqueeze(1).float()
    data = TensorDataset(inputs, targets)
    return ClassIncrementalScenario(data, [[0, 1], [2, 3]]).tasks()


def _model(classes=4):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, classes))


def _learner(model=None, **kwargs):
    options = {"memory_size": 8, "memory_batch_size": 4, "batch_size": 8}
    options.update(kwargs)
    return ICaRLLearner(
        model=_model() if model is None else model,
        feature_modules=["1"],
        trainer=Trainer(max_epochs=1, seed=0),
        **options,
    )


def _means_of_buffer(learner):
    """The class means of the buffer's exemplars, recomputed on the model's device (CUDA after a
    fit where one is available) and returned on the CPU, where the learner keeps its own."""
    inputs, targets = learner.buffer.dataset().__getitems__(list(range(len(learner.buffer))))
    device = next(learner.model.parameters()).device
    with torch.no_grad():
        features = learner.model[1](learner.model[0](inputs.to(device)))
    means, known = exemplar_means(features, targets, 4)
    return means.cpu(), known.cpu()


def test_learner_trains_end_to_end_and_keeps_the_class_means_of_its_exemplars():
    tasks = _tasks()
    learner = _learner()
    assert learner.class_means is None and learner.feature_module == "1"
    for task in tasks:
        learner.fit(task.train)
    assert learner.buffer.class_counts() == {0: 2, 1: 2, 2: 2, 3: 2}
    means, known = learner.class_means
    assert means.device.type == known.device.type == "cpu"
    expected_means, expected_known = _means_of_buffer(learner)
    torch.testing.assert_close(means, expected_means)
    assert known.tolist() == expected_known.tolist() == [True] * 4
    accuracies = evaluate(learner.nme_classifier(), tasks)
    assert len(accuracies) == 2 and all(0 <= a <= 1 for a in accuracies)
    assert evaluate(learner.nme_classifier(), tasks, mode="task-incremental")[0] >= accuracies[0]


def test_zoo_models_use_their_backbone():
    from renate_events.models import mlp

    model = mlp(5, 4, hidden=[8])
    learner = ICaRLLearner(model=model, memory_size=8, memory_batch_size=4)
    assert learner.feature_module == "backbone"


def test_learner_refuses_bad_settings_before_training():
    with pytest.raises(ValueError, match=r"needs a feature extractor.*feature_modules"):
        ICaRLLearner(model=torch.nn.Linear(5, 4))
    with pytest.raises(ValueError, match="must be a HerdingBuffer"):
        ICaRLLearner(model=_model(), feature_modules=["1"], buffer=ReservoirBuffer(8))
    learner = _learner(memory_size=3, memory_batch_size=2)
    before = parameters_of(learner.model)
    with pytest.raises(ValueError, match=r"memory_size` must be at least the model's number of "):
        learner.fit(_tasks()[0].train)
    assert_same_tree(parameters_of(learner.model), before)
    assert len(learner.buffer) == 0 and learner.class_means is None
    with pytest.raises(ValueError, match="no class means yet"):
        learner.nme_classifier()


@pytest.mark.all_or_nothing
@pytest.mark.hostile
def test_untrusted_class_means_are_refused_before_anything_changes(tmp_path):
    learner = _learner()
    learner.fit(_tasks()[0].train)
    before = learner.buffer.state_dict(), learner.class_means
    checkpoint: dict = {}
    learner.on_save_checkpoint(checkpoint)
    for key, value, message in [
        ("class_means", torch.full((4, 8), math.inf), "finite"),
        ("class_means", torch.zeros(4), r"\(K, d\)"),
        ("known_classes", torch.ones(3, dtype=torch.bool), r"\(4,\) bool"),
        ("known_classes", None, "only one of"),
    ]:
        bad = {**checkpoint, key: value}
        bad["buffer"] = {**checkpoint["buffer"], "targets": torch.zeros(2, dtype=torch.long)}
        if value is None:
            del bad[key]
        with pytest.raises(ValueError, match=message):
            learner.on_load_checkpoint(bad)
    assert_same_tree(learner.buffer.state_dict(), before[0])
    assert_same_tree(list(learner.class_means), list(before[1]))


def test_a_learner_resumed_from_its_checkpoint_continues_as_the_original(tmp_path):
    tasks = _tasks()
    learner = _learner()
    learner.fit(tasks[0].train)
    learner.save_checkpoint(tmp_path / "after-0.ckpt")
    twin = _learner(model=_model())
    twin.load_checkpoint(tmp_path / "after-0.ckpt")
    assert_same_tree(list(twin.class_means), list(learner.class_means))
    state = torch.get_rng_state()
    learner.fit(tasks[1].train)
    torch.set_rng_state(state)
    twin.fit(tasks[1].train)
    assert_same_tree(list(twin.class_means), list(learner.class_means))
    assert_same_tree(twin.buffer.state_dict(), learner.buffer.state_dict())


def test_state_folders_keep_exemplars_and_class_means(tmp_path):
    tasks = _tasks()

    def updater(model, **folders):
        return ModelUpdater(
            model,
            learner="icarl",
            buffer="herding",
            learner_kwargs={
                "memory_size": 8,
                "memory_batch_size": 4,
                "batch_size": 8,
                "feature_modules": ["1"],
            },
            max_epochs=1,
            **folders,
        )

    first = updater(_model(), output_state_folder=tmp_path / "s1")
    first.update(tasks[0].train, task_id="0")
    learner = first.learner_instance
    second = updater(_model(), input_state_folder=tmp_path / "s1")
    restored = second.learner_instance
    assert_same_tree(list(restored.class_means), list(learner.class_means))
    assert_same_tree(restored.buffer.state_dict(), learner.buffer.state_dict())
    assert_same_tree(parameters_of(restored.model), parameters_of(learner.model))
    old = restored.components["icarl"]._old_classes
    second.update(tasks[1].train, task_id="1")
    assert old is None and restored.components["icarl"]._old_classes.tolist() == [
        True,
        True,
        False,
        False,
    ]
    assert restored.buffer.class_counts() == {0: 2, 1: 2, 2: 2, 3: 2}
    assert restored.class_means[1].all()


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_run_and_evaluate_with_the_nme_classifier(tmp_path, capsys):
    out = tmp_path / "out"
    # on the CPU: `evaluate` reads the state onto the CPU, and the run's own evaluation agrees with
    # it to the last digit only on the same device (where CUDA is visible, run would use it)
    args = ["run", "--learner", "icarl", "--hidden", "16", "--epochs", "1", "--device", "cpu"]
    assert main([*args, "--memory-size", "40", "--output-dir", str(out), "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "average_accuracy" in table
    state = str(out / "state" / "seed-0")
    argv = ["evaluate", "--state", state, "--scenario", "split-digits", "--classifier", "nme"]
    assert main(argv) == 0
    nme = capsys.readouterr().out
    final = float(nme.split("average accuracy ")[1].split()[0])
    assert f"average_accuracy                    {final:.3f}" in table  # run's own evaluation
    assert nme.startswith("classifier nme\n")
    assert main(argv[:-2]) == 0  # no --classifier: the method's own, said on the first line
    own = capsys.readouterr().out
    assert "average accuracy" in own
    assert own == nme.replace("classifier nme\n", "classifier nme (the method's own)\n")
    assert main([*argv[:-1], "logits"]) == 0  # the model's logits
    assert capsys.readouterr().out.startswith("classifier logits\n")


def test_cli_refuses_the_nme_classifier_for_other_learners(tmp_path, capsys):
    out = tmp_path / "out"
    run = ["run", "--learner", "fine-tuning", "--hidden", "8", "--epochs", "1"]
    assert main([*run, "--output-dir", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    state = str(out / "state" / "seed-0")
    argv = ["evaluate", "--state", state, "--scenario", "split-digits", "--classifier", "nme"]
    assert main(argv) == 2
    assert "--classifier nme needs a state folder of --learner icarl" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_config_file_run_and_evaluate_with_the_nme_classifier(tmp_path, capsys):

    config = str(ROOT / "examples" / "configs" / "quick_config.py")
    out = tmp_path / "out"
    run = ["run", "--config-file", config, "--chunks", "2", "--learner", "icarl"]
    assert main([*run, "--epochs", "1", "--output-dir", str(out), "--no-progress"]) == 2
    assert "needs a feature extractor" in capsys.readouterr().err
    assert not out.exists()
    features = ["--feature-modules", '["1"]', "--epochs", "1", "--device", "cpu"]  # as above
    assert main([*run, *features, "--output-dir", str(out), "--no-progress"]) == 0
    table = capsys.readouterr().out
    state = str(out / "state" / "seed-0")
    argv = ["evaluate", "--state", state, "--config-file", config, "--classifier", "nme"]
    assert main(argv) == 0
    final = float(capsys.readouterr().out.split("average accuracy ")[1].split()[0])
    assert f"average_accuracy                    {final:.3f}" in table
