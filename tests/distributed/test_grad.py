"""clip_grad_norm_ and no_sync on plain models (the sharded paths run in test_parallelize.py)."""

from __future__ import annotations

import pytest
import torch

from distributed import clip_grad_norm_, no_sync
from tests.distributed.scenarios import build_model, make_batch


def _model_with_grads() -> torch.nn.Module:
    model = build_model()
    batch = make_batch(0)
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).backward()
    return model


@pytest.mark.parametrize("max_norm, norm_type", [(0.5, 2.0), (0.5, 1.0), (0.05, float("inf")), (1e6, 2.0)])
def test_matches_torch_on_plain_gradients(max_norm, norm_type):
    ours, theirs = _model_with_grads(), _model_with_grads()
    total = clip_grad_norm_(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type)
    assert total.dtype == torch.float32 and total.dim() == 0
    torch.testing.assert_close(total, expected)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_zero_max_norm_measures_without_clipping():
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    total = clip_grad_norm_(model, 0.0)
    assert total > 0
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


def test_clipping_scales_to_max_norm():
    model = _model_with_grads()
    clip_grad_norm_(model, 0.1)
    torch.testing.assert_close(clip_grad_norm_(model, 0.0), torch.tensor(0.1), rtol=1e-4, atol=0)


def test_no_grads_gives_zero():
    assert clip_grad_norm_(build_model(), 1.0) == 0


def test_no_sync_is_transparent_for_a_plain_model():
    model = build_model()
    with no_sync(model):
        pass
