"""The batch-invariant kernels on one CUDA GPU (``determinism.batch_invariant``): the chain, exact, and its cost.

    python benchmarks/batch_invariant_gpu.py --out bench_out/batch_invariant_gpu.json \
        [--parts chain,sampler,grpo,matmul,kernels,logprobs,update] [--sampler-quick] [--grpo-steps 3] \
        [--grpo-timeout 300] [--grpo-runs on,off,off-eager] [--run-set on:runtime.profile_start_step=3] \
        [--work /tmp/lockstep-bi]
    python benchmarks/batch_invariant_gpu.py --out bench_out/bi-cpu.json --parts grpo --grpo-steps 2 \
        --grpo-config tests/configs/e2e-grpo.yaml --set parallel.device=cpu   # the GRPO part, CPU smoke
    python benchmarks/batch_invariant_gpu.py ... --parts grpo --grpo-runs on --grpo-steps 200 \
        --grpo-checkpoint-interval 50 --grpo-timeout 540    # a run longer than one call: checkpoints, then
    python benchmarks/batch_invariant_gpu.py ... --parts grpo --grpo-runs on --grpo-steps 200 --grpo-resume

1. ``chain``: models/batch_invariant.py's kernels on CUDA (models/batch_invariant_triton.py), every
   comparison ``torch.equal``, at the Qwen3-0.6B shapes (hidden 1024, 16 heads over 8 key/value
   heads of 128, vocabulary 151,936), random inputs:
   - ``linear``: a row of ``x @ W.T`` computed among 1, 7, 64 and 1000 rows, and moved to row 500,
     for the q, gate, down and output-head weights; under bf16 autocast (fp32 inputs, as the
     trainer's) and in fp32; and the matmul's two launches (a program per chunk, the chunks in one
     program) equal on 1, 64 and 1000 rows.
   - ``attention``: 8 documents of 1 to 200 tokens attended as a training forward (packed rows at
     micro-batch 1, 2 and 8, each document at another offset beside other neighbours), as the
     sampler's prefill (chunks of 64 into a cache whose later slots hold stale values) and as its
     cached decode (one token a step, 8 rows over 512 slots, and 3 rows in another order over 384):
     every token's output the same bits in all six. Two dtype cases: the bf16 autocast trainer's
     (q and k fp32 after the rotary, v bf16, an fp32 cache) and bf16 throughout (FSDP2's bf16
     parameters, a bf16 cache).
   - ``rows``: the row reductions (the norm over the hidden size in fp32 and bf16 and over a head,
     the log-partition over the vocabulary of fp32 and bf16 logits, a softmax over 128 experts): a
     row among 1, 7, 64 and 1000 rows, moved to row 500, and read through a view starting at row 3.
   - ``control``: the same comparisons with the stock kernels (``F.linear``'s cuBLAS; SDPA in
     training, the cached path's SDPA or fp32 matmuls in the cache; torch's mean, logsumexp and
     softmax); and the row kernels' largest difference from the stock ones.
2. ``matmul``: the invariant matmul's forward times at a decode step's rows (16, 64, 128; 20 calls
   replayed from one CUDA graph, as the sampler runs them) and a training micro-batch's (8,192; CUDA
   events, median of 20), bf16, for the Qwen2.5-0.5B and Qwen3-1.7B
   weights: as dispatched, its chunks forced into one program, the whole width as one chunk (the
   kernel before chunks), two other chunk widths (timing only: other bits), and the stock
   ``F.linear``; and each case's split and unsplit outputs ``torch.equal``.
   ``kernels``: forward times (CUDA events, median of 20) of the invariant kernels and the stock
   ones at the GRPO recipe's sizes; for the row reductions also the tree sums they replaced
   (models/batch_invariant.py's ``_*_by_trees``), and each one's kernel launches per call.
3. ``sampler``: the recipe's rollouts alone, at the Qwen3-0.6B shape (random weights, bf16
   parameters and no autocast as under the recipe's FSDP2 policy, the run's bitwise switches):
   ``--sampler-rows`` rows (16, the recipe's) over 512 slots, ``--sampler-prompts`` prompts (128, a
   step's) of 20-59 random tokens, 64 new tokens each at temperature 1. Two timed ``generate``
   calls of the default sampler (CUDA graphs of the eager forwards; the first captures them), one
   round of rows eagerly (its samples must equal the graphed ones) and eagerly with the tree
   reductions (the previous path), one graphed call under torch's profiler (GPU time by kernel,
   launches), and the trainer's log-probs of every sampled token (prompt + completion rows of 512,
   micro-batches of 16, the fused head) against the sampler's: ``torch.equal``.
4. ``logprobs``: a step's log-prob passes at the recipe's size (128 rows of 512 random tokens,
   micro-batches of 16, the fused head, fp32 parameters under bf16 autocast), eager, with
   batch_invariant on and off: the reference pass (no gradients) and the update's forward and backward.
   ``update``: one update micro-batch as the recipe's policy computes it (16 rows of a 120-token
   document and padding, bf16 parameters without autocast, the fused head over the completion),
   eager, on and off, under torch's profiler: forward and backward seconds, the busiest kernels by
   GPU time and operators by host time.
5. ``grpo``: configs/qwen3-0.6b-grpo.yaml from random weights (``model.init_from=null``, the byte
   tokenizer), ``objective.grpo.max_new_tokens=64``, ``--grpo-steps`` steps, no checkpoints or
   evaluation, with ``determinism.batch_invariant`` true and then false: each step's time, its
   phases and ``logprob_parity`` from the run's ledger and metrics, and the ratio of the median
   step times from step 2 (step 1 compiles). ``--grpo-runs`` picks the runs (``on``, ``off``, and
   ``off-eager``: the stock kernels with the blocks eager, as batch_invariant runs them, so that the
   compiler's share of the ratio shows); ``--run-set RUN:KEY=VALUE`` adds an override to one run (a
   profiler window, ``on:runtime.profile_start_step=3``), whose traces are summarized in the call
   (benchmarks/trace_summary.py: GPU time by the phase that launched it) and whose profiled steps
   are left out of the median.

The parts run in the order chain, sampler, grpo, matmul, kernels, logprobs, update (``--parts`` picks;
``--sampler-quick`` runs the sampler's eager round once and leaves the tree reductions and the
profile out). Prints a table and writes
``--out`` after each part (a call cut short keeps what finished); a part that raises is recorded
with its error and the next one runs. Exit 1 if a part failed, a chain comparison failed, the
sampler's samples or log-probs broke an equality above, or a run with batch_invariant on wrote a
nonzero ``logprob_parity``. Needs a CUDA device, Triton, and for ``grpo``
the embedded tasks (datasets/tasks, ``python -m data prepare``) in the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models import attention, batch_invariant  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 16, 8, 128, 1024, 151936
WEIGHTS = {"q_proj": (2048, 1024), "gate_proj": (3072, 1024), "down_proj": (1024, 3072), "lm_head": (151936, 1024)}
DOC_LENGTHS = (1, 5, 17, 33, 64, 100, 129, 200)
ATTENTION_CASES = {  # name: (q and k dtype, v dtype, cache dtype)
    "autocast": (torch.float32, torch.bfloat16, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
}
CUDA = torch.device("cuda")


# ---------------------------------------------------------------------------- 1. the chain


def linear_chain(invariant: bool) -> dict[str, Any]:
    """Each weight's rows at 1, 7, 64 and 1000 rows and moved, against the 1000-row call's."""
    generator = torch.Generator(device=CUDA).manual_seed(0)
    kernel = batch_invariant.linear if invariant else F.linear
    results = {}
    for name, (out_features, in_features) in WEIGHTS.items():
        weight = torch.randn(out_features, in_features, device=CUDA, generator=generator) * in_features**-0.5
        x = torch.randn(1000, in_features, device=CUDA, generator=generator)
        for case, context in (("bf16_autocast", lambda: torch.autocast("cuda", torch.bfloat16)),
                              ("fp32", torch.no_grad)):
            with torch.no_grad(), context():
                full = kernel(x, weight)
                same = {str(rows): torch.equal(kernel(x[:rows], weight), full[:rows]) for rows in (1, 7, 64)}
                same["moved_to_row_500"] = torch.equal(kernel(x.roll(500, 0), weight)[500], full[0])
                if invariant:  # a chunk per program (a decode step's launch) == the chunks in one program
                    same.update(_split_equals_unsplit(x, weight))
            results[f"{name}/{case}"] = same
    return results


def _split_equals_unsplit(x: torch.Tensor, weight: torch.Tensor) -> dict[str, bool]:
    """The matmul's two launches (models/batch_invariant_triton.py ``matmul``'s ``split``) on 1, 64 and
    1000 rows, in the operand dtype ``batch_invariant.linear`` would use."""
    from models import batch_invariant_triton as triton_kernels

    dtype = triton_kernels.operand_dtype(x, weight)
    w = weight.to(dtype).contiguous()
    return {f"split_equals_unsplit_{rows}": torch.equal(
        triton_kernels.matmul(x[:rows].to(dtype).contiguous(), w, split=True),
        triton_kernels.matmul(x[:rows].to(dtype).contiguous(), w, split=False)) for rows in (1, 64, 1000)}


def _documents(q_dtype: torch.dtype, v_dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator(device=CUDA).manual_seed(1)

    def draw(heads: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(heads, length, HEAD_DIM, device=CUDA, generator=generator).to(dtype)

    return [{"q": draw(HEADS, n, q_dtype), "k": draw(KV_HEADS, n, q_dtype), "v": draw(KV_HEADS, n, v_dtype)}
            for n in DOC_LENGTHS]


def _pack(docs, rows: list[list[int]], lead: list[int], row_len: int):
    """Packed training rows: row r holds a leading filler document of lead[r] tokens, its documents,
    then a filler to row_len. -> q, k, v (B, heads, T, hd), positions and document ids (B, T), and
    each document's (row, offset)."""
    generator = torch.Generator(device=CUDA).manual_seed(2)
    parts = {key: [] for key in ("q", "k", "v")}
    positions, document_ids, places = [], [], {}
    for r, members in enumerate(rows):
        pieces, lengths = [], []
        fill = row_len - lead[r] - sum(DOC_LENGTHS[i] for i in members)
        for index in ([None] if lead[r] else []) + list(members) + ([None] if fill else []):
            length = DOC_LENGTHS[index] if index is not None else (lead[r] if not pieces else fill)
            if index is not None:
                places[index] = (r, sum(lengths))
                pieces.append(docs[index])
            else:
                pieces.append({key: torch.randn(docs[0][key].shape[0], length, HEAD_DIM, device=CUDA,
                                                generator=generator).to(docs[0][key].dtype) for key in parts})
            lengths.append(length)
        for key in parts:
            parts[key].append(torch.cat([piece[key] for piece in pieces], dim=1))
        positions.append(torch.cat([torch.arange(n, device=CUDA) for n in lengths]))
        document_ids.append(torch.cat([torch.full((n,), d, device=CUDA) for d, n in enumerate(lengths)]))
    q, k, v = (torch.stack(parts[key]) for key in ("q", "k", "v"))
    return q, k, v, torch.stack(positions), torch.stack(document_ids), places


