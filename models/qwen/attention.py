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
128-token block, sdpa otherwise: on an H200 (torch 2.11) the compiled flex kernel has no
configuration for a 112-token sequence (inductor's ``NoValidChoicesError``), the length of
configs/tiny-grpo.yaml. Without
``document_ids`` the whole sequence is one document: sdpa runs plain causal SDPA
(``is_causal=True``) and flex a causal BlockMask, built once per (length, device). On an
H200, SDPA's deterministic (memory-efficient) backward took 66 ms a step for Qwen3-1.7B at
2,048 tokens, 43% of the step's GPU time, where flex's is a few ms (docs/performance.md).

The mask is built once per forward by ``build_attention_mask`` and handed to every
block, because building a BlockMask costs about as much as one attention layer.

On CUDA, ``sdpa_backends="deterministic"`` restricts SDPA to the memory-efficient and
math backends (docs/contracts.md: flash and cuDNN backward were measured not to be bitwise
repeatable). The memory-efficient backward is repeatable only while
``torch.use_deterministic_algorithms(True)`` is on, which bitwise mode must set; the flex
path was measured repeatable with or without it (docs/models.md).
"""

from __future__ import annotations

import functools
from typing import Literal, Optional, Union

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from models.qwen.row_copy import RowCopy, addresses

# What a block receives as its mask: None (plain causal), a boolean SDPA mask, or a BlockMask.
AttentionMask = Optional[Union[torch.Tensor, BlockMask]]
Kernel = Literal["sdpa", "flex"]


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


_DETERMINISTIC_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


FLEX_BLOCK = 128  # flex_attention's default block: ``auto`` takes flex for multiples of it


def select_kernel(attention: str, device: torch.device, seq_len: int | None = None) -> Kernel:
    """Resolve ModelConfig.attention ("auto" | "sdpa" | "flex") for ``seq_len`` tokens on ``device``."""
    if attention == "auto":
        whole_blocks = seq_len is None or seq_len % FLEX_BLOCK == 0
        return "flex" if device.type == "cuda" and whole_blocks else "sdpa"
    if attention in ("sdpa", "flex"):
        return attention  # type: ignore[return-value]
    raise ValueError(f"unknown attention kernel {attention!r}; expected auto, sdpa or flex")


def build_attention_mask(
    document_ids: torch.Tensor | None, kernel: Kernel, *, seq_len: int, device: torch.device
) -> AttentionMask:
    """The causal document mask for a batch of packed sequences of length ``seq_len``.

    ``document_ids`` is (B, T) (or (1, T), shared by the batch) integers, equal within a
    document and distinct between the documents of a row (0, 1, 2, ... as the packer numbers
    them: a reused id would join two documents). Without document_ids: None for sdpa (plain
    causal), a causal BlockMask for flex.
    """
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
    sdpa_backends: str = "deterministic",
) -> torch.Tensor:
    """Causal attention. q is (B, n_head, T, head_dim); k, v are (B, n_kv_head, T, head_dim).

    Returns (B, n_head, T, head_dim). The scale is head_dim ** -0.5 (the kernels' default).
    """
    if isinstance(mask, BlockMask):
        return _flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    k, v = _expand_kv_heads(k, q.shape[1]), _expand_kv_heads(v, q.shape[1])
    if q.device.type == "cuda" and sdpa_backends == "deterministic":
        with sdpa_kernel(_DETERMINISTIC_SDPA):
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


# --------------------------------------------------------------------------- KV-cache decoding
# Generation (models/qwen/sampler.py) runs the same blocks over a preallocated key/value
# cache instead of a packed batch. The training path above is untouched by this section.


class KVCache(torch.nn.Module):
    """Preallocated keys and values, one (B, n_kv_head, slots, head_dim) buffer pair per layer.

    The cache is indexed by position: the key/value of the token at position p of row b
    lives in slot p of row b, so a row's layout never depends on the other rows of its
    batch (ragged prompts need no left padding). It is zero-initialized, and slots a row
    has not written are masked, never read: stale or padding values cannot reach a result.
    Buffers (not plain attributes) so that torch.compile and CUDA graphs see static
    addresses that the decode step updates in place.

    Values are stored in the model's compute dtype, one buffer per layer (not one stacked
    tensor), so that the compiled step updates each in place instead of rewriting a stacked
    cache.

    Each buffer has one row more than ``batch``: the scratch row (index ``batch``), which
    ``read`` never returns. A forward that must leave some rows' caches untouched (the
    sampler's chunked continuation of some episodes, ``Sampler._extend``) still runs all
    ``batch`` rows, and sends the writes of the rows it does not fill into the scratch row
    (``redirected``).
    """

    def __init__(
        self, *, num_layers: int, batch: int, num_kv_heads: int, slots: int, head_dim: int,
        device: torch.device, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        shape = (batch + 1, num_kv_heads, slots, head_dim)  # + the scratch row
        for layer in range(num_layers):
            for name in (f"k{layer}", f"v{layer}"):
                self.register_buffer(name, torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.num_layers = num_layers
        self.batch = batch
        self._row_copies: dict[int, RowCopy] = {}  # id(source cache) -> its copy into this one (CUDA)

    @property
    def slots(self) -> int:
        return self.k0.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        """Every layer's key and value buffer (to mark their addresses static)."""
        return [buffer for _, buffer in self.named_buffers()]

    def write(
        self, layer: int, position_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Store k, v (B, T, n_kv_head, head_dim) of tokens at position_ids (B, T) into their slots.

        Input row b writes cache row ``rows[b]`` ((B, 1) int64; default: row b itself).
        """
        keys, values = getattr(self, f"k{layer}"), getattr(self, f"v{layer}")
        if rows is None:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
        # Advanced indices around a slice put the indexed dims first: the target is (B, T, n_kv, hd).
        keys[rows, :, position_ids] = k
        values[rows, :, position_ids] = v

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer, each (B, n_kv_head, slots, head_dim): the scratch row left out.

        A view of the first B rows of the buffer: the same address and strides as a (B, ...)
        tensor, so kernels see exactly what they saw before the scratch row existed.
        """
        return getattr(self, f"k{layer}")[: self.batch], getattr(self, f"v{layer}")[: self.batch]

    def copy_rows(self, source: "KVCache", rows: torch.Tensor, source_rows: torch.Tensor | None = None) -> None:
        """Copy rows of ``source`` (a cache of the same slots) into rows ``rows`` ((k,) int64): its rows
        ``source_rows`` ((k,) int64), or its first k rows.

        On CUDA with Triton, one kernel for every layer's buffers (``models/qwen/row_copy.py``);
        otherwise one ``index_copy_`` per buffer (two per layer; with ``source_rows`` a gather too),
        fewer host operations than indexed assignment, deterministic under
        ``use_deterministic_algorithms`` (the rows are distinct). Either way the rows' bytes."""
        count = rows.shape[0]
        copy = self._row_copy(source)
        if copy is not None:
            copy(rows, torch.arange(count, device=rows.device) if source_rows is None else source_rows)
            return
        for layer in range(self.num_layers):
            for name in (f"k{layer}", f"v{layer}"):
                held = getattr(source, name)
                held = held[:count] if source_rows is None else held[source_rows]
                getattr(self, name).index_copy_(0, rows, held)

    def _row_copy(self, source: "KVCache") -> RowCopy | None:
        """The one-kernel copy from ``source`` into this cache, where it runs (built once per pair)."""
        targets, sources = self.tensors(), source.tensors()
        if not RowCopy.fits(targets + sources):
            return None
        copy = self._row_copies.get(id(source))
        if copy is None or copy.addresses != (addresses(targets), addresses(sources)):
            copy = self._row_copies[id(source)] = RowCopy(targets, sources)
        return copy

    def redirected(self, fill: torch.Tensor) -> "RedirectedKVCache":
        """This cache as seen by a forward that fills only the rows where ``fill`` ((B,) bool) is set.

        Reads are unchanged (every row attends over its own cache row); the other rows'
        writes go to the scratch row, so their caches keep what they hold.
        """
        rows = torch.arange(self.batch, device=fill.device).masked_fill(~fill, self.batch)
        return RedirectedKVCache(self, rows[:, None])


class RedirectedKVCache:
    """A KVCache whose writes from input row b land in cache row ``rows[b]`` (``KVCache.redirected``)."""

    def __init__(self, cache: KVCache, rows: torch.Tensor) -> None:
        self.cache, self.rows = cache, rows

    @property
    def slots(self) -> int:
        return self.cache.slots

    def write(self, layer: int, position_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write(layer, position_ids, k, v, rows=self.rows)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.read(layer)


def cache_mask(position_ids: torch.Tensor, slots: int) -> torch.Tensor:
    """(B, 1, T, slots) boolean: the query at position p may read slots 0..p of its own row."""
    slot = torch.arange(slots, device=position_ids.device)
    return (slot[None, None, :] <= position_ids[:, :, None]).unsqueeze(1)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of new queries over a whole cache.

    q is (B, n_head, T, head_dim); k, v are a layer's cache (B, n_kv_head, slots, head_dim);
    mask is ``cache_mask``'s (B, 1, T, slots). Returns (B, n_head, T, head_dim) in q's dtype.
    Query heads are grouped under their key/value head instead of expanding the cache to
    every query head (which would copy the whole cache at every step). Every reduction runs
    over the full, fixed number of slots, so a row's result does not depend on how many
    slots its neighbours use.

    A float32 cache (the CPU configs) is attended with explicit fp32 matmuls, whose results
    the tests compare with the training forward's. A bf16/fp16 cache goes to SDPA's fused
    kernel, which accumulates in fp32 without widening the cache: widening every layer's
    whole cache at every decode step cost more than the matmuls (docs/bench/log.md).
    """
    batch, num_heads, seq_len, head_dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    groups = num_heads // kv_heads
    # Query head h reads kv head h // groups, as _expand_kv_heads arranges it.
    qg = q.reshape(batch, kv_heads, groups * seq_len, head_dim)  # (B, n_kv, G*T, hd), row g*T + t
    if k.dtype != torch.float32:
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
