"""The ready-made listeners, each on a small fit of synthetic data."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time

import attrs
import pytest
import torch

from tests.helpers import Recorder, classification_step, make_data, make_loader, make_model
from trainer import EVENTS, ListenerError, ListenerState, Trainer, read_checkpoint
from trainer.listeners import (
    EarlyStopping,
    LearningRateMonitor,
    MetricsLogger,
    ModelCheckpoint,
    ProgressBar,
    TensorBoardLogger,
    Timer,
)

BATCHES = 6  # make_data() has 48 samples; batches of 8


def _fit(trainer, *, epochs_val=None, val=False, resume_from=None, step=None, lr=0.1):
    """Fit a fresh model on the shared data; ``epochs_val`` scripts ``val_loss`` per epoch."""
    model = make_model()
    loader = make_loader(make_data(), batch_size=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    kwargs = {}
    if val or epochs_val is not None:
        kwargs["val_loader"] = make_loader(make_data(n=16, seed=1), batch_size=8, shuffle=False)
    if epochs_val is not None:  # validation after epoch e runs at global step (e + 1) * BATCHES
        kwargs["val_step"] = lambda batch: torch.tensor(
            epochs_val[trainer.state.global_step // BATCHES - 1]
        )
    step = step(model) if step is not None else classification_step(model)
    return trainer.fit(model, optimizer, loader, step, resume_from=resume_from, **kwargs)


@attrs.define(eq=False)
class LossLog:
    """Keeps every batch's loss (a copy, so that it never syncs during the fit)."""

    losses: list[torch.Tensor] = attrs.field(factory=list)

    def on_batch_end(self, loss):
        self.losses.append(loss.detach().clone())


@attrs.define(eq=False)
class Crash:
    """Raises at the end of batch ``at``."""

    at: int

    def on_batch_end(self, state):
        if state.global_step == self.at:
            raise RuntimeError("simulated crash")


# -- arguments -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "field", "value"),
    [
        (lambda: MetricsLogger("m.csv", format="parquet"), "format", "'parquet'"),
        (lambda: MetricsLogger("m.csv", log_every_n_steps=0), "log_every_n_steps", "0"),
        (lambda: MetricsLogger("m.csv", log_every_n_steps=True), "log_every_n_steps", "True"),
        (lambda: ModelCheckpoint("c", every_n_steps=0), "every_n_steps", "0"),
        (lambda: ModelCheckpoint("c", every_n_epochs=-1), "every_n_epochs", "-1"),
        (lambda: ModelCheckpoint("c", mode="best"), "mode", "'best'"),
        (lambda: ModelCheckpoint("c", keep_last=-1), "keep_last", "-1"),
        (lambda: ModelCheckpoint("c", monitor=""), "monitor", "''"),
        (lambda: ModelCheckpoint("c", filename="{loss}"), "filename", "'{loss}'"),
        (lambda: ModelCheckpoint("c", filename="a/{step}"), "filename", "'a/{step}'"),
        (lambda: ModelCheckpoint("c", filename="best"), "filename", "'best'"),
        (lambda: EarlyStopping(patience=0), "patience", "0"),
        (lambda: EarlyStopping(min_delta=-0.1), "min_delta", "-0.1"),
        (lambda: EarlyStopping(min_delta=math.nan), "min_delta", "nan"),
        (lambda: EarlyStopping(mode="up"), "mode", "'up'"),
        (lambda: LearningRateMonitor(log_every_n_steps=0), "log_every_n_steps", "0"),
        (lambda: LearningRateMonitor(max_history=0), "max_history", "0"),
        (lambda: ProgressBar(log_every_n_steps=0), "log_every_n_steps", "0"),
    ],
)
def test_invalid_arguments_name_the_field_the_value_and_the_range(make, field, value):
    with pytest.raises(ValueError, match=field) as info:
        make()
    message = str(info.value)
    assert value in message
    assert any(word in message for word in (">=", "one of", "pattern", "metric name"))


def test_model_checkpoint_that_saves_nothing_is_refused():
    with pytest.raises(ValueError, match="would save nothing"):
        ModelCheckpoint("c", every_n_epochs=None, save_last=False)
    with pytest.raises(ValueError, match="would save nothing"):
        ModelCheckpoint("c", keep_last=0, save_last=False)


def test_tensorboard_logger_without_tensorboard_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'renate-events\[tensorboard\]'"):
        TensorBoardLogger("runs")


