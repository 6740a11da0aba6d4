"""The precision switches of ``Trainer``: TF32 (process-wide, set for one fit and put back, also
when it fails) and the channels-last memory format (same losses, same checkpoint values)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer import Trainer
from trainer.data import to_device
from trainer.validators import WrongTypeError


def _tf32_settings() -> tuple[str, bool]:
    """What the legacy API reads: the float32 matmul precision and cuDNN's TF32 switch."""
    return torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32


@pytest.fixture(autouse=True)
def _restore_tf32():
    """Every test leaves torch's TF32 settings as it found them (written back through the
    legacy API, which makes both APIs readable again)."""
    matmul, conv = _tf32_settings()
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = conv


def _fit(trainer: Trainer, seen: list, *, fail: bool = False):
    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(2)]

    def step(batch):
        seen.append(_tf32_settings())
        if fail:
            raise RuntimeError("the step fails")
        x, y = batch
        return F.cross_entropy(model(x), y)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return trainer.fit(model, optimizer, data, step)


@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_is_set_for_the_fit_and_put_back(enabled):
    torch.set_float32_matmul_precision("medium")  # a user's own choice, not the default
    before = _tf32_settings()
    seen: list = []
    _fit(Trainer(max_epochs=1, device="cpu", tf32=enabled), seen)
    assert seen == [("high" if enabled else "highest", enabled)] * 2
    assert _tf32_settings() == before


def test_tf32_none_leaves_the_settings_alone():
    torch.backends.cudnn.allow_tf32 = False
    before = _tf32_settings()
    seen: list = []
    _fit(Trainer(max_epochs=1, device="cpu"), seen)
    assert seen == [before] * 2 and _tf32_settings() == before


def test_tf32_is_put_back_when_the_fit_fails():
    before = _tf32_settings()
    seen: list = []
    with pytest.raises(RuntimeError, match="the step fails"):
        _fit(Trainer(max_epochs=1, device="cpu", tf32=True), seen, fail=True)
    assert seen == [("high", True)]
    assert _tf32_settings() == before


@pytest.mark.skipif(
    not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
    reason="torch < 2.9 has no fp32_precision strings",
)
def test_tf32_uses_the_fp32_precision_strings_when_the_process_did():
    # torch refuses to read a setting through one API after it was written through the other;
    # the switch must write and restore through the strings then, and never raise.
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    matmul.fp32_precision, conv.fp32_precision = "ieee", "ieee"
    seen: list = []
    model = torch.nn.Linear(4, 2)

    def step(batch):
        seen.append((matmul.fp32_precision, conv.fp32_precision))
        return model(batch).sum()

    trainer = Trainer(max_epochs=1, device="cpu", tf32=True)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.randn(2, 4)], step)
    assert seen == [("tf32", "tf32")]
    assert (matmul.fp32_precision, conv.fp32_precision) == ("ieee", "ieee")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("tf32", "yes", "Trainer.tf32 must be True, False or None, got 'yes'"),
        ("tf32", 1, "Trainer.tf32 must be True, False or None, got 1"),
        ("channels_last", None, "Trainer.channels_last must be a bool (True or False), got None"),
    ],
)
def test_bad_switch_values_are_refused(field, value, message):
    with pytest.raises(WrongTypeError) as refused:
        Trainer(device="cpu", **{field: value})
    assert str(refused.value) == message


# -- channels-last ------------------------------------------------------------------------------


def _conv_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 4),
    )


def _images() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(6, 3, 8, 8, generator=generator),
            torch.randint(0, 4, (6,), generator=generator),
        )
        for _ in range(4)
    ]


def _train(
    channels_last: bool, epochs: int = 2
) -> tuple[torch.nn.Module, Trainer, list[float], list[bool]]:
    model = _conv_net()
    losses: list[float] = []
    layouts: list[bool] = []

    def step(batch):
        x, y = batch
        layouts.append(x.is_contiguous(memory_format=torch.channels_last))
        loss = F.cross_entropy(model(x), y)
        losses.append(float(loss.detach()))
        return loss

    trainer = Trainer(max_epochs=epochs, device="cpu", seed=0, channels_last=channels_last)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _images(), step)
    return model, trainer, losses, layouts


def test_channels_last_gives_the_losses_of_the_contiguous_layout():
    model, _, losses, layouts = _train(channels_last=True)
    reference, _, expected, plain = _train(channels_last=False)
    assert all(layouts) and not any(plain)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, reference.state_dict()[name], msg=name)


def test_a_channels_last_checkpoint_reloads_the_same_values(tmp_path):
    model, trainer, _, _ = _train(channels_last=True)
    path = tmp_path / "ckpt.safetensors"
    trainer.save_checkpoint(path)
    for channels_last in (True, False):
        target = _conv_net()
        if channels_last:
            target = target.to(memory_format=torch.channels_last)
        loader = Trainer(device="cpu", channels_last=channels_last)
        loader.load_checkpoint(
            path, model=target, optimizer=torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
        )
        for name, tensor in model.state_dict().items():
            loaded = target.state_dict()[name]
            assert torch.equal(loaded, tensor), name
        assert target[0].weight.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_a_channels_last_fit_resumes_like_an_uninterrupted_one(tmp_path):
    _, trainer, _, _ = _train(channels_last=True)
    path = tmp_path / "ckpt.safetensors"
    trainer.save_checkpoint(path)
    uninterrupted, _, _, _ = _train(channels_last=True, epochs=3)
    resumed = _conv_net()
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)

    def step(batch):
        x, y = batch
        return F.cross_entropy(resumed(x), y)

    again = Trainer(max_epochs=3, device="cpu", seed=0, channels_last=True)
    result = again.fit(resumed, optimizer, _images(), step, resume_from=path)
    assert result.steps == 12
    assert resumed[0].weight.is_contiguous(memory_format=torch.channels_last)
    for name, tensor in uninterrupted.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], tensor, msg=name)


def test_to_device_converts_only_four_dimensional_tensors():
    batch = {"x": torch.randn(2, 3, 4, 4), "y": torch.arange(2), "m": torch.zeros(2, 4, 4)}
    moved = to_device(batch, torch.device("cpu"), channels_last=True)
    assert moved["x"].is_contiguous(memory_format=torch.channels_last)
    assert not moved["x"].is_contiguous()
    assert moved["y"] is batch["y"] and moved["m"] is batch["m"]
    assert torch.equal(moved["x"], batch["x"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_channels_last_on_the_gpu_keeps_the_copy_asynchronous():
    # The conversion happens on the device, after the copy from pinned memory.
    device = torch.device("cuda")
    x = torch.randn(4, 3, 8, 8).pin_memory()
    moved = to_device(x, device, channels_last=True)
    assert moved.device.type == "cuda"
    assert moved.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(moved.cpu(), x)
