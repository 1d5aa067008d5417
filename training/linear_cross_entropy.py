"""Output projection and cross entropy in one pass over chunks of tokens.

The plain path materializes the logits of the whole micro-batch: tokens x vocabulary, which
for a 152k vocabulary at 16k tokens is 2.3 G values, written in bf16, copied to fp32 for the
loss, soft-maxed, and written again as their gradient. Here the tokens are split into
chunks; for each chunk the logits are computed, the loss and the gradient of the logits are
taken at once (the gradient of a sum of cross entropies does not depend on anything but the
chunk), and the gradient is immediately folded into the gradients of the hidden states and
of the weight. The logits of one chunk are the only vocabulary-sized tensor alive.

Because the gradient is computed in the forward pass, the backward pass only scales the
stored gradients by the incoming scalar (the loss is a sum, so its gradient is linear in
the upstream scale). The result is deterministic: the chunking is fixed by the shapes, the
weight gradient is accumulated chunk after chunk in fp32.

Numerics equal the plain path's: matmuls in the compute dtype with fp32 accumulation,
log-softmax in fp32, the logits' gradient rounded to the compute dtype before the matmuls.
"""

from __future__ import annotations

import functools

import torch

from data.batch import IGNORE_INDEX


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    compute_dtype: torch.dtype | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Sum over tokens of cross_entropy(hidden @ weight.T, labels), IGNORE_INDEX labels skipped.

    hidden (..., d), weight (V, d), labels (...) -> fp32 scalar. ``compute_dtype`` is the
    dtype of the matmuls (default: hidden's; under autocast pass the autocast dtype).
    ``compiled``: run the per-chunk loss and gradient through torch.compile (CUDA only).
    """
    dtype = compute_dtype or hidden.dtype
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_tokens, dtype, compiled
    )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens: int, dtype: torch.dtype, compiled: bool):
        h = hidden.detach().to(dtype)
        w = weight.detach().to(dtype)
        labels = labels.to(h.device)
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        step = max(1, int(chunk_tokens))
        ce = _chunk_kernel(compiled and h.device.type == "cuda")
        for start in range(0, h.shape[0], step):
            h_c = h[start : start + step]
            loss, grad_logits = ce(h_c @ w.t(), labels[start : start + step])
            total += loss
            if need_h:
                torch.mm(grad_logits, w, out=grad_h[start : start + step])
            if need_w:
                grad_w += (grad_logits.t() @ h_c).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out.float()
        dh = (grad_h.float() * scale).to(ctx.hidden_dtype) if grad_h is not None else None
        dw = (grad_w * scale).to(ctx.weight_dtype) if grad_w is not None else None
        return dh, dw, None, None, None, None


def _cross_entropy_chunk(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, d(sum)/d(logits) in logits' dtype) for one chunk."""
    x = logits.float()
    valid = labels != IGNORE_INDEX
    target = labels.clamp_min(0).unsqueeze(1)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    loss = ((lse.squeeze(1) - x.gather(1, target).squeeze(1)) * valid).sum()
    one_hot = torch.arange(x.shape[1], device=x.device) == target  # (chunk, V), fused away when compiled
    grad = (torch.exp(x - lse) - one_hot.float()) * valid.unsqueeze(1)
    return loss, grad.to(logits.dtype)


@functools.cache
def _chunk_kernel(compiled: bool):
    """The chunk function; compiled, it is one reduction and one pointwise kernel."""
    return torch.compile(_cross_entropy_chunk, dynamic=False) if compiled else _cross_entropy_chunk
