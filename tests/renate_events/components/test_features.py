"""The intermediate-representation recorder and hook-free copies."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from renate_events.components import (
    IntermediateRepresentations,
    copy_without_hooks,
    record_intermediate_representations,
)


class Branchy(nn.Module):
    """A model whose ``extra`` layer only runs when asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
        self.extra = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        out = self.body(x)
        return self.extra(out) if use_extra else out


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_records_outputs_in_the_given_order():
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(2, 4)
    recorder = IntermediateRepresentations(model, ["extra", "body.2", "body.0"])
    logits = model(x, use_extra=True)
    hidden = model.body[0](x)
    body = model.body[2](torch.relu(hidden))
    extra, second, first = recorder.representations
    torch.testing.assert_close(first, hidden)
    torch.testing.assert_close(second, body)
    torch.testing.assert_close(extra, logits)
    assert first.requires_grad  # not detached: losses on features reach the parameters
    assert len(recorder) == 3 and recorder.module_names == ("extra", "body.2", "body.0")


def test_cleared_at_each_forward_of_the_root_model():
    model = Branchy()
    recorder = record_intermediate_representations(model, ["body.0", "extra"])
    assert recorder.representations == [None, None]
    model(torch.randn(2, 4), use_extra=True)
    before = recorder.representations
    assert all(isinstance(t, torch.Tensor) for t in before)
    model(torch.randn(2, 4), use_extra=False)
    after = recorder.representations
    assert after[1] is None  # "extra" did not run in this forward pass
    assert after[0] is not before[0]
    assert before[1] is not None  # a list handed out earlier is left intact
    recorder.clear()
    assert recorder.representations == [None, None]


def test_remove_detaches_every_hook_and_is_idempotent():
    model = Branchy()
    baseline = hook_count(model)
    recorder = IntermediateRepresentations(model, ["body.0", "extra"])
    assert hook_count(model) == baseline + 3  # two output hooks and the reset pre-hook
    model(torch.randn(1, 4), use_extra=True)
    recorder.remove()
    recorder.remove()
    assert recorder.removed and hook_count(model) == baseline
    assert recorder.representations == [None, None]
    model(torch.randn(1, 4), use_extra=True)
    assert recorder.representations == [None, None]


def test_context_manager_removes_on_exit():
    model = Branchy()
    with IntermediateRepresentations(model, ["body.0"]) as recorder:
        model(torch.randn(1, 4))
        assert recorder.representations[0] is not None
    assert recorder.removed and hook_count(model) == 0


def test_deepcopy_does_not_record_or_reference_the_recorder():
    model = Branchy()
    recorder = IntermediateRepresentations(model, ["body.0", "body.2"])
    model(torch.randn(2, 4))  # the recorder now holds non-leaf tensors with a graph
    recorded = recorder.representations
    twin = copy.deepcopy(model)  # must not try to copy those tensors
    twin(torch.randn(2, 4))
    assert [a is b for a, b in zip(recorder.representations, recorded)] == [True, True]
    # The copy keeps no reference to the recorder: dropping it frees it.
    ref = weakref.ref(recorder)
    del recorder, recorded, model
    gc.collect()
    assert ref() is None
    twin(torch.randn(2, 4))  # the copy still works


def test_copy_without_hooks_strips_recorder_hooks_only():
    model = Branchy()
    calls = []
    model.body[0].register_forward_hook(lambda module, args, out: calls.append(out.shape))
    recorder = IntermediateRepresentations(model, ["body.0"])
    model(torch.randn(2, 4)).sum().backward()  # gradients must not be copied either
    twin = copy_without_hooks(model)
    assert hook_count(twin) == 1  # the user's hook survives
    assert all(p.grad is None for p in twin.parameters())
    for a, b in zip(twin.parameters(), model.parameters()):
        assert a is not b
        torch.testing.assert_close(a, b)
    recorded = recorder.representations[0]
    twin(torch.randn(3, 4))
    assert recorder.representations[0] is recorded
    assert calls == [torch.Size([2, 5]), torch.Size([3, 5])]
    model(torch.randn(1, 4))  # the original still records
    assert recorder.representations[0].shape == (1, 5)


def test_unknown_or_missing_module_names_raise_value_error():
    model = Branchy()
    with pytest.raises(ValueError) as info:
        IntermediateRepresentations(model, ["body.0", "head"])
    message = str(info.value)
    assert "'head'" in message
    for name in ("body", "body.0", "body.1", "body.2", "extra"):
        assert f"'{name}'" in message
    with pytest.raises(ValueError, match="at least one"):
        IntermediateRepresentations(model, [])
    with pytest.raises(ValueError, match="wrap it in a list"):
        IntermediateRepresentations(model, "body.0")
    assert hook_count(model) == 0  # nothing half-registered


def test_records_shared_modules_and_the_root():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    with IntermediateRepresentations(model, ["2", ""]) as recorder:
        out = model(torch.randn(2, 3))
        last, root = recorder.representations
        assert last is out and root is out  # last call of the shared layer, and the root output
