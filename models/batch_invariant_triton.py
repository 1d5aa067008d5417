"""The batch-invariant kernels on CUDA, in Triton: models/batch_invariant.py's contract at GPU speed.

models/batch_invariant.py dispatches here when its inputs live on a CUDA device (Triton is then
required: it raises a ConfigError without it). The contract is the CPU path's: a token's result
depends on its own inputs only, never on the call's row count, its row, its packing neighbours or
the cache's length, so the training forward, the sampler's prefill and its cached decode compute a
token identically. The bits are not the CPU path's (other reduction orders); the equalities hold
within a device, which is where the sampler and the trainer meet.

- ``linear``: one Triton matmul, ``x @ weight.T`` by (BLOCK_M, BLOCK_N) output tiles. The input width
  is cut into chunks of ``chunk_k`` features; a chunk's dot is accumulated from zero in BLOCK_K steps,
  and the chunks' fp32 partial sums are added in chunk order. The tile shape, chunk, warps and
  pipeline stages are ``matmul_tiles(weight shape, dtype)``: they never depend on the number of rows,
  so a row's output tile is computed by the same instructions whatever rows share it or wherever it
  sits (the tensor cores' products and the per-element accumulation do not mix rows). Where a call's
  tiles cannot fill the GPU (a decode step's few rows), each chunk is its own program and writes its
  partial sum, and a second kernel adds the partials in chunk order; otherwise one program walks the
  chunks in turn. The two launches run the same instructions on a chunk and the same additions
  after it, so which one a call takes (a function of its row count) never changes a bit. The
  operands are the dtype autocast would give the stock linear (bf16 under a bf16 autocast, else the
  inputs' own), accumulated in fp32; fp32 operands use IEEE fp32 products, never TF32. The backward
  is the stock matmuls' (``LinearFunction``): gradients must be deterministic, not batch-invariant.
- ``attend`` / ``attend_cached``: one kernel over the *relative-key* layout of
  models/batch_invariant.py: query t's key j is its document's j-th token (row ``t - position[t]
  + j`` of a packed training row; slot j of the cache, which holds position j). The keys are
  visited in blocks of ``ATTENTION_TILES.block_n`` counted from the document's first token, an
  online softmax in fp32 (the scores' products over head_dim, a running maximum, the weighted
  values' products over the block's keys) updates a query's state block by block up to the block
  holding its own position, and no further. The products are bf16 on the tensor cores, accumulated
  in fp32, where the queries are bf16 (bf16 parameters; the keys, values and softmax weights are
  rounded to bf16 for them, as flash attention does), else IEEE fp32. The queries' dtype decides:
  the trainer's call and the sampler's share it (a cache may hold bf16 keys in fp32, never the
  queries). A program holds ``block_m`` query rows (a query and its GQA group's heads); rows of another document (a packed
  row's neighbour) are computed in a pass of their own over their own key blocks, the others' state
  left untouched, so a row's arithmetic is the same alone, beside neighbours, in a prefill chunk or
  in a decode step. The whole tile configuration is one constant for every call. The backward is
  the dense fp32 attention's (``dense_attention``) in closed form (``AttentionFunction``).
- ``rms_norm``, ``logsumexp`` and ``softmax``: one program per row, which walks its row in steps of
  ``row_block(width)`` elements (a function of the row's width alone), keeps one fp32 partial per
  lane of the block (the mean square's squares, the log-partition's ``exp(x - max)``, the softmax's
  weights), adds the steps in order and sums the lanes at the end by Triton's reduction of a block of
  that width and ``ROW_WARPS`` warps. A row's bits thus depend on its values and its width, never on
  the number of rows: the norm of a decode step's 16 rows and of a training micro-batch's 8,192, the
  log-partition of the sampler's logits and of the trainer's fused-head chunk, agree. The kernels are
  not specialized on their pointers' alignment or their integers' divisibility
  (``do_not_specialize``): Triton picks a load's vector width from those, and with it which elements
  a thread holds, so a row that sits at another offset (a sliced tensor, a moved row) would otherwise
  be summed in another order. sqrt and divisions are IEEE-rounded (``sqrt_rn``, ``div_rn``), as
  torch's are; exp and log are Triton's. The backwards are their plain torch formulas' derivatives
  (``RowFunction``): deterministic, not batch-invariant, as the other backwards.

The backwards (models/batch_invariant_grads.py) are written out in closed form and run on CUDA as
one compiled function each (a few fused kernels): recomputing a forward and its autograd graph took
twenty to forty launches a norm or attention, and with small micro-batches the host could not keep
the GPU busy (the Qwen3-0.6B GRPO recipe's update: 64 micro-batches of 2 x 512 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from models import batch_invariant_grads as grads


@dataclass(frozen=True)
class Tiles:
    """A Triton kernel's fixed launch configuration."""

    block_m: int
    """Rows of the output tile (matmul: input rows; attention: query rows of one program)."""
    block_n: int
    """Columns of the output tile (matmul: output features; attention: keys per online-softmax step)."""
    block_k: int
    """matmul: input features per step of the K loop (attention: unused, the head_dim is one step)."""
    num_warps: int
    """Warps of a program: with the tile shape, it lays out which thread reduces which elements."""
    num_stages: int
    """Software-pipeline stages of the K loop's loads (the loads only: the sums keep their order)."""
    chunk_k: int = 0
    """matmul: input features whose dot is accumulated from zero before it is added to the chunks
    before it (a multiple of block_k); the split a decode step's programs run in parallel."""


