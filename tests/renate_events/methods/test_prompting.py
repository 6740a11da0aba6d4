"""What the prompt methods (L2P, DualPrompt, CODA-Prompt) share, on a tiny random ViT (2 blocks,
width 32, 8x8 images): the backbone frozen while prompts, keys and head learn; exact checkpoint
and state-folder round trips; the refusal of a model that is not a ViT; key-query matching
against hand-written references; no host synchronisation per step on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.hyperparameters import hyperparameters
from renate_events.methods import LEARNERS, method
from renate_events.methods._prompting import (
    PromptModelError,
    batchwise_keys,
    key_similarity,
    orthogonal_rows_,
    orthogonality_penalty,
    pull_loss,
    top_k_keys,
)
from renate_events.models import vit
from renate_events.updater import ModelUpdater
from tests.helpers import assert_next_update_steps_do_not_sync, one_line_cli_error, parameters_of
from trainer import ListenerError, Trainer

CLASSES = 4
TINY = {"num_classes": CLASSES, "image_size": 8, "patch_size": 4, "dim": 32, "depth": 2}
SMALL_ARGS = {
    "l2p": {"pool_size": 6, "pool_selection_size": 2, "prompt_size": 3},
    "dualprompt": {"g_prompt_layers": [0], "e_prompt_layers": [1], "pool_size": 4},
    "coda-prompt": {"pool_size": 8, "num_tasks": 4, "prompt_layers": [0, 1], "ortho_mu": 0.1},
}
NAMES = sorted(SMALL_ARGS)


def tiny_vit(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return vit(**TINY)


def task(labels: list[int], seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(len(labels), 3, 8, 8, generator=generator)
    return TensorDataset(images, torch.tensor(labels))


def learner_of(name: str, model: torch.nn.Module, **options):
    return LEARNERS[name](
        model=model,
        optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1),
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cpu", seed=0),
        **{**SMALL_ARGS[name], **options},
    )


@pytest.mark.parametrize("name", NAMES)
def test_only_prompts_keys_and_head_train(name):
    model = tiny_vit()
    learner = learner_of(name, model)
    before = parameters_of(model)
    learner.fit(task([0, 1] * 8, seed=0))
    learner.fit(task([2, 3] * 8, seed=1))
    after = parameters_of(model)
    changed = {key for key in after if not torch.equal(after[key], before[key])}
    frozen = {key for key in before if key.startswith("backbone.") and ".prompt." not in key}
    assert frozen and not changed & frozen
    assert {"head.weight", "head.bias"} <= changed
    assert any(key.startswith("backbone.prompt.") for key in changed)
    assert int(model.backbone.prompt.task) == 1  # two updates
    assert not any(p.requires_grad for k, p in model.named_parameters() if k in frozen)


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_is_exact(name, tmp_path):
    model = tiny_vit()
    learner = learner_of(name, model)
    learner.fit(task([0, 1] * 8, seed=0))
    learner.save_checkpoint(tmp_path / "learner.ckpt")
    fresh = tiny_vit(seed=1)
    restored = learner_of(name, fresh)
    restored.load_checkpoint(tmp_path / "learner.ckpt")
    saved, loaded = model.state_dict(), fresh.state_dict()
    assert sorted(saved) == sorted(loaded)
    assert any(key.startswith("backbone.prompt.") for key in saved)
    for key, value in saved.items():
        assert torch.equal(value, loaded[key]), key
    images = task([0] * 4, seed=3).tensors[0]
    model.eval(), fresh.eval()
    assert torch.equal(model(images), fresh(images))


@pytest.mark.parametrize("name", NAMES)
def test_state_folder_round_trip_through_the_updater(name, tmp_path):
    def updater(**folders):
        return ModelUpdater(
            model=tiny_vit(seed=len(folders)),
            learner=name,
            learner_kwargs={"batch_size": 8, **SMALL_ARGS[name]},
            max_epochs=1,
            trainer_kwargs={"device": "cpu"},
            **folders,
        )

    first = updater(output_state_folder=str(tmp_path / "one"))
    first.update(task([0, 1] * 8, seed=0))
    second = updater(input_state_folder=str(tmp_path / "one"))
    a, b = first.learner_instance.model, second.learner_instance.model
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    second.update(task([2, 3] * 8, seed=1))
    assert int(b.backbone.prompt.task) == 1


@pytest.mark.parametrize("name", NAMES)
def test_a_model_that_is_not_a_vit_is_refused_before_anything_changes(name):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, CLASSES))
    with pytest.raises(PromptModelError, match=r"got a Sequential without a 'backbone'$"):
        learner_of(name, model)  # not "whose backbone is NoneType"
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_registered_with_its_paper_and_schema(name):
    spec = method(name)
    assert not spec.uses_memory and spec.classifier == "logits" and spec.model == "vit"
    assert any(venue in spec.summary for venue in ("CVPR 2022", "ECCV 2022", "CVPR 2023"))
    schema = hyperparameters(name)
    for key in SMALL_ARGS[name]:
        assert key in schema, key


def test_a_second_learner_continues_the_prompts_attached_already():
    model = tiny_vit()
    first = learner_of("l2p", model)
    first.fit(task([0, 1] * 8, seed=0))
    keys = model.backbone.prompt.keys.detach().clone()
    second = learner_of("l2p", model, prompt_sim_loss_weight=0.5)
    assert torch.equal(model.backbone.prompt.keys, keys)
    assert model.backbone.prompt.prompt_sim_loss_weight == 0.5
    assert second.prompt is model.backbone.prompt
    with pytest.raises(PromptModelError, match="other shapes"):
        learner_of("l2p", model, pool_size=7)


def test_the_command_line_refuses_a_prompt_method_on_an_mlp(capsys, tmp_path):
    one_line_cli_error(
        capsys,
        ["run", "--learner", "l2p", "--epochs", "1", "--output-dir", str(tmp_path / "s")],
        "ViTBackbone",
        "--model vit",
    )


# -- key-query matching against hand-written references -------------------------------------------


def test_key_similarity_and_top_k_match_a_loop():
    generator = torch.Generator().manual_seed(0)
    query, keys = torch.randn(5, 8, generator=generator), torch.randn(7, 8, generator=generator)
    similarity = key_similarity(query, keys)
    for i in range(5):
        for m in range(7):
            expected = float(query[i] @ keys[m] / (query[i].norm() * keys[m].norm()))
            assert similarity[i, m].item() == pytest.approx(expected, abs=1e-6)
        ranked = sorted(range(7), key=lambda m: -similarity[i, m].item())
        assert top_k_keys(similarity, 3)[i].tolist() == ranked[:3]


def test_batchwise_keys_are_the_most_frequent_choices():
    indices = torch.tensor([[0, 3], [3, 1], [3, 0], [2, 0]])
    chosen = batchwise_keys(indices, pool_size=5)
    assert chosen.shape == (4, 2)
    assert sorted(chosen[0].tolist()) == [0, 3] and (chosen == chosen[0]).all()


def test_pull_loss_is_minus_the_mean_summed_similarity_of_the_chosen_keys():
    similarity = torch.tensor([[0.5, -0.2, 0.1], [0.3, 0.9, 0.0]])
    indices = torch.tensor([[0, 2], [1, 0]])
    expected = -((0.5 + 0.1) + (0.9 + 0.3)) / 2
    assert pull_loss(similarity, indices).item() == pytest.approx(expected)


def test_orthogonal_rows_are_orthonormal_to_the_earlier_ones():
    torch.manual_seed(0)
    weight = torch.randn(6, 4, 5)  # rows of length 20
    earlier = weight[:2].clone()
    orthogonal_rows_(weight, 2, 4)
    flat = weight.view(6, -1)
    assert torch.equal(flat[:2], earlier.view(2, -1))
    new = flat[2:4]
    assert torch.allclose(new @ new.t(), torch.eye(2), atol=1e-5)
    assert torch.allclose(new @ flat[:2].t(), torch.zeros(2, 2), atol=1e-5)


def test_orthogonality_penalty_counts_the_active_rows_only():
    rows = torch.eye(4)
    rows[3] = 2.0
    active = torch.tensor([True, True, False, False])
    assert orthogonality_penalty(rows, active).item() == 0.0
    full = torch.ones(4, dtype=torch.bool)
    gram = rows @ rows.t() - torch.eye(4)
    assert orthogonality_penalty(rows, full).item() == pytest.approx(gram.square().mean().item())


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_the_step_makes_no_host_sync_on_cuda(name):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny_vit().cuda()
    learner = LEARNERS[name](
        model=model,
        batch_size=8,
        trainer=Trainer(max_epochs=1, device="cuda", nonfinite_loss="off"),
        **SMALL_ARGS[name],
    )
    first, batch = task([0, 1] * 8, seed=0), task([2, 3] * 4, seed=1).tensors
    assert_next_update_steps_do_not_sync(learner, first, batch)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_command_line_runs_updates_and_evaluates_a_prompt_method(name, tmp_path, capsys):
    import json

    import safetensors.torch

    from renate_events.cli import main
    from tests.renate_events.datasets.test_readers_cifar import write_cifar10

    write_cifar10(tmp_path / "c" / "cifar-10-batches-bin", per_class=2, test_per_class=1)
    out = tmp_path / "out"
    argv = ["run", "--scenario", "seq-cifar10", "--data-dir", str(tmp_path / "c"), "--model"]
    argv += ["vit", "--model-args", "{dim = 32, depth = 2, patch_size = 8}", "--learner", name]
    argv += ["--epochs", "1", "--no-progress", "--device", "cpu", "--batch-size", "8"]
    hyper = {"dualprompt": ["--g-prompt-layers", "[0]", "--e-prompt-layers", "[1]"]}
    hyper["coda-prompt"] = ["--prompt-layers", "[0, 1]", "--pool-size", "10", "--num-tasks", "5"]
    assert main([*argv, *hyper.get(name, []), "--output-dir", str(out)]) == 0
    state = out / "state" / "seed-0"
    manifest = json.loads((state / "manifest.json").read_text())
    assert manifest["learner"] == name
    assert any(key.startswith("backbone.prompt.") for key in manifest["model"])
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    data = tmp_path / "new.safetensors"
    safetensors.torch.save_file({"inputs": images, "targets": torch.arange(8) % 10}, str(data))
    argv = ["update", "--input-state", str(state), "--data", str(data)]
    assert main([*argv, "--output-state", str(tmp_path / "next"), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--state", str(tmp_path / "next"), "--data", str(data)]) == 0
    assert "task 0: accuracy" in capsys.readouterr().out


@pytest.mark.hostile
@pytest.mark.all_or_nothing
@pytest.mark.parametrize("name", NAMES)
def test_a_loaded_update_index_out_of_range_is_refused_leaving_the_learner_as_it_was(
    name, tmp_path
):
    model = tiny_vit()
    learner = learner_of(name, model)
    learner.fit(task([0, 1] * 8, seed=0))
    model.backbone.prompt.task.fill_(-3)
    learner.save_checkpoint(tmp_path / "bad.ckpt")
    fresh = tiny_vit(seed=1)
    restored = learner_of(name, fresh)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ListenerError, match=r"key .backbone\.prompt\.task. must be"):
        restored.load_checkpoint(tmp_path / "bad.ckpt")
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, before[key]), key
