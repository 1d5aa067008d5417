"""Distillation losses: hand-worked values, the fused chunked path against plain autograd, memory bound."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.exceptions import ConfigError
from data.batch import IGNORE_INDEX
from training.objectives.distill_loss import distill_loss_from_logits, distill_loss_sum


def _kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b))


def _softmax(logits, temperature=1.0):
    e = [math.exp(v / temperature) for v in logits]
    return [v / sum(e) for v in e]


# One token over a 2-word vocabulary: the student is uniform, the teacher says 3:1.
STUDENT, TEACHER = [0.0, 0.0], [math.log(3.0), 0.0]
P, Q = [0.75, 0.25], [0.5, 0.5]


def _one_token(kind, **kw):
    loss, count, metrics = distill_loss_from_logits(
        torch.tensor([STUDENT]), torch.tensor([TEACHER]), torch.tensor([0]), torch.tensor([True]), kind=kind, **kw
    )
    assert count.item() == 1
    return loss.item(), metrics


@pytest.mark.parametrize(
    "kind, beta, expected",
    [
        ("forward_kl", 0.5, _kl(P, Q)),
        ("reverse_kl", 0.5, _kl(Q, P)),
        ("jsd", 0.5, 0.5 * _kl(P, [0.625, 0.375]) + 0.5 * _kl(Q, [0.625, 0.375])),
        ("jsd", 0.25, 0.25 * _kl(P, [0.5625, 0.4375]) + 0.75 * _kl(Q, [0.5625, 0.4375])),
        ("jsd", 0.0, _kl(P, Q)),  # by convention, the forward KL
        ("jsd", 1.0, _kl(Q, P)),  # and the reverse KL
    ],
)
def test_divergences_by_hand(kind, beta, expected):
    loss, metrics = _one_token(kind, beta=beta)
    assert loss == pytest.approx(expected, rel=1e-6)
    assert metrics.divergence_sum.item() == pytest.approx(expected, rel=1e-6)
    assert metrics.ce_sum.item() == pytest.approx(math.log(2.0), rel=1e-6)


def test_jsd_over_beta_tends_to_forward_kl_and_over_one_minus_beta_to_reverse():
    small, _ = _one_token("jsd", beta=1e-3)
    large, _ = _one_token("jsd", beta=1 - 1e-3)
    assert small / 1e-3 == pytest.approx(_kl(P, Q), rel=2e-3)
    assert large / 1e-3 == pytest.approx(_kl(Q, P), rel=2e-3)


def test_temperature_scales_by_t_squared_and_alpha_mixes_in_hard_labels():
    temperature, alpha = 2.0, 0.3
    loss, metrics = _one_token("forward_kl", temperature=temperature, alpha=alpha)
    divergence = _kl(_softmax(TEACHER, temperature), _softmax(STUDENT, temperature))
    ce = -math.log(0.5)  # label 0 under the student at temperature 1
    assert metrics.divergence_sum.item() == pytest.approx(divergence, rel=1e-6)
    assert loss == pytest.approx((1 - alpha) * temperature**2 * divergence + alpha * ce, rel=1e-6)
    pure_sft, _ = _one_token("reverse_kl", temperature=temperature, alpha=1.0)
    assert pure_sft == pytest.approx(ce, rel=1e-6)


def _inputs(tokens=37, vocab=23, dim=8, teacher_dim=6, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) * 0.5).to(dtype).requires_grad_()
    t_hidden = torch.randn(tokens, teacher_dim, generator=gen).to(dtype)
    t_weight = (torch.randn(vocab, teacher_dim, generator=gen) * 0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    mask = torch.rand(tokens, generator=gen) > 0.3
    labels[~mask] = IGNORE_INDEX
    return hidden, weight, t_hidden, t_weight, labels, mask


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_identical_distributions_give_zero(kind):
    hidden, weight, _, _, labels, mask = _inputs()
    loss, _, metrics = distill_loss_sum(
        hidden, weight, hidden.detach(), weight.detach(), labels, mask, kind=kind, temperature=1.5, chunk_tokens=8
    )
    assert abs(loss.item()) < 1e-5 and abs(metrics.divergence_sum.item()) < 1e-5
    loss.backward()
    assert hidden.grad.abs().max().item() < 1e-6 and weight.grad.abs().max().item() < 1e-6


SETTINGS = [
    dict(kind="forward_kl"),
    dict(kind="reverse_kl", temperature=2.0),
    dict(kind="jsd", beta=0.3, temperature=0.7),
    dict(kind="jsd", beta=0.5, alpha=0.4),
    dict(kind="forward_kl", temperature=3.0, alpha=0.25),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_fused_matches_plain_autograd(settings):
    hidden, weight, t_hidden, t_weight, labels, mask = _inputs()
    ref_loss, ref_count, ref_metrics = distill_loss_from_logits(
        hidden @ weight.t(), t_hidden @ t_weight.t(), labels, mask, **settings
    )
    (ref_loss * 0.37).backward()
    ref_dh, ref_dw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    args = (hidden, weight, t_hidden, t_weight, labels, mask)
    loss, count, metrics = distill_loss_sum(*args, chunk_tokens=5, **settings)
    (loss * 0.37).backward()
    assert count.item() == ref_count.item() == int(mask.sum())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(metrics.divergence_sum, ref_metrics.divergence_sum, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(metrics.ce_sum, ref_metrics.ce_sum, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_dw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("settings", SETTINGS[:4], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_fused_gradients_pass_gradcheck_in_fp64(settings):
    tiny = dict(tokens=6, vocab=7, dim=3, teacher_dim=3, dtype=torch.float64)
    hidden, weight, t_hidden, t_weight, labels, mask = _inputs(**tiny)

    def fn(h, w):
        return distill_loss_sum(h, w, t_hidden, t_weight, labels, mask, chunk_tokens=4, **settings)[0]

    assert torch.autograd.gradcheck(fn, (hidden, weight))


@pytest.mark.parametrize("chunk", [1, 4, 16, 37, 1000])
def test_loss_does_not_depend_on_chunking(chunk):
    hidden, weight, t_hidden, t_weight, labels, mask = _inputs()
    whole, whole_metrics, ref_dh, ref_dw = _run_fused(hidden, weight, t_hidden, t_weight, labels, mask, 10_000)
    loss, metrics, dh, dw = _run_fused(hidden, weight, t_hidden, t_weight, labels, mask, chunk)
    torch.testing.assert_close(loss, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(metrics.divergence_sum, whole_metrics.divergence_sum, rtol=1e-6, atol=0)
    torch.testing.assert_close(dh, ref_dh, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 4, 16, 37])
def test_sums_are_bitwise_equal_across_chunkings_when_logits_are_exact(chunk):
    # Small integers and halves: every logit is exact whatever the matmul's blocking (a
    # one-row chunk takes a different kernel), so any difference would come from the order
    # in which per-token losses are summed, which must not depend on the chunking.
    hidden, weight, t_hidden, t_weight, labels, mask = _inputs()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for x in (hidden, weight, t_hidden, t_weight):
            x.copy_(torch.randint(-3, 4, x.shape, generator=gen) * 0.5)
    whole, whole_metrics, _, _ = _run_fused(hidden, weight, t_hidden, t_weight, labels, mask, 10_000)
    loss, metrics, _, _ = _run_fused(hidden, weight, t_hidden, t_weight, labels, mask, chunk)
    assert torch.equal(loss, whole)
    assert torch.equal(metrics.divergence_sum, whole_metrics.divergence_sum)
    assert torch.equal(metrics.ce_sum, whole_metrics.ce_sum)


def _run_fused(hidden, weight, t_hidden, t_weight, labels, mask, chunk):
    hidden.grad = weight.grad = None
    settings = dict(kind="jsd", beta=0.4, temperature=2.0, alpha=0.2)
    args = (hidden, weight, t_hidden, t_weight, labels, mask)
    loss, _, metrics = distill_loss_sum(*args, chunk_tokens=chunk, **settings)
    loss.backward()
    return loss, metrics, hidden.grad.clone(), weight.grad.clone()


def test_unmasked_tokens_contribute_nothing_and_teacher_gets_no_gradient():
    hidden, weight, t_hidden, t_weight, labels, mask = _inputs()
    t_hidden.requires_grad_()
    loss, count, _ = distill_loss_sum(
        hidden, weight, t_hidden, t_weight, labels, torch.zeros_like(mask), kind="reverse_kl", chunk_tokens=8
    )
    loss.backward()
    assert loss.item() == 0.0 and count.item() == 0
    assert hidden.grad.abs().max().item() == 0.0 and weight.grad.abs().max().item() == 0.0
    assert t_hidden.grad is None


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def test_no_tensor_larger_than_one_chunk_of_logits():
    tokens, vocab, chunk = 96, 50, 8
    hidden, weight, t_hidden, t_weight, labels, mask = _inputs(tokens=tokens, vocab=vocab, dim=4, teacher_dim=4)
    # Everything else (hidden states, weights, per-token sums) is far smaller than tokens x vocab.
    assert max(hidden.numel(), weight.numel(), 3 * tokens) <= chunk * vocab
    with _LargestTensor() as probe:
        args = (hidden, weight, t_hidden, t_weight, labels, mask)
        loss, _, _ = distill_loss_sum(*args, kind="jsd", alpha=0.5, chunk_tokens=chunk)
        loss.backward()
    assert probe.largest <= chunk * vocab
    with _LargestTensor() as plain:  # the probe sees the full logits of the plain path
        distill_loss_from_logits(hidden @ weight.t(), t_hidden @ t_weight.t(), labels, mask, kind="jsd")[0].backward()
    assert plain.largest >= tokens * vocab


def test_bf16_hidden_states_keep_their_dtype_and_stay_close():
    hidden, weight, t_hidden, t_weight, labels, mask = _inputs(dtype=torch.bfloat16)
    loss, _, _ = distill_loss_sum(hidden, weight, t_hidden, t_weight, labels, mask, kind="forward_kl", chunk_tokens=8)
    loss.backward()
    assert loss.dtype == torch.float32
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    ref, _, _ = distill_loss_from_logits(
        hidden.float() @ weight.float().t(), t_hidden.float() @ t_weight.float().t(), labels, mask, kind="forward_kl"
    )
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=1e-2)


def test_bad_settings_are_rejected():
    hidden, weight, t_hidden, t_weight, labels, mask = _inputs()
    args = (hidden, weight, t_hidden, t_weight, labels, mask)
    with pytest.raises(ConfigError, match="unknown distillation loss"):
        distill_loss_sum(*args, kind="kl")
    with pytest.raises(ConfigError, match="temperature"):
        distill_loss_sum(*args, kind="jsd", temperature=0.0)
    with pytest.raises(ConfigError, match="alpha"):
        distill_loss_sum(*args, kind="jsd", alpha=1.5)
    with pytest.raises(ConfigError, match="beta"):
        distill_loss_sum(*args, kind="jsd", beta=-0.1)
    unlabeled = labels.clone()
    unlabeled[mask.nonzero()[0]] = IGNORE_INDEX
    with pytest.raises(ValueError, match="no label"):
        distill_loss_sum(hidden, weight, t_hidden, t_weight, unlabeled, mask, kind="jsd", alpha=0.5)
    with pytest.raises(ValueError, match="labels are required"):
        distill_loss_sum(hidden, weight, t_hidden, t_weight, None, mask, kind="jsd", alpha=0.5)


def test_compiled_chunk_kernel_matches_eager(monkeypatch):
    """``compiled`` (CUDA in the loop) fuses each chunk's work after the matmuls; forced on the
    CPU here, loss, metrics and gradients agree with the eager kernel to rounding."""
    from training.objectives import distill_loss

    settings = dict(kind="jsd", beta=0.5, alpha=0.4, temperature=0.8)
    hidden, weight, t_hidden, t_weight, labels, mask = _inputs()
    args = (hidden, weight, t_hidden, t_weight, labels, mask)
    loss, _, metrics = distill_loss_sum(*args, chunk_tokens=16, **settings)
    loss.backward()
    eager = loss.detach(), metrics, hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    kernel = distill_loss._chunk_kernel
    monkeypatch.setattr(distill_loss, "_chunk_kernel", lambda compiled: kernel(True))
    loss, _, metrics = distill_loss_sum(*args, chunk_tokens=16, **settings)
    loss.backward()
    torch.testing.assert_close(loss.detach(), eager[0])
    torch.testing.assert_close(metrics.divergence_sum, eager[1].divergence_sum)
    torch.testing.assert_close(metrics.ce_sum, eager[1].ce_sum)
    torch.testing.assert_close(hidden.grad, eager[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, eager[3], rtol=1e-5, atol=1e-6)
