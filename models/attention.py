"""Causal attention kernels, with document masking for packed sequences.

A packed sequence holds several documents back to back; a token may attend only to
earlier tokens of its own document. Two kernels implement that, chosen by
``ModelConfig.attention``:

- ``sdpa`` (exact, runs anywhere): ``scaled_dot_product_attention`` with a boolean
  (B, 1, T, T) mask built from ``document_ids``. Every row keeps at least its diagonal,
  so no row is fully masked and the math backend never produces NaN.
- ``flex`` (fast, GPU): compiled ``flex_attention`` with a causal-document ``BlockMask``,
  which skips the blocks that cross documents instead of computing and discarding them.

``auto`` means flex when the input lives on CUDA and its length is a multiple of flex's
128-token block, sdpa otherwise; the run's ``Numerics`` (models/numerics.py) resolves it. Without
``document_ids`` the whole sequence is one document: sdpa runs plain causal SDPA
(``is_causal=True``) and flex a causal BlockMask, built once per (length, device). On an
H200, SDPA's deterministic (memory-efficient) backward took 66 ms a step for Qwen3-1.7B at
2,048 tokens, 43% of the step's GPU time, where flex's is a few ms (docs/performance.md).

The mask is built once per forward by ``build_attention_mask`` and handed to every
block, because building a BlockMask costs about as much as one attention layer.

On CUDA, ``sdpa_backends="deterministic"`` restricts SDPA to the memory-efficient and
math backends (``Numerics.sdpa_backends_on``; docs/contracts.md: flash and cuDNN backward were
measured not to be bitwise repeatable). The memory-efficient backward is repeatable only while
``torch.use_deterministic_algorithms(True)`` is on, which bitwise mode must set; the flex
path was measured repeatable with or without it (docs/models.md).

The cached attention of generation (``attend_cached``) reads a ``KVCache``
(models/generation/kv_cache.py) and runs the kernel ``Numerics.cached_attention`` picks.

A third kernel, ``exact`` (``Numerics.batch_invariant``), is models/batch_invariant.py's: its mask is
a ``RelativeKeys`` layout built from the positions, and the cached attention's ``exact`` computes
a token bitwise as the training forward does.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from models import batch_invariant
from models.batch_invariant import RelativeKeys
from models.numerics import CachedKernel, Kernel

# What a block receives as its mask: None (plain causal), a boolean SDPA mask, a BlockMask, or the
# exact kernel's relative key layout.
AttentionMask = Optional[Union[torch.Tensor, BlockMask, RelativeKeys]]


# Eager flex_attention materializes the full score matrix and is meant for debugging only;
# the fused kernel exists only when compiled. Inside an enclosing torch.compile (e.g. a
# compiled block) the plain functions are called and the outer compile fuses them;
# otherwise a compiled wrapper is made on first use, lazily so that importing the model
# does not load the compiler (about a second) on the sdpa path.
@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _flex_attention(*args, **kwargs):
    fn = flex_attention if torch.compiler.is_compiling() else _compiled(flex_attention)
    return fn(*args, **kwargs)


def _create_block_mask(*args, **kwargs):
    fn = create_block_mask if torch.compiler.is_compiling() else _compiled(create_block_mask)
    return fn(*args, **kwargs)


def build_attention_mask(
    document_ids: torch.Tensor | None, kernel: Kernel, *, seq_len: int, device: torch.device,
    positions: torch.Tensor | None = None,
) -> AttentionMask:
    """The causal document mask for a batch of packed sequences of length ``seq_len``.

    ``document_ids`` is (B, T) (or (1, T), shared by the batch) integers, equal within a
    document and distinct between the documents of a row (0, 1, 2, ... as the packer numbers
    them: a reused id would join two documents). Without document_ids: None for sdpa (plain
    causal), a causal BlockMask for flex. The exact kernel's layout also reads ``positions``
    (B or 1, T), counting from 0 at each document's first token (default 0..T-1).
    """
    if kernel == "exact":
        if positions is None:
            positions = torch.arange(seq_len, device=device).unsqueeze(0)
        rows = max(positions.shape[0], 1 if document_ids is None else document_ids.shape[0])
        return batch_invariant.relative_keys(positions, document_ids, rows)
    if document_ids is None:
        return causal_block_mask(seq_len, str(device)) if kernel == "flex" else None
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be (B, T), got shape {tuple(document_ids.shape)}")
    if kernel == "flex":
        return causal_document_block_mask(document_ids)
    return causal_document_bool_mask(document_ids)


def causal_document_bool_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean mask, True where query i may attend key j (j <= i, same document)."""
    seq_len = document_ids.shape[1]
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)  # (B, 1, T, T): broadcast over heads


