"""Review of issue 18 (the rest of Renate's methods): regressions found by trying the learners
as a user would."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import TensorDataset

from renate_events.cli import main
from renate_events.methods import (
    ElasticWeightConsolidationLearner,
    GDumbLearner,
    ICaRLLearner,
    LearningWithoutForgettingLearner,
    OfflineExperienceReplayLearner,
)
from trainer import Trainer
from trainer.exceptions import NonFiniteLossError


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 255


def _bytes(task: int) -> TensorDataset:
    """uint8 inputs the model can only take through the learner's transforms (as the CIFAR
    presets keep images)."""
    g = torch.Generator().manual_seed(task)
    inputs = torch.randint(0, 255, (16, 8), dtype=torch.uint8, generator=g)
    return TensorDataset(inputs, torch.randint(2 * task, 2 * task + 2, (16,), generator=g))


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


_TRANSFORMS: dict[str, Any] = {
    "train_transform": _scaled,
    "test_transform": _scaled,
    "buffer_transform": _scaled,
}


@pytest.mark.parametrize(
    ("cls", "kwargs", "steps"),
    [
        (ElasticWeightConsolidationLearner, {}, 2),
        (ICaRLLearner, {"feature_modules": ["1"], "memory_size": 8, "memory_batch_size": 4}, 2),
        (GDumbLearner, {"memory_size": 8, "memory_batch_size": 4}, 1),  # the 8 buffered
    ],
    ids=["ewc-fisher", "icarl-means", "gdumb-class-probe"],
)
def test_learners_call_the_model_on_transformed_inputs_only(
    cls: Any, kwargs: Any, steps: int
) -> None:
    # EWC's Fisher pass, iCaRL's class count after herding and GDumb's class probe ran the
    # model on the raw inputs, which fails for data that needs the learner's transform.
    learner = cls(
        model=_mlp(),
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
        **_TRANSFORMS,
        **kwargs,
    )
    for task in range(2):
        assert learner.fit(_bytes(task)).steps == steps


def test_ewc_fisher_is_that_of_the_transformed_training_data() -> None:
    learner = ElasticWeightConsolidationLearner(
        model=_mlp(), batch_size=16, trainer=Trainer(max_epochs=1, device="cpu"), **_TRANSFORMS
    )
    data = _bytes(0)
    learner.fit(data)
    (fisher,) = learner.components["ewc"].fisher_information()  # type: ignore[attr-defined]
    model = learner.model
    model.zero_grad()
    inputs, targets = data.tensors
    torch.nn.functional.cross_entropy(model(_scaled(inputs)), targets).backward()
    torch.testing.assert_close(fisher["0.weight"], model[0].weight.grad.square())


def _chunk(task: int, n: int = 32, width: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(task)
    inputs = torch.randn(n, width, generator=g)
    return TensorDataset(inputs, torch.randint(2 * task, 2 * task + 2, (n,), generator=g))


def test_a_refused_offline_er_update_keeps_the_loss_weights() -> None:
    learner = OfflineExperienceReplayLearner(
        model=_mlp(),
        memory_size=16,
        memory_batch_size=4,
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    for task in range(2):
        learner.fit(_chunk(task))
    memory_loss = learner.components["memory_loss"]
    # Renate's dynamic weight of the second update: N_t / (N_t + N_M) = 32 / (32 + 16).
    assert learner.loss_weight == pytest.approx(2 / 3)
    assert memory_loss.weight == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="per-sample shape"):
        learner.fit(_chunk(2, n=64, width=5))  # refused: inputs of another shape
    assert learner.loss_weight == pytest.approx(2 / 3)
    assert memory_loss.weight == pytest.approx(1 / 3)


def test_gdumb_with_another_buffer_says_what_to_pass_to_model_updater() -> None:
    # ModelUpdater builds a reservoir unless told otherwise: "leave buffer unset" alone was no
    # help to a user who had left it unset.
    from renate_events.updater import ModelUpdater

    with pytest.raises(ValueError, match="ModelUpdater: buffer='greedy-class-balancing'"):
        ModelUpdater(
            model=_mlp(), learner="gdumb", buffer="reservoir", learner_kwargs={"memory_size": 8}
        ).update(_chunk(0))


@pytest.mark.parametrize("learner", ["gdumb", "icarl"])
def test_model_updater_builds_the_buffer_the_learner_needs_when_none_is_named(learner: str) -> None:
    # ModelUpdater's default buffer was always the reservoir, which GDumb and iCaRL refuse: a
    # user had to know to name their buffer (the command line already picked it).
    from renate_events.updater import ModelUpdater

    kwargs = {"memory_size": 8, "memory_batch_size": 4}
    if learner == "icarl":
        kwargs["feature_modules"] = ["1"]
    updater = ModelUpdater(
        model=_mlp(), learner=learner, learner_kwargs=kwargs, trainer_kwargs={"device": "cpu"}
    )
    assert updater.update(_chunk(0)).steps > 0


def test_ewc_refuses_a_decay_factor_it_would_ignore() -> None:
    # decay_factor acts only in online mode; in "separate" mode it was silently ignored
    # (Avalanche's EWCPlugin refuses the combination too).
    with pytest.raises(ValueError, match=r"decay_factor.*ewc_mode='online'"):
        ElasticWeightConsolidationLearner(model=_mlp(), decay_factor=0.5)


def test_a_mapped_herding_buffer_is_refused_in_one_line(tmp_path: Any, capsys: Any) -> None:
    # There is no memory-mapped HerdingBuffer: ModelUpdater raised a KeyError when it made the
    # buffer, and the command line printed a traceback (exit 1).
    from renate_events.cli import main
    from renate_events.updater import ModelUpdater

    with pytest.raises(ValueError, match=r"buffer_storage='mapped'.*'herding'"):
        ModelUpdater(
            model=_mlp(),
            learner="icarl",
            buffer="herding",
            buffer_storage="mapped",
            learner_kwargs={"feature_modules": ["1"], "memory_size": 8},
        )
    config = tmp_path / "config.py"
    config.write_text(
        "import torch\n"
        "def model_fn():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),\n"
        "                               torch.nn.Linear(16, 4))\n"
        "def data_fn(chunk_id, seed):\n"
        "    return torch.randn(16, 8), torch.arange(16) % 4\n"
    )
    status = main(
        ["update", "--config-file", str(config), "--output-state", str(tmp_path / "state"),
         "--learner", "icarl", "--feature-modules", '["1"]', "--memory-size", "8",
         "--buffer-storage", "mapped", "--epochs", "1", "--no-progress"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "'herding'" in err, err
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("learner", ["er", "offline-er", "der"])
def test_the_herding_buffer_is_refused_for_learners_that_do_not_herd(learner: str) -> None:
    # A HerdingBuffer's update only fills free slots: with any learner but iCaRL the memory
    # froze after its first memory_size samples, silently.
    from renate_events.updater import ModelUpdater

    with pytest.raises(ValueError, match="herding"):
        ModelUpdater(model=_mlp(), learner=learner, buffer="herding")


@pytest.mark.parametrize("cls", [LearningWithoutForgettingLearner, ICaRLLearner])
def test_a_first_update_that_fails_leaves_no_old_model_to_distil_from(cls: Any) -> None:
    # The frozen copy's count of updates and the classes noted in the failed step survived a
    # first update that failed before its first optimizer step, so the retried first update
    # distilled from the untrained model over those classes.
    kwargs = {"feature_modules": ["1"], "memory_size": 8, "memory_batch_size": 4}
    learner = cls(
        model=_mlp(),
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu"),
        **(kwargs if cls is ICaRLLearner else {}),
    )
    (component,) = learner.components.values()
    nan = TensorDataset(torch.full((16, 8), float("nan")), torch.arange(16) % 2)
    with pytest.raises(NonFiniteLossError):
        learner.fit(nan)
    learner.fit(_chunk(0))
    assert component._old_model is None and component._old_classes is None


def _edit_checkpoint_tree(state: Any, edit: Any) -> None:
    """Rewrite ``state``'s learner.safetensors with ``edit(tree)`` applied, its checksums and the
    manifest's made to match (a hand-crafted folder that every checksum vouches for)."""
    path = state / "learner.safetensors"
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    tree = json.loads(metadata["tree"])
    edit(tree)
    metadata["tree"] = json.dumps(tree, separators=(",", ":"))
    fields = [metadata[key] for key in ("format", "format_version", "tree")]
    checksums = json.loads(metadata["checksums"])
    checksums["tree"] = hashlib.sha256(
        json.dumps(fields, separators=(",", ":")).encode()
    ).hexdigest()
    metadata["checksums"] = json.dumps(checksums, separators=(",", ":"))
    save_file(tensors, str(path), metadata=metadata)
    manifest = json.loads((state / "manifest.json").read_text())
    manifest["files"]["learner.safetensors"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (state / "manifest.json").write_text(json.dumps(manifest))


def test_a_component_refusing_the_state_folders_checkpoint_is_one_line(
    tmp_path: Any, capsys: Any
) -> None:
    # A listener refusing its state on load came out as the trainer's ListenerError: a
    # traceback on the command line instead of an error naming the folder's file.
    run = ["run", "--learner", "lwf", "--epochs", "1", "--no-progress"]
    assert main([*run, "--output-dir", str(tmp_path / "run")]) == 0
    state = tmp_path / "run" / "state" / "seed-0"
    _edit_checkpoint_tree(state, lambda tree: tree["listeners"]["lwf"].update(updates=-1))
    x = np.random.default_rng(0).random((16, 64), dtype=np.float32)
    np.savez(tmp_path / "new.npz", inputs=x, targets=np.arange(16) % 2)
    capsys.readouterr()
    for argv in (
        ["update", "--input-state", str(state), "--output-state", str(tmp_path / "out")],
        ["evaluate", "--state", str(state)],
    ):
        assert main([*argv, "--data", str(tmp_path / "new.npz")]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert str(state / "learner.safetensors") in line and "'updates' must be" in line
    assert not (tmp_path / "out").exists()
