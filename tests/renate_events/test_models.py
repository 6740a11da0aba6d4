"""The model zoo: shapes, sizes against the published figures, feature modules, bad arguments."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from renate_events.methods import PooledOutputDistillationExperienceReplayLearner
from renate_events.models import MODELS, build_model, mlp
from trainer import Trainer


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "kwargs", "shape", "millions"),
    [
        ("resnet18", {"nf": 64}, (3, 32, 32), 11.17),  # DER's ResNet-18
        ("resnet18", {"nf": 20}, (3, 32, 32), 1.09),  # GEM's reduced ResNet-18
        ("resnet32", {}, (3, 32, 32), 0.46),  # He et al.'s CIFAR ResNet-32
        ("vit", {"dim": 64, "depth": 2, "heads": 4}, (3, 32, 32), 0.11),  # 2 x 12 dim^2 + patches
        ("mlp", {"inputs": 64, "hidden": [32, 16]}, (8, 8), 0.0028),
    ],
)
def test_every_model_classifies_and_has_the_expected_size(name, kwargs, shape, millions):
    model = build_model(name, num_classes=10, **kwargs)
    assert model(torch.rand(2, *shape)).shape == (2, 10)
    assert _parameters(model) / 1e6 == pytest.approx(millions, rel=0.02)
    modules = dict(model.named_modules())
    assert model.feature_module_names and all(n in modules for n in model.feature_module_names)
    assert model.head.out_features == 10


def test_feature_modules_feed_podnet():
    model = build_model("resnet18", num_classes=4, nf=4)
    learner = PooledOutputDistillationExperienceReplayLearner(
        model=model,
        memory_size=8,
        memory_batch_size=4,
        batch_size=4,
        feature_modules=model.feature_module_names,
        trainer=Trainer(max_epochs=1, device="cpu"),
    )
    data = TensorDataset(torch.rand(8, 3, 8, 8), torch.randint(0, 4, (8,)))
    assert learner.fit(data).steps == 2
    assert learner.fit(data).steps == 2  # the second update distils the stored features


def test_mlp_flattens_images_and_names_its_relu_outputs():
    model = mlp(inputs=12, num_classes=3, hidden=(5,))
    assert model(torch.zeros(4, 3, 4)).shape == (4, 3)
    features = {}
    module = dict(model.named_modules())[model.feature_module_names[0]]
    module.register_forward_hook(lambda m, i, o: features.setdefault("x", o))
    model(torch.randn(2, 12))
    assert features["x"].shape == (2, 5) and (features["x"] >= 0).all()


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("resnet50", {"num_classes": 10}, "unknown model 'resnet50'"),
        ("resnet18", {"num_classes": 10, "width": 3}, "does not take \\['width'\\]"),
        ("resnet18", {}, "needs \\['num_classes'\\]"),
        ("mlp", {"inputs": 4, "num_classes": 2, "hidden": [-1]}, "each hidden size must be"),
        ("mlp", {"inputs": 4, "num_classes": 2, "hidden": [2**31]}, "each hidden size must be"),
        ("vit", {"num_classes": 2, "image_size": 30}, "not a multiple of patch_size"),
        ("resnet32", {"num_classes": 0}, "num_classes must be an int >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_allocated(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_model(name, **kwargs)


def test_vit_says_which_image_size_it_was_built_for():
    model = build_model("vit", num_classes=2, dim=32, depth=1, heads=2)
    with pytest.raises(ValueError, match="images must be 32x32, got \\(28, 28\\)"):
        model(torch.zeros(1, 3, 28, 28))


def test_the_registry_lists_the_zoo():
    assert sorted(MODELS) == ["mlp", "resnet18", "resnet32", "vit"]
