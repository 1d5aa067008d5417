"""Batch-invariant kernels: a token's result depends on its own inputs only, never on the call's shape.

The sampler runs its model at other shapes than the trainer: a decode step is ``max_batch`` rows of
one token over a cache of ``max_len`` slots, a prefill ``prefill_rows`` x ``prefill_chunk``, a
training micro-batch ``B x T`` rows of packed documents. The stock kernels round differently at
different shapes: on a CPU (MKL, torch 2.13) a row of ``x @ W.T`` changes with the number of
rows (1 vs 2 vs 7 rows, and again past a few hundred rows for wider weights), a batched
``q @ k.T`` with the batch and the number of queries, a library reduction with the kernel it picks
for the whole shape. So the sampler's log-probs differ from the trainer's in the last bits (about
1e-6 in fp32). Here every reduction a token goes through has a fixed order that its own shape
alone decides:

- ``linear``: the rows in blocks of ``ROW_BLOCK``, each block one matmul of the same shape
  ``(ROW_BLOCK, in) @ (in, out)``, the last block padded with zero rows; a row's result depends on
  the weight's shape, not on the number of rows or on where in the call the row sits (measured:
  tests/models/test_batch_invariance.py).
- ``pairwise_sum``: a sum by one fixed tree (zero-padded to a power of two, neighbours added level
  by level, each level an elementwise add). Padding a sum with more zeros leaves it unchanged
  bitwise (the extra levels add exact zeros), so a sum over 112 keys and over 128 or 256 slots of
  which the last are masked agree.
- ``attend``: attention by elementwise products and sums in a fixed order (a tree over head_dim;
  over the keys, a tree within each block of ``KEY_BLOCK`` keys and the blocks added in order),
  with the keys laid out by *relative position* (key j of a query is its document's j-th token):
  the training forward's packed rows and the cache's slots give every query the same keys in the
  same places, so training, prefill and cached decode compute a token identically, whatever its
  row, its packing neighbours or the cache's length (extra masked keys add exact zeros).
- ``rms_norm``, ``silu``, ``logsumexp``, ``token_logprobs`` and ``softmax``: the norm's mean square, the
  activation, the full-vocabulary log-softmax and a router's softmax in fp32 through the same sums.
- A mixture of experts (models/qwen3_moe/moe.py) asks ``active()``: its router's softmax is ``softmax``,
  its weights' renormalization and the combine over a token's ``top_k`` slots ``pairwise_sum``s, and
  its experts run as a loop of ``linear``s (never a grouped matmul), so a token's expert choices and
  output are the same in the sampler's cached forward and in the trainer's.

Elementwise operations (products, exp, cos/sin of the rotary table, divisions) round each element
on its own and stay as they are. Under autocast (a bf16 run) ``linear``'s matmuls take autocast's
bf16 inputs as the stock linear would, in the trainer and in the sampler alike: the sampler's
forwards run under the training forward's autocast (``Numerics.sampler_autocast``). These kernels cost time (no library matmul in attention: its
products are materialized ``KEY_BLOCK`` keys at a time); ``Numerics.batch_invariant`` (models/numerics.py)
turns them on, in ``determinism.mode: bitwise`` with ``determinism.batch_invariant: true``.
``Linears`` is the context the model's forward runs its blocks under: it sends every
``F.linear`` (plain, LoRA's, the tied head) and ``F.silu`` to these kernels, and ``active()`` tells
the norm to use its own.

On a CUDA device ``linear``, ``attend``, ``attend_cached``, ``rms_norm``, ``logsumexp`` (and so
``token_logprobs``) and ``softmax`` run models/batch_invariant_triton.py's Triton kernels instead (the
same contract, other bits than the CPU's): one launch a row reduction, where a tree sum takes one
per level besides its elementwise steps (docs/determinism.md has the counts measured on an H200).
``pairwise_sum`` itself (a mixture's few top-k slots) and the elementwise kernels are invariant on
any device and stay. Without Triton the CUDA path raises a ConfigError naming
``determinism.batch_invariant``: there is no silent fallback to the stock kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from core.exceptions import ConfigError

ROW_BLOCK = 64
"""Rows per matmul of ``linear``: every call is a loop of ``(ROW_BLOCK, in) @ (in, out)`` matmuls."""


def pairwise_sum(values: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The sum over ``dim`` by one fixed tree: zero-padded to a power of two, then neighbours added
    level by level. Its bits depend on the summed values and the padded width only, and padding
    with zeros to a wider power of two changes nothing (each extra level adds an exact zero)."""
    dim = dim % values.dim()
    length = values.shape[dim]
    width = 1 << max(length - 1, 0).bit_length()
    if width != length:
        pad = [0, 0] * (values.dim() - 1 - dim) + [0, width - length]
        values = F.pad(values, pad)
    while values.shape[dim] > 1:
        pairs = values.unflatten(dim, (values.shape[dim] // 2, 2))
        values = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
    return values.squeeze(dim)


def _on_cuda(x: torch.Tensor) -> bool:
    """Whether ``x``'s kernels are models/batch_invariant_triton.py's (a CUDA tensor)."""
    return x.device.type == "cuda"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with every row computed by a matmul of one shape (module docstring).

    x (..., in), weight (out, in) -> (..., out) in x's dtype. Differentiable. On CUDA: the Triton matmul."""
    if _on_cuda(x):
        out = _cuda_kernels().linear(x, weight)
        return out if bias is None else out + bias
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    blocks = max(-(-count // ROW_BLOCK), 1)  # no rows (an expert without tokens): one padded block, none kept
    padded = F.pad(rows, (0, 0, 0, blocks * ROW_BLOCK - count))
    weight_t = weight.t()
    parts = [padded[i * ROW_BLOCK:(i + 1) * ROW_BLOCK] @ weight_t for i in range(blocks)]
    out = (torch.cat(parts) if len(parts) > 1 else parts[0])[:count]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as ``x / (1 + exp(-x))``: elementwise operations whose rounding does not depend
    on the element's place in the tensor (torch's fused silu rounds a lone element otherwise)."""
    return x / (1 + torch.exp(-x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))``, normalized in fp32, the mean a ``pairwise_sum``; cast back
    to x's dtype before the weight, as models/qwen/model.py's ``RMSNorm``. On CUDA: one Triton program a row."""
    if _on_cuda(x):
        return _cuda_kernels().rms_norm(x, weight, eps)
    return _rms_norm_by_trees(x, weight, eps)


def _rms_norm_by_trees(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` by elementwise torch operations and a ``pairwise_sum`` (the CPU's; any device)."""
    x32 = x.to(torch.float32)
    mean_square = pairwise_sum(x32 * x32) / x32.shape[-1]
    normed = x32 / torch.sqrt(mean_square + eps).unsqueeze(-1)
    return weight * normed.to(x.dtype)


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """log sum exp over the last dimension in fp32 (fp64 stays): the max, then a ``pairwise_sum``. On CUDA
    (fp32, bf16, fp16): one Triton program a row."""
    if _on_cuda(logits) and logits.dtype != torch.float64:
        return _cuda_kernels().logsumexp(logits)
    return _logsumexp_by_trees(logits)


def _logsumexp_by_trees(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` by elementwise torch operations and a ``pairwise_sum`` (the CPU's; any device)."""
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    top = x.amax(dim=-1, keepdim=True)
    return top.squeeze(-1) + torch.log(pairwise_sum(torch.exp(x - top)))


def softmax(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension in fp32 (fp64 stays): ``exp(x - max)`` over its ``pairwise_sum``
    (a router's probabilities over its experts). On CUDA (fp32, bf16, fp16): one Triton program a row."""
    if _on_cuda(logits) and logits.dtype != torch.float64:
        return _cuda_kernels().softmax(logits)
    return _softmax_by_trees(logits)


def _softmax_by_trees(logits: torch.Tensor) -> torch.Tensor:
    """``softmax`` by elementwise torch operations and a ``pairwise_sum`` (the CPU's; any device)."""
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    weights = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return weights / pairwise_sum(weights).unsqueeze(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per row: ``logits[token] - logsumexp(logits)``, fp32 (fp64 stays).

    logits (..., V), tokens (...) in [0, V) -> (...). The sampler's rule and the trainer's log-probs
    both read this one function, so a token's log-prob is the same bits on both sides."""
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    return x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logsumexp(x)


@dataclass(frozen=True)
class RelativeKeys:
    """The training forward's keys laid out by relative position: query t's key j is its document's j-th
    token, row t - position[t] + j, valid while j <= position[t] (causal) and in its document."""

    index: Optional[torch.Tensor]
    """(B, T, S) int64: the row of query t's key j (clamped into the row where it is not valid); None on
    CUDA, whose kernel reads ``positions`` and ``documents``."""
    valid: Optional[torch.Tensor]
    """(B, T, S) bool: whether query t reads key j; None on CUDA."""
    absolute: bool = False
    """Every row at positions 0..T-1 (its documents, if several, only masked): key j is row j for every
    query, a slice instead of a gather."""
    positions: Optional[torch.Tensor] = None
    """On CUDA: the (B or 1, T) positions the layout was built from (the Triton kernel's input)."""
    documents: Optional[torch.Tensor] = None
    """On CUDA: the (B or 1, T) document ids, or None (one document a row)."""


def relative_keys(position_ids: torch.Tensor, document_ids: Optional[torch.Tensor], batch: int) -> RelativeKeys:
    """The layout of ``attend`` for a packed batch: ``position_ids`` (B or 1, T) count from 0 at each
    document's first token (as the packer writes them); ``document_ids`` (B or 1, T) or None (one
    document a row). On CUDA the layout holds just these two: the Triton kernel finds the rows itself."""
    if _on_cuda(position_ids):
        return RelativeKeys(None, None, positions=position_ids, documents=document_ids)
    seq_len = position_ids.shape[-1]
    positions = position_ids.expand(batch, seq_len)
    query = torch.arange(seq_len, device=positions.device)
    j = torch.arange(seq_len, device=positions.device)
    index = (query - positions)[:, :, None] + j  # (B, T, S)
    valid = (j <= positions[:, :, None]) & (index >= 0)
    index = index.clamp(0, seq_len - 1)
    if document_ids is not None:
        docs = document_ids.expand(batch, seq_len)
        valid &= docs.gather(1, index.flatten(1)).view(index.shape) == docs[:, :, None]
    absolute = bool((positions == query).all())  # index[b, t, j] = j: the documents only mask
    return RelativeKeys(index, valid, absolute)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RelativeKeys) -> torch.Tensor:
    """Causal attention of a packed batch. q (B, n_head, T, head_dim), k and v (B, n_kv_head, T, head_dim)
    -> (B, n_head, T, head_dim) in q's dtype. On CUDA: the Triton kernel."""
    if _on_cuda(q):
        if layout.positions is None:
            raise ValueError("batch_invariant.attend: CUDA queries with a layout built on the CPU; build the "
                             "mask (models.attention.build_attention_mask) on the queries' device")
        return _cuda_kernels().attend(q, k, v, layout.positions, layout.documents)
    batch, seq_len = q.shape[0], q.shape[2]
    rows = torch.arange(batch, device=q.device)[:, None, None]

    def relative(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """x's rows at relative positions start..stop-1 of every query: (B, n_kv, 1, T or 1, stop - start, hd)."""
        if layout.absolute:  # the same rows for every query: a slice, broadcast over the queries
            return x[:, :, None, None, start:stop]
        picked = x.transpose(1, 2)[rows, layout.index[:, :, start:stop]]  # (B, T, S', n_kv, hd)
        return picked.permute(0, 3, 1, 2, 4).unsqueeze(2)

    return _attend(q, functools.partial(relative, k), functools.partial(relative, v), layout.valid[:, None, None],
                   seq_len)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of new queries over a whole cache, slot j holding position j. q (B, n_head, T, head_dim),
    k and v (B, n_kv_head, slots, head_dim), mask ``models.attention.cache_mask``'s (B, 1, T, slots)
    -> (B, n_head, T, head_dim) in q's dtype: bitwise ``attend``'s for the same tokens. On CUDA: the
    Triton kernel (bitwise the CUDA ``attend``'s)."""
    if _on_cuda(q):
        return _cuda_kernels().attend_cached(q, k, v, mask)

    def block(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return x[:, :, None, None, start:stop]  # (B, n_kv, 1, 1, S', hd)

    return _attend(q, functools.partial(block, k), functools.partial(block, v), mask[:, :, None], k.shape[2])


KEY_BLOCK = 16
"""Keys per step of ``_attend``: a block's products are summed by a tree, the blocks one after the other."""


def _attend(q: torch.Tensor, keys_at, values_at, valid: torch.Tensor, length: int) -> torch.Tensor:
    """q (B, H, T, hd); ``keys_at(start, stop)`` and ``values_at(start, stop)`` the keys and values of
    relative positions start..stop-1, (B, n_kv, 1, T or 1, S', hd) each; valid (B, 1, 1, T, length).

    Key block by key block (``KEY_BLOCK`` relative positions each): a score is a ``pairwise_sum`` over
    head_dim, and the weighted values of a block a ``pairwise_sum`` over its keys, added to the
    running output in block order. Where a call has more keys than another (a cache of more slots),
    its extra blocks are masked: they add exact zeros, so both agree."""
    batch, heads, seq_len, head_dim = q.shape
    qg = None
    scores = []
    for start in range(0, length, KEY_BLOCK):
        keys = keys_at(start, min(start + KEY_BLOCK, length))
        if qg is None:
            qg = q.to(torch.float32).view(batch, keys.shape[1], heads // keys.shape[1], seq_len, 1, head_dim)
        scores.append(pairwise_sum(qg * keys.to(torch.float32)))  # (B, n_kv, G, T, S')
    scores = (torch.cat(scores, dim=-1) * head_dim**-0.5).masked_fill(~valid, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # (B, n_kv, G, T, length)
    out = None
    for start in range(0, length, KEY_BLOCK):
        stop = min(start + KEY_BLOCK, length)
        values = values_at(start, stop)
        part = weights[..., start:stop]
        if stop - start < KEY_BLOCK:  # a short last block: zero weights, so it sums as a whole one
            part = F.pad(part, (0, KEY_BLOCK - (stop - start)))
            values = F.pad(values, (0, 0, 0, KEY_BLOCK - (stop - start)))
        block = pairwise_sum(part.unsqueeze(-1) * values.to(torch.float32), dim=-2)  # (B, n_kv, G, T, hd)
        out = block if out is None else out + block
    out = out / pairwise_sum(weights).unsqueeze(-1)
    return out.reshape(batch, heads, seq_len, head_dim).to(q.dtype)


def _cuda_kernels():
    """models/batch_invariant_triton.py, imported on the first call on a CUDA device (Triton is
    imported there and only there). Without Triton: a ConfigError, never the stock kernels."""
    try:
        from models import batch_invariant_triton
    except ModuleNotFoundError as error:
        if error.name is None or error.name.split(".")[0] != "triton":
            raise
        raise ConfigError("determinism.batch_invariant on a CUDA device needs Triton for its kernels "
                          "(models/batch_invariant_triton.py), and triton is not installed",
                          key="determinism.batch_invariant",
                          hint="install the triton release that matches your torch build (pip install triton), "
                               "or set determinism.batch_invariant: false") from error
    return batch_invariant_triton


_ACTIVE = [0]


def active() -> bool:
    """Whether the calling code runs under ``Linears`` (the norm asks)."""
    return _ACTIVE[0] > 0


class Linears(TorchFunctionMode):
    """Within it, ``F.linear`` runs as ``linear`` and ``F.silu`` as ``silu`` (the module docstring)."""

    def __enter__(self):
        _ACTIVE[0] += 1
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE[0] -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        if func is F.silu and not kwargs.get("inplace", False):
            return silu(args[0])
        return func(*args, **kwargs)
