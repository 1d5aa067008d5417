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
``nucleus_cut_cuda`` in a Triton kernel that tests 3 cuts per pass over the vocabulary, 15
passes in all: 0.7 ms of GPU time for 64 rows of 151,936 probabilities and 1.8 ms for 256 on
an H200, where their sort took about 1.2 and 4 ms (docs/bench/log.md, 2026-11-29f and
2026-11-30a; 7 cuts a pass took 0.76 and 2.15 ms, 31 cuts 1.4 and 5.4 ms, 1 cut 1.0 and 2.6 ms).
Integer weights summed in float64 stay exact (the totals are far below 2^53), so neither
depends on the order of its sums, and both give the same cut.

The draw inverts the CDF of the kept weights in vocabulary order at ``k / 2^24``: ``draw_kept``
in torch (the whole vocabulary's int64 weights, their prefix sums, a binary search) and
``draw_kept_cuda`` by two Triton kernels, which sum each part of a row's vocabulary and then
scan only the part the target falls in: 0.28 against 1.05 ms for 64 rows, 0.69 against 2.42
ms for 256, the unfiltered rule whole (softmax included), the same tokens bitwise.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

PROB_BITS = 32
"""Probabilities become integer weights in units of 2^-PROB_BITS before the CDF is summed: integer
sums are exact and so independent of the summation order (torch.cumsum of a floating-point CUDA
tensor has no deterministic implementation). A token less likely than 2^-32 is never drawn."""
UNIFORM_BITS = 24
"""A draw's uniform is k / 2^UNIFORM_BITS (models/generation/sampler.py counter_uniforms' resolution)."""
_CUT_BITS = 30
_FANOUT = 4  # the Triton search splits the cut's range into 4 per pass: 2 bits of it, 15 passes


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


def draw_kept(probs: torch.Tensor, cut: torch.Tensor, ties: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The token drawn from the kept tokens (every one above ``cut``, the first ``ties`` at it),
    in torch (the reference, any device): the first index whose CDF of kept weights, in
    vocabulary order, exceeds ``steps * total / 2^UNIFORM_BITS`` (steps (B,) int64, k < 2^24).
    ``cut = -1`` keeps every token."""
    bits = probs.view(torch.int32)
    tied = bits == cut
    kept = (bits > cut) | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= ties))
    return inverse_cdf(fixed_point(probs) * kept, steps)


def inverse_cdf(weights: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Inverse CDF of integer weights (B, n) at k / 2^24: the first index whose CDF exceeds k * total / 2^24.

    The target is below the total, so the index exists, and its weight is positive.
    """
    cdf = weights.cumsum(dim=-1)  # (B, n) int64, exact
    target = (steps * cdf[:, -1]) >> UNIFORM_BITS  # k < 2^24, total <= 2^32 * (1 + eps): no overflow
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)


# ---------------------------------------------------------------- CUDA: Triton kernels

# The kernels split each row's vocabulary into PARTS programs (parts of `chunk` probabilities,
# a multiple of the block), so that a few rows still fill the GPU; every partial is an exact
# integer (or an integer-valued float64), so the partials' order never shows in a result.
_BLOCK, _WARPS = 512, 4  # the search's probabilities per loop step and warps per program
_PARTS = 16


def _layout(vocab: int, block: int, parts: int = _PARTS) -> tuple[int, int]:
    """(programs per row, probabilities per program): ``parts`` of whole blocks, fewer for a small vocabulary."""
    parts = max(1, min(parts, math.ceil(vocab / (4 * block))))
    return parts, math.ceil(vocab / (parts * block)) * block


def nucleus_cut_cuda(probs: torch.Tensor, top_p: float, *, block: int = _BLOCK, warps: int = _WARPS,
                     parts: int = _PARTS, fanout: int = _FANOUT) -> tuple[torch.Tensor, torch.Tensor]:
    """``nucleus_cut`` by Triton kernels (CUDA); the same cut and count, bitwise.

    The cut is searched ``log2(fanout)`` bits a pass: the masses above ``fanout`` cuts of the range
    left (15 passes of 4); then one more pass counts the mass above the cut."""
    cut, limit = _search(probs, top_p, block=block, warps=warps, parts=parts, fanout=fanout)
    above, _ = kept_parts(probs, cut)
    return cut, _kept_at_cut(cut, above.sum(dim=1, keepdim=True), limit)


def _search(probs: torch.Tensor, top_p: float, *, block: int, warps: int, parts: int, fanout: int):
    """(cut (B, 1) int32, limit (B, 1) float64): the cut probability's bits and top_p of the total."""
    bits = fanout.bit_length() - 1
    if fanout != 1 << bits or _CUT_BITS % bits:
        raise ValueError(f"fanout must be a power of 2 whose bits divide {_CUT_BITS}, got {fanout}")
    kernel = _kernels()["masses"]
    rows, vocab = probs.shape
    probs = probs.contiguous()
    parts, chunk = _layout(vocab, block, parts)
    masses = torch.empty(rows, parts, fanout, dtype=torch.float64, device=probs.device)
    low = torch.zeros(rows, dtype=torch.int32, device=probs.device)
    limit = None
    for shift in range(_CUT_BITS - bits, -1, -bits):  # the cut is in [low, low + fanout * step)
        kernel[(rows, parts)](probs, low, masses, vocab, 1 << shift, chunk, BLOCK=block, FANOUT=fanout,
                              num_warps=warps)
        mass = masses.sum(dim=1)  # (rows, fanout): the masses above the cuts low + j * step - 1
        if limit is None:
            limit = top_p * mass[:, :1]  # the first pass's j = 0 cut is -1: the total
        # The cut is past the j-th part's end where that end's mass still reaches the limit.
        low = low + (mass[:, 1:] >= limit).sum(dim=1, dtype=torch.int32) * (1 << shift)
    return low[:, None], limit


def kept_parts(probs: torch.Tensor, cut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass above ``cut``, count of tokens at it), (B, parts) int64 each, by part of the vocabulary."""
    rows, vocab = probs.shape
    parts, chunk = _layout(vocab, _PART_BLOCK)
    above = torch.empty(rows, parts, dtype=torch.int64, device=probs.device)
    tied = torch.empty_like(above)
    _kernels()["kept_parts"][(rows, parts)](probs.contiguous(), cut.contiguous(), above, tied, vocab, chunk,
                                            BLOCK=_PART_BLOCK, num_warps=4)
    return above, tied


_PART_BLOCK = 1024  # the draw's probabilities per loop step


def draw_kept_cuda(probs: torch.Tensor, cut: torch.Tensor, ties: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``draw_kept`` by Triton kernels (CUDA); the same token, bitwise.

    One pass gives each part's kept mass, the parts' running sums (a few (B, parts) tensors)
    give the part the target falls in and the target within it, and one program per row scans
    that part alone for the token."""
    rows, vocab = probs.shape
    probs = probs.contiguous()
    parts, chunk = _layout(vocab, _PART_BLOCK)
    above, tied = kept_parts(probs, cut)
    tied_before = tied.cumsum(dim=1) - tied
    kept_tied = (ties - tied_before).clamp(min=0).minimum(tied)
    mass = above + kept_tied * fixed_point(cut.clamp(min=0).view(torch.float32))  # each part's kept mass
    running = mass.cumsum(dim=1)
    target = (steps[:, None] * running[:, -1:]) >> UNIFORM_BITS
    part = (running <= target).sum(dim=1, keepdim=True)  # the first part whose running sum exceeds it
    within = target - (running.gather(1, part) - mass.gather(1, part))
    tokens = torch.empty(rows, dtype=torch.int64, device=probs.device)
    _kernels()["draw"][(rows,)](probs, cut.contiguous(), ties.contiguous(), part * chunk,
                                tied_before.gather(1, part), within, tokens, vocab, chunk,
                                BLOCK=_PART_BLOCK, num_warps=4)
    return tokens


_KERNELS: dict = {}


def _kernels() -> dict:
    """The Triton kernels, defined on first use (Triton is imported only on CUDA)."""
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def masses(probs_ptr, low_ptr, out_ptr, vocab, step, chunk, BLOCK: tl.constexpr, FANOUT: tl.constexpr):
        """Masses above FANOUT cuts of a row, float64, one partial per (row, part)."""
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

    @triton.jit
    def kept_parts(probs_ptr, cut_ptr, above_ptr, tied_ptr, vocab, chunk, BLOCK: tl.constexpr):
        """A part's integer mass above the row's cut and its count of tokens at the cut."""
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        parts = tl.num_programs(1)
        cut = tl.load(cut_ptr + row)
        mass = tl.zeros([BLOCK], dtype=tl.int64)
        count = tl.zeros([BLOCK], dtype=tl.int64)
        begin = part * chunk
        for start in range(begin, begin + chunk, BLOCK):
            index = start + tl.arange(0, BLOCK)
            valid = index < vocab
            p = tl.load(probs_ptr + row * vocab + index, mask=valid, other=0.0)
            bits = p.to(tl.int32, bitcast=True)
            weight = tl.floor(p.to(tl.float64) * 4294967296.0).to(tl.int64)
            mass += tl.where(bits > cut, weight, 0)
            count += ((bits == cut) & valid).to(tl.int64)
        tl.store(above_ptr + row * parts + part, tl.sum(mass, axis=0))
        tl.store(tied_ptr + row * parts + part, tl.sum(count, axis=0))

    @triton.jit
    def draw(probs_ptr, cut_ptr, ties_ptr, begin_ptr, tied_before_ptr, within_ptr, out_ptr, vocab, chunk,
             BLOCK: tl.constexpr):
        """A row's token: the first index of its part whose running kept mass exceeds ``within``."""
        row = tl.program_id(0).to(tl.int64)
        cut = tl.load(cut_ptr + row)
        ties = tl.load(ties_ptr + row)
        begin = tl.load(begin_ptr + row)
        seen = tl.load(tied_before_ptr + row)  # tokens at the cut before this block
        within = tl.load(within_ptr + row)
        total = tl.zeros([], dtype=tl.int64)  # kept mass before this block
        token = tl.zeros([], dtype=tl.int64) + vocab
        for offset in range(0, chunk, BLOCK):
            index = begin + offset + tl.arange(0, BLOCK)
            valid = index < vocab
            p = tl.load(probs_ptr + row * vocab + index, mask=valid, other=0.0)
            bits = p.to(tl.int32, bitcast=True)
            tied = ((bits == cut) & valid).to(tl.int64)
            kept = (bits > cut) | ((tied != 0) & (seen + tl.cumsum(tied, axis=0) <= ties))
            weight = tl.where(kept, tl.floor(p.to(tl.float64) * 4294967296.0).to(tl.int64), 0)
            crossed = tl.where(total + tl.cumsum(weight, axis=0) > within, index, vocab)
            token = tl.minimum(token, tl.min(crossed, axis=0))
            total += tl.sum(weight, axis=0)
            seen += tl.sum(tied, axis=0)
        tl.store(out_ptr + row, token)

    _KERNELS.update(masses=masses, kept_parts=kept_parts, draw=draw)
    return _KERNELS


class CapturedGraph:
    """A function of static-shape CUDA tensors, captured once as a CUDA graph on its first call.

    Its kernel launches and the small reductions between them cost the host more than the GPU;
    replayed, they are one launch (and copies of the inputs into the graph's). The returned
    tensors are the graph's: a call's results are valid until the next call.
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.graph: Optional[torch.cuda.CUDAGraph] = None

    def capture(self, *inputs: torch.Tensor) -> None:
        """Run ``fn`` once on ``inputs`` (on a stream of its own: kernels compile, caches warm up), then
        capture it (a capture runs nothing). A function of no inputs, but the tensors it reads and
        writes, runs once here, and each call replays it.

        Its matmuls get a cuBLAS workspace of their own, allocated in the graph's memory pool while
        it is captured. PyTorch keeps one workspace per stream and hands it to every matmul on that
        stream: graphs captured on one stream would share one, and two of them replayed at once on
        two streams (the sampler's decode step beside a prefill ahead) race on it, changing results
        from run to run; a workspace allocated before the capture can be freed (torch.compile's
        CUDA graphs clear them) while the graph still writes into it.
        """
        self.inputs = tuple(x.clone() for x in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        _clear_cublas_workspaces()
        with torch.cuda.graph(self.graph):
            self.result = self.fn(*self.inputs)
        _clear_cublas_workspaces()  # this graph's stays in its pool; the next capture allocates its own

    def __call__(self, *inputs: torch.Tensor):
        if self.graph is None:
            self.capture(*inputs)
        for held, given in zip(self.inputs, inputs, strict=True):
            if held.shape != given.shape or held.dtype != given.dtype:
                raise ValueError(f"captured for inputs {[(tuple(x.shape), x.dtype) for x in self.inputs]}, "
                                 f"called with {[(tuple(x.shape), x.dtype) for x in inputs]}")
            held.copy_(given)
        self.graph.replay()
        return self.result


def _clear_cublas_workspaces() -> None:
    """Drop PyTorch's cuBLAS workspaces (the next matmul on a stream allocates a new one)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run: a CUDA device and Triton installed."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
