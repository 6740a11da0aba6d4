"""DualPrompt (Wang et al., ECCV 2022): the update's own E-prompt in training, the most similar
key's in evaluation, the G-prompt everywhere, against hand-written prefixes; a pool too small
for the updates is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from renate_events.methods import DualPromptLearner
from renate_events.methods.dualprompt import DualPrompts
from renate_events.models import vit
from trainer import Trainer


def _prompted():
    torch.manual_seed(0)
    model = vit(num_classes=3, image_size=8, patch_size=4, dim=32, depth=3)
    prompts = DualPrompts(32, g_layers=[0], g_length=2, e_layers=[1, 2], e_length=3,
                          pool_size=4, pull_constraint_coeff=1.0)  # fmt: skip
    model.backbone.attach_prompt(prompts)
    return model, prompts


def _reference(backbone, prompts, images, chosen):
    batch = len(images)
    prefixes = {0: (prompts.g_prompts[0, 0].expand(batch, -1, -1),
                    prompts.g_prompts[0, 1].expand(batch, -1, -1))}  # fmt: skip
    for number, layer in enumerate((1, 2)):
        e = prompts.e_prompts[number]
        prefixes[layer] = (e[0][chosen], e[1][chosen])
    return backbone.encode(backbone.embed(images), prefixes)[:, 0]


def test_training_uses_the_updates_own_e_prompt_and_pulls_its_key():
    model, prompts = _prompted()
    prompts.task.fill_(2)  # the third update
    model.train()
    images = torch.randn(4, 3, 8, 8)
    features = model.backbone(images)
    chosen = torch.full((4,), 2)
    assert torch.allclose(features, _reference(model.backbone, prompts, images, chosen), atol=1e-5)
    with torch.no_grad():
        query = model.backbone.query(images)
    pull = F.cosine_similarity(query, prompts.keys[2].unsqueeze(0)).sum() / 4
    assert torch.allclose(prompts.take_loss(), -pull, atol=1e-5)


def test_evaluation_chooses_the_most_similar_key():
    model, prompts = _prompted()
    model.eval()
    images = torch.randn(6, 3, 8, 8)
    with torch.no_grad():
        query = model.backbone.query(images)
        similarity = F.normalize(query, dim=1) @ F.normalize(prompts.keys, dim=1).t()
        chosen = similarity.argmax(dim=1)
        expected = _reference(model.backbone, prompts, images, chosen)
        assert torch.allclose(model.backbone(images), expected, atol=1e-5)


def test_an_update_beyond_the_pool_is_refused_and_leaves_no_trace():
    torch.manual_seed(0)
    model = vit(num_classes=4, image_size=8, patch_size=4, dim=32, depth=2)
    learner = DualPromptLearner(
        model=model, g_prompt_layers=[0], e_prompt_layers=[1], pool_size=1,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )  # fmt: skip
    data = TensorDataset(torch.randn(8, 3, 8, 8), torch.tensor([0, 1] * 4))
    learner.fit(data)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="larger pool_size"):
        learner.fit(data)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_an_update_beyond_the_pool_is_an_update_input_error_of_the_updater(tmp_path):
    """ModelUpdater refuses it before training, as an UpdateInputError (one line on the
    command line), and writes nothing."""
    from renate_events.updater import ModelUpdater, UpdateInputError

    def updater(**folders):
        torch.manual_seed(0)
        return ModelUpdater(
            model=vit(num_classes=4, image_size=8, patch_size=4, dim=32, depth=2),
            learner="dualprompt",
            learner_kwargs={"g_prompt_layers": [0], "e_prompt_layers": [1], "pool_size": 1},
            max_epochs=1,
            trainer_kwargs={"device": "cpu"},
            **folders,
        )

    data = TensorDataset(torch.randn(8, 3, 8, 8), torch.tensor([0, 1] * 4))
    updater(output_state_folder=str(tmp_path / "one")).update(data)
    second = updater(
        input_state_folder=str(tmp_path / "one"), output_state_folder=str(tmp_path / "two")
    )
    with pytest.raises(UpdateInputError, match="larger pool_size"):
        second.update(data)
    assert not (tmp_path / "two").exists()


def test_a_run_longer_than_the_pool_is_one_line_before_training(tmp_path, capsys, monkeypatch):
    """A run of five tasks with a pool of three E-prompts: refused before the first update (it
    trained three updates, then stopped at the fourth)."""
    from renate_events.methods import DualPromptLearner as learner_class
    from tests.helpers import one_line_cli_error
    from tests.renate_events.datasets.test_readers_cifar import write_cifar10

    write_cifar10(tmp_path / "data" / "cifar-10-batches-bin", per_class=2, test_per_class=1)
    fits = []
    original = learner_class.fit
    monkeypatch.setattr(
        learner_class, "fit", lambda self, *a, **k: fits.append(1) or original(self, *a, **k)
    )
    argv = ["run", "--scenario", "seq-cifar10", "--data-dir", str(tmp_path / "data")]
    argv += ["--model", "vit", "--model-args", "{dim = 32, depth = 2, patch_size = 8}"]
    argv += ["--learner", "dualprompt", "--pool-size", "3", "--g-prompt-layers", "[0]"]
    argv += ["--e-prompt-layers", "[1]", "--epochs", "1", "--no-progress"]
    argv += ["--output-dir", str(tmp_path / "out")]
    one_line_cli_error(capsys, argv, "--pool-size must be at least 5 for 5 more updates")
    assert fits == [] and not (tmp_path / "out").exists()
