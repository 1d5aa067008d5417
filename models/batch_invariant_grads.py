"""The backwards of the batch-invariant CUDA kernels, in closed form (models/batch_invariant_triton.py).

A gradient must be deterministic, not batch-invariant: the sampler never runs a backward, so the
trainer's gradients need only repeat, bit for bit, from run to run. Each function here is the
derivative of its kernel's reference formula (the plain torch formula models/batch_invariant_triton.py
names beside each kernel), written out: no recomputed autograd graph, so on CUDA it can run as one
compiled function (``compiled``) of a few fused kernels instead of the twenty to forty launches of a
recomputed forward and its autograd backward. On an H200 the Qwen3-0.6B GRPO recipe's update, 64
micro-batches of 2 x 512 tokens, launched about 6,100 kernels a micro-batch in its backward that way,
and the host could not issue them as fast as the GPU ran them (docs/bench/log.md, 2026-12-02,
"the update").

Everything is computed in fp32 (the kernels' own precision; fp64 inputs stay fp64) and cast to each
input's dtype at the end; none of it depends on which rows share a call in a way the reduction order could not repeat:
library reductions and matmuls of a fixed shape, and compiled kernels of a fixed shape, are
deterministic. The functions are plain torch and run anywhere; the tests compare them with autograd
of the reference formulas on the CPU.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch


def _wide(x: torch.Tensor) -> torch.dtype:
    """The dtype a formula computes in: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The row kernel's formula in plain torch (models/qwen/model.py's ``RMSNorm``)."""
    x32 = x.to(_wide(x))
    normed = x32 / torch.sqrt((x32 * x32).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def logsumexp_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x.to(_wide(x)), dim=-1)


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.to(_wide(x)), dim=-1)


def rms_norm_grads(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of ``out = weight * (x32 / sqrt(mean(x32^2) + eps)).to(x.dtype)`` over the last
    dimension, x32 = x in fp32. x (..., width), weight (width,), grad like out -> dx like x, dweight like
    weight. With s = sqrt(mean(x32^2) + eps) and gn = grad * weight: dx = gn / s - x32 * sum(gn * x32) /
    (width * s^3); dweight = the sum over rows of grad * (x32 / s).to(x.dtype)."""
    width, wide = x.shape[-1], _wide(x)
    x32 = x.to(wide)
    root = torch.sqrt((x32 * x32).mean(dim=-1, keepdim=True) + eps)
    normed = (x32 / root).to(x.dtype).to(wide)
    g32 = grad.to(wide)
    gn = g32 * weight.to(wide)
    dx = gn / root - x32 * ((gn * x32).sum(dim=-1, keepdim=True) / (width * root * root * root))
    dweight = (g32 * normed).reshape(-1, width).sum(dim=0)
    return dx.to(x.dtype), dweight.to(weight.dtype)


def logsumexp_grads(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dx of ``logsumexp(x32)`` over the last dimension: grad times the softmax, in x's dtype."""
    return (grad.to(_wide(x)).unsqueeze(-1) * torch.softmax(x.to(_wide(x)), dim=-1)).to(x.dtype)


def softmax_grads(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dx of ``softmax(x32)`` over the last dimension: y * (grad - sum(grad * y)), in x's dtype."""
    y = torch.softmax(x.to(_wide(x)), dim=-1)
    g32 = grad.to(_wide(x))
    return (y * (g32 - (g32 * y).sum(dim=-1, keepdim=True))).to(x.dtype)


def allowed_keys(positions: torch.Tensor, documents: Optional[torch.Tensor], relative: bool, batch: int,
                 k_len: int) -> torch.Tensor:
    """(B, T, S) bool: which key rows each query reads, the attention kernel's rule as a dense mask.
    positions (B or 1, T) from 0 at each document's first token; documents (B or 1, S) or None;
    relative: key rows ``t - position + j`` (a packed training row), else slots 0..position (a cache)."""
    positions = positions.expand(batch, -1)
    query = torch.arange(positions.shape[1], device=positions.device)
    key = torch.arange(k_len, device=positions.device)
    start = (query - positions) if relative else torch.zeros_like(positions)
    j = key[None, None, :] - start[:, :, None]  # the key row's place in the query's document
    allowed = (j >= 0) & (j <= positions[:, :, None])
    if documents is not None:
        documents = documents.expand(batch, k_len)
        allowed &= documents[:, None, :] == documents[:, :positions.shape[1], None]
    return allowed


def attention_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    documents: Optional[torch.Tensor], grad: torch.Tensor,
                    relative: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the dense attention in fp32 (models/batch_invariant_triton.py ``dense_attention``):
    q (B, H, T, hd), k and v (B, n_kv, S, hd), the mask ``allowed_keys``, grad (B, H, T, hd) -> each
    like its input. With P = softmax(scale * q k^T, masked) and dO = grad: dv = P^T dO, dP = dO v^T,
    dS = P * (dP - rowsum(dP * P)), dq = scale * dS k, dk = scale * dS^T q; a key/value head's
    gradient sums over the query heads of its group (one matmul over their stacked rows)."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    scale, wide = head_dim**-0.5, _wide(q)
    allowed = allowed_keys(positions, documents, relative, batch, k_len)
    qg = q.to(wide).reshape(batch, kv_heads, groups * q_len, head_dim)  # row g*T + t: head kv*G + g
    k32, v32 = k.to(wide), v.to(wide)
    scores = (qg @ k32.transpose(-1, -2) * scale).view(batch, kv_heads, groups, q_len, k_len)
    probs = scores.masked_fill(~allowed[:, None, None], float("-inf")).softmax(dim=-1)
    probs = probs.view(batch, kv_heads, groups * q_len, k_len)
    d_out = grad.to(wide).reshape(batch, kv_heads, groups * q_len, head_dim)
    dv = probs.transpose(-1, -2) @ d_out  # (B, n_kv, S, hd)
    d_probs = d_out @ v32.transpose(-1, -2)  # (B, n_kv, G*T, S)
    d_scores = probs * (d_probs - (d_probs * probs).sum(dim=-1, keepdim=True)) * scale
    dq = (d_scores @ k32).view(batch, heads, q_len, head_dim)
    dk = d_scores.transpose(-1, -2) @ qg
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@functools.cache
def compiled(fn: Callable) -> Callable:
    """``fn`` through torch.compile (one graph, static shapes): its elementwise work and reductions
    fused into a few kernels, compiled once per shape and dtype it meets. Used on CUDA only, where a
    backward's launches cost more host time than its arithmetic costs the GPU."""
    return torch.compile(fn, dynamic=False, fullgraph=True)
