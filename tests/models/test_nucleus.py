"""models/qwen/nucleus.py: the filters' kept sets without a sort equal a stable sort's, ties included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.qwen.nucleus import CapturedCut, fixed_point, nucleus_cut, nucleus_cut_cuda
from models.qwen.sampler import SamplingParams, _kept, counter_uniforms, sample_next


def _kept_by_sorting(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Reference: the kept set by a stable descending sort and exact fixed-point prefix sums."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    weights = fixed_point(sorted_probs)
    keep = torch.ones_like(weights, dtype=torch.bool)
    if params.top_k > 0:
        keep &= torch.arange(probs.shape[-1], device=probs.device) < params.top_k
    if params.top_p < 1:
        before = weights.cumsum(dim=-1) - weights
        keep &= before.to(torch.float64) < params.top_p * weights.sum(dim=-1, keepdim=True).to(torch.float64)
    if params.min_p > 0:
        keep &= sorted_probs >= params.min_p * sorted_probs[:, :1]
    return torch.zeros_like(keep).scatter(-1, order, keep)


def _probabilities(vocab: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randn(16, vocab, generator=generator) * scale for scale in (0.1, 1.0, 4.0, 12.0)]
    tied = torch.randint(0, 6, (16, vocab), generator=generator).float()  # many exact ties at every level
    peaked = torch.full((4, vocab), -80.0).index_fill(1, torch.tensor([5]), 0.0)  # the rest underflow
    rows += [tied, tied * 7.0, torch.zeros(4, vocab), peaked]
    return torch.softmax(torch.cat(rows), dim=-1).to(device)


RULES = [SamplingParams(top_p=p) for p in (0.01, 0.3, 0.9, 0.95, 0.999999)]
RULES += [SamplingParams(top_k=k) for k in (1, 7, 999, 1000, 5000)]
RULES += [SamplingParams(top_k=20, top_p=0.9, min_p=0.02), SamplingParams(top_p=0.5, min_p=0.1)]


@pytest.mark.parametrize("params", RULES, ids=str)
def test_kept_set_is_the_sorted_prefix(params):
    probs = _probabilities(1000)
    assert torch.equal(_kept(probs, params, nucleus_cut), _kept_by_sorting(probs, params))


def test_top_p_one_keeps_the_whole_mass_and_draws_what_no_filter_draws():
    probs = _probabilities(1000)
    bits, weights = probs.view(torch.int32), fixed_point(probs)
    cut, ties = nucleus_cut(probs, 1.0)
    tied = bits == cut
    assert torch.equal((bits > cut) | (tied & (tied.cumsum(dim=-1) <= ties)), weights > 0)
    logits = torch.randn(256, 300, generator=torch.Generator().manual_seed(4)) * 3
    uniforms = torch.from_numpy(counter_uniforms(np.arange(256, dtype=np.uint64), 1)[:, 0])
    plain, _ = sample_next(logits, uniforms, SamplingParams())
    filtered, _ = sample_next(logits, uniforms, SamplingParams(top_p=1.0, min_p=1e-30))  # the filtered path
    assert torch.equal(plain, filtered)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA (benchmarks on a GPU)")
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_cuda_kernel_gives_the_reference_cut(vocab):
    probs = _probabilities(vocab, "cuda")
    for top_p in (0.01, 0.3, 0.9, 0.95, 0.999999, 1.0):
        expected = nucleus_cut(probs, top_p)
        captured = CapturedCut(tuple(probs.shape), top_p, probs.device)
        eager, replayed = nucleus_cut_cuda(probs, top_p), captured(probs, top_p)
        assert torch.equal(eager[0], expected[0]) and torch.equal(eager[1], expected[1]), top_p
        assert torch.equal(replayed[0], expected[0]) and torch.equal(replayed[1], expected[1]), top_p
        flipped = captured(probs.flip(0), top_p)  # a replay reads its new input
        assert torch.equal(flipped[0], expected[0].flip(0)) and torch.equal(flipped[1], expected[1].flip(0)), top_p
