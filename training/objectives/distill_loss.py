"""Distillation losses between a teacher's and a student's next-token distributions.

Per trained token, with student logits ``z``, teacher logits ``t`` and temperature ``T``:
``q = softmax(z / T)`` (student), ``p = softmax(t / T)`` (teacher), and the divergence ``D``:

- ``forward_kl``: ``KL(p ‖ q) = Σ p (log p - log q)`` (mode covering; classic KD),
- ``reverse_kl``: ``KL(q ‖ p) = Σ q (log q - log p)`` (mode seeking),
- ``jsd``: the generalized Jensen-Shannon divergence of Agarwal et al. 2024 (GKD), with the
  teacher's weight β in the mixture ``m = β p + (1 - β) q``:
  ``JSD_β = β KL(p ‖ m) + (1 - β) KL(q ‖ m)`` for 0 < β < 1. By convention β = 0 *is*
  ``forward_kl`` and β = 1 *is* ``reverse_kl``: these are the limits of ``JSD_β / β`` (β → 0)
  and ``JSD_β / (1 - β)`` (β → 1), not of ``JSD_β`` itself, which goes to 0 at both ends.
  β = 0.5 is the symmetric JSD.

The token's loss is ``(1 - alpha) · T² · D + alpha · CE``, ``CE`` the hard-label cross
entropy of the student at temperature 1. ``alpha`` is the weight of the hard labels:
0 is pure distillation, 1 is plain SFT. The ``T²`` factor (Hinton et al. 2015) keeps the
divergence's gradients, which shrink as ``1/T²``, on the scale of the CE's as T changes.

``mask`` (N,) selects the trained tokens (bool or 0/1 ints); the loss is the *sum* over
them, returned with their count, so the caller divides by the global batch's count.
With ``alpha > 0`` every trained token needs a label (not IGNORE_INDEX).

Memory: ``distill_loss_sum`` takes hidden states and output weights and never holds more
than one chunk of tokens' logits (the pattern of training/linear_cross_entropy.py): the
gradient of each chunk's loss with respect to the student's logits is computed in closed
form in the forward pass (below) and folded at once into the gradients of the hidden states
and the weight, so the backward only scales them. Per chunk, the live vocabulary-sized
tensors are a handful of ``(chunk_tokens, V)`` fp32 buffers. The per-token losses are
summed once at the end, in token order, so the loss does not depend on the chunking.

Gradients with respect to the scaled student logits ``s = z / T`` (``dD/dz = dD/ds / T``):
forward KL ``q - p``; reverse KL ``q ⊙ (r - Σ q r)`` with ``r = log q - log p``; JSD
``(1 - β) q ⊙ (r - Σ q r)`` with ``r = log q - log m`` (the teacher-side terms cancel
because ``β p + (1 - β) q = m``).

The teacher is never differentiated; logits are assumed finite. ``compiled`` (CUDA only, as
training/linear_cross_entropy.py) runs each chunk's work after the two matmuls as compiled
kernels: eager, it is a dozen vocabulary-sized fp32 passes per chunk, more time than the
matmuls on a small model.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from core.exceptions import ConfigError
from data.batch import IGNORE_INDEX

KINDS = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class DistillMetrics:
    """Detached fp32 sums over the trained tokens (divide by the count to report)."""

    divergence_sum: torch.Tensor
    """Σ D, without the T² factor and the (1 - alpha) weight."""
    ce_sum: torch.Tensor
    """Σ CE of the hard labels (0 when no labels are given)."""


def distill_loss_sum(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    kind: str,
    temperature: float = 1.0,
    alpha: float = 0.0,
    beta: float = 0.5,
    chunk_tokens: int = 4096,
    compute_dtype: torch.dtype | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, DistillMetrics]:
    """(loss sum, trained-token count, metrics) from hidden states, chunk by chunk over tokens.

    student_hidden (..., d), student_weight (V, d), teacher_hidden (..., d_t), teacher_weight
    (V, d_t), labels and mask (...). The student's matmuls run in ``compute_dtype`` (default:
    the hidden states' dtype; under autocast pass the autocast dtype), the teacher's in its
    hidden states' dtype; everything after the matmuls is fp32. Gradients reach
    ``student_hidden`` and ``student_weight`` only. ``compiled``: the per-chunk work through
    torch.compile (CUDA only; rounds differently from eager, deterministically).
    """
    kind, beta = _resolve(kind, temperature, alpha, beta)
    d = student_hidden.shape[-1]
    hidden = student_hidden.reshape(-1, d)
    t_hidden = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).detach()
    mask = mask.reshape(-1).to(hidden.device, torch.bool)
    labels = _checked_labels(labels, mask, alpha, hidden.device)
    options = (kind, float(temperature), float(alpha), float(beta), compiled and hidden.device.type == "cuda")
    loss, divergence, ce = _FusedDistill.apply(
        hidden, student_weight, t_hidden, teacher_weight.detach(), labels, mask,
        max(1, int(chunk_tokens)), options, compute_dtype or student_hidden.dtype,
    )
    return loss, mask.sum(), DistillMetrics(divergence, ce)


def distill_loss_from_logits(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    kind: str,
    temperature: float = 1.0,
    alpha: float = 0.0,
    beta: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, DistillMetrics]:
    """The same loss from full logits (..., V) through plain autograd: small inputs and tests."""
    kind, beta = _resolve(kind, temperature, alpha, beta)
    vocab = student_logits.shape[-1]
    z = _at_least_fp32(student_logits.reshape(-1, vocab))
    t = _at_least_fp32(teacher_logits.reshape(-1, vocab).detach())
    mask = mask.reshape(-1).to(z.device, torch.bool)
    labels = _checked_labels(labels, mask, alpha, z.device)
    per_token, divergence, ce, _ = _token_losses(z, t, labels, mask, kind, temperature, alpha, beta)
    return per_token.sum(), mask.sum(), DistillMetrics(divergence.detach().sum(), ce.detach().sum())


def _resolve(kind: str, temperature: float, alpha: float, beta: float) -> tuple[str, float]:
    """Validate the settings; ``jsd`` with β = 0 or 1 becomes the KL it is defined as."""
    if kind not in KINDS:
        raise ConfigError(f"unknown distillation loss {kind!r}", hint=f"choose one of {', '.join(KINDS)}")
    if not temperature > 0:
        raise ConfigError(f"distillation temperature must be > 0, got {temperature}")
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha (the hard-label weight) must be in [0, 1], got {alpha}")
    if not 0.0 <= beta <= 1.0:
        raise ConfigError(f"beta (the teacher's weight in the JSD mixture) must be in [0, 1], got {beta}")
    if kind == "jsd" and beta in (0.0, 1.0):
        kind = "forward_kl" if beta == 0.0 else "reverse_kl"
    return kind, beta


def _checked_labels(labels: torch.Tensor | None, mask: torch.Tensor, alpha: float, device) -> torch.Tensor | None:
    if labels is None:
        if alpha > 0:
            raise ValueError("alpha > 0 mixes in hard-label cross entropy: labels are required")
        return None
    labels = labels.reshape(-1).to(device)
    if alpha > 0 and bool(((labels == IGNORE_INDEX) & mask).any()):
        raise ValueError("a trained token (mask set) has no label (IGNORE_INDEX) while alpha > 0")
    return labels


def _token_losses(z, t, labels, mask, kind, temperature, alpha, beta, *, with_grad: bool = False):
    """Per-token (loss, D, CE) for fp32 logits z (student) and t (teacher), zero where not masked.

    With ``with_grad``, also d(Σ loss)/dz (fp32), for the fused path (no autograd graph).
    """
    inv_t = 1.0 / temperature
    s = z if temperature == 1.0 else z * inv_t
    log_q = torch.log_softmax(s, dim=-1)
    log_p = torch.log_softmax(t if temperature == 1.0 else t * inv_t, dim=-1)
    q = log_q.exp()
    if kind == "forward_kl":
        p = log_p.exp()
        divergence = (p * (log_p - log_q)).sum(-1)
        grad_s = (q - p) if with_grad else None
    elif kind == "reverse_kl":
        r = log_q - log_p
        divergence = (q * r).sum(-1)
        grad_s = q * (r - divergence.unsqueeze(-1)) if with_grad else None
    else:
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
        r = log_q - log_m
        q_r = (q * r).sum(-1)
        divergence = beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1.0 - beta) * q_r
        grad_s = (1.0 - beta) * q * (r - q_r.unsqueeze(-1)) if with_grad else None
    weight = mask.to(z.dtype)
    divergence = divergence * weight
    loss = (1.0 - alpha) * temperature**2 * divergence
    grad = (1.0 - alpha) * temperature * grad_s if with_grad else None
    ce = torch.zeros_like(divergence)
    if labels is not None:
        valid = mask & (labels != IGNORE_INDEX)
        log_q1 = log_q if temperature == 1.0 else torch.log_softmax(z, dim=-1)
        target = labels.clamp_min(0).unsqueeze(1)
        ce = -log_q1.gather(1, target).squeeze(1) * valid
        if alpha > 0:
            loss = loss + alpha * ce
            if with_grad:
                one_hot = torch.arange(z.shape[1], device=z.device) == target
                grad = grad + alpha * (log_q1.exp() - one_hot.to(z.dtype))
    if with_grad:
        grad = grad * weight.unsqueeze(1)
    return loss, divergence, ce, grad


def _chunk_losses(z, t, labels, mask, kind, temperature, alpha, beta, with_grad):
    """``_token_losses`` of one chunk's raw logits (compute dtype) in fp32, its gradient in ``z``'s dtype."""
    loss, div, ce, grad = _token_losses(_at_least_fp32(z), _at_least_fp32(t), labels, mask, kind, temperature,
                                        alpha, beta, with_grad=with_grad)
    return loss, div, ce, None if grad is None else grad.to(z.dtype)


@functools.cache
def _chunk_kernel(compiled: bool):
    """The chunk function; compiled, a few reduction and pointwise kernels instead of dozens of passes."""
    return torch.compile(_chunk_losses, dynamic=False) if compiled else _chunk_losses


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp32 for half precision inputs; fp32 and fp64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class _FusedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, labels, mask, chunk_tokens, options, dtype):
        kind, temperature, alpha, beta, compiled = options
        h = hidden.detach().to(dtype)
        w = weight.detach().to(dtype)
        tw = t_weight.to(t_hidden.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        per_token_dtype = torch.promote_types(dtype, torch.float32)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=per_token_dtype, device=h.device) if need_w else None
        n = h.shape[0]
        per_token = torch.empty(3, n, dtype=per_token_dtype, device=h.device)  # loss, D, CE
        chunk_losses = _chunk_kernel(compiled)
        for start in range(0, n, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk_labels = None if labels is None else labels[rows]
            loss, div, ce, grad = chunk_losses(
                h[rows] @ w.t(), t_hidden[rows] @ tw.t(), chunk_labels, mask[rows], kind, temperature, alpha, beta,
                need_h or need_w,
            )  # the logits (chunk, V) in the compute dtypes; the gradient in the student's
            per_token[0, rows], per_token[1, rows], per_token[2, rows] = loss, div, ce
            if grad is None:
                continue
            if need_h:
                torch.mm(grad, w, out=grad_h[rows])
            if need_w:
                grad_w += grad.t() @ h[rows]
        loss_sum, div_sum, ce_sum = (row.sum() for row in per_token)  # in token order: chunking-independent
        ctx.save_for_backward(grad_h, grad_w)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(div_sum, ce_sum)
        return loss_sum, div_sum, ce_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_div, _grad_ce):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss.to(torch.promote_types(grad_loss.dtype, torch.float32))
        dh = (_at_least_fp32(grad_h) * scale).to(ctx.hidden_dtype) if grad_h is not None else None
        dw = (grad_w * scale).to(ctx.weight_dtype) if grad_w is not None else None
        return dh, dw, None, None, None, None, None, None, None
