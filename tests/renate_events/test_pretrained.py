"""Pretrained ViTs from local files: a tiny Hugging Face ViTModel saved with save_pretrained
(safetensors) loads into the project's backbone with the same outputs, from its folder or its
weights file; a missing path or weights that do not fit is one clear error; a prompt method
trains on it. The weights file holds the key names of transformers 4
(``encoder.layer.N.attention.attention.query``), a model read from a folder by transformers 5
those of version 5 (``layers.N.attention.q_proj``): both namings are loaded."""

from __future__ import annotations

import shutil

import pytest
import torch

from renate_events.methods import LEARNERS
from renate_events.pretrained import PretrainedModelError, pretrained_vit
from trainer import Trainer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved_vit(tmp_path_factory):
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=8,
        patch_size=4,
    )
    torch.manual_seed(0)
    model = transformers.ViTModel(config, add_pooling_layer=False).eval()
    folder = tmp_path_factory.mktemp("hf") / "tiny-vit"
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def _cls_of(model, images):
    with torch.no_grad():
        return model(pixel_values=images).last_hidden_state[:, 0]


def test_a_folder_loads_with_the_same_outputs(saved_vit):
    hf, folder = saved_vit
    model = pretrained_vit(folder, num_classes=5).eval()
    images = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        features = model.backbone(images)
    assert torch.allclose(features, _cls_of(hf, images), atol=1e-5)
    assert model(images).shape == (3, 5)


def test_a_weights_file_alone_loads_with_the_heads_given(saved_vit, tmp_path):
    hf, folder = saved_vit
    alone = tmp_path / "weights.safetensors"
    shutil.copy(folder / "model.safetensors", alone)
    images = torch.randn(2, 3, 8, 8)
    beside = pretrained_vit(folder / "model.safetensors", num_classes=2).eval()
    given = pretrained_vit(alone, num_classes=2, heads=4).eval()
    for model in (beside, given):
        with torch.no_grad():
            assert torch.allclose(model.backbone(images), _cls_of(hf, images), atol=1e-5)


def test_a_missing_path_is_one_clear_error(tmp_path):
    with pytest.raises(PretrainedModelError, match="no such file or folder"):
        pretrained_vit(tmp_path / "nothing", num_classes=2)


def test_weights_of_another_architecture_are_refused_naming_the_key(tmp_path):
    import safetensors.torch

    other = tmp_path / "mlp.safetensors"
    safetensors.torch.save_file({"0.weight": torch.zeros(2, 2)}, str(other))
    with pytest.raises(PretrainedModelError, match=r"embeddings\.patch_embeddings"):
        pretrained_vit(other, num_classes=2)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not safetensors")
    with pytest.raises(PretrainedModelError, match="not a safetensors file"):
        pretrained_vit(broken, num_classes=2)


def test_a_tensor_of_another_shape_is_refused(saved_vit, tmp_path):
    import safetensors.torch

    _, folder = saved_vit
    state = safetensors.torch.load_file(str(folder / "model.safetensors"))
    state["layernorm.weight"] = torch.ones(7)  # the final norm
    bad = tmp_path / "bad.safetensors"
    safetensors.torch.save_file(state, str(bad))
    with pytest.raises(PretrainedModelError, match=r"'norm\.weight'"):
        pretrained_vit(bad, num_classes=2, heads=4)
    with pytest.raises(PretrainedModelError, match="heads do not divide"):
        pretrained_vit(folder / "model.safetensors", num_classes=2, heads=5)


def test_a_folder_that_is_not_a_vit_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PretrainedModelError, match="not a Hugging Face ViT folder"):
        pretrained_vit(tmp_path, num_classes=2)