def _training(docs, rows, lead, row_len, invariant: bool) -> list[torch.Tensor]:
    """Each document's outputs (heads, L, hd) from the packed training forward."""
    q, k, v, positions, document_ids, places = _pack(docs, rows, lead, row_len)
    if invariant:
        mask = attention.build_attention_mask(document_ids, "exact", seq_len=row_len, device=CUDA, positions=positions)
        out = attention.attend(q, k, v, mask)
    else:  # the stock trainer: SDPA with the document mask, in bf16 as the bf16 autocast casts its inputs
        mask = attention.build_attention_mask(document_ids, "sdpa", seq_len=row_len, device=CUDA)
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        out = attention.attend(q, k, v, mask, backends=[torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                                                        torch.nn.attention.SDPBackend.MATH])
    return [out[places[i][0], :, places[i][1]:places[i][1] + n] for i, n in enumerate(DOC_LENGTHS)]


def _cache(docs, order: list[int], slots: int, dtype: torch.dtype):
    """A cache of one row per document (in ``order``), its slots past the document stale random values."""
    generator = torch.Generator(device=CUDA).manual_seed(3)
    k = torch.randn(len(order), KV_HEADS, slots, HEAD_DIM, device=CUDA, generator=generator).to(dtype)
    v = torch.randn(len(order), KV_HEADS, slots, HEAD_DIM, device=CUDA, generator=generator).to(dtype)
    for row, index in enumerate(order):
        k[row, :, :DOC_LENGTHS[index]] = docs[index]["k"]
        v[row, :, :DOC_LENGTHS[index]] = docs[index]["v"]
    return k, v


def _cached(docs, order: list[int], slots: int, chunk: int, cache_dtype: torch.dtype,
            kernel: str) -> dict[int, torch.Tensor]:
    """The outputs of the documents in ``order`` (a cache row each) by the cached attention, ``chunk``
    queries a call (1: decode steps)."""
    k, v = _cache(docs, order, slots, cache_dtype)
    lengths = torch.tensor([DOC_LENGTHS[i] for i in order], device=CUDA)
    outs = {i: [] for i in order}
    for start in range(0, max(DOC_LENGTHS[i] for i in order), chunk):
        positions = torch.minimum(start + torch.arange(chunk, device=CUDA)[None], lengths[:, None] - 1)  # (B, chunk)
        q = torch.stack([docs[i]["q"][:, positions[row]] for row, i in enumerate(order)])  # (B, heads, chunk, hd)
        out = attention.attend_cached(q, k, v, attention.cache_mask(positions, slots), kernel=kernel)
        for row, i in enumerate(order):
            keep = min(chunk, DOC_LENGTHS[i] - start)
            if keep > 0:
                outs[i].append(out[row, :, :keep])
    return {i: torch.cat(outs[i], dim=1) for i in order}


