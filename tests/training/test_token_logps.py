"""Chunked label log-probs equal the plain log-softmax path, values and gradients, with bounded memory."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from data.batch import IGNORE_INDEX
from training.objectives.preference_loss import SequenceLogps, sigmoid
from training.objectives.token_logps import linear_token_logps, token_logps_from_logits


def _inputs(batch=4, seq=9, vocab=29, dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, dim, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[:, :3] = IGNORE_INDEX  # the prompt
    labels[1, -2:] = IGNORE_INDEX
    return hidden, weight, labels


def _dpo_on_pairs(token_logps):
    """A loss that is not linear in the log-probs: rows 0/1 chosen, 2/3 rejected, reference 0."""
    sums = token_logps.sum(-1)
    zero = torch.zeros(2, dtype=sums.dtype)
    return sigmoid(SequenceLogps(sums[:2], sums[2:]), SequenceLogps(zero, zero), beta=0.5)[0].sum()


@pytest.mark.parametrize("chunk, temperature", [(1, 1.0), (5, 1.0), (7, 0.7), (1000, 1.3)])
def test_matches_plain_log_softmax_through_a_nonlinear_loss(chunk, temperature):
    hidden, weight, labels = _inputs()
    ref = token_logps_from_logits(hidden @ weight.t(), labels, temperature=temperature)
    _dpo_on_pairs(ref).backward()
    ref_dh, ref_dw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logps = linear_token_logps(hidden, weight, labels, chunk_tokens=chunk, temperature=temperature)
    _dpo_on_pairs(logps).backward()
    assert logps.shape == labels.shape and logps.dtype == torch.float32
    torch.testing.assert_close(logps, ref, rtol=1e-6, atol=1e-6)
    assert (logps[labels == IGNORE_INDEX] == 0).all()
    torch.testing.assert_close(hidden.grad, ref_dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_dw, rtol=1e-5, atol=1e-6)


def test_gradcheck_fp64():
    hidden, weight, labels = _inputs(batch=2, seq=4, vocab=6, dim=3, dtype=torch.float64)
    upstream = torch.linspace(-1.0, 2.0, 8, dtype=torch.float64).reshape(2, 4)

    def fn(h, w):
        return (linear_token_logps(h, w, labels, chunk_tokens=3, temperature=0.8) * upstream).sum().exp()

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_ignored_tokens_get_no_gradient():
    hidden, weight, labels = _inputs()
    labels[0] = IGNORE_INDEX
    linear_token_logps(hidden, weight, labels, chunk_tokens=4).sum().backward()
    assert hidden.grad[0].abs().max().item() == 0.0 and hidden.grad[1].abs().max().item() > 0.0


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def test_no_tensor_larger_than_one_chunk_of_logits_in_either_pass():
    hidden, weight, labels = _inputs(batch=4, seq=24, vocab=64, dim=4)
    chunk = 8
    assert max(hidden.numel(), weight.numel()) <= chunk * 64
    with _LargestTensor() as probe:
        _dpo_on_pairs(linear_token_logps(hidden, weight, labels, chunk_tokens=chunk)).backward()
    assert probe.largest <= chunk * 64
    with _LargestTensor() as plain:  # the probe does see full logits
        _dpo_on_pairs(token_logps_from_logits(hidden @ weight.t(), labels)).backward()
    assert plain.largest >= 4 * 24 * 64


def test_bf16_keeps_dtypes_and_stays_close():
    hidden, weight, labels = _inputs(dtype=torch.bfloat16)
    logps = linear_token_logps(hidden, weight, labels, chunk_tokens=8)
    _dpo_on_pairs(logps).backward()
    assert logps.dtype == torch.float32
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    ref = token_logps_from_logits(hidden.float() @ weight.float().t(), labels)
    torch.testing.assert_close(logps, ref, rtol=2e-2, atol=2e-2)


def test_compiled_chunk_kernels_match_eager(monkeypatch):
    """``compiled`` (CUDA in the loop) fuses each chunk's work after the matmul; forced on the
    CPU here, values and gradients agree with the eager kernels to rounding."""
    from training.objectives import token_logps

    hidden, weight, labels = _inputs(seq=11)
    _dpo_on_pairs(linear_token_logps(hidden, weight, labels, chunk_tokens=16, temperature=0.7)).backward()
    eager = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    kernels = token_logps._kernels
    monkeypatch.setattr(token_logps, "_kernels", lambda compiled: kernels(True))
    logps = linear_token_logps(hidden, weight, labels, chunk_tokens=16, temperature=0.7)
    _dpo_on_pairs(logps).backward()
    torch.testing.assert_close(logps, token_logps_from_logits(hidden @ weight.t(), labels, temperature=0.7))
    torch.testing.assert_close(hidden.grad, eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, eager[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("invariant", [False, True])
def test_under_autocast_the_backward_recomputes_the_forwards_logits(invariant):
    """fp32 weights under bf16 autocast (a mixed-precision run's policy): the head's matmul runs in bf16
    in the forward, and the backward (outside autocast) recomputes those bf16 logits, as the explicit
    ``compute_dtype`` does, not fp32 ones that the forward's log-partition never saw."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen) / 4
    labels = torch.randint(0, 40, (2, 5), generator=gen)
    labels[0, :2] = IGNORE_INDEX

    def run(autocast: bool, compute_dtype):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logps = linear_token_logps(h, w, labels, chunk_tokens=4, compute_dtype=compute_dtype, invariant=invariant)
        (logps * torch.linspace(0.5, 1.5, logps.numel()).reshape(logps.shape)).sum().backward()
        return logps.detach(), h.grad, w.grad

    default, explicit, fp32 = run(True, None), run(False, torch.bfloat16), run(False, None)
    for a, b in zip(default, explicit):
        assert torch.equal(a, b)
    assert not torch.equal(default[1], fp32[1])  # the fp32 recompute's gradient is another one