def matmul_tiles(out_features: int, in_features: int, dtype: torch.dtype) -> Tiles:
    """The matmul's tiles for a weight of this shape and operand dtype: a function of these alone
    (never of the row count), so every call with this weight rounds a row the same way. Today one
    configuration per dtype: tensor-core tiles for bf16/fp16, FMA tiles for IEEE fp32, both in chunks
    of ``MATMUL_CHUNK_K`` input features."""
    if dtype == torch.float32:
        return Tiles(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2, chunk_k=MATMUL_CHUNK_K)
    return Tiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, chunk_k=MATMUL_CHUNK_K)


MATMUL_CHUNK_K = 512
"""The matmul's chunk of input features (``Tiles.chunk_k``): a decode step's matmul over a width of
4,864 runs ten programs a tile of eight steps each rather than one program of 76 steps."""

SPLIT_BYTES_MAX = 64 << 20
"""The most memory a split call's fp32 partial sums may take; a larger call walks its chunks in one
program (the same bits)."""


ATTENTION_TILES = Tiles(block_m=16, block_n=32, block_k=0, num_warps=4, num_stages=1)
"""The attention kernel's one configuration (training, prefill and decode alike: a row's reductions
are laid out by it, so it must not change between the trainer's call and the sampler's)."""

_NO_START = 1 << 30
"""A query row past the call's queries: its document start, larger than any real one."""


# ---------------------------------------------------------------------------- the matmul