def attention_chain(case: str, invariant: bool) -> dict[str, Any]:
    """Training at micro-batch 8, 2 and 1, prefill and two decodes: every document's outputs against
    micro-batch 8's."""
    q_dtype, v_dtype, cache_dtype = ATTENTION_CASES[case]
    docs = _documents(q_dtype, v_dtype)
    cached_kernel = "exact" if invariant else ("fp32" if cache_dtype == torch.float32 else "sdpa")
    with torch.no_grad():
        ways = {
            "training_mb8": _training(docs, [[i] for i in range(8)], [(i * 37) % 61 for i in range(8)], 264, invariant),
            "training_mb2": _training(docs, [[3, 0, 2, 1], [7, 4, 6, 5]], [0, 11], 512, invariant),
            "training_mb1": _training(docs, [list(range(7, -1, -1))], [23], 600, invariant),
            "prefill_chunk64": _cached(docs, list(range(8)), 256, 64, cache_dtype, cached_kernel),
            "decode_8rows_512slots": _cached(docs, list(range(8)), 512, 1, cache_dtype, cached_kernel),
        }
        decode3 = {}
        for order in ([5, 0, 7], [1, 6, 2], [3, 4, 0]):
            decode3.update(_cached(docs, order, 384, 1, cache_dtype, cached_kernel))
        ways["decode_3rows_384slots"] = decode3
        ways = {name: [outs[i] for i in range(len(DOC_LENGTHS))] if isinstance(outs, dict) else outs
                for name, outs in ways.items()}
        anchor = ways["training_mb8"]
        result = {name: all(torch.equal(a, b) for a, b in zip(anchor, outs)) for name, outs in ways.items()
                  if name != "training_mb8"}
        if invariant:  # against the same attention in plain fp32 ops: close, not equal
            from models import batch_invariant_grads, batch_invariant_triton

            gaps = []
            for doc, out in zip(docs, anchor):
                positions = torch.arange(doc["q"].shape[1], device=CUDA)[None]
                allowed = batch_invariant_grads.allowed_keys(positions, None, True, 1, doc["q"].shape[1])
                dense = batch_invariant_triton.dense_attention(doc["q"][None], doc["k"][None], doc["v"][None], allowed)
                gaps.append((dense[0].float() - out.float()).abs().max().item())
            result["max_abs_vs_dense_fp32"] = max(gaps)
    return result


def _stock_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """models/qwen/model.py's RMSNorm outside batch_invariant."""
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _row_cases(invariant: bool) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int, torch.dtype]]:
    """name: (function of (rows, width) -> per-row result, width, input dtype), the recipe's row reductions."""
    generator = torch.Generator(device=CUDA).manual_seed(5)
    hidden_weight = 1 + 0.1 * torch.randn(HIDDEN, device=CUDA, generator=generator)
    head_weight = 1 + 0.1 * torch.randn(HEAD_DIM, device=CUDA, generator=generator)
    norm = batch_invariant.rms_norm if invariant else _stock_rms_norm
    lse = batch_invariant.logsumexp if invariant else (lambda x: torch.logsumexp(x.float(), dim=-1))
    soft = batch_invariant.softmax if invariant else (lambda x: torch.softmax(x.float(), dim=-1))
    return {
        # The residual stream under bf16 autocast (fp32 rows, fp32 weight) and under FSDP2's policy (bf16).
        "rms_norm hidden fp32": (lambda x: norm(x, hidden_weight, 1e-6), HIDDEN, torch.float32),
        "rms_norm hidden bf16": (lambda x: norm(x, hidden_weight.bfloat16(), 1e-6), HIDDEN, torch.bfloat16),
        # q/k norm over a head: bf16 projections, fp32 weight (autocast).
        "rms_norm head bf16/fp32": (lambda x: norm(x, head_weight, 1e-6), HEAD_DIM, torch.bfloat16),
        "logsumexp vocab fp32": (lse, VOCAB, torch.float32),
        "logsumexp vocab bf16": (lse, VOCAB, torch.bfloat16),
        "softmax 128 experts": (soft, 128, torch.float32),
    }


def rows_chain(invariant: bool) -> dict[str, Any]:
    """Each row reduction's rows among 1, 7, 64 and 1000 rows, moved to row 500 and read through a
    view that starts at row 3 (another address), against the 1000-row call's."""
    generator = torch.Generator(device=CUDA).manual_seed(6)
    results = {}
    with torch.no_grad():
        for name, (fn, width, dtype) in _row_cases(invariant).items():
            x = (4 * torch.randn(1000, width, device=CUDA, generator=generator)).to(dtype)
            full = fn(x)
            same = {str(rows): torch.equal(fn(x[:rows]), full[:rows]) for rows in (1, 7, 64)}
            same["moved_to_row_500"] = torch.equal(fn(x.roll(500, 0))[500], full[0])
            same["view_from_row_3"] = torch.equal(fn(x[3:]), full[3:])
            results[name] = same
    return results


def row_gaps() -> dict[str, float]:
    """The row kernels against the stock torch ones on the same 1000 rows: max |difference|."""
    generator = torch.Generator(device=CUDA).manual_seed(7)
    gaps = {}
    with torch.no_grad():
        for (name, (fn, width, dtype)), (_, (stock, _, _)) in zip(_row_cases(True).items(), _row_cases(False).items()):
            x = (4 * torch.randn(1000, width, device=CUDA, generator=generator)).to(dtype)
            gaps[name] = (fn(x).float() - stock(x).float()).abs().max().item()
    return gaps


def run_chain() -> dict[str, Any]:
    chain = {"linear": linear_chain(True), "attention": {c: attention_chain(c, True) for c in ATTENTION_CASES},
             "rows": rows_chain(True)}
    control = {"linear": linear_chain(False), "attention": {c: attention_chain(c, False) for c in ATTENTION_CASES},
               "rows": rows_chain(False)}
    return {"invariant": chain, "control_stock_kernels": control, "rows_max_abs_vs_stock": row_gaps(),
            "backward": backward_checks()}