# -- MetricsLogger -------------------------------------------------------------------------------


def _read_csv(path):
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["step", "epoch", "name", "value"]
    return [(int(s), int(e), name, float(v)) for s, e, name, v in rows[1:]]


def _components_step(model):
    """A step whose outputs hold per-component 0-d losses and a non-scalar tensor."""

    def step(batch):
        x, y = batch
        logits = model(x)
        ce = torch.nn.functional.cross_entropy(logits, y)
        reg = logits.pow(2).mean()
        return {"loss": ce + 0.1 * reg, "ce": ce, "reg": reg, "logits": logits, "note": "x"}

    return step


def test_metrics_logger_csv_rows_hold_window_means_outputs_lr_throughput_and_validation(tmp_path):
    path = tmp_path / "logs" / "metrics.csv"
    trainer = Trainer(max_epochs=2, device="cpu", seed=0)
    trainer.subscribe(logger := MetricsLogger(path, log_every_n_steps=5))
    trainer.subscribe(losses := LossLog())
    _fit(trainer, val=True, step=_components_step)
    rows = _read_csv(path)
    train_steps = sorted({s for s, _, name, _ in rows if name == "train_loss"})
    assert train_steps == [5, 10, 12]  # every 5 steps, and the rest at train_end
    by = {(s, name): v for s, _, name, v in rows}
    expected = [
        torch.stack(losses.losses[a:b]).mean().item() for a, b in ((0, 5), (5, 10), (10, 12))
    ]
    for step, value in zip(train_steps, expected):
        assert by[step, "train_loss"] == pytest.approx(value, rel=1e-6)
        assert by[step, "lr"] == pytest.approx(0.1)
        assert by[step, "samples_per_s"] > 0
        assert {(step, "train_ce"), (step, "train_reg")} <= by.keys()
    names = {name for _, _, name, _ in rows}
    assert names == {"train_loss", "train_ce", "train_reg", "lr", "samples_per_s", "val_loss"}
    assert [(s, e) for s, e, name, _ in rows if name == "val_loss"] == [(6, 0), (12, 1)]
    assert logger._file is None  # closed at train_end


def test_metrics_logger_jsonl_and_one_column_per_parameter_group(tmp_path):
    path = tmp_path / "metrics.jsonl"
    trainer = Trainer(max_epochs=1, device="cpu")
    trainer.subscribe(MetricsLogger(path, format="jsonl", log_every_n_steps=3))
    model = make_model()
    groups = [
        {"params": model[0].parameters(), "lr": 0.1},
        {"params": model[3].parameters(), "lr": 0.01},
    ]
    loader = make_loader(make_data(), batch_size=8)
    trainer.fit(model, torch.optim.SGD(groups), loader, classification_step(model))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["step"] for row in rows] == [3, 6]
    assert all(row["epoch"] == 0 for row in rows)
    assert rows[0]["lr_group0"] == pytest.approx(0.1)
    assert rows[0]["lr_group1"] == pytest.approx(0.01)
    assert "lr" not in rows[0]