@triton.jit
def _chunk_dot(x_ptr, w_ptr, m, n, k, rows, cols, depth, begin, PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr):
    """The fp32 dot of rows m and columns n over input features [begin, begin + CHUNK_K) ∩ [0, depth),
    accumulated from zero in BLOCK_K steps in order."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(begin, tl.minimum(begin + CHUNK_K, depth), BLOCK_K):
        kk = start + k
        a = tl.load(x_ptr + m[:, None] * depth + kk[None, :], mask=(m[:, None] < rows) & (kk[None, :] < depth),
                    other=0.0)
        b = tl.load(w_ptr + n[None, :] * depth + kk[:, None], mask=(n[None, :] < cols) & (kk[:, None] < depth),
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["rows"])
def _matmul_kernel(x_ptr, w_ptr, out_ptr, rows, cols, depth, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr):
    """out (rows, cols) = x (rows, depth) @ w (cols, depth).T by chunks of CHUNK_K input features.
    SPLIT: program (i, j, c) writes chunk c's fp32 dot to out (chunks, rows, cols), for
    ``_sum_chunks_kernel``; else program (i, j) adds its chunks' dots in order and writes the sum in
    out's dtype. ``rows`` is never specialized on (a value of 1 would compile another kernel)."""
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    keep = (m[:, None] < rows) & (n[None, :] < cols)
    if SPLIT:
        chunk = tl.program_id(2)
        acc = _chunk_dot(x_ptr, w_ptr, m, n, k, rows, cols, depth, chunk * CHUNK_K, PRECISION,
                         BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_K)
        tl.store(out_ptr + chunk.to(tl.int64) * rows * cols + m[:, None] * cols + n[None, :], acc, mask=keep)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for begin in range(0, depth, CHUNK_K):
            total += _chunk_dot(x_ptr, w_ptr, m, n, k, rows, cols, depth, begin, PRECISION,
                                BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_K)
        tl.store(out_ptr + m[:, None] * cols + n[None, :], total.to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit(do_not_specialize=["numel"])
def _sum_chunks_kernel(part_ptr, out_ptr, numel, chunks, BLOCK: tl.constexpr):
    """out[i] = sum over c in order of part[c, i], from zero in fp32 (the unsplit kernel's additions)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = i < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    part = part_ptr + i
    for _ in range(0, chunks):
        total += tl.load(part, mask=keep, other=0.0)
        part += numel  # pointer steps: chunks x numel may pass 2**31
    tl.store(out_ptr + i, total.to(out_ptr.dtype.element_ty), mask=keep)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def matmul(x: torch.Tensor, weight: torch.Tensor, split: Optional[bool] = None,
           tiles: Optional[Tiles] = None) -> torch.Tensor:
    """x (rows, in) @ weight (out, in).T -> (rows, out) in x's dtype, both contiguous and of one dtype.
    split: run each chunk as its own program (True) or walk them in one (False); by default split
    where the output's tiles are fewer than the GPU's multiprocessors. Either gives the same bits.
    tiles: ``matmul_tiles``' by default (another configuration computes other bits: benchmarks only)."""
    rows, depth = x.shape
    cols = weight.shape[0]
    out = torch.empty(rows, cols, device=x.device, dtype=x.dtype)
    if rows == 0:
        return out
    tiles = tiles or matmul_tiles(cols, depth, weight.dtype)
    grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(cols, tiles.block_n))
    chunks = triton.cdiv(depth, tiles.chunk_k)
    if split is None:
        split = (chunks > 1 and grid[0] * grid[1] < _sm_count(x.device)
                 and chunks * rows * cols * 4 <= SPLIT_BYTES_MAX)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, CHUNK_K=tiles.chunk_k,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if not split:
        _matmul_kernel[grid](x, weight, out, rows, cols, depth, precision, False, **launch)
        return out
    partials = torch.empty(chunks, rows, cols, device=x.device, dtype=torch.float32)
    _matmul_kernel[(*grid, chunks)](x, weight, partials, rows, cols, depth, precision, True, **launch)
    block = 1024
    _sum_chunks_kernel[(triton.cdiv(rows * cols, block),)](partials, out, rows * cols, chunks, BLOCK=block,
                                                           num_warps=4)
    return out