def backward_checks() -> dict[str, Any]:
    """The kernels' backwards as the trainer runs them on CUDA (models/batch_invariant_grads.py's closed
    forms, compiled) at the GRPO recipe's update shapes (2 rows of 512: a 120-token document and padding):
    the norm over the hidden size (fp32, the residual stream under autocast) and over a head (bf16 input,
    fp32 weight), the attention (fp32 queries and keys, bf16 values). Each twice on the same inputs
    (``repeat_equal``: deterministic) and against autograd of its reference formula in fp32 (the largest
    difference, over the largest reference value)."""
    from models import batch_invariant_grads as grads
    from models.batch_invariant_triton import dense_attention

    generator = torch.Generator(device=CUDA).manual_seed(7)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=CUDA).to(dtype)

    def compare(compiled: Callable, formula: Callable, inputs: list[torch.Tensor], grad: torch.Tensor,
                *extra: Any) -> dict[str, Any]:
        first, second = compiled(*inputs, grad, *extra), compiled(*inputs, grad, *extra)
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        want = torch.autograd.grad(formula(*leaves), leaves, grad)
        gaps = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(first, want)]
        return {"repeat_equal": all(torch.equal(a, b) for a, b in zip(first, second)),
                "max_rel_vs_autograd": max(gaps)}

    out: dict[str, Any] = {}
    for name, x in (("rms_norm_hidden_fp32", rand(2, 512, 1024)),
                    ("rms_norm_head_bf16", rand(2, 512, 16, 128, dtype=torch.bfloat16))):
        weight = 1 + rand(x.shape[-1]) / 4
        grad = rand(*x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
        out[name] = compare(grads.compiled(grads.rms_norm_grads), lambda a, b: grads.rms_norm_reference(a, b, 1e-6),
                            [x, weight], grad, 1e-6)
    positions = torch.arange(512, device=CUDA)[None]
    documents = (torch.arange(512, device=CUDA) >= 120).long().expand(2, 512)
    q, k, v = rand(2, 16, 512, 128), rand(2, 8, 512, 128), rand(2, 8, 512, 128, dtype=torch.bfloat16)
    allowed = grads.allowed_keys(positions, documents, True, 2, 512)
    out["attention"] = compare(
        lambda a, b, c, g: grads.compiled(grads.attention_grads)(a, b, c, positions, documents, g, True),
        lambda a, b, c: dense_attention(a, b, c, allowed), [q, k, v], rand(2, 16, 512, 128))
    return out


def _booleans(tree) -> list[bool]:
    if isinstance(tree, bool):
        return [tree]
    if isinstance(tree, dict):
        return [b for value in tree.values() for b in _booleans(value)]
    return []


# ---------------------------------------------------------------------------- 2. kernel times


def _time_ms(fn: Callable[[], Any], repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return round(statistics.median(times), 4)


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
"""The host calls that launch a kernel, as torch's profiler names them."""


def _launches(fn: Callable[[], Any]) -> int:
    """Kernel launches of one call of ``fn`` (after a warm-up call), counted by torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)


def run_row_times() -> dict[str, Any]:
    """The row reductions at the recipe's sizes: the Triton kernels, the tree sums they replace (the
    previous CUDA path, models/batch_invariant.py's ``_*_by_trees``) and the stock torch ones."""
    generator = torch.Generator(device=CUDA).manual_seed(8)
    weight = torch.ones(HIDDEN, device=CUDA)
    out: dict[str, Any] = {}
    with torch.no_grad():
        for rows in (16, 8192):
            x = torch.randn(rows, HIDDEN, device=CUDA, generator=generator)
            variants = {"invariant": lambda: batch_invariant.rms_norm(x, weight, 1e-6),
                        "trees": lambda: batch_invariant._rms_norm_by_trees(x, weight, 1e-6),
                        "stock": lambda: _stock_rms_norm(x, weight, 1e-6)}
            out[f"rms_norm {rows} x {HIDDEN} fp32"] = {
                **{f"{k}_ms": _time_ms(f) for k, f in variants.items()},
                **{f"{k}_launches": _launches(f) for k, f in variants.items()}}
        for rows in (16, 4096):
            x = torch.randn(rows, VOCAB, device=CUDA, generator=generator)
            variants = {"invariant": lambda: batch_invariant.logsumexp(x),
                        "trees": lambda: batch_invariant._logsumexp_by_trees(x),
                        "stock": lambda: torch.logsumexp(x, dim=-1)}
            out[f"logsumexp {rows} x {VOCAB} fp32"] = {
                **{f"{k}_ms": _time_ms(f) for k, f in variants.items()},
                **{f"{k}_launches": _launches(f) for k, f in variants.items()}}
    return out


def run_kernel_times() -> dict[str, Any]:
    generator = torch.Generator(device=CUDA).manual_seed(4)
    out: dict[str, Any] = run_row_times()
    backends = [torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION, torch.nn.attention.SDPBackend.MATH]
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        for rows, (name, shape) in ((16384, ("gate_proj", WEIGHTS["gate_proj"])), (128, ("gate_proj", WEIGHTS["gate_proj"])),
                                    (2048, ("lm_head", WEIGHTS["lm_head"]))):
            weight = torch.randn(*shape, device=CUDA, generator=generator)
            x = torch.randn(rows, shape[1], device=CUDA, generator=generator)
            out[f"linear {name} {rows} rows (bf16 autocast)"] = {
                "invariant_ms": _time_ms(lambda: batch_invariant.linear(x, weight)),
                "stock_ms": _time_ms(lambda: F.linear(x, weight))}
    # Training attention: 16 rows of 512 tokens, one document a row, bf16, forward and forward + backward.
    q = torch.randn(16, HEADS, 512, HEAD_DIM, device=CUDA, generator=generator, dtype=torch.bfloat16)
    k = torch.randn(16, KV_HEADS, 512, HEAD_DIM, device=CUDA, generator=generator, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    exact = attention.build_attention_mask(None, "exact", seq_len=512, device=CUDA)
    for label, grad in (("forward", False), ("forward+backward", True)):
        qg, kg, vg = (x.clone().requires_grad_(grad) for x in (q, k, v))

        def invariant():
            o = attention.attend(qg, kg, vg, exact)
            if grad:
                o.sum().backward()

        def stock():
            o = attention.attend(qg, kg, vg, None, backends=backends)
            if grad:
                o.sum().backward()

        with torch.set_grad_enabled(grad):
            out[f"attention training 16x512 bf16 {label}"] = {"invariant_ms": _time_ms(invariant),
                                                              "stock_ms": _time_ms(stock)}
    # Decode attention: 128 rows at position 320 over 512 slots, bf16 cache.
    kc = torch.randn(128, KV_HEADS, 512, HEAD_DIM, device=CUDA, generator=generator, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    qd = torch.randn(128, HEADS, 1, HEAD_DIM, device=CUDA, generator=generator, dtype=torch.bfloat16)
    mask = attention.cache_mask(torch.full((128, 1), 320, device=CUDA), 512)
    with torch.no_grad():
        out["attention decode 128 rows, 512 slots, bf16"] = {
            "invariant_ms": _time_ms(lambda: attention.attend_cached(qd, kc, vc, mask, kernel="exact")),
            "stock_ms": _time_ms(lambda: attention.attend_cached(qd, kc, vc, mask, kernel="sdpa"))}
    return out


DECODE_SHAPES = {  # name: its weights (out, in) as the sampler's decode step multiplies them
    "qwen2.5-0.5b": {"q_proj": (896, 896), "k_proj": (128, 896), "gate_proj": (4864, 896),
                     "down_proj": (896, 4864), "lm_head": (151936, 896)},
    "qwen3-1.7b": {"q_proj": (2048, 2048), "k_proj": (1024, 2048), "gate_proj": (6144, 2048),
                   "down_proj": (2048, 6144), "lm_head": (151936, 2048)},
}


def _graph_time_ms(fn: Callable[[], Any], calls: int = 20, repeats: int = 5) -> float:
    """GPU milliseconds a call of ``fn``: ``calls`` calls captured as one CUDA graph, its replay timed
    by CUDA events (median of ``repeats``), so that the host's launches (which bound an eager call at
    a decode step's sizes) are not in the figure; the sampler replays its decode step the same way."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / calls)
    return round(statistics.median(times), 4)


def run_matmul_times() -> dict[str, Any]:
    """The invariant matmul at a decode step's rows (16, 64, 128) and a training micro-batch's (8,192),
    bf16, for the weights of two model shapes: as dispatched (``auto``: the chunks split over programs
    where the tiles are fewer than the multiprocessors), forced into one program (``unsplit``), in one
    chunk (``one_chunk``: the kernel before chunks, a K loop over the whole width), with other chunk
    widths (timing only: another chunk width computes other bits), and the stock ``F.linear``.
    At the decode rows each is timed as the sampler runs it, replayed from a CUDA graph
    (``_graph_time_ms``); at 8,192 rows eagerly (``_time_ms``). Each row: its split and unsplit
    outputs ``torch.equal``."""
    from dataclasses import replace

    import triton

    from models import batch_invariant_triton as triton_kernels

    generator = torch.Generator(device=CUDA).manual_seed(9)
    out: dict[str, Any] = {}
    with torch.no_grad():
        for shape, weights in DECODE_SHAPES.items():
            for name, (cols, depth) in weights.items():
                weight = torch.randn(cols, depth, device=CUDA, generator=generator).to(torch.bfloat16)
                tiles = triton_kernels.matmul_tiles(cols, depth, torch.bfloat16)
                one_chunk = replace(tiles, chunk_k=triton.cdiv(depth, tiles.block_k) * tiles.block_k)
                for rows in (16, 64, 128, 8192):
                    x = torch.randn(rows, depth, device=CUDA, generator=generator).to(torch.bfloat16)
                    timed = _graph_time_ms if rows <= 128 else _time_ms
                    row = {"auto_ms": timed(lambda: triton_kernels.matmul(x, weight)),
                           "unsplit_ms": timed(lambda: triton_kernels.matmul(x, weight, split=False)),
                           "one_chunk_ms": timed(lambda: triton_kernels.matmul(x, weight, tiles=one_chunk)),
                           "stock_ms": timed(lambda: F.linear(x, weight)), "graphed": rows <= 128}
                    if rows <= 128:
                        for chunk in (256, 1024):
                            other = replace(tiles, chunk_k=chunk)
                            row[f"chunk_{chunk}_ms"] = timed(lambda: triton_kernels.matmul(x, weight, tiles=other))
                    row["split_equals_unsplit"] = torch.equal(triton_kernels.matmul(x, weight, split=True),
                                                              triton_kernels.matmul(x, weight, split=False))
                    out[f"{shape} {name} {cols}x{depth} {rows} rows"] = row
    return out


def _print_matmul(times: dict[str, Any]) -> bool:
    columns = ("auto_ms", "unsplit_ms", "one_chunk_ms", "chunk_256_ms", "chunk_1024_ms", "stock_ms")
    print(f"{'matmul, bf16, ms a call (decode rows graphed)':48s} " + " ".join(f"{c[:-3]:>10s}" for c in columns)
          + " split==unsplit")
    equal = True
    for name, row in times.items():
        if not isinstance(row, dict):
            continue
        equal &= row["split_equals_unsplit"]
        print(f"{name:48s} " + " ".join(f"{row[c]:10.4f}" if c in row else " " * 10 for c in columns)
              + f" {row['split_equals_unsplit']}")
    return equal


# ---------------------------------------------------------------------------- 3. the sampler


def _qwen3(dtype: torch.dtype, numerics) -> torch.nn.Module:
    """Qwen3-0.6B's shape from random weights (seed 0) on the GPU in ``dtype``, under ``numerics``."""
    import models
    from core.config import ModelConfig

    config = ModelConfig(arch="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=3072, num_layers=28,
                         num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_embeddings=True, qk_norm=True, attention="sdpa")
    model = models.build(config, generator=torch.Generator().manual_seed(0)).to(CUDA, dtype)
    model.use_numerics(numerics)
    return model


@contextlib.contextmanager
def _tree_row_reductions():
    """The previous CUDA path, for comparison: the norm, log-partition and softmax by tree sums (one
    launch per level, models/batch_invariant.py's ``_*_by_trees``) instead of the Triton row kernels."""
    from models import batch_invariant_triton as kernels

    kept = kernels.rms_norm, kernels.logsumexp, kernels.softmax
    kernels.rms_norm = batch_invariant._rms_norm_by_trees
    kernels.logsumexp = batch_invariant._logsumexp_by_trees
    kernels.softmax = batch_invariant._softmax_by_trees
    try:
        yield
    finally:
        kernels.rms_norm, kernels.logsumexp, kernels.softmax = kept


def run_sampler(rows: int, prompts_count: int, new_tokens: int = 64, max_len: int = 512,
                quick: bool = False) -> dict[str, Any]:
    """The GRPO recipe's rollouts alone: its ``rows`` sampler rows over ``max_len`` slots, ``prompts_count``
    random prompts of 20-59 tokens, ``new_tokens`` each at temperature 1; Qwen3-0.6B's shape in bf16
    without autocast (the recipe's FSDP2 policy), the run's process-wide switches (bitwise). ``quick``:
    the eager round once (the graphed calls compiled its kernels), no tree reductions, no profile."""
    from torch.profiler import ProfilerActivity, profile

    from models.generation.sampler import SampleKey, Sampler, SamplingParams
    from models.numerics import Numerics
    from training import determinism
    from training.objectives.token_logps import linear_token_logps

    numerics = Numerics(batch_invariant=True, precision="bf16", wrapper_casts=True)
    determinism.configure(numerics, CUDA)
    model = _qwen3(torch.bfloat16, numerics).eval()
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(20, 60, (prompts_count,), generator=generator).tolist()
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    keys = [SampleKey(seed=0, purpose="bench", step=0, prompt_index=i) for i in range(prompts_count)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)

    def timed(sampler: Sampler, count: int) -> tuple[float, list]:
        torch.cuda.synchronize()
        began = time.perf_counter()
        samples = sampler.generate(prompts[:count], keys[:count], params)
        torch.cuda.synchronize()
        return round(time.perf_counter() - began, 3), samples

    def per_step_ms(seconds: float, samples: list) -> float:  # decode steps: the tokens over the rows
        return round(1e3 * seconds / math.ceil(sum(len(s.tokens) for s in samples) / rows), 3)

    report: dict[str, Any] = {"rows": rows, "prompts": prompts_count, "new_tokens": new_tokens, "max_len": max_len}
    graphed = Sampler(model, max_batch=rows, max_len=max_len)
    report["graphed_by_default"] = graphed.cuda_graphs and not graphed.compile
    first, _ = timed(graphed, prompts_count)
    seconds, samples = timed(graphed, prompts_count)
    report["graphed"] = {"first_generate_s": first, "generate_s": seconds, "tokens": sum(len(s.tokens) for s in samples),
                         "per_decode_step_ms": per_step_ms(seconds, samples)}
    # The same samples eagerly (one round of rows): a graph replays the eager launches, so the same bits.
    eager = Sampler(model, max_batch=rows, max_len=max_len, cuda_graphs=False)
    if not quick:
        timed(eager, rows)
    seconds, alone = timed(eager, rows)
    report["eager"] = {"prompts": rows, "generate_s": seconds, "per_decode_step_ms": per_step_ms(seconds, alone),
                       "samples_equal_graphed": all(a.tokens == b.tokens and a.logprobs == b.logprobs
                                                    for a, b in zip(alone, samples))}
    if not quick:
        with _tree_row_reductions():
            timed(eager, rows)
            seconds, trees = timed(eager, rows)
        report["eager_tree_reductions"] = {"prompts": rows, "generate_s": seconds,
                                           "per_decode_step_ms": per_step_ms(seconds, trees)}
    if not quick:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            timed(graphed, prompts_count)
        averages = prof.key_averages()
        busiest = sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)[:10]
        report["graphed_profile"] = {
            "device_s": round(sum(e.self_device_time_total for e in averages) / 1e6, 3),
            "launches": sum(e.count for e in averages if e.key in LAUNCHES),
            "graph_launches": sum(e.count for e in averages if e.key == "cudaGraphLaunch"),
            "busiest_by_device_time": [{"op": e.key[:80], "calls": e.count,
                                        "device_ms": round(e.self_device_time_total / 1e3, 1)} for e in busiest]}
    # The trainer's log-probs of the sampled tokens (the recipe's rows: prompt + completion padded to
    # max_len, micro-batches of ``rows``, the fused head) against the sampler's, bitwise.
    equal, gap = True, 0.0
    with torch.no_grad():
        for first_row in range(0, prompts_count, rows):
            group = range(first_row, min(first_row + rows, prompts_count))
            ids = torch.zeros(len(group), max_len, dtype=torch.long)
            labels = torch.full_like(ids, -100)
            for r, i in enumerate(group):
                sequence = prompts[i] + samples[i].tokens
                ids[r, :len(sequence)] = torch.tensor(sequence)
                labels[r, len(prompts[i]) - 1:len(sequence) - 1] = torch.tensor(samples[i].tokens)
            labels = labels.to(CUDA)
            out = models_forward(model, ids.to(CUDA), lambda h, w: linear_token_logps(
                h, w, labels, chunk_tokens=8192, invariant=True))
            for r, i in enumerate(group):
                begin = len(prompts[i]) - 1
                trainer = out[r, begin:begin + len(samples[i].tokens)].cpu()
                sampled = torch.tensor(samples[i].logprobs, dtype=torch.float32)
                equal &= torch.equal(trainer, sampled)
                gap = max(gap, (trainer - sampled).abs().max().item())
    report["trainer_logprobs_equal_sampler"] = equal
    report["trainer_logprobs_max_abs_gap"] = gap
    return report


def _profile_summary(prof, top: int = 12) -> dict[str, Any]:
    """A torch profiler's busiest kernels by GPU time and operators by host time, and its totals."""
    averages = prof.key_averages()
    by_device = sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    by_host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"device_s": round(sum(e.self_device_time_total for e in averages) / 1e6, 3),
            "host_s": round(sum(e.self_cpu_time_total for e in averages) / 1e6, 3),
            "launches": sum(e.count for e in averages if e.key in LAUNCHES),
            "busiest_by_device_time": [{"op": e.key[:80], "calls": e.count,
                                        "device_ms": round(e.self_device_time_total / 1e3, 1)} for e in by_device],
            "busiest_by_host_time": [{"op": e.key[:80], "calls": e.count,
                                      "host_ms": round(e.self_cpu_time_total / 1e3, 1)} for e in by_host]}


def run_update_profile(micro: int = 16, seq_len: int = 512, prompt: int = 56, completion: int = 64) -> dict[str, Any]:
    """One GRPO update micro-batch as the recipe's policy computes it: ``micro`` rows of ``seq_len``
    positions, each a document of ``prompt + completion`` random tokens and a padding document after it,
    log-probs of the completion tokens by the fused head, their sum's backward; Qwen3-0.6B's shape with
    bf16 parameters and no autocast (FSDP2's policy, unsharded), eager, batch_invariant on and then
    off. Each profiled after one warm-up micro-batch: forward and backward seconds (synchronized),
    the busiest kernels and host operators."""
    from torch.profiler import ProfilerActivity, profile

    from models import ModelInputs, model_forward
    from models.numerics import Numerics
    from training import determinism
    from training.objectives.token_logps import linear_token_logps

    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (micro, seq_len), generator=generator).to(CUDA)
    length = prompt + completion
    documents = (torch.arange(seq_len) >= length).long().expand(micro, seq_len).to(CUDA)
    positions = torch.arange(seq_len).expand(micro, seq_len).to(CUDA)
    labels = torch.full((micro, seq_len), -100, dtype=torch.long)
    labels[:, prompt - 1:length - 1] = ids[:, prompt:length].cpu()
    labels = labels.to(CUDA)
    out: dict[str, Any] = {"rows": micro, "seq_len": seq_len, "tokens_per_row": length}
    model = None
    for invariant in (True, False):
        numerics = Numerics(batch_invariant=invariant, precision="bf16", wrapper_casts=True)
        determinism.configure(numerics, CUDA)
        if model is None:
            model = _qwen3(torch.bfloat16, numerics)
        model.use_numerics(numerics)

        def step(invariant=invariant) -> tuple[float, float]:
            torch.cuda.synchronize()
            began = time.perf_counter()
            logps = model_forward(model, ModelInputs(ids, positions, documents), head=lambda h, w: linear_token_logps(
                h, w, labels, chunk_tokens=8192, invariant=invariant)).head
            torch.cuda.synchronize()
            forward = time.perf_counter() - began
            logps.sum().backward()
            torch.cuda.synchronize()
            return round(forward, 4), round(time.perf_counter() - began - forward, 4)

        step()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            forward, backward = step()
        out["on" if invariant else "off"] = {"forward_s": forward, "backward_s": backward, **_profile_summary(prof)}
        model.zero_grad(set_to_none=True)
    return out


def models_forward(model: torch.nn.Module, ids: torch.Tensor, head: Callable) -> torch.Tensor:
    """The model's one forward (models.model_forward) over (B, T) ids with a fused head: the head's result."""
    from models import ModelInputs, model_forward

    return model_forward(model, ModelInputs(ids), head=head).head


def run_logprob_passes(rows: int = 128, seq_len: int = 512, micro: int = 16) -> dict[str, Any]:
    """A GRPO step's log-prob passes at the recipe's size (``rows`` rows of ``seq_len`` random tokens,
    micro-batches of ``micro``, the fused head), with batch_invariant on and off, eager, one model: the
    reference pass (no gradients) and the update's forwards and backwards. fp32 parameters under bf16
    autocast. Each timed after one micro-batch's warm-up (the kernels of these shapes compile)."""
    from models.numerics import Numerics
    from training import determinism
    from training.objectives.token_logps import linear_token_logps

    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (rows, seq_len), generator=generator).to(CUDA)
    labels = ids.roll(-1, dims=1)
    out: dict[str, Any] = {"rows": rows, "seq_len": seq_len, "micro_batch": micro}
    model = None
    for invariant in (True, False):
        numerics = Numerics(batch_invariant=invariant, precision="bf16")
        determinism.configure(numerics, CUDA)
        if model is None:
            model = _qwen3(torch.float32, numerics)
        model.use_numerics(numerics)

        def logps(start: int, invariant=invariant, numerics=numerics) -> torch.Tensor:
            part = slice(start, start + micro)
            with numerics.autocast(CUDA):
                return models_forward(model, ids[part], lambda h, w: linear_token_logps(
                    h, w, labels[part], chunk_tokens=8192, invariant=invariant, compute_dtype=torch.bfloat16))

        def reference(starts) -> None:
            with torch.no_grad():
                for start in starts:
                    logps(start)

        def update(starts) -> None:
            for start in starts:
                logps(start).sum().backward()

        timings = {}
        for name, fn in (("reference_pass", reference), ("update_forward_backward", update)):
            fn([0])
            torch.cuda.synchronize()
            began = time.perf_counter()
            fn(range(0, rows, micro))
            torch.cuda.synchronize()
            timings[f"{name}_s"] = round(time.perf_counter() - began, 3)
        out["on" if invariant else "off"] = timings
        model.zero_grad(set_to_none=True)
    return out