@functools.lru_cache(maxsize=8)
def causal_block_mask(seq_len: int, device: str) -> BlockMask:
    """flex_attention BlockMask of plain causal attention, shared by every row and head."""

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return _create_block_mask(causal, None, None, seq_len, seq_len, device=device)


def causal_document_block_mask(document_ids: torch.Tensor) -> BlockMask:
    """flex_attention BlockMask for the same pattern as ``causal_document_bool_mask``."""
    batch, seq_len = document_ids.shape

    def causal_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    # H=None: one mask shared by every head.
    return _create_block_mask(causal_document, batch, None, seq_len, seq_len, device=document_ids.device)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    *,
    backends: Optional[list[SDPBackend]] = None,
) -> torch.Tensor:
    """Causal attention. q is (B, n_head, T, head_dim); k, v are (B, n_kv_head, T, head_dim).

    Returns (B, n_head, T, head_dim). The scale is head_dim ** -0.5 (the kernels' default).
    ``backends``: the SDPA backends allowed (``Numerics.sdpa_backends_on``); None: torch's choice.
    """
    if isinstance(mask, RelativeKeys):
        return batch_invariant.attend(q, k, v, mask)
    if isinstance(mask, BlockMask):
        return _flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    k, v = _expand_kv_heads(k, q.shape[1]), _expand_kv_heads(v, q.shape[1])
    if backends is not None:
        with sdpa_kernel(backends):
            return _sdpa(q, k, v, mask)
    return _sdpa(q, k, v, mask)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat each key/value head for the query heads of its group.

    SDPA's own ``enable_gqa`` is served only by the flash and math backends; expanding here
    keeps the memory-efficient backend (deterministic, no T x T matrix) available.
    """
    batch, kv_heads, seq_len, head_dim = x.shape
    if kv_heads == num_heads:
        return x
    groups = num_heads // kv_heads
    x = x[:, :, None].expand(batch, kv_heads, groups, seq_len, head_dim)  # (B, n_kv_head, groups, T, head_dim)
    return x.reshape(batch, num_heads, seq_len, head_dim)  # (B, n_head, T, head_dim)


def cache_mask(position_ids: torch.Tensor, slots: int) -> torch.Tensor:
    """(B, 1, T, slots) boolean: the query at position p may read slots 0..p of its own row."""
    slot = torch.arange(slots, device=position_ids.device)
    return (slot[None, None, :] <= position_ids[:, :, None]).unsqueeze(1)


def attend_cached(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, kernel: CachedKernel
) -> torch.Tensor:
    """Attention of new queries over a whole cache.

    q is (B, n_head, T, head_dim); k, v are a layer's cache (B, n_kv_head, slots, head_dim);
    mask is ``cache_mask``'s (B, 1, T, slots). Returns (B, n_head, T, head_dim) in q's dtype.
    Query heads are grouped under their key/value head instead of expanding the cache to
    every query head (which would copy the whole cache at every step). Every reduction runs
    over the full, fixed number of slots, so a row's result does not depend on how many
    slots its neighbours use.

    ``kernel`` is ``Numerics.cached_attention(k.dtype)``: "fp32" attends with explicit fp32
    matmuls (a float32 cache, the CPU configs, whose results the tests compare with the training
    forward's); "sdpa" with SDPA's fused kernel, which accumulates in fp32 without widening the
    cache (a bf16/fp16 cache); "exact" by ``batch_invariant.attend_cached``, bitwise the training
    forward's exact kernel for the same tokens.
    """
    if kernel == "exact":
        return batch_invariant.attend_cached(q, k, v, mask)
    batch, num_heads, seq_len, head_dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    groups = num_heads // kv_heads
    # Query head h reads kv head h // groups, as _expand_kv_heads arranges it.
    qg = q.reshape(batch, kv_heads, groups * seq_len, head_dim)  # (B, n_kv, G*T, hd), row g*T + t
    if kernel == "sdpa":
        grouped_mask = mask.repeat(1, 1, groups, 1)  # (B, 1, G*T, slots): row g*T + t is mask row t
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=grouped_mask)
        return out.reshape(batch, num_heads, seq_len, head_dim).to(q.dtype)
    qg = qg.to(torch.float32)
    scores = qg @ k.to(torch.float32).transpose(-1, -2) * head_dim**-0.5  # (B, n_kv, G*T, slots)
    scores = scores.view(batch, kv_heads, groups, seq_len, slots)
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))  # mask (B, 1, 1, T, slots)
    probs = scores.softmax(dim=-1).view(batch, kv_heads, groups * seq_len, slots)
    out = probs @ v.to(torch.float32)  # (B, n_kv, G*T, hd)
    return out.view(batch, num_heads, seq_len, head_dim).to(q.dtype)
