"""The output head in FP8 (``linear_cross_entropy(float8=True)``, ``parallel.float8_head``):
its three matmuls are those of its FP8 operands (scales and transposed layouts right), the
static e5m2 scale of the logits' gradient never saturates, padding rows change nothing, and
the result is within FP8's rounding of fp32 and repeatable bit for bit. On CPU, where
torch._scaled_mm runs too."""

from __future__ import annotations

import pytest
import torch

from training import linear_cross_entropy as lce
from training.linear_cross_entropy import E4M3, E5M2, LOGITS_GRAD_SCALE, linear_cross_entropy, to_float8
from training.losses import IGNORE_INDEX


def _inputs(tokens=64, dim=32, vocab=48, seed=3):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(vocab, dim, generator=gen) * 0.1).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[5] = labels[17] = IGNORE_INDEX
    return hidden, weight, labels


def _run(hidden, weight, labels, chunk, **kwargs):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, chunk_tokens=chunk, float8=True, **kwargs)
    (loss * 0.5).backward()
    return loss.detach(), h.grad, w.grad


def _dequantized(x, dtype):
    x8, inv = to_float8(x, dtype)
    return x8.float() * inv


@pytest.mark.parametrize("chunk", [16, 24, 64])
def test_the_fp8_chunks_are_the_matmuls_of_their_dequantized_operands(chunk):
    """Step by step in fp32 from the FP8 tensors times their inverse scales: logits (rounded to
    bf16), the chunk's cross entropy, its gradient in e5m2 at the static scale, then the two
    gradient matmuls. chunk=24 pads each chunk's rows to 32 with ignored tokens."""
    hidden, weight, labels = _inputs()
    loss, grad_h, grad_w = _run(hidden, weight, labels, chunk)
    w = _dequantized(weight, E4M3)
    ref_loss, ref_gh, ref_gw = torch.zeros(()), [], torch.zeros(weight.shape)
    for s in range(0, hidden.shape[0], chunk):
        h = _dequantized(hidden[s : s + chunk], E4M3)
        part, g = lce._cross_entropy_chunk((h @ w.t()).to(torch.bfloat16).float(), labels[s : s + chunk])
        g = (g * LOGITS_GRAD_SCALE).to(E5M2).float() / LOGITS_GRAD_SCALE
        ref_loss += part
        ref_gh.append(g @ w)
        ref_gw += g.t() @ h
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad_h.float(), (0.5 * torch.cat(ref_gh)).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(grad_w.float(), (0.5 * ref_gw).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-5)
    assert grad_h.dtype == hidden.dtype and grad_w.dtype == weight.dtype


def test_the_casts_are_tensorwise_and_use_all_of_e4m3():
    hidden, _, _ = _inputs()
    x8, inv = to_float8(hidden[:16], E4M3)
    assert x8.dtype == E4M3 and x8.float().abs().max() == torch.finfo(E4M3).max
    torch.testing.assert_close(inv, hidden[:16].abs().amax().float() / torch.finfo(E4M3).max, rtol=1e-6, atol=0)
    zeros8, zeros_inv = to_float8(torch.zeros(16, 16), E4M3)  # the amax floor: no inf, no nan
    assert torch.isfinite(zeros_inv) and zeros8.float().abs().max() == 0


def test_the_static_logits_gradient_scale_fits_e5m2():
    """softmax - one_hot is within [-1, 1]: at 2**15 it stays below e5m2's 57,344 even for a
    chunk whose logits are extreme, and it equals the fp32 gradient to e5m2's precision."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(32, 64, generator=gen) * 30).to(torch.bfloat16)  # near one-hot softmaxes
    labels = torch.randint(0, 64, (32,), generator=gen)
    labels[3] = IGNORE_INDEX
    loss, g8 = lce._cross_entropy_chunk_float8(logits, labels)
    ref_loss, ref_grad = lce._cross_entropy_chunk(logits.float(), labels)
    assert g8.dtype == E5M2 and torch.equal(loss, ref_loss)
    assert g8.float().abs().max() <= LOGITS_GRAD_SCALE < torch.finfo(E5M2).max
    grad = g8.float() / LOGITS_GRAD_SCALE
    assert torch.equal(grad[3], torch.zeros(64))
    big = ref_grad.abs() > 2**-14  # above e5m2's subnormals at this scale
    torch.testing.assert_close(grad[big], ref_grad[big], rtol=0.125, atol=0)


def test_within_fp8_rounding_of_fp32_and_repeatable():
    hidden, weight, labels = _inputs(tokens=200, dim=64, vocab=256)
    runs = [_run(hidden, weight, labels, 64) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    h = hidden.float().requires_grad_()
    w = weight.float().requires_grad_()
    ref = linear_cross_entropy(h, w, labels, chunk_tokens=64)
    (ref * 0.5).backward()
    loss, grad_h, grad_w = runs[0]
    assert abs(float(loss / ref.detach()) - 1) < 1e-2
    for got, want in ((grad_h, h.grad), (grad_w, w.grad)):
        err = float((got.float() - want).norm() / want.norm())
        assert 1e-3 < err < 0.1  # FP8 applied (bf16 alone is ~2e-3 here), and no worse than FP8 rounds


def test_frozen_weight_gets_no_gradient():
    hidden, weight, labels = _inputs()
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, labels, chunk_tokens=32, float8=True)
    loss.backward()
    assert weight.grad is None and h.grad is not None and torch.isfinite(h.grad.float()).all()
    assert h.grad.abs().max() > 0


def test_shapes_fp8_matmuls_cannot_take_are_refused():
    hidden, weight, labels = _inputs(vocab=40)
    with pytest.raises(ValueError, match="multiples of 16"):
        linear_cross_entropy(hidden, weight[:37], labels.clamp(max=36), chunk_tokens=16, float8=True)
