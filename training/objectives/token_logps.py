"""Log-probabilities of the label tokens, from hidden states and the output weight, chunk by chunk.

DPO-style and policy-gradient losses need ``log p(label_t | prefix)`` per token (summed per
sequence, or weighted by advantages) and are not linear in it, so the trick of
training/linear_cross_entropy.py (gradient computed in the forward, merely scaled in the
backward) does not apply: the upstream gradient differs per token. Here the forward keeps,
per token, only the log-prob and the log-partition ``lse``; the backward recomputes each
chunk's logits, ``softmax = exp(z / T - lse)``, and folds
``d logp / d z = (onehot - softmax) / T``, scaled by the token's upstream gradient, into the
gradients of the hidden states and of the weight. One chunk of ``(chunk_tokens, V)`` logits
is alive at a time, in both passes; the price is a second matmul per chunk.

Matmuls run in the compute dtype (fp32 accumulation), everything after them in fp32; the
weight gradient is accumulated chunk after chunk in fp32, so results are deterministic.
``compiled`` (CUDA only, as training/linear_cross_entropy.py) runs each chunk's pointwise and
reduction work after the matmul as compiled kernels: eager, the backward alone makes five
vocabulary-sized fp32 passes per chunk, which cost as much as the matmuls on a small model.

Under ``determinism.batch_invariant`` (the model's ``Numerics``) the forward's matmuls and
log-partitions are models/batch_invariant.py's (``invariant``): the log-prob of a token is then the
sampler's for it bitwise, whatever the micro-batch, the row or the chunk it is computed in.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from data.batch import IGNORE_INDEX
from models import batch_invariant
from models.forward import model_forward
from models.numerics import Numerics


def pairwise_sum(values: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension by one fixed tree: padded with zeros to a power of two,
    then neighbours added level by level. Each level is an elementwise add, so a sum's bits
    depend on its own values and the dimension's length only, not on the tensor's other
    dimensions (a library reduction's order follows the kernel it picks for the whole shape)."""
    length = values.shape[-1]
    width = 1 << max(length - 1, 0).bit_length()
    if width != length:
        values = torch.nn.functional.pad(values, (0, width - length))
    while values.shape[-1] > 1:
        values = values[..., 0::2] + values[..., 1::2]
    return values[..., 0]


def linear_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    compute_dtype: torch.dtype | None = None,
    compiled: bool = False,
    invariant: bool = False,
) -> torch.Tensor:
    """``log softmax(hidden @ weight.T / temperature)[label]`` per token, 0 where the label is IGNORE_INDEX.

    hidden (..., d), weight (V, d), labels (...) -> fp32 (or fp64 for fp64 inputs) tensor of
    labels' shape. Differentiable with respect to ``hidden`` and ``weight``. ``compute_dtype``:
    the matmuls' dtype in both passes (default: autocast's where it is on, else ``hidden``'s).
    ``compiled``:
    the per-chunk work after the matmuls through torch.compile (CUDA only; rounds differently
    from eager, deterministically). ``invariant``: the batch-invariant matmul and log-partition
    (models/batch_invariant.py; not compiled).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if compute_dtype is None:
        # Under autocast the forward's matmul multiplies in autocast's dtype; the backward runs
        # outside autocast and must recompute the same logits, not fp32 ones (which did not match
        # the forward's log-partition, and took 23 ms a 1,024-token chunk of Qwen's vocabulary on an
        # H200 with the invariant matmul, against about 1 ms in bf16).
        compute_dtype = autocast_dtype(hidden.device)
    logps = _LinearTokenLogps.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
        max(1, int(chunk_tokens)), float(temperature), compute_dtype or hidden.dtype,
        compiled and hidden.device.type == "cuda" and not invariant, invariant,
    )
    return logps.reshape(labels.shape)


def token_logps_from_logits(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                            invariant: bool = False) -> torch.Tensor:
    """The same from full logits (..., V) through plain autograd (small inputs and tests); ``invariant``:
    by ``batch_invariant.token_logprobs``, the sampler's function under ``batch_invariant``."""
    valid = labels != IGNORE_INDEX
    if invariant:
        scaled = logits if temperature == 1.0 else logits.float() / temperature
        return batch_invariant.token_logprobs(scaled, labels.clamp_min(0)) * valid
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    log_probs = torch.log_softmax(x / temperature if temperature != 1.0 else x, dim=-1)
    picked = log_probs.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return picked * valid