class LinearFunction(torch.autograd.Function):
    """The invariant matmul forward; the stock matmuls' backward (deterministic, row-count dependent)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return matmul(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


def operand_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the stock ``F.linear`` would multiply in: autocast's where it is on for this device,
    else the inputs' own (which must agree, as for the stock linear)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    if x.dtype != weight.dtype:
        raise TypeError(f"batch_invariant.linear: input dtype {x.dtype} and weight dtype {weight.dtype} differ "
                        "outside autocast (the stock linear refuses this too); cast one of them")
    return x.dtype


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (no bias: models/batch_invariant.py adds it) with a row's bits independent of
    the other rows. x (..., in), weight (out, in) -> (..., out) in the operand dtype. Differentiable."""
    dtype = operand_dtype(x, weight)
    rows = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    weight = weight.to(dtype).contiguous()
    if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
        out = LinearFunction.apply(rows, weight)
    else:
        out = matmul(rows, weight)
    return out.reshape(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------- the attention


@triton.jit(do_not_specialize=["q_len", "k_len"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, pos_ptr, doc_ptr,
                      groups, q_len, k_len, head_dim, scale,
                      sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sp_b, sp_t, sd_b, sd_t,
                      RELATIVE: tl.constexpr, HAS_DOCS: tl.constexpr, NO_START: tl.constexpr, BF16_DOTS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: BLOCK_M query rows (query t, group head g) of one (batch row, kv head), over the
    keys of each row's document (models/batch_invariant_triton.py's docstring). BF16_DOTS: both dots on
    the tensor cores from bf16 operands (the queries, keys and values as bf16, the softmax weights
    rounded to bf16), accumulated in fp32; else IEEE fp32 products."""
    tile = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    heads = tl.num_programs(2) * groups
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // groups
    head = kv_head * groups + r % groups
    row_ok = t < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + head[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(tl.bfloat16) if BF16_DOTS else q.to(tl.float32)
    pos = tl.load(pos_ptr + b * sp_b + t * sp_t, mask=row_ok, other=0).to(tl.int32)
    if RELATIVE:
        start = t - pos  # the row of the document's first token
    else:
        start = tl.zeros_like(pos)  # the cache: slot j holds position j
    start = tl.where(row_ok, start, NO_START)
    if HAS_DOCS:
        doc = tl.load(doc_ptr + b * sd_b + t * sd_t, mask=row_ok, other=-1)
    k_base = k_ptr + b.to(tl.int64) * sk_b + kv_head * sk_h
    v_base = v_ptr + b.to(tl.int64) * sv_b + kv_head * sv_h
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    first = tl.min(start, axis=0)
    while first < NO_START:  # one pass per document start among the tile's rows
        seg = start == first
        last = tl.max(tl.where(seg, pos, -1), axis=0)
        for key0 in range(0, last + 1, BLOCK_N):
            j = key0 + tl.arange(0, BLOCK_N)
            row = first + j
            key_ok = (row >= 0) & (row < k_len) & (j <= last)
            keys = tl.load(k_base + row[None, :] * sk_t + d[:, None], mask=key_ok[None, :] & d_ok[:, None],
                           other=0.0)  # (BLOCK_D, BLOCK_N)
            if BF16_DOTS:
                scores = tl.dot(q, keys.to(tl.bfloat16))
            else:
                scores = tl.dot(q, keys.to(tl.float32), input_precision="ieee")
            scores = scores * scale  # (BLOCK_M, BLOCK_N), fp32
            valid = seg[:, None] & key_ok[None, :] & (j[None, :] <= pos[:, None])
            if HAS_DOCS:
                key_doc = tl.load(doc_ptr + b * sd_b + row * sd_t, mask=key_ok, other=-1)
                valid = valid & (key_doc[None, :] == doc[:, None])
            scores = tl.where(valid, scores, float("-inf"))
            # A row updates only over the blocks up to its own position: the same blocks in every call.
            live = seg & (key0 <= pos)
            m_new = tl.where(live, tl.maximum(m_i, tl.max(scores, axis=1)), m_i)
            live = live & (m_new > float("-inf"))
            alpha = tl.where(live, tl.exp(m_i - m_new), 1.0)
            weights = tl.where(valid & live[:, None], tl.exp(scores - m_new[:, None]), 0.0)
            values = tl.load(v_base + row[:, None] * sv_t + d[None, :], mask=key_ok[:, None] & d_ok[None, :],
                             other=0.0)  # (BLOCK_N, BLOCK_D)
            if BF16_DOTS:
                weighted = tl.dot(weights.to(tl.bfloat16), values.to(tl.bfloat16))
            else:
                weighted = tl.dot(weights, values.to(tl.float32), input_precision="ieee")
            l_i = tl.where(live, l_i * alpha + tl.sum(weights, axis=1), l_i)
            acc = tl.where(live[:, None], acc * alpha[:, None] + weighted, acc)
            m_i = m_new
        first = tl.min(tl.where(start > first, start, NO_START), axis=0)
    out = acc / l_i[:, None]
    offset = ((b.to(tl.int64) * heads + head[:, None]) * q_len + t[:, None]) * head_dim + d[None, :]
    tl.store(out_ptr + offset, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      documents: Optional[torch.Tensor], relative: bool) -> torch.Tensor:
    """The kernel's launch. q (B, n_head, T, hd); k, v (B, n_kv, S, hd); positions (B or 1, T) from 0 at
    each document's first token; documents (B or 1, S) or None; relative: keys at rows
    ``t - position + j`` of k (a packed training row), else at slot j (a cache) -> (B, n_head, T, hd)
    in q's dtype."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    positions = positions.expand(batch, q_len)
    out = torch.empty(batch, heads, q_len, head_dim, device=q.device, dtype=q.dtype)
    if documents is not None:
        documents = documents.expand(batch, k_len)
        doc_args = (documents, documents.stride(0), documents.stride(1))
    else:
        doc_args = (positions, 0, 0)  # never read
    groups = heads // kv_heads
    tiles = ATTENTION_TILES
    grid = (triton.cdiv(q_len * groups, tiles.block_m), batch, kv_heads)
    _attention_kernel[grid](
        q, k, v, out, positions, doc_args[0], groups, q_len, k_len, head_dim, head_dim**-0.5,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), positions.stride(0), positions.stride(1), doc_args[1], doc_args[2],
        RELATIVE=relative, HAS_DOCS=documents is not None, NO_START=_NO_START, BF16_DOTS=q.dtype == torch.bfloat16,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The same attention by plain differentiable fp32 ops: q (B, H, T, hd), k, v (B, n_kv, S, hd),
    allowed (B, T, S) -> (B, H, T, hd) in q's dtype."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    qg = q.to(torch.float32).reshape(batch, kv_heads, groups * q_len, head_dim)  # row g*T + t: head kv*G + g
    scores = qg @ k.to(torch.float32).transpose(-1, -2) * head_dim**-0.5  # (B, n_kv, G*T, S)
    scores = scores.view(batch, kv_heads, groups, q_len, k_len).masked_fill(~allowed[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1).view(batch, kv_heads, groups * q_len, k_len)
    out = probs @ v.to(torch.float32)  # (B, n_kv, G*T, hd)
    return out.view(batch, heads, q_len, head_dim).to(q.dtype)


class AttentionFunction(torch.autograd.Function):
    """The invariant attention forward; the backward of ``dense_attention`` in closed form
    (models/batch_invariant_grads.py ``attention_grads``: deterministic library matmuls and fused
    kernels, not batch-invariant), one compiled function on CUDA."""

    @staticmethod
    def forward(ctx, q, k, v, positions, documents, relative):
        ctx.save_for_backward(q, k, v, positions, documents)
        ctx.relative = relative
        return attention_forward(q, k, v, positions, documents, relative)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, positions, documents = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _backward(grads.attention_grads, q)(q, k, v, positions, documents, grad.contiguous(),
                                                             ctx.relative)
        return (*(d if needed else None for d, needed in zip((dq, dk, dv), ctx.needs_input_grad[:3])),
                None, None, None)


def _backward(formula, x: torch.Tensor):
    """A closed-form backward of models/batch_invariant_grads.py: compiled on CUDA (a few fused
    kernels), as written elsewhere."""
    return grads.compiled(formula) if x.device.type == "cuda" else formula


def _attention(q, k, v, positions, documents, relative: bool) -> torch.Tensor:
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return AttentionFunction.apply(q, k, v, positions, documents, relative)
    return attention_forward(q, k, v, positions, documents, relative)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
           documents: Optional[torch.Tensor]) -> torch.Tensor:
    """Causal attention of a packed batch (``batch_invariant.attend`` on CUDA). q (B, n_head, T, hd);
    k, v (B, n_kv, T, hd); positions (B or 1, T) from 0 at each document's first token; documents
    (B or 1, T) or None -> (B, n_head, T, hd) in q's dtype."""
    return _attention(q, k, v, positions, documents, relative=True)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of new queries over a whole cache (``batch_invariant.attend_cached`` on CUDA): q (B,
    n_head, T, hd), k, v (B, n_kv, slots, hd), mask ``models.attention.cache_mask``'s (B, 1, T, slots),
    slots 0..position of each query's row, from which the positions are read back."""
    positions = mask[:, 0].sum(dim=-1) - 1  # (B, T): cache_mask allows slots 0..position
    return _attention(q, k, v, positions, None, relative=False)


# ---------------------------------------------------------------------------- the row reductions

ROW_WARPS = 4
"""Warps of a row program: with the block's width, it lays out which lanes each thread adds."""

ROW_BLOCK_MAX = 4096
"""The widest step of a row program (a vocabulary row is walked in steps of it)."""


def row_block(width: int) -> int:
    """The elements a row program reads per step: the row's width rounded up to a power of two, at
    most ``ROW_BLOCK_MAX``. A function of the width alone, so every call on rows of this width sums
    them in the same order."""
    return min(ROW_BLOCK_MAX, triton.next_power_of_2(max(width, 16)))


_ROW_NO_SPECIALIZE = dict(do_not_specialize=["width", "x_stride", "out_stride"],
                          do_not_specialize_on_alignment=["x_ptr", "w_ptr", "out_ptr"])


@triton.jit(**_ROW_NO_SPECIALIZE)
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, width, x_stride, out_stride, eps, BLOCK: tl.constexpr):
    """out[row] = w * (x / sqrt(mean(x^2) + eps)).to(x's dtype), the product rounded to out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < width, other=0.0).to(tl.float32)
        squares += x * x
    mean_square = tl.div_rn(tl.sum(squares, axis=0), width.to(tl.float32))
    root = tl.sqrt_rn(mean_square + eps)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < width
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        normed = tl.div_rn(x, root).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(**_ROW_NO_SPECIALIZE)
def _logsumexp_kernel(x_ptr, w_ptr, out_ptr, width, x_stride, out_stride, BLOCK: tl.constexpr):
    """out[row] = max + log(sum(exp(x - max))) in fp32 (w_ptr unused); a row of -inf gives -inf."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(x_row + cols, mask=cols < width, other=float("-inf")).to(tl.float32))
    most = tl.max(top, axis=0)
    most = tl.where(most == float("-inf"), 0.0, most)
    weights = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        weights += tl.exp(x - most)
    tl.store(out_ptr + row * out_stride, most + tl.log(tl.sum(weights, axis=0)))


@triton.jit(**_ROW_NO_SPECIALIZE)
def _softmax_kernel(x_ptr, w_ptr, out_ptr, width, x_stride, out_stride, BLOCK: tl.constexpr):
    """out[row] = exp(x - max) / sum(exp(x - max)) in fp32 (w_ptr unused)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(x_row + cols, mask=cols < width, other=float("-inf")).to(tl.float32))
    most = tl.max(top, axis=0)
    weights = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        weights += tl.where(cols < width, tl.exp(x - most), 0.0)
    total = tl.sum(weights, axis=0)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < width
        x = tl.load(x_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, tl.div_rn(tl.exp(x - most), total), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous (rows, width): every row at a stride of its width."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _launch_rows(kernel, x: torch.Tensor, out: torch.Tensor, *extra, weight: Optional[torch.Tensor] = None) -> None:
    """One program per row of ``x`` (rows, width), writing ``out``'s row (a value or width values)."""
    rows, width = x.shape
    if rows == 0:
        return
    kernel[(rows,)](x, x if weight is None else weight, out, width, x.stride(0), out.stride(0), *extra,
                    BLOCK=row_block(width), num_warps=ROW_WARPS, num_stages=1)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x32 / sqrt(mean(x32^2) + eps)).to(x.dtype)`` over the last dimension, x32 = x in fp32:
    x (..., width), weight (width,) -> (...,  width) in the promoted dtype of the two, as the product
    of models/qwen/model.py's ``RMSNorm`` would be."""
    rows = _rows(x)
    out = torch.empty(rows.shape, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    _launch_rows(_rms_norm_kernel, rows, out, float(eps), weight=weight.contiguous())
    return out.view(*x.shape[:-1], x.shape[-1])


def logsumexp_forward(x: torch.Tensor) -> torch.Tensor:
    """log sum exp over the last dimension in fp32: x (..., width) of any float dtype -> (...)."""
    rows = _rows(x)
    out = torch.empty(rows.shape[0], device=x.device, dtype=torch.float32)
    _launch_rows(_logsumexp_kernel, rows, out[:, None])
    return out.view(x.shape[:-1])


def softmax_forward(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension in fp32: x (..., width) -> (..., width) fp32."""
    rows = _rows(x)
    out = torch.empty(rows.shape, device=x.device, dtype=torch.float32)
    _launch_rows(_softmax_kernel, rows, out)
    return out.view(x.shape)


class RowFunction(torch.autograd.Function):
    """A row kernel's forward; the backward of its reference formula in closed form
    (models/batch_invariant_grads.py: deterministic fused reductions, not batch-invariant), one
    compiled function on CUDA. ``formula(x, weight, grad, *extra)`` gives (dx, dweight) where the
    kernel takes a weight, else ``formula(x, grad)`` gives dx."""

    @staticmethod
    def forward(ctx, kernel, formula, x, weight, *extra):
        ctx.formula, ctx.extra = formula, extra
        ctx.has_weight = weight is not None
        ctx.save_for_backward(x, *([weight] if weight is not None else []))
        return kernel(x, weight, *extra) if weight is not None else kernel(x, *extra)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        x = saved[0]
        with torch.autocast(grad.device.type, enabled=False):
            if ctx.has_weight:
                dx, dweight = _backward(ctx.formula, x)(x, saved[1], grad.contiguous(), *ctx.extra)
            else:
                dx, dweight = _backward(ctx.formula, x)(x, grad.contiguous(), *ctx.extra), None
        needs_x, needs_weight = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        return (None, None, dx if needs_x else None, dweight if needs_weight else None,
                *(None for _ in ctx.extra))


def _differentiable(kernel, formula, x: torch.Tensor, weight: Optional[torch.Tensor], *extra):
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return RowFunction.apply(kernel, formula, x, weight, *extra)
    return kernel(x, weight, *extra) if weight is not None else kernel(x, *extra)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``batch_invariant.rms_norm`` on CUDA (``_rms_norm_kernel``). Differentiable."""
    return _differentiable(rms_norm_forward, grads.rms_norm_grads, x, weight, float(eps))


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``batch_invariant.logsumexp`` on CUDA for fp32/bf16/fp16 rows (``_logsumexp_kernel``). Differentiable."""
    return _differentiable(logsumexp_forward, grads.logsumexp_grads, x, None)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """``batch_invariant.softmax`` on CUDA for fp32/bf16/fp16 rows (``_softmax_kernel``). Differentiable."""
    return _differentiable(softmax_forward, grads.softmax_grads, x, None)