def test_a_prompt_method_trains_on_the_pretrained_backbone(saved_vit):
    _, folder = saved_vit
    model = pretrained_vit(folder, num_classes=4)
    frozen = model.backbone.blocks[0].linear1.weight.detach().clone()
    learner = LEARNERS["l2p"](
        model=model,
        pool_size=4,
        pool_selection_size=2,
        batch_size=4,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, 8, 8), torch.tensor([0, 1] * 4))
    assert learner.fit(data).steps == 2
    assert torch.equal(model.backbone.blocks[0].linear1.weight, frozen)


def test_a_classification_model_file_loads_without_its_head(saved_vit, tmp_path):
    hf, _ = saved_vit
    classifier = transformers.ViTForImageClassification(hf.config)
    classifier.vit.load_state_dict(hf.state_dict(), strict=False)
    classifier.save_pretrained(tmp_path / "cls", safe_serialization=True)
    model = pretrained_vit(tmp_path / "cls" / "model.safetensors", num_classes=3).eval()
    images = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.allclose(model.backbone(images), _cls_of(hf, images), atol=1e-5)


def _folder_with(tmp_path, saved_vit, state):
    """A copy of the saved folder (its config.json) holding ``state`` as its weights."""
    import safetensors.torch

    _, folder = saved_vit
    copy = tmp_path / "copy"
    copy.mkdir(parents=True)
    shutil.copy(folder / "config.json", copy / "config.json")
    if isinstance(state, bytes):
        (copy / "model.safetensors").write_bytes(state)
    else:
        safetensors.torch.save_file(state, str(copy / "model.safetensors"))
    return copy


@pytest.mark.hostile
def test_a_folder_whose_weights_do_not_fit_its_config_is_one_error(saved_vit, tmp_path):
    """transformers reinitialises missing tensors at random (a warning only) and raises its own
    error types for a corrupt file or a tensor of another shape: each is a PretrainedModelError
    naming the folder, never a half-pretrained model."""
    import safetensors.torch

    _, folder = saved_vit
    state = safetensors.torch.load_file(str(folder / "model.safetensors"))
    missing = {k: v for k, v in state.items() if ".1." not in k}  # block 1 left out
    with pytest.raises(PretrainedModelError, match=r"layers?\.1\..*is missing"):
        pretrained_vit(_folder_with(tmp_path / "a", saved_vit, missing), num_classes=2)
    other = dict(state, **{"layernorm.weight": torch.ones(7)})
    with pytest.raises(PretrainedModelError, match=r"layernorm\.weight.*shape"):
        pretrained_vit(_folder_with(tmp_path / "b", saved_vit, other), num_classes=2)
    with pytest.raises(PretrainedModelError, match="not a Hugging Face ViT folder"):
        pretrained_vit(_folder_with(tmp_path / "c", saved_vit, b"garbage"), num_classes=2)


@pytest.mark.hostile
def test_a_weights_file_that_contradicts_its_config_is_refused(saved_vit, tmp_path):
    """A file's architecture comes from its tensors; with a config.json beside it (a
    save_pretrained folder's file) a truncated file is not silently a shallower model."""
    import safetensors.torch

    _, folder = saved_vit
    state = safetensors.torch.load_file(str(folder / "model.safetensors"))
    missing = {k: v for k, v in state.items() if ".1." not in k}
    copy = _folder_with(tmp_path, saved_vit, missing)
    with pytest.raises(PretrainedModelError, match="num_hidden_layers"):
        pretrained_vit(copy / "model.safetensors", num_classes=2)


@pytest.mark.hostile
def test_a_config_beside_the_weights_nested_too_deeply_is_refused(saved_vit, tmp_path):
    """Counted before parsing, so that every Python version refuses it the same way (json's own
    limit is the interpreter's recursion limit)."""
    _, folder = saved_vit
    copy = tmp_path / "deep"
    copy.mkdir()
    shutil.copy(folder / "model.safetensors", copy / "model.safetensors")
    (copy / "config.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(PretrainedModelError, match="not JSON \\(it nests deeper than 32 levels"):
        pretrained_vit(copy / "model.safetensors", num_classes=2)