# ---------------------------------------------------------------------------- 4. GRPO steps


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


GRPO_RUNS = {"on": (True, []), "off": (False, []), "off-eager": (False, ["parallel.compile=false"])}
"""``--grpo-runs``' names: batch_invariant and the overrides of each (``off-eager``: the stock kernels with the
blocks eager, as batch_invariant runs them: what the compiler alone gives the ``off`` run)."""


def grpo_run(label: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``args.grpo_config`` as ``GRPO_RUNS[label]`` says (with its ``--run-set`` overrides);
    SIGKILLed (its process group) after ``args.grpo_timeout`` seconds, keeping what its ledger and metrics
    hold. A profiler window's traces are summarized here (benchmarks/trace_summary.py) and its steps left
    out of the median."""
    invariant, overrides = GRPO_RUNS[label]
    overrides = [*overrides, *(value.split(":", 1)[1] for value in args.run_set if value.split(":", 1)[0] == label)]
    name = f"bi-{label}"
    resumed = None
    if args.grpo_resume:  # the newest run of this label under --work, from its newest checkpoint
        runs = sorted(args.work.glob(f"{name}-*"), key=lambda path: path.stat().st_mtime)
        if not runs:
            raise FileNotFoundError(f"--grpo-resume: no run {name}-* under {args.work} (run the part without it first)")
        resumed = {"run": runs[-1].name, "ledger_before": _jsonl(runs[-1] / "ledger.jsonl")}
        cmd = [sys.executable, str(ROOT / "train.py"), "--resume", runs[-1].name, "--root", str(args.work),
               f"train.max_steps={args.grpo_steps}",  # and checkpoints of its own, for a call after this one
               *([f"checkpoint.interval={args.grpo_checkpoint_interval}"] if args.grpo_checkpoint_interval else [])]
    else:
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / args.grpo_config), "--root", str(args.work),
               "model.init_from=null", f"train.max_steps={args.grpo_steps}", "objective.grpo.max_new_tokens=64",
               f"checkpoint.interval={args.grpo_checkpoint_interval}", "checkpoint.keep=1", "checkpoint.at_end=false",
               "train.eval_interval=0", "metrics.tensorboard=false", f"run.name={name}",
               f"determinism.batch_invariant={str(invariant).lower()}", *args.set, *overrides]
    print("$ " + " ".join(cmd), flush=True)
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    killer = threading.Timer(args.grpo_timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    killer.start()
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            print("  " + line.rstrip(), flush=True)
        code = proc.wait()
    finally:
        killer.cancel()
    wall = time.monotonic() - began
    run_dir = next((Path(line.split(":", 1)[1].strip()) for line in lines if line.startswith("run_dir:")), None)
    ledger = _jsonl(run_dir / "ledger.jsonl") if run_dir else []
    metrics = _jsonl(run_dir / "metrics.jsonl") if run_dir else []
    per_step = []
    for record in metrics:
        values = record.get("metrics", {})
        times = {key: round(value["mean"] if isinstance(value, dict) else value, 3)
                 for key, value in values.items() if key == "step_time" or key.startswith("time_")}
        per_step.append({"step": record.get("step"), **times})
    parity = [line.get("logprob_parity") for line in ledger]
    traces = sorted((run_dir / "artifacts" / "traces").glob("*.json")) if run_dir else []
    profiled = _profiled_steps(traces)
    later = [s["step_time"] for s in per_step
             if s.get("step", 0) >= 2 and "step_time" in s and s.get("step") not in profiled]
    report = {"command": " ".join(cmd), "exit": code, "wall_s": round(wall, 1),
              "timed_out": wall >= args.grpo_timeout, "steps_in_ledger": len(ledger),
              "logprob_parity": parity, "per_step": per_step,
              # whether the policy moved: a step with rewards that differ in a group has a gradient
              "ledger": {key: [line.get(key) for line in ledger] for key in ("reward_mean", "grad_norm", "loss")}, "profiled_steps": sorted(profiled),
              "median_step_s_from_step_2": round(statistics.median(later), 3) if later else None,
              "console_tail": lines[-6:]}
    if traces:
        report["trace_summaries"] = _summarize_traces(traces)
    if resumed is not None:
        report["resume"] = _compare_resumed(resumed, ledger)
    return report


TIMING_KEYS = ("wall_time", "time", "timestamp")


def _compare_resumed(resumed: dict[str, Any], ledger: list[dict]) -> dict[str, Any]:
    """The killed run's ledger lines after the restored step against the resumed run's lines for the same
    steps: every key but the clock's equal is the kill/resume guarantee at this shape. (Lines up to the
    restored step are the killed run's, kept; a key only the last step writes, as ``param_hash``, is
    compared where both lines hold it.)"""
    before = {line["step"]: line for line in resumed["ledger_before"]}
    after = {line["step"]: line for line in ledger}
    overlap = sorted(step for step in before if step in after)
    differing = {step: sorted(key for key in before[step] if key not in TIMING_KEYS and key in after[step] and before[step][key] != after[step][key])
                 for step in overlap}
    differing = {step: keys for step, keys in differing.items() if keys}
    return {"run": resumed["run"], "steps_before": len(before), "steps_after": len(after),
            "steps_compared": overlap[:1] + overlap[-1:], "lines_compared": len(overlap), "lines_differing": differing}


def _profiled_steps(traces: list[Path]) -> set[int]:
    """The steps runtime/profiler.py's trace names cover (``rank0_steps3-3.json``: step 3)."""
    steps: set[int] = set()
    for path in traces:
        span = path.stem.rsplit("_steps", 1)[-1].split("-")
        if len(span) == 2 and all(part.isdigit() for part in span):
            steps.update(range(int(span[0]), int(span[1]) + 1))
    return steps