_SYNCING = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts calls of the tensor methods that copy a value to the host (and wait for it)."""
    count = [0]
    for name in _SYNCING:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return count


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_metrics_logger_reads_the_device_only_every_n_steps(tmp_path, host_reads, fmt):
    # Functions right before and right after the logger count the reads the logger makes.
    reads: list[int] = []
    trainer = Trainer(max_epochs=2, device="cpu", seed=0)
    trainer.subscribe(MetricsLogger(tmp_path / f"m.{fmt}", format=fmt, log_every_n_steps=4))
    for event in ("batch_start", "batch_end"):
        trainer.connect(event, lambda: reads.append(-host_reads[0]), priority=1)
        trainer.connect(event, lambda: reads.append(host_reads[0]), priority=-1)
    _fit(trainer, step=_components_step)
    per_event = [before + after for before, after in zip(reads[::2], reads[1::2])]
    per_step = [start + end for start, end in zip(per_event[::2], per_event[1::2])]
    assert per_step == [0, 0, 0, 1] * 3  # one tolist() per row, nothing in between


def test_metrics_logger_flushes_at_epoch_end_and_closes_on_exception(tmp_path):
    path = tmp_path / "m.csv"
    seen: list[int] = []
    trainer = Trainer(max_epochs=3, device="cpu")
    trainer.subscribe(logger := MetricsLogger(path, log_every_n_steps=2))
    trainer.connect("epoch_end", lambda: seen.append(len(_read_csv(path))))
    trainer.subscribe(Crash(at=BATCHES + 3))
    with pytest.raises(ListenerError, match="simulated crash"):
        _fit(trainer)
    assert seen == [3 * 3]  # after epoch 0, its three rows of three values are on disk
    assert logger._file is None


def test_metrics_logger_appends_when_a_fit_resumes(tmp_path):
    path, ckpt = tmp_path / "m.csv", tmp_path / "ckpt"
    first = Trainer(max_epochs=1, device="cpu", seed=0)
    first.subscribe(MetricsLogger(path, log_every_n_steps=3))
    first.subscribe(ModelCheckpoint(ckpt, every_n_epochs=1))
    _fit(first)
    second = Trainer(max_epochs=2, device="cpu", seed=0)
    second.subscribe(MetricsLogger(path, log_every_n_steps=3))
    second.subscribe(ModelCheckpoint(ckpt, every_n_epochs=1))
    _fit(second, resume_from=ckpt / "last.safetensors")
    assert path.read_text().count("step,epoch") == 1  # one header
    rows = _read_csv(path)
    assert sorted({s for s, _, name, _ in rows if name == "train_loss"}) == [3, 6, 9, 12]


def test_metrics_logger_keeps_skipped_batches_out_of_the_means(tmp_path):
    path = tmp_path / "m.jsonl"
    trainer = Trainer(max_epochs=1, device="cpu", nonfinite_loss="skip")
    trainer.subscribe(MetricsLogger(path, format="jsonl", log_every_n_steps=4))
    trainer.subscribe(losses := LossLog())

    def step_with_a_nan(model):
        step = classification_step(model)

        def nan_at_step_3(batch):
            outputs = step(batch)
            if trainer.state.global_step == 2:  # the third batch
                outputs["loss"] = outputs["loss"] * math.nan
            return outputs

        return nan_at_step_3

    _fit(trainer, step=step_with_a_nan)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    kept = [losses.losses[i] for i in (0, 1, 3)]
    assert rows[0]["train_loss"] == pytest.approx(torch.stack(kept).mean().item(), rel=1e-6)
    assert rows[0]["skipped_batches"] == 1
    assert rows[1]["step"] == 6 and math.isfinite(rows[1]["train_loss"])


def test_metrics_logger_writes_the_last_rows_on_ctrl_c(tmp_path):
    @attrs.define(eq=False)
    class Interrupt:
        def on_batch_end(self, state):
            if state.global_step == 6:
                raise KeyboardInterrupt

    path = tmp_path / "m.csv"
    trainer = Trainer(max_epochs=2, device="cpu")
    trainer.subscribe(logger := MetricsLogger(path, log_every_n_steps=4))
    trainer.subscribe(Interrupt())
    with pytest.raises(KeyboardInterrupt):
        _fit(trainer)
    steps = sorted({s for s, _, name, _ in _read_csv(path) if name == "train_loss"})
    assert steps == [4, 6]  # train_end after the interrupt logs steps 5-6
    assert logger._file is None


# -- ModelCheckpoint -----------------------------------------------------------------------------


def _periodic(folder):
    return sorted(
        name for name in os.listdir(folder) if name not in ("last.safetensors", "best.safetensors")
    )


def test_model_checkpoint_keeps_the_last_k_and_links_last(tmp_path):
    trainer = Trainer(max_epochs=2, device="cpu")
    checkpoint = ModelCheckpoint(tmp_path, every_n_steps=4, every_n_epochs=None, keep_last=2)
    trainer.subscribe(checkpoint)
    _fit(trainer)
    assert _periodic(tmp_path) == ["epoch=1-step=12.safetensors", "epoch=1-step=8.safetensors"]
    assert checkpoint.kept == [str(tmp_path / f"epoch=1-step={s}.safetensors") for s in (8, 12)]
    newest = read_checkpoint(checkpoint.kept[-1])
    assert newest["listeners"]["model_checkpoint_0"]["kept"] == [
        "epoch=1-step=8.safetensors",
        "epoch=1-step=12.safetensors",
    ]  # each file stores the list it leaves behind
    assert newest["trainer"]["progress"]["global_step"] == 12
    last = read_checkpoint(checkpoint.last_model_path)
    assert last["trainer"]["progress"]["global_step"] == 12
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_model_checkpoint_copies_last_and_syncs_the_copy_where_hard_links_fail(
    tmp_path, monkeypatch
):
    import trainer.listeners.model_checkpoint as module

    def no_links(source, target):
        raise OSError("hard links not supported")

    def record(path):  # what is flushed to disk, before it is renamed into place
        with open(path, "rb") as handle:
            synced.append((os.path.basename(path), handle.read()))

    synced: list[tuple[str, bytes]] = []
    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(module, "fsync_file", record)
    trainer = Trainer(max_epochs=1, device="cpu")
    checkpoint = ModelCheckpoint(tmp_path, every_n_epochs=1, keep_last=1)
    trainer.subscribe(checkpoint)
    _fit(trainer)
    with open(checkpoint.kept[-1], "rb") as handle:
        periodic = handle.read()
    assert [(name.startswith(".last.safetensors."), data == periodic) for name, data in synced] == [
        (True, True)
    ]
    assert not os.path.samefile(checkpoint.kept[-1], checkpoint.last_model_path)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_model_checkpoint_never_deletes_before_the_new_file_is_written(tmp_path, monkeypatch):
    import trainer.checkpointing as trainer_module

    written: list[str] = []
    write = trainer_module.write_checkpoint

    def failing_third_write(path, tree):
        if len(written) == 2:
            raise OSError("disk full")
        written.append(os.path.basename(path))
        write(path, tree)

    monkeypatch.setattr(trainer_module, "write_checkpoint", failing_third_write)
    trainer = Trainer(max_epochs=1, device="cpu")
    checkpoint = ModelCheckpoint(
        tmp_path, every_n_steps=2, every_n_epochs=None, keep_last=1, save_last=False
    )
    trainer.subscribe(checkpoint)
    with pytest.raises(OSError, match="disk full"):
        _fit(trainer)
    # The write at step 4 replaced the step-2 file; the failed step-6 write deleted nothing.
    assert _periodic(tmp_path) == ["epoch=0-step=4.safetensors"]


def test_model_checkpoint_tracks_the_best_validation_score(tmp_path):
    scores = [1.0, 0.5, 0.75, 0.25, 0.375]
    trainer = Trainer(max_epochs=5, device="cpu")
    checkpoint = ModelCheckpoint(tmp_path, monitor="val_loss", keep_last=None)
    trainer.subscribe(checkpoint)
    snapshots = {}
    trainer.connect(
        "validation_end",
        lambda model, state: snapshots.__setitem__(state.global_step, model[0].weight.clone()),
    )
    _fit(trainer, epochs_val=scores)
    assert checkpoint.best_score == 0.25
    assert checkpoint.best_step == 4 * BATCHES
    best = read_checkpoint(checkpoint.best_model_path)
    assert best["listeners"]["model_checkpoint_0"]["best_score"] == 0.25
    assert torch.equal(best["model"]["0.weight"], snapshots[4 * BATCHES])
    assert len(_periodic(tmp_path)) == 5  # keep_last=None keeps every periodic file


def test_model_checkpoint_max_mode_and_unknown_metric(tmp_path):
    trainer = Trainer(max_epochs=3, device="cpu")
    checkpoint = ModelCheckpoint(tmp_path, monitor="val_loss", mode="max", every_n_epochs=None)
    trainer.subscribe(checkpoint)
    _fit(trainer, epochs_val=[0.25, 0.75, 0.5])
    assert (checkpoint.best_score, checkpoint.best_step) == (0.75, 2 * BATCHES)
    assert _periodic(tmp_path) == []
    wrong = Trainer(max_epochs=1, device="cpu")
    wrong.subscribe(ModelCheckpoint(tmp_path / "w", monitor="val_accuracy"))
    with pytest.raises(ListenerError, match=r"val_accuracy.*val_loss"):
        _fit(wrong, val=True)


def test_model_checkpoint_state_survives_a_mid_epoch_resume(tmp_path):
    scores = [1.0, 0.5, 0.75, 0.25]

    def subscribe(trainer, folder):
        checkpoint = ModelCheckpoint(folder, every_n_steps=4, monitor="val_loss", keep_last=2)
        trainer.subscribe(checkpoint)
        return checkpoint

    whole = Trainer(max_epochs=4, device="cpu", seed=0)
    reference = subscribe(whole, tmp_path / "whole")
    _fit(whole, epochs_val=scores)

    broken = Trainer(max_epochs=4, device="cpu", seed=0)
    subscribe(broken, tmp_path / "split")
    broken.subscribe(Crash(at=9))
    with pytest.raises(ListenerError):
        _fit(broken, epochs_val=scores)
    resumed = Trainer(max_epochs=4, device="cpu", seed=0)
    checkpoint = subscribe(resumed, tmp_path / "split")
    _fit(resumed, epochs_val=scores, resume_from=tmp_path / "split" / "epoch=1-step=8.safetensors")

    assert checkpoint.best_score == reference.best_score == 0.25
    assert checkpoint.best_step == reference.best_step
    assert [os.path.basename(p) for p in checkpoint.kept] == [
        os.path.basename(p) for p in reference.kept
    ]
    assert _periodic(tmp_path / "split") == _periodic(tmp_path / "whole")
    for name in ("last.safetensors", "best.safetensors"):
        a = read_checkpoint(tmp_path / "whole" / name)["model"]
        b = read_checkpoint(tmp_path / "split" / name)["model"]
        assert all(torch.equal(a[k], b[k]) for k in a)


# -- EarlyStopping -------------------------------------------------------------------------------


def test_early_stopping_stops_after_patience_validations_without_improvement():
    trainer = Trainer(max_epochs=10, device="cpu")
    trainer.subscribe(stopper := EarlyStopping(patience=2, min_delta=0.1))
    # 0.45 improves on 0.5 by less than min_delta: it does not count as an improvement.
    result = _fit(trainer, epochs_val=[1.0, 0.5, 0.45, 0.75] + [0.0] * 6)
    assert result.stopped_early and result.epochs == 4
    assert (stopper.best_score, stopper.wait_count, stopper.stopped_epoch) == (0.5, 2, 3)


def test_early_stopping_max_mode_and_non_finite_values():
    trainer = Trainer(max_epochs=10, device="cpu")
    trainer.subscribe(stopper := EarlyStopping(mode="max", patience=5))
    result = _fit(trainer, epochs_val=[0.5, 0.75, math.nan] + [1.0] * 7)
    assert result.stopped_early and result.epochs == 3
    assert stopper.best_score == 0.75


def test_early_stopping_counters_round_trip_and_restart_with_a_new_fit():
    stopper = EarlyStopping(patience=4)
    stopper.best_score, stopper.wait_count = 0.5, 3
    saved = ListenerState("early_stopping_0")
    stopper.on_save_checkpoint(saved)
    restored, state = EarlyStopping(patience=4), Trainer().state
    restored.on_load_checkpoint(ListenerState("early_stopping_0", saved, readonly=True), state)
    assert (restored.best_score, restored.wait_count, restored.stopped_epoch) == (0.5, 3, None)
    assert not state.should_stop
    restored.on_train_start()
    assert (restored.best_score, restored.wait_count) == (None, 0)


def test_early_stopping_resumed_stops_where_the_uninterrupted_run_stops(tmp_path):
    scores = [1.0, 0.5, 0.75, 0.875, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25]
    whole = Trainer(max_epochs=10, device="cpu")
    whole.subscribe(EarlyStopping(patience=3))
    expected = _fit(whole, epochs_val=scores)

    broken = Trainer(max_epochs=10, device="cpu")
    broken.subscribe(EarlyStopping(patience=3))
    broken.subscribe(ModelCheckpoint(tmp_path, keep_last=None))
    broken.subscribe(Crash(at=4 * BATCHES + 1))
    with pytest.raises(ListenerError):
        _fit(broken, epochs_val=scores)
    saved = read_checkpoint(tmp_path / "epoch=3-step=24.safetensors")
    assert saved["listeners"]["early_stopping_0"]["wait_count"] == 1  # before epoch 3's validation
    resumed = Trainer(max_epochs=10, device="cpu")
    resumed.subscribe(stopper := EarlyStopping(patience=3))
    resumed.subscribe(ModelCheckpoint(tmp_path, keep_last=None))
    result = _fit(resumed, epochs_val=scores, resume_from=tmp_path / "epoch=3-step=24.safetensors")
    assert result.stopped_early and result.steps == expected.steps == 8 * BATCHES
    assert (stopper.wait_count, stopper.stopped_epoch) == (3, 7)

    with pytest.warns(UserWarning, match="finished run"):
        again = Trainer(max_epochs=10, device="cpu")
        again.subscribe(EarlyStopping(patience=3))
        again.subscribe(ModelCheckpoint(tmp_path, keep_last=None))
        result = _fit(again, epochs_val=scores, resume_from=tmp_path / "last.safetensors")
    assert result.stopped_early and result.steps == 8 * BATCHES


# -- LearningRateMonitor -------------------------------------------------------------------------


def test_learning_rate_monitor_records_the_rate_each_step_used():
    trainer = Trainer(max_epochs=1, device="cpu")
    trainer.subscribe(monitor := LearningRateMonitor(log_every_n_steps=2))
    model = make_model()
    optimizer = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "lr": 1.0},
            {"params": model[3].parameters(), "lr": 0.5},
        ]
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = make_loader(make_data(), batch_size=8)
    trainer.fit(
        model,
        optimizer,
        loader,
        classification_step(model),
        scheduler=scheduler,
        scheduler_interval="step",
    )
    # Step s trains with 0.5 ** (s - 1) times the initial rates.
    assert monitor.history == [(s, [0.5 ** (s - 1), 0.5**s]) for s in (2, 4, 6)]
    assert monitor.last == [0.5**5, 0.5**6]


def _record_steps(monitor, steps):
    """Drive ``monitor`` through ``steps`` batches of one SGD group whose rate is 1 / step."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    state = Trainer().state
    for step in range(1, steps + 1):
        optimizer.param_groups[0]["lr"] = 1.0 / step
        state.global_step = step - 1  # the batch that completes global step `step`
        monitor.on_batch_start(state=state, optimizer=optimizer)


