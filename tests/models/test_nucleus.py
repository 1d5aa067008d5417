"""models/generation/nucleus.py: the filters' kept sets without a sort equal a stable sort's, ties included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functools import partial

from models.generation.nucleus import (
    CapturedGraph,
    draw_kept,
    draw_kept_cuda,
    fixed_point,
    inverse_cdf,
    nucleus_cut,
    nucleus_cut_cuda,
)
from models.generation.sampler import SamplingParams, _kept, counter_uniforms, sample_next


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


def _steps(rows: int, device: str = "cpu") -> torch.Tensor:
    """Each row's draw at k / 2^24 (counter_uniforms' resolution), as the sampler computes it."""
    uniforms = torch.from_numpy(counter_uniforms(np.arange(rows, dtype=np.uint64), 1)[:, 0]).to(torch.float64)
    return (uniforms * 2**24).to(torch.int64).to(device)


def test_draw_inverts_the_kept_tokens_cdf():
    probs = _probabilities(1000)
    steps = _steps(probs.shape[0])
    for top_p in (0.01, 0.5, 0.95):
        cut, ties = nucleus_cut(probs, top_p)
        kept = _kept(probs, SamplingParams(top_p=top_p), nucleus_cut)
        tokens = draw_kept(probs, cut, ties, steps)
        assert kept.gather(1, tokens[:, None]).all()
        assert torch.equal(tokens, inverse_cdf(fixed_point(probs) * kept, steps))
    everything = torch.full((probs.shape[0], 1), -1, dtype=torch.int32)
    none_tied = torch.zeros(probs.shape[0], 1, dtype=torch.int64)
    assert torch.equal(draw_kept(probs, everything, none_tied, steps), inverse_cdf(fixed_point(probs), steps))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA (benchmarks on a GPU)")


@cuda
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_cuda_kernels_give_the_reference_cut_and_draw(vocab):
    probs = _probabilities(vocab, "cuda")
    rows = probs.shape[0]
    step_sets = (_steps(rows, "cuda"), torch.zeros(rows, dtype=torch.int64, device="cuda"),
                 torch.full((rows,), 2**24 - 1, dtype=torch.int64, device="cuda"))
    for top_p in (0.01, 0.3, 0.9, 0.95, 0.999999, 1.0):
        expected = nucleus_cut(probs, top_p)
        captured = CapturedGraph(partial(nucleus_cut_cuda, top_p=top_p))
        eager, replayed = nucleus_cut_cuda(probs, top_p), captured(probs)
        assert torch.equal(eager[0], expected[0]) and torch.equal(eager[1], expected[1]), top_p
        assert torch.equal(replayed[0], expected[0]) and torch.equal(replayed[1], expected[1]), top_p
        flipped = captured(probs.flip(0))  # a replay reads its new input
        assert torch.equal(flipped[0], expected[0].flip(0)) and torch.equal(flipped[1], expected[1].flip(0)), top_p
        for steps in step_sets:
            assert torch.equal(draw_kept_cuda(probs, *expected, steps), draw_kept(probs, *expected, steps)), top_p
    cut, ties = nucleus_cut(probs, 0.5)
    for tied in (1, 2, 5, 50):  # more or fewer tokens at the cut kept than it holds
        ties = torch.full_like(ties, tied)
        assert torch.equal(draw_kept_cuda(probs, cut, ties, step_sets[0]), draw_kept(probs, cut, ties, step_sets[0]))


@cuda
def test_cuda_sampling_rule_gives_the_reference_tokens():
    logits = torch.randn(64, 151936, generator=torch.Generator().manual_seed(5)).cuda() * 4
    uniforms = torch.from_numpy(counter_uniforms(np.arange(64, dtype=np.uint64), 1)[:, 0]).cuda()
    for params in (SamplingParams(), SamplingParams(top_p=0.95), SamplingParams(temperature=0.7, top_p=0.5)):
        expected = sample_next(logits, uniforms, params)
        rule = CapturedGraph(partial(sample_next, params=params, cut=nucleus_cut_cuda, draw=draw_kept_cuda))
        got = rule(logits, uniforms)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), params
