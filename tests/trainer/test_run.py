"""Tests for trainer.run: place_model, where a fit (and what runs the model before it) puts it."""

from __future__ import annotations

import pytest
import torch

from trainer import Trainer
from trainer.run import place_model


def test_place_model_puts_the_model_where_the_fit_trains_it() -> None:
    model = torch.nn.Linear(2, 2)
    weight = model.weight
    assert place_model(Trainer(device="cpu"), model) == torch.device("cpu")
    assert model.weight is weight  # moved in place: an optimizer built before still holds it
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert place_model(Trainer(device="auto"), torch.nn.Linear(2, 2)).type == expected


def test_place_model_takes_the_channels_last_format_as_the_fit_does() -> None:
    model = torch.nn.Conv2d(3, 4, 3)
    place_model(Trainer(device="cpu", channels_last=True), model)
    assert model.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.weight.is_contiguous()
    plain = torch.nn.Conv2d(3, 4, 3)
    place_model(Trainer(device="cpu"), plain)
    assert plain.weight.is_contiguous()


@pytest.mark.gpu
def test_place_model_on_a_gpu() -> None:
    model = torch.nn.Linear(2, 2)
    assert place_model(Trainer(device="cuda"), model).type == "cuda"
    assert model.weight.device.type == "cuda"