def _summarize_traces(traces: list[Path]) -> list[dict[str, Any]]:
    """benchmarks/trace_summary.py's summary of each trace, printed; the traces themselves stay where they are."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "benchmarks" / "trace_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    summaries = []
    for path in traces:
        began = time.monotonic()
        summary = module.summarize(path)
        summary["trace_mb"] = round(path.stat().st_size / 1e6, 1)
        summary["summarize_s"] = round(time.monotonic() - began, 1)
        module.print_summary(summary)
        summaries.append(summary)
    return summaries


# ---------------------------------------------------------------------------- the report


def environment() -> dict[str, Any]:
    import triton

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "commit": commit or None}


def _print_chain(chain: dict[str, Any]) -> bool:
    invariant = _booleans(chain["invariant"])
    control = _booleans(chain["control_stock_kernels"])
    print(f"chain (torch.equal): {sum(invariant)} of {len(invariant)} comparisons equal with the invariant "
          f"kernels, {sum(control)} of {len(control)} with the stock ones")
    for part in ("invariant", "control_stock_kernels"):
        for group, cases in chain[part].items():
            for case, checks in cases.items():
                print(f"  {part:22s} {group:9s} {case:24s} " + " ".join(f"{k}={v}" for k, v in checks.items()))
    print("  row kernels against the stock ones, max |difference|: "
          + ", ".join(f"{k} {v:.3g}" for k, v in chain["rows_max_abs_vs_stock"].items()))
    backward = chain.get("backward", {})
    for name, check in backward.items():
        print(f"  backward {name:24s} repeat equal {check['repeat_equal']}, largest difference from autograd of "
              f"the reference {check['max_rel_vs_autograd']:.3g} (relative to its largest value)")
    return all(invariant) and all(check["repeat_equal"] for check in backward.values())


def _print_kernels(kernels: dict[str, Any]) -> None:
    print(f"{'kernel (median of 20, ms)':55s} {'invariant':>10s} {'trees':>8s} {'stock':>10s} {'ratio':>7s} launches")
    for name, times in kernels.items():
        if not isinstance(times, dict):
            continue
        trees = f"{times['trees_ms']:8.3f}" if "trees_ms" in times else " " * 8
        launches = (f"{times['invariant_launches']}/{times['trees_launches']}/{times['stock_launches']}"
                    if "trees_launches" in times else "")
        print(f"{name:55s} {times['invariant_ms']:10.3f} {trees} {times['stock_ms']:10.3f} "
              f"{times['invariant_ms'] / times['stock_ms']:7.2f} {launches}")


def _print_sampler(sampler: dict[str, Any]) -> bool:
    graphed, eager = sampler["graphed"], sampler["eager"]
    trees = sampler.get("eager_tree_reductions", {"per_decode_step_ms": None})
    print(f"sampler ({sampler['rows']} rows, {sampler['prompts']} prompts x {sampler['new_tokens']} tokens, "
          f"{sampler['max_len']} slots): graphed {graphed['generate_s']} s ({graphed['per_decode_step_ms']} ms a "
          f"decode step; first call {graphed['first_generate_s']} s), eager {eager['per_decode_step_ms']} ms a step, "
          f"eager with tree reductions {trees['per_decode_step_ms']} ms a step; eager samples == graphed: "
          f"{eager['samples_equal_graphed']}; trainer log-probs == sampler's: {sampler['trainer_logprobs_equal_sampler']} "
          f"(max gap {sampler['trainer_logprobs_max_abs_gap']})")
    profile = sampler.get("graphed_profile")
    if profile is not None:
        print(f"  graphed, profiled: {profile['device_s']} s of GPU time, {profile['launches']} kernel launches, "
              f"{profile['graph_launches']} graph launches")
        for row in profile["busiest_by_device_time"]:
            print(f"  {row['op']:60s} {row['calls']:8d} calls {row['device_ms']:10.1f} ms GPU")
    return sampler["trainer_logprobs_equal_sampler"] and eager["samples_equal_graphed"]


def _print_update(update: dict[str, Any]) -> None:
    for label in ("on", "off"):
        run = update[label]
        print(f"update micro-batch ({update['rows']} x {update['seq_len']}), batch_invariant {label}: forward "
              f"{run['forward_s']} s, backward {run['backward_s']} s; profiled {run['device_s']} s GPU, "
              f"{run['host_s']} s host, {run['launches']} launches")
        for row in run["busiest_by_device_time"]:
            print(f"  {row['op']:80s} {row['calls']:7d} calls {row['device_ms']:9.1f} ms GPU")
        for row in run["busiest_by_host_time"][:6]:
            print(f"  {row['op']:80s} {row['calls']:7d} calls {row['host_ms']:9.1f} ms host")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="chain,sampler,grpo,matmul,kernels,logprobs,update",
                        help="comma-separated: chain, sampler, grpo, matmul, kernels, logprobs, update")
    parser.add_argument("--sampler-rows", type=int, default=16, help="the sampler's rows (the recipe's rollout rows)")
    parser.add_argument("--sampler-prompts", type=int, default=128, help="prompts of the sampler part (a step's)")
    parser.add_argument("--sampler-quick", action="store_true",
                        help="the sampler part without its second eager round, the tree reductions and the profile")
    parser.add_argument("--grpo-config", default="configs/qwen3-0.6b-grpo.yaml")
    parser.add_argument("--grpo-steps", type=int, default=3)
    parser.add_argument("--grpo-timeout", type=float, default=300.0, help="seconds per GRPO run")
    parser.add_argument("--set", action="append", default=[], help="another override of every GRPO run")
    parser.add_argument("--grpo-runs", default="on,off",
                        help="comma-separated GRPO runs, in order: on, off, off-eager (GRPO_RUNS)")
    parser.add_argument("--run-set", action="append", default=[], metavar="RUN:KEY=VALUE",
                        help="an override of one GRPO run (a profiler window: on:runtime.profile_start_step=3)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lockstep-batch-invariant"))
    parser.add_argument("--grpo-checkpoint-interval", type=int, default=0,
                        help="steps between the GRPO runs' checkpoints (0: none); keep 1, none at the end; "
                             "with --grpo-resume the resumed run's (0: the recorded interval)")
    parser.add_argument("--grpo-resume", action="store_true",
                        help="resume each GRPO run's newest run under --work (a run longer than one call: "
                             "the killed run's lines after the checkpoint are compared with the resumed ones)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    unknown = sorted((set(args.grpo_runs.split(",")) | {v.split(":", 1)[0] for v in args.run_set}) - set(GRPO_RUNS))
    if unknown:
        print(f"batch_invariant_gpu.py: --grpo-runs or --run-set names {unknown}; known: {sorted(GRPO_RUNS)}",
              file=sys.stderr)
        return 2
    if parts - {"grpo"} and not torch.cuda.is_available():
        print("batch_invariant_gpu.py: every part but grpo needs a CUDA device", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"environment": environment() if torch.cuda.is_available() else {}}
    failed = False

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=1))

    def part(name: str, run: Callable[[], Any], show: Callable[[Any], Any]) -> None:
        """Run one part; one that raises is recorded with its error (and fails the call), the others still run."""
        nonlocal failed
        if name not in parts:
            return
        began = time.monotonic()
        try:
            report[name] = run()
        except Exception as error:  # a part's failure is reported, not fatal to the parts after it
            report[name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{name}: FAILED: {type(error).__name__}: {error}", flush=True)
            failed = True
        else:
            if isinstance(report[name], dict):
                report[name]["seconds"] = round(time.monotonic() - began, 1)
            save()
            try:
                failed |= show(report[name]) is False
            except Exception as error:  # the numbers are saved; a printing slip is reported, not fatal
                print(f"{name}: could not print its table: {type(error).__name__}: {error}", flush=True)
                failed = True
        save()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # The GRPO runs before the kernel times and the log-prob passes: a call cut short keeps the ratio.
    part("chain", run_chain, _print_chain)
    part("sampler", lambda: run_sampler(args.sampler_rows, args.sampler_prompts, quick=args.sampler_quick),
         _print_sampler)

    def grpo() -> dict[str, Any]:
        runs = {}
        for label in args.grpo_runs.split(","):
            runs[label] = grpo_run(label, args)
            report["grpo"] = runs
            save()
        return runs

    def show_grpo(runs: dict[str, Any]) -> bool:
        for label, run in runs.items():
            if isinstance(run, dict) and "exit" in run:
                print(f"grpo {label}: exit {run['exit']}, {run['steps_in_ledger']} steps, median step "
                      f"{run['median_step_s_from_step_2']} s (from step 2, profiled steps {run['profiled_steps']} "
                      f"left out), parity {run['logprob_parity']}")
                for step in run["per_step"]:
                    print("    " + " ".join(f"{k}={v}" for k, v in step.items()
                                            if k in ("step", "step_time") or k.startswith("time_") and v))
                if "resume" in run:
                    resume = run["resume"]
                    print(f"grpo {label}: resumed {resume['run']}: {resume['lines_compared']} ledger lines of the killed "
                          f"run (steps {resume['steps_compared']}) against the resumed run's, "
                          f"{len(resume['lines_differing'])} differ {resume['lines_differing'] or ''}")
        on, off = (runs.get(k, {}).get("median_step_s_from_step_2") for k in ("on", "off"))
        if on and off:
            print(f"grpo step-time ratio on/off: {on / off:.2f}")
        if "on" not in runs:
            return True
        resumed_equal = not runs["on"].get("resume", {}).get("lines_differing")
        return (bool(runs["on"]["logprob_parity"]) and all(value == 0.0 for value in runs["on"]["logprob_parity"])
                and resumed_equal)

    part("grpo", grpo, show_grpo)
    part("matmul", run_matmul_times, _print_matmul)
    part("kernels", run_kernel_times, _print_kernels)
    part("logprobs", run_logprob_passes, lambda r: print("log-prob passes (s): " + json.dumps(r)))
    part("update", run_update_profile, _print_update)
    save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