def label_logps(
    model: nn.Module,
    placed,
    *,
    fused: bool,
    chunk_tokens: int,
    compute_dtype: torch.dtype | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """(B, T) log-probs of a placed batch's labels under ``model``, 0 where there is none: the
    fused head (``linear_token_logps``) or full logits. ``compute_dtype`` and ``compiled`` are
    the fused head's (see ``linear_token_logps``); the caller says which, once, for all its
    forwards (the policy's and a frozen model's). Under the model's ``Numerics.batch_invariant``
    both paths compute by models/batch_invariant.py's kernels."""
    invariant = model_numerics(model).batch_invariant
    if not fused:
        return token_logps_from_logits(model_forward(model, placed).logits, placed.labels, invariant=invariant)

    def head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear_token_logps(hidden, weight, placed.labels, chunk_tokens=chunk_tokens,
                                  compute_dtype=compute_dtype, compiled=compiled, invariant=invariant)

    return model_forward(model, placed, head=head).head


def model_numerics(model: nn.Module) -> Numerics:
    """The ``Numerics`` a (possibly wrapped: DDP, compiled) model runs under; the defaults where it
    carries none."""
    while model is not None:
        numerics = getattr(model, "numerics", None)
        if isinstance(numerics, Numerics):
            return numerics
        inner = getattr(model, "module", None)
        model = inner if inner is not None else getattr(model, "_orig_mod", None)
    return Numerics()


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype in force on ``device``'s type, None where autocast is off."""
    kind = device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """Raw logits (chunk, V) in the compute dtype -> fp32 (fp64 stays), divided by the temperature."""
    z = z if z.dtype in (torch.float32, torch.float64) else z.float()
    return z if temperature == 1.0 else z / temperature


def _logps_chunk(z: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of the targets, log-partition) of one chunk's raw logits (chunk, V)."""
    x = _scaled(z, temperature)
    lse = torch.logsumexp(x, dim=-1)
    return (x.gather(1, target.unsqueeze(1)).squeeze(1) - lse) * valid, lse


def _grad_chunk(z: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor,
                temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """d(Σ scale · logp)/d(raw logits) of one chunk, in the compute dtype (``scale`` holds the
    upstream gradient, zero for ignored tokens, divided by the temperature)."""
    softmax = torch.exp(_scaled(z, temperature) - lse.unsqueeze(1))
    one_hot = torch.arange(softmax.shape[1], device=softmax.device) == target.unsqueeze(1)
    return ((one_hot.to(softmax.dtype) - softmax) * scale.unsqueeze(1)).to(dtype)


def _invariant_logps_chunk(z: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
                           temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``_logps_chunk`` by ``batch_invariant.logsumexp`` (a row's bits do not depend on the chunk)."""
    x = _scaled(z, temperature)
    lse = batch_invariant.logsumexp(x)
    return (x.gather(1, target.unsqueeze(1)).squeeze(1) - lse) * valid, lse


def _matmul(invariant: bool):
    """A chunk's logits ``h @ w.T``: the batch-invariant linear or torch's matmul."""
    return batch_invariant.linear if invariant else (lambda h, w: h @ w.t())


def _chunk_kernels(compiled: bool, invariant: bool):
    """The chunk functions of a call: the batch-invariant log-probs, or ``_kernels(compiled)``."""
    return (_invariant_logps_chunk, _grad_chunk) if invariant else _kernels(compiled)


@functools.cache
def _kernels(compiled: bool):
    """The chunk functions; compiled, each is a reduction and a pointwise kernel."""
    if not compiled:
        return _logps_chunk, _grad_chunk
    return torch.compile(_logps_chunk, dynamic=False), torch.compile(_grad_chunk, dynamic=False)


class _LinearTokenLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, temperature, dtype, compiled, invariant):
        h = hidden.detach().to(dtype)
        w = weight.detach().to(dtype)
        out_dtype = torch.promote_types(dtype, torch.float32)
        n = h.shape[0]
        logps = torch.empty(n, dtype=out_dtype, device=h.device)
        lse = torch.empty(n, dtype=out_dtype, device=h.device)
        valid = labels != IGNORE_INDEX
        target = labels.clamp_min(0)
        logps_chunk, _ = _chunk_kernels(compiled, invariant)
        matmul = _matmul(invariant)
        for start in range(0, n, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logps[rows], lse[rows] = logps_chunk(matmul(h[rows], w), target[rows], valid[rows], temperature)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_tokens, ctx.temperature, ctx.dtype, ctx.compiled = chunk_tokens, temperature, dtype, compiled
        ctx.invariant = invariant
        return logps

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype, temperature, step = ctx.dtype, ctx.temperature, ctx.chunk_tokens
        h = hidden.detach().to(dtype)
        w = weight.detach().to(dtype)
        # d logp / d z, times the upstream gradient, is zero for ignored tokens.
        scale = (grad_out.to(lse.dtype) * (labels != IGNORE_INDEX)) / temperature
        target = labels.clamp_min(0)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=h.device) if need_w else None
        _, grad_chunk = _chunk_kernels(ctx.compiled, ctx.invariant)
        matmul = _matmul(ctx.invariant)  # the forward's logits, so the softmax matches its lse
        for start in range(0, h.shape[0], step):
            rows = slice(start, start + step)
            grad_z = grad_chunk(matmul(h[rows], w), lse[rows], target[rows], scale[rows], temperature, dtype)
            if need_h:
                torch.mm(grad_z, w, out=grad_h[rows])
            if need_w:
                grad_w += grad_z.t() @ h[rows]
        dh = grad_h.to(hidden.dtype) if need_h else None
        dw = grad_w.to(weight.dtype) if need_w else None
        return dh, dw, None, None, None, None, None, None
