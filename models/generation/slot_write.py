"""A forward's keys and values written into their cache slots by one Triton launch (CUDA, eager).

``KVCache.write`` stores each token's key and value at ``[row, :, position]`` of a layer's
(B, n_kv_head, slots, head_dim) buffers. As torch's indexed assignment that is ``index_put_``,
which under ``torch.use_deterministic_algorithms`` (bitwise mode) sorts its indices, checks them
with device asserts and, the indexed dimensions not leading, copies the whole buffer to a
contiguous permutation and back: on an H200, in the batch-invariant sampler's eager decode step
(16 rows, 512 slots, 28 layers), those kernels took about 40% of the step's GPU time
(docs/bench/log.md, 2026-12-02). The compiled sampler never runs it (the compiler writes its own
scatter). Here one program copies one token's head: ``head_dim`` values of the key and of the
value, to slots no other program writes (a row's positions are distinct), so the copy is the
assignment's, byte for byte, and a CUDA graph may capture it (no host synchronization).
"""

from __future__ import annotations

import torch

_KERNEL: list = []


def write_slots(keys: torch.Tensor, values: torch.Tensor, position_ids: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """``keys[b, :, position_ids[b, t]] = k[b, t]`` and the same for values, for every b < B, t < T.

    keys, values: one layer's buffers (B' >= B, n_kv, slots, head_dim), contiguous; position_ids
    (B, T) int64, distinct within a row; k, v (B, T, n_kv, head_dim) of the buffers' dtype, each
    head's values contiguous. A position outside [0, slots) writes nothing (the callers keep them
    inside: the sampler clamps its positions and its chunks lie within the slots); the indexed
    assignment would stop on a device assert there."""
    batch, length, heads, head_dim = k.shape
    if batch * length == 0:
        return
    import triton

    _kernel()[(batch * length * heads,)](
        keys, values, position_ids, k, v, length, heads, keys.shape[2], head_dim,
        position_ids.stride(0), position_ids.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        BLOCK=max(16, triton.next_power_of_2(head_dim)), num_warps=1)


def _kernel():
    """The Triton kernel, defined on first use (Triton is imported only on CUDA)."""
    if _KERNEL:
        return _KERNEL[0]
    import triton
    import triton.language as tl

    @triton.jit
    def write(keys_ptr, values_ptr, pos_ptr, k_ptr, v_ptr, length, heads, slots, head_dim,
              sp_b, sp_t, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, BLOCK: tl.constexpr):
        """Program (b * length + t) * heads + h: head h of token t of row b into its slot."""
        program = tl.program_id(0).to(tl.int64)
        h = program % heads
        token = program // heads
        t = token % length
        b = token // length
        position = tl.load(pos_ptr + b * sp_b + t * sp_t)
        d = tl.arange(0, BLOCK)
        inside = (d < head_dim) & (position >= 0) & (position < slots)
        target = ((b * heads + h) * slots + position) * head_dim + d
        key = tl.load(k_ptr + b * sk_b + t * sk_t + h * sk_h + d, mask=inside)
        value = tl.load(v_ptr + b * sv_b + t * sv_t + h * sv_h + d, mask=inside)
        tl.store(keys_ptr + target, key, mask=inside)
        tl.store(values_ptr + target, value, mask=inside)

    _KERNEL.append(write)
    return write
