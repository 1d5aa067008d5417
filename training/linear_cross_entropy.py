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

FP8 (``float8=True``, ``parallel.float8_head``): the three matmuls of each chunk run in FP8
through ``torch._scaled_mm``, tensorwise. The weight and each chunk's hidden states are cast to
e4m3 with a dynamic scale (max / amax), and the forward accumulates fast, like torchao's
recipes. The logits' gradient, softmax minus one-hot, lies within [-1, 1], so it takes a
fixed power-of-two scale, ``LOGITS_GRAD_SCALE``, in e5m2: no amax pass over the
vocabulary-sized tensor, and the compiled loss kernel writes it in FP8 directly. The
backward's two matmuls always accumulate precisely: their sums run over the vocabulary
(151,936 terms for Qwen) and the chunk, and with the tensor cores' fast accumulation there
Qwen3-1.7B's loss ended 11% above bf16's after 300 steps, with spikes, against 0.4% with the
precise one (docs/performance.md, 2026-11-28f). ``_scaled_mm`` takes its first operand
row-major and its second column-major, so the weight and each chunk's hidden states and
logits' gradient also get transposed FP8 copies. Rows are padded with ignored tokens to a
multiple of 16, its shape requirement. The logits come out in the compute dtype and the loss
is taken from them in fp32, as in bf16; the gradients' error against fp32 is about 3% here,
against 0.2% in bf16 (docs/performance.md, 2026-11-28e and 2026-11-28f).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from data.batch import IGNORE_INDEX

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLOAT8_MULTIPLE = 16  # torch._scaled_mm: both dimensions of each operand
AMAX_FLOOR = 1e-12  # torchao's: the scale of an all-zero tensor stays finite
# |softmax - one_hot| <= 1 and e5m2 reaches 57,344: 2**15 keeps every value in range, is exact
# (a power of two), and e5m2's relative precision does not depend on the scale.
LOGITS_GRAD_SCALE = 2.0**15


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    compute_dtype: torch.dtype | None = None,
    compiled: bool = False,
    float8: bool = False,
) -> torch.Tensor:
    """Sum over tokens of cross_entropy(hidden @ weight.T, labels), IGNORE_INDEX labels skipped.

    hidden (..., d), weight (V, d), labels (...) -> fp32 scalar. ``compute_dtype`` is the
    dtype of the matmuls (default: hidden's; under autocast pass the autocast dtype).
    ``compiled``: run the per-chunk loss and gradient through torch.compile (CUDA only).
    ``float8``: the matmuls in FP8 (module docstring); d and V must be multiples of 16.
    """
    dtype = compute_dtype or hidden.dtype
    if float8 and (hidden.shape[-1] % FLOAT8_MULTIPLE or weight.shape[0] % FLOAT8_MULTIPLE):
        raise ValueError(f"an FP8 head needs hidden size and vocabulary multiples of {FLOAT8_MULTIPLE}, "
                         f"got weight {tuple(weight.shape)}")
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_tokens, dtype, compiled, float8
    )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens: int, dtype: torch.dtype, compiled: bool,
                float8: bool):
        h = hidden.detach().to(dtype)
        labels = labels.to(h.device)
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        step = max(1, int(chunk_tokens))
        compiled = compiled and h.device.type == "cuda"
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        if float8:
            total = _float8_chunks(h, weight.detach(), labels, step, grad_h, grad_w, total, compiled=compiled)
            ctx.save_for_backward(grad_h, grad_w)
            return total
        w = weight.detach().to(dtype)
        ce = _chunk_kernel(compiled)
        for start in range(0, h.shape[0], step):
            h_c = h[start : start + step]
            loss, grad_logits = ce(h_c @ w.t(), labels[start : start + step])
            total += loss
            if need_h:
                torch.mm(grad_logits, w, out=grad_h[start : start + step])
            if need_w:
                grad_w += (grad_logits.t() @ h_c).float()
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out.float()
        dh = (grad_h.float() * scale).to(ctx.hidden_dtype) if grad_h is not None else None
        dw = (grad_w * scale).to(ctx.weight_dtype) if grad_w is not None else None
        return dh, dw, None, None, None, None, None


def _float8_chunks(h, weight, labels, step, grad_h, grad_w, total, *, compiled: bool):
    """The chunk loop of ``_LinearCrossEntropy.forward`` with FP8 matmuls (module docstring):
    fills grad_h and grad_w, returns the loss. h (N, d) in the compute dtype."""
    cast, ce = _float8_kernels(compiled)
    w8, w_inv = cast(weight, E4M3)  # (V, d): the logits' second operand as w8.t()
    w8_t = w8.t().contiguous() if grad_h is not None else None  # (d, V): grad_h's as w8_t.t()
    grad_inv = torch.full((), 1.0 / LOGITS_GRAD_SCALE, device=h.device)  # once: a scalar per chunk would sync
    for start in range(0, h.shape[0], step):
        h_c, labels_c = h[start : start + step], labels[start : start + step]
        rows = h_c.shape[0]
        pad = -rows % FLOAT8_MULTIPLE
        if pad:  # zero rows with ignored labels: no loss, no gradient
            h_c = F.pad(h_c, (0, 0, 0, pad))
            labels_c = F.pad(labels_c, (0, pad), value=IGNORE_INDEX)
        h8, h_inv = cast(h_c, E4M3)
        logits = torch._scaled_mm(h8, w8.t(), scale_a=h_inv, scale_b=w_inv, out_dtype=h.dtype, use_fast_accum=True)
        loss, g8 = ce(logits, labels_c)
        total += loss
        if grad_h is not None:
            grad_h[start : start + rows] = torch._scaled_mm(
                g8, w8_t.t(), scale_a=grad_inv, scale_b=w_inv, out_dtype=h.dtype, use_fast_accum=False
            )[:rows]
        if grad_w is not None:
            grad_w += torch._scaled_mm(g8.t().contiguous(), h8.t().contiguous().t(), scale_a=grad_inv, scale_b=h_inv,
                                       out_dtype=torch.float32, use_fast_accum=False)
    return total


def to_float8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise dynamic scaling as torchao's: scale = max / amax, a saturated cast. Returns the
    FP8 tensor and the inverse scale that ``torch._scaled_mm`` takes."""
    top = torch.finfo(dtype).max
    scale = top / x.abs().amax().float().clamp(min=AMAX_FLOOR)
    return (x.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


def _cross_entropy_chunk_float8(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_cross_entropy_chunk with the logits' gradient written in e5m2 at LOGITS_GRAD_SCALE."""
    loss, grad = _cross_entropy_chunk(logits.float(), labels)
    return loss, (grad * LOGITS_GRAD_SCALE).to(E5M2)


@functools.cache
def _float8_kernels(compiled: bool):
    """(cast, chunk loss) of the FP8 loop; compiled, each is fused into few kernels."""
    if not compiled:
        return to_float8, _cross_entropy_chunk_float8
    return torch.compile(to_float8, dynamic=False), torch.compile(_cross_entropy_chunk_float8, dynamic=False)


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