def test_learning_rate_monitor_history_keeps_only_the_latest_records():
    monitor = LearningRateMonitor()
    _record_steps(monitor, 25_000)
    assert monitor.max_history == 1000
    assert len(monitor.history) == 1000
    assert [step for step, _ in monitor.history] == list(range(24_001, 25_001))
    assert monitor.last == [1.0 / 25_000]

    few = LearningRateMonitor(log_every_n_steps=2, max_history=3)
    _record_steps(few, 12)
    assert few.history == [(s, [1.0 / s]) for s in (8, 10, 12)]
    few.max_history = 2  # a smaller bound applies at the next record
    _record_steps(few, 2)
    assert few.history == [(12, [1.0 / 12]), (2, [0.5])]

    unbounded = LearningRateMonitor(max_history=None)
    _record_steps(unbounded, 1500)
    assert len(unbounded.history) == 1500


# -- Timer ---------------------------------------------------------------------------------------


@attrs.define(eq=False)
class Slow:
    seconds: float

    def on_epoch_end(self):
        time.sleep(self.seconds)


def test_timer_reports_every_event_with_its_listeners(tmp_path):
    log: list = []
    trainer = Trainer(max_epochs=2, device="cpu")
    timer = Timer().attach(trainer)
    trainer.subscribe(Recorder(log))
    trainer.subscribe(Slow(0.02))
    trainer.subscribe(ModelCheckpoint(tmp_path, save_last=False))
    _fit(trainer, val=True)
    summary = timer.summary()
    assert list(summary) == [event for event in EVENTS if event != "load_checkpoint"]
    counts = {event: sum(1 for e, _ in log if e == event) for event in summary}
    counts["save_checkpoint"] = 2  # one periodic file per epoch
    assert {event: row["calls"] for event, row in summary.items()} == counts
    assert summary["epoch_end"]["total_s"] >= 0.04
    assert summary["epoch_end"]["max_s"] >= 0.02
    assert summary["epoch_end"]["listeners"] == ["recorder_0", "slow_0", "model_checkpoint_0"]
    slowest = max(summary, key=lambda event: summary[event]["total_s"])
    assert slowest == "epoch_end"
    assert timer.fit_seconds >= summary["epoch_end"]["total_s"]
    report = timer.report()
    assert report.splitlines()[1].startswith("epoch_end")
    assert "s in fit" in report

    # A failing fit closes the timing of the exception event and of the fit.
    before = timer.fit_seconds
    trainer.subscribe(Crash(at=2))
    with pytest.raises(ListenerError):
        _fit(trainer)
    assert timer.summary()["exception"]["calls"] == 1
    assert timer.fit_seconds > before
    timer.detach()
    assert all(
        key.startswith(("recorder", "slow", "model", "crash")) for key, _ in trainer.listeners
    )


