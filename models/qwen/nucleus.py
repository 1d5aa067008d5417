"""Top-p's kept set without a sort: the cut probability and how many tokens at it are kept.

Ranked by descending probability (ties by ascending id, as a stable sort ranks them), top-p
keeps a token while the mass of the tokens before it is below ``top_p`` of the total, with
every mass an exact sum of fixed-point weights (probabilities in units of 2^-32, floored).
So the kept tokens are every token more likely than a cut probability ``c`` plus the first
``m`` (by id) of the tokens exactly at ``c``, where ``c`` is the least probability whose
strictly-more-likely mass A(c) is below the limit (A falls as ``c`` rises), and the j-th
token at the cut (from 0) is kept while A(c) + j * w(c) is below it.

A probability's float32 bits, read as an int32, order the way the probabilities do (they are
>= +0), and one of at most 1.0 (0x3F800000) has them below 2^30: ``c`` is searched over those
30 bits. ``nucleus_cut`` does it in torch, one masked sum per bit (the reference, any device);
``nucleus_cut_cuda`` in a Triton kernel that tests 7 cuts per pass over the vocabulary, 10
passes in all: 0.8 ms of GPU time for 64 rows of 151,936 probabilities and 2.2 ms for 256 on
an H200, where their sort took about 1.2 and 4 ms (docs/bench/log.md, 2026-11-29f). Integer weights summed in float64 stay exact (the totals are far
below 2^53), so neither depends on the order of its sums, and both give the same cut.
"""

from __future__ import annotations

import math

import torch

PROB_BITS = 32
"""Probabilities become integer weights in units of 2^-PROB_BITS."""
_CUT_BITS = 30
_FANOUT = 8  # the Triton search splits the cut's range into 8 per pass: 3 bits of it


def fixed_point(probs: torch.Tensor) -> torch.Tensor:
    """Probabilities -> int64 weights in units of 2^-32, floored (exact: >= 0, below 2^33 in all)."""
    return (probs.to(torch.float64) * 2**PROB_BITS).to(torch.int64)


def nucleus_cut(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """probs (B, vocab) fp32 -> (cut probability bits (B, 1) int32, tokens kept at the cut (B, 1) int64)."""
    bits = probs.view(torch.int32)
    weights = fixed_point(probs)
    limit = top_p * weights.sum(dim=-1, keepdim=True).to(torch.float64)  # (B, 1)
    cut = torch.zeros_like(bits[:, :1])
    for bit in reversed(range(_CUT_BITS)):
        below = cut | ((1 << bit) - 1)  # the largest cut with the bits found so far and this one 0
        mass = torch.where(bits > below, weights, 0).sum(dim=-1, keepdim=True)
        cut = torch.where(mass.to(torch.float64) < limit, cut, cut | (1 << bit))
    above = torch.where(bits > cut, weights, 0).sum(dim=-1, keepdim=True)
    return cut, _kept_at_cut(cut, above, limit)


def _kept_at_cut(cut: torch.Tensor, above: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    weight = fixed_point(cut.view(torch.float32))  # every token at the cut has it; > 0, as A falls there
    room = torch.ceil(limit).to(torch.int64) - above  # >= 1: an integer is below limit iff below its ceil
    return (room - 1) // weight + 1


def nucleus_cut_cuda(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``nucleus_cut`` by the Triton kernel (CUDA); the same cut and count, bitwise."""
    kernel = _masses_kernel()
    rows, vocab = probs.shape
    probs = probs.contiguous()
    block = 256
    parts = max(1, min(16, math.ceil(vocab / (4 * block))))  # programs per row
    chunk = math.ceil(vocab / (parts * block)) * block
    masses = torch.empty(rows, parts, _FANOUT, dtype=torch.float64, device=probs.device)

    def masses_above(low: torch.Tensor, step: int) -> torch.Tensor:
        """(rows, 8) exact masses above the cuts low + j * step - 1, j = 0..7."""
        kernel[(rows, parts)](probs, low, masses, vocab, step, chunk, BLOCK=block, FANOUT=_FANOUT)
        return masses.sum(dim=1)

    low = torch.zeros(rows, dtype=torch.int32, device=probs.device)
    limit = None
    for shift in range(_CUT_BITS - 3, -1, -3):  # the cut is in [low, low + 8 * step): 10 passes
        mass = masses_above(low, 1 << shift)
        if limit is None:
            limit = top_p * mass[:, :1]  # the first pass's j = 0 cut is -1: the total
        # The cut is past the j-th eighth's end where that end's mass still reaches the limit.
        low = low + (mass[:, 1:] >= limit).sum(dim=1, dtype=torch.int32) * (1 << shift)
    above = masses_above(low + 1, 0)[:, :1].to(torch.int64)  # j = 0: the cut itself
    cut = low[:, None]
    return cut, _kept_at_cut(cut, above, limit)


_KERNEL = None


def _masses_kernel():
    """Masses above 8 cuts per row, in float64, one partial per (row, part) of the vocabulary."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def masses(probs_ptr, low_ptr, out_ptr, vocab, step, chunk, BLOCK: tl.constexpr, FANOUT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        parts = tl.num_programs(1)
        low = tl.load(low_ptr + row)
        j = tl.arange(0, FANOUT)
        cuts = low + j * step - 1
        # Each lane sums its own elements; one reduction across the lanes at the end.
        lanes = tl.zeros([BLOCK, FANOUT], dtype=tl.float64)
        begin = part * chunk
        for start in range(begin, begin + chunk, BLOCK):
            index = start + tl.arange(0, BLOCK)
            p = tl.load(probs_ptr + row * vocab + index, mask=index < vocab, other=0.0)
            bits = p.to(tl.int32, bitcast=True)
            weight = tl.floor(p.to(tl.float64) * 4294967296.0)
            lanes += tl.where(bits[:, None] > cuts[None, :], weight[:, None], 0.0)
        tl.store(out_ptr + (row * parts + part) * FANOUT + j, tl.sum(lanes, axis=0))

    _KERNEL = masses
    return _KERNEL


class CapturedCut:
    """``nucleus_cut_cuda`` for one shape and ``top_p``, captured once as a CUDA graph.

    Its 11 kernel launches and the small reductions between them cost the host more than the
    GPU; replayed, they are one launch (and a copy of the probabilities into the graph's input).
    The returned tensors are the graph's: a call's results are valid until the next call.
    """

    def __init__(self, shape: tuple[int, int], top_p: float, device: torch.device) -> None:
        self.top_p = top_p
        self.probs = torch.full(shape, 1.0 / shape[-1], device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            nucleus_cut_cuda(self.probs, top_p)  # compiles the kernel outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.result = nucleus_cut_cuda(self.probs, top_p)

    def __call__(self, probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        if top_p != self.top_p or probs.shape != self.probs.shape:
            raise ValueError(f"captured for top_p {self.top_p} and shape {tuple(self.probs.shape)}, "
                             f"called with {top_p} and {tuple(probs.shape)}")
        self.probs.copy_(probs)
        self.graph.replay()
        return self.result


def nucleus_cut_for(device: torch.device, shape: tuple[int, int], top_p: float, *, graphs: bool = True):
    """The cut function for a device and a static (rows, vocab) shape: on CUDA with Triton installed
    the Triton kernel (captured as a CUDA graph where ``graphs``), else the torch reference."""
    if device.type != "cuda" or top_p >= 1:
        return nucleus_cut
    try:
        import triton  # noqa: F401
    except ImportError:
        return nucleus_cut
    return CapturedCut(shape, top_p, device) if graphs else nucleus_cut_cuda
