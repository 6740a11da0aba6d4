"""The config files in examples/configs: each loads, its model fits its data, one short update
through the Python API runs. CIFAR and CSV data are generated in tmp_path in the real formats."""

from __future__ import annotations

import csv
import pathlib

import pytest
import torch

from renate_events.config import ConfigError, load_config
from renate_events.methods import ExperienceReplayLearner
from tests.helpers import ROOT
from tests.renate_events.datasets.test_readers_cifar import write_cifar10
from trainer import Trainer

CONFIGS = ROOT / "examples" / "configs"


def _update(config, chunk_id: int, seed: int = 0, max_steps: int | None = None):
    """One update: the config's model, loss, optimizer, data; returns the learner's result."""
    model = config.model()
    train, validation = config.data(chunk_id=chunk_id, seed=seed)
    test = config.test_data(chunk_id=chunk_id, seed=seed)
    loss = config.loss()
    learner = ExperienceReplayLearner(
        model=model,
        optimizer=config.optimizer,
        memory_size=16,
        memory_batch_size=8,
        batch_size=16,
        trainer=Trainer(max_epochs=1, max_steps=max_steps, device="cpu"),
        **({} if loss is None else {"loss_fn": loss}),
    )
    result = learner.fit(train, validation)
    model.eval()
    with torch.no_grad():
        logits = model(test.tensors[0])
    return result, logits, train, validation, test


def _check_shapes(config, train, validation, test, num_classes: int) -> None:
    model = config.model()
    for data in (train, validation, test):
        inputs, targets = data.tensors
        assert len(data) > 0 and targets.dtype == torch.int64
        assert inputs.dtype == torch.float32
        assert int(targets.max()) < num_classes
        assert model(inputs[:3]).shape == (min(3, len(inputs)), num_classes)


def test_digits_cnn() -> None:
    config = load_config(CONFIGS / "digits_cnn.py")
    module_names = ("loss_fn", "optimizer_fn", "lr_scheduler_fn", "metrics_fn", "test_data_fn")
    assert all(config.has(name) for name in module_names)
    result, logits, train, validation, test = _update(config, chunk_id=1)
    assert result.steps > 0 and logits.shape == (len(test), 10)
    _check_shapes(config, train, validation, test, num_classes=10)
    assert train.tensors[0].shape[1:] == (1, 8, 8)
    assert float(train.tensors[0].min()) >= 0 and float(train.tensors[0].max()) <= 1
    assert set(train.tensors[1].tolist()) == {2, 3} and set(test.tensors[1].tolist()) == {2, 3}
    assert len(validation) == int(0.2 * (len(train) + len(validation)))
    scheduler, interval = config.scheduler(config.optimizer(config.model().parameters()))
    assert interval == "epoch" and callable(scheduler.step)
    error = config.metrics()["error"](logits, test.tensors[1])
    assert 0 <= float(error) <= 1
    with pytest.raises(ConfigError, match=r"chunk_id must be in \[0, 4\]"):
        config.data(chunk_id=5, seed=0)


def _write_csv(path: pathlib.Path, rows: int) -> None:
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(rows, 3, generator=generator)
    labels = (features[:, 0] > 0).long() + (features[:, 1] > 1).long()
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["a", "label", "b", "c"])  # the label need not be the last column
        for x, y in zip(features.tolist(), labels.tolist()):
            writer.writerow([x[0], y, x[1], x[2]])


def test_tabular_csv_from_the_environment(tmp_path: pathlib.Path, monkeypatch) -> None:
    path = tmp_path / "rows.csv"
    _write_csv(path, rows=200)
    monkeypatch.setenv("RENATE_EVENTS_CSV", str(path))
    config = load_config(CONFIGS / "tabular_csv.py")
    result, logits, train, validation, test = _update(config, chunk_id=3)
    assert result.steps > 0 and logits.shape == (len(test), 3)
    _check_shapes(config, train, validation, test, num_classes=3)
    assert (len(train), len(validation), len(test)) == (35, 7, 8)  # 50 rows of block 3
    # block 3 is the last 50 rows of the file, in any order, the label column read as targets
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))[151:]
    expected = torch.tensor([[float(v) for v in row] for row in rows])
    got = torch.cat(
        [torch.cat([d.tensors[0], d.tensors[1][:, None]], 1) for d in (train, validation, test)]
    )
    expected = expected[:, [0, 2, 3, 1]]
    assert torch.allclose(got[torch.argsort(got[:, 0])], expected[torch.argsort(expected[:, 0])])


def test_tabular_csv_default_file_and_bad_files(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.delenv("RENATE_EVENTS_CSV", raising=False)
    shipped = CONFIGS / "data" / "tabular.csv"
    assert shipped.stat().st_size < 100_000
    config = load_config(CONFIGS / "tabular_csv.py")
    train, validation = config.data(chunk_id=0, seed=0)
    assert len(train) == 140 and len(validation) == 30 and train.tensors[0].shape[1] == 6
    bad = tmp_path / "bad.csv"
    monkeypatch.setenv("RENATE_EVENTS_CSV", str(bad))
    for text, words in [
        ("a,b\n1,2\n", "'label'"),
        ("a,label\n1,0\nx,1\n1,0\n1,0\n", "line 3: column 'a' is 'x'"),
        ("a,label\n1,0\n1,7\n1,0\n1,0\n", "line 3: 'label' is '7'"),
    ]:
        bad.write_text(text)
        with pytest.raises(ConfigError, match=words) as info:
            load_config(CONFIGS / "tabular_csv.py").data(chunk_id=0, seed=0)
        assert str(bad) in str(info.value)


@pytest.mark.slow
def test_cifar10(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.delenv("RENATE_EVENTS_CIFAR10", raising=False)
    config = load_config(CONFIGS / "cifar10.py")
    with pytest.raises(ConfigError, match="set RENATE_EVENTS_CIFAR10"):
        config.data(chunk_id=0, seed=0)
    write_cifar10(tmp_path / "cifar-10-batches-bin", per_class=50, test_per_class=5)
    monkeypatch.setenv("RENATE_EVENTS_CIFAR10", str(tmp_path))
    config = load_config(CONFIGS / "cifar10.py")
    result, logits, train, validation, test = _update(config, chunk_id=2)  # one epoch
    assert result.steps == 6 and logits.shape == (10, 10)  # 90 images in batches of 16
    _check_shapes(config, train, validation, test, num_classes=10)
    assert (len(train), len(validation)) == (90, 10)
    assert set(test.tensors[1].tolist()) == {4, 5} and float(train.tensors[0].max()) <= 1