def test_timer_subscribed_like_any_listener_times_the_others_from_its_first_fit_on():
    trainer = Trainer(max_epochs=2, device="cpu")
    trainer.subscribe(Slow(0.02))
    timer = Timer()
    assert trainer.subscribe(timer) == "timer_0"
    _fit(trainer)
    summary = timer.summary()
    # Subscribed after Slow with the same priority, it still brackets it.
    assert summary["epoch_end"]["calls"] == 2 and summary["epoch_end"]["total_s"] >= 0.04
    assert summary["epoch_end"]["listeners"] == ["slow_0"]
    assert summary["batch_end"]["calls"] == 2 * BATCHES
    # It attaches during the first train_start, whose listeners it therefore does not time; the
    # fit's wall time counts from there.
    assert summary["train_start"]["calls"] == 0 and summary["train_end"]["calls"] == 1
    assert summary["train_start"]["listeners"] == []  # its own receivers are not listed
    assert timer.fit_seconds >= 0.04
    _fit(trainer)
    assert timer.summary()["train_start"]["calls"] == 1
    assert timer.summary()["epoch_end"]["calls"] == 4
    timer.detach()  # stops it and unsubscribes it
    assert [key for key, _ in trainer.listeners] == ["slow_0"]
    _fit(trainer)
    assert timer.summary()["epoch_end"]["calls"] == 4


