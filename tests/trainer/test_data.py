"""trainer.TensorLoader: batches by indexing, order from the global RNG, exact resume."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    assert_same_tensors,
    classification_step,
    make_data,
    make_model,
    parameters_of,
)
from trainer import TensorLoader, Trainer


def test_batches_cover_every_sample_once_per_epoch():
    x = torch.arange(10)
    loader = TensorLoader((x, x * 2), batch_size=4)
    batches = list(loader)
    assert len(loader) == 3 and [len(b[0]) for b in batches] == [4, 4, 2]
    seen = torch.cat([b[0] for b in batches])
    assert sorted(seen.tolist()) == list(range(10))
    assert all(torch.equal(b[1], b[0] * 2) for b in batches)
    assert len(TensorLoader((x,), batch_size=4, drop_last=True)) == 2
    assert torch.equal(next(iter(TensorLoader((x,), batch_size=10, shuffle=False)))[0], x)


def test_order_follows_the_global_rng():
    x = torch.arange(20)
    torch.manual_seed(1)
    first = [b[0] for b in TensorLoader((x,), batch_size=5)]
    torch.manual_seed(1)
    again = [b[0] for b in TensorLoader((x,), batch_size=5)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize(
    ("tensors", "error"),
    [
        ((), TypeError),
        ((torch.zeros(3), torch.zeros(4)), ValueError),
        ((torch.tensor(1.0),), TypeError),
    ],
)
def test_bad_tensors_are_refused(tensors, error):
    with pytest.raises(error):
        TensorLoader(tensors)


def test_mid_epoch_resume_with_tensor_loader_is_bit_identical(tmp_path):
    data = make_data(n=40)

    def run(resume=None, crash_at=None):
        torch.manual_seed(3)
        model = make_model(dropout=0.3)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        trainer = Trainer(max_epochs=3, device="cpu")
        if crash_at is not None:

            class Crash:
                def on_batch_end(self, trainer, state):
                    if state.global_step == crash_at:
                        trainer.save_checkpoint(tmp_path / "c.safetensors")

                def on_batch_start(self, state):
                    if state.global_step == crash_at:
                        raise KeyboardInterrupt

            trainer.subscribe(Crash())
        loader = TensorLoader(data.tensors, batch_size=8)
        trainer.fit(model, optimizer, loader, classification_step(model), resume_from=resume)
        return parameters_of(model)

    reference = run()
    with pytest.raises(KeyboardInterrupt):
        run(crash_at=7)
    assert_same_tensors(reference, run(resume=tmp_path / "c.safetensors"))
