"""Rows of many same-shaped buffers copied by one kernel launch (CUDA, Triton).

A refill point of the sampler (models/generation/sampler.py) copies prefilled cache rows into the
rows they start decoding in: for a 24-layer model, the same rows of 48 key and value buffers.
``index_copy_`` per buffer is 48 launches (96 with a gather), and in a CUDA graph on an H200
they took 269 us for 8 rows where the bytes moved need about 25 (docs/bench/log.md,
2026-11-30d). Here one kernel copies them all: each program copies one block of one row of
one buffer, reading the buffers' addresses from a table on the device.

A copy is a copy: the rows' bytes, bitwise, whatever the kernel. The buffers are moved as
8-byte words, so a row's size in bytes must be a multiple of 8 (``RowCopy.fits`` says
whether it is); the caller copies others with ``index_copy_``.
"""

from __future__ import annotations

import torch

_WORD = 8  # bytes per word moved
_BLOCK = 2048  # words per program: 16 KiB


class RowCopy:
    """``copy(rows, source_rows)``: for every pair of buffers, ``target[rows] = source[source_rows]``.

    ``targets`` and ``sources`` are lists of contiguous CUDA tensors, pairwise of the same
    shape and dtype, whose addresses stay fixed (a KV cache's buffers); the address tables
    are built here once. ``rows`` and ``source_rows`` are (k,) int64 on the device, ``rows``
    distinct. The launch queues no host-to-device copy, so a CUDA graph may capture it.
    """

    def __init__(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        if len(targets) != len(sources) or not targets:
            raise ValueError(f"RowCopy needs pairs of buffers, got {len(targets)} targets and {len(sources)} sources")
        shape, dtype = sources[0].shape[1:], sources[0].dtype
        for buffer in targets + sources:
            if buffer.shape[1:] != shape or buffer.dtype != dtype or not buffer.is_contiguous():
                raise ValueError("RowCopy's buffers must be contiguous, of one dtype and row shape")
        self.row_words = sources[0][0].numel() * sources[0].element_size() // _WORD
        self.buffers = len(targets)
        self.addresses = addresses(targets), addresses(sources)
        self.targets, self.sources = (torch.tensor(a, dtype=torch.int64, device=targets[0].device)
                                      for a in self.addresses)

    @staticmethod
    def fits(buffers: list[torch.Tensor]) -> bool:
        """Whether these buffers' rows can be copied here: CUDA, Triton installed, rows of whole words."""
        from models.generation.nucleus import triton_available

        first = buffers[0]
        return (triton_available(first.device) and all(b.is_contiguous() for b in buffers)
                and (first[0].numel() * first.element_size()) % _WORD == 0)

    def __call__(self, rows: torch.Tensor, source_rows: torch.Tensor) -> None:
        count = rows.shape[0]
        if count == 0:
            return
        grid = (self.buffers * count, -(-self.row_words // _BLOCK))
        _kernel()[grid](self.targets, self.sources, rows, source_rows, count, self.row_words, BLOCK=_BLOCK,
                        num_warps=4)


def addresses(buffers: list[torch.Tensor]) -> tuple[int, ...]:
    """The buffers' data addresses: what a ``RowCopy`` built for them holds (``RowCopy.addresses``)."""
    return tuple(b.data_ptr() for b in buffers)


_KERNEL: list = []


def _kernel():
    """The Triton kernel, defined on first use (Triton is imported only on CUDA)."""
    if _KERNEL:
        return _KERNEL[0]
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows(targets_ptr, sources_ptr, rows_ptr, source_rows_ptr, count, row_words, BLOCK: tl.constexpr):
        """Program (buffer * count + j, block): words [block * BLOCK, +BLOCK) of row rows[j] of that buffer."""
        pair = tl.program_id(0)
        buffer = pair // count
        j = pair % count
        target = tl.load(targets_ptr + buffer).to(tl.pointer_type(tl.int64))
        source = tl.load(sources_ptr + buffer).to(tl.pointer_type(tl.int64))
        row = tl.load(rows_ptr + j)
        source_row = tl.load(source_rows_ptr + j)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < row_words
        words = tl.load(source + source_row * row_words + offsets, mask=inside)
        tl.store(target + row * row_words + offsets, words, mask=inside)

    _KERNEL.append(copy_rows)
    return copy_rows