def test_timer_leaves_resuming_unaffected(tmp_path):
    first = Trainer(max_epochs=1, device="cpu", seed=0)
    Timer().attach(first)
    _fit(first)
    first.save_checkpoint(tmp_path / "c.safetensors")
    second = Trainer(max_epochs=2, device="cpu", seed=0)
    timer = Timer().attach(second)
    _fit(second, resume_from=tmp_path / "c.safetensors")  # without Timer state in the file
    assert timer.summary()["batch_end"]["calls"] == BATCHES
    plain = Trainer(max_epochs=2, device="cpu", seed=0)
    _fit(plain, resume_from=tmp_path / "c.safetensors")  # and without a Timer at all


def test_timer_uses_its_clock_and_attaches_once():
    ticks = iter(range(100))
    trainer = Trainer(max_epochs=1, device="cpu")
    timer = Timer(clock=lambda: float(next(ticks))).attach(trainer)
    with pytest.raises(RuntimeError, match="attached"):
        timer.attach(trainer)
    _fit(trainer)
    # Each event takes one tick between its opening and closing receivers.
    assert timer.summary()["batch_start"] == {
        "calls": BATCHES,
        "total_s": BATCHES,
        "mean_s": 1.0,
        "max_s": 1.0,
        "listeners": [],
    }
    timer.reset()
    assert timer.summary()["batch_start"]["calls"] == 0 and timer.fit_seconds == 0


# -- TensorBoardLogger ---------------------------------------------------------------------------


def test_tensorboard_logger_writes_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = Trainer(max_epochs=2, device="cpu")
    trainer.subscribe(logger := TensorBoardLogger(tmp_path, log_every_n_steps=4))
    _fit(trainer, val=True)
    assert logger._writer is None  # closed at train_end
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train_loss", "lr", "samples_per_s", "val_loss"} <= tags
    assert [e.step for e in events.Scalars("train_loss")] == [4, 8, 12]
    assert [e.step for e in events.Scalars("val_loss")] == [6, 12]


def test_tensorboard_logger_purges_what_a_crashed_run_logged_after_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def subscribe(trainer):
        trainer.subscribe(TensorBoardLogger(tmp_path / "tb", log_every_n_steps=2))
        trainer.subscribe(ModelCheckpoint(tmp_path / "ckpt", every_n_steps=4, keep_last=None))

    broken = Trainer(max_epochs=2, device="cpu", seed=0)
    subscribe(broken)
    broken.subscribe(Crash(at=7))
    with pytest.raises(ListenerError):
        _fit(broken)
    resumed = Trainer(max_epochs=2, device="cpu", seed=0)
    subscribe(resumed)
    _fit(resumed, resume_from=tmp_path / "ckpt" / "epoch=0-step=4.safetensors")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == [2, 4, 6, 8, 10, 12]
