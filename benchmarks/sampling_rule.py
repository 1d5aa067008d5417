"""The sampler's sampling rule alone: ms per call on (rows, 151,936) bf16 logits, and whether each
path draws the reference's tokens bitwise.

    python benchmarks/sampling_rule.py --rows 64,256 --out bench_out/sampling-rule.json
    python benchmarks/sampling_rule.py --rows 4 --vocab 2000 --device cpu --out bench_out/sampling-rule-cpu.json

Every path is ``models.generation.sampler.sample_next`` with one rule and one pair of (cut, draw)
functions, captured as one CUDA graph (``models.generation.nucleus.CapturedGraph``, what the Sampler
replays each decode step; on the CPU run eagerly), timed by CUDA events over ``--calls`` replays
after a warm-up (the host time of a call is not in it). Rules: greedy; temperature 1 with no
filter; top-p ``--top-p``. For top-p and no filter, the draw in torch (``draw_kept``: int64 weights
of the whole vocabulary, their prefix sums and a search) and by the Triton kernels
(``draw_kept_cuda``); the cut always by the Triton search (the torch reference's 30 masked
sums are for checking). ``--search`` adds the search alone for each (block, warps, parts, fanout) layout
listed, checked against the reference cut. ``equal`` says a path's tokens and log-probs are
bitwise the torch reference's (``nucleus_cut``, ``draw_kept``) on the same logits.
"""

from __future__ import annotations

import argparse
import platform
import sys
from functools import partial
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hf_baseline import write_json  # noqa: E402
from models.generation.nucleus import (  # noqa: E402
    CapturedGraph,
    draw_kept,
    draw_kept_cuda,
    nucleus_cut,
    nucleus_cut_cuda,
    triton_available,
)
from models.generation.sampler import SamplingParams, sample_next  # noqa: E402


def timed_ms(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Mean ms per call: CUDA events around ``calls`` calls after 3 warm-up calls (wall time on the CPU)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        import time

        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / calls


def run(rows: int, vocab: int, top_p: float, calls: int, device: torch.device,
        layouts: list[tuple[int, int, int]]) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(rows)
    logits = (torch.randn(rows, vocab, device=device, generator=generator) * 2).to(torch.bfloat16)
    uniforms = torch.rand(rows, device=device, generator=generator)
    kernels = triton_available(device)
    paths = [("greedy", SamplingParams(temperature=0), nucleus_cut, draw_kept)]
    for name, params in (("no filter", SamplingParams()), (f"top-p {top_p}", SamplingParams(top_p=top_p))):
        if kernels:
            paths.append((f"{name}, torch draw", params, nucleus_cut_cuda, draw_kept))
            paths.append((f"{name}, Triton draw", params, nucleus_cut_cuda, draw_kept_cuda))
        else:
            paths.append((f"{name}, torch", params, nucleus_cut, draw_kept))
    results = []
    for name, params, cut, draw in paths:
        reference = sample_next(logits, uniforms, params)
        rule = partial(sample_next, params=params, cut=cut, draw=draw)
        call = CapturedGraph(rule) if device.type == "cuda" else rule
        tokens, logprobs = call(logits, uniforms)
        equal = torch.equal(tokens, reference[0]) and torch.equal(logprobs, reference[1])
        ms = timed_ms(lambda: call(logits, uniforms), calls, device)
        results.append({"rows": rows, "path": name, "ms": round(ms, 4), "equal": bool(equal)})
    if kernels:
        probs = torch.softmax(logits.float(), dim=-1)
        expected = nucleus_cut(probs, top_p)
        for block, warps, parts, fanout in layouts:
            search = CapturedGraph(partial(nucleus_cut_cuda, top_p=top_p, block=block, warps=warps, parts=parts,
                                           fanout=fanout))
            cut, ties = search(probs)
            equal = torch.equal(cut, expected[0]) and torch.equal(ties, expected[1])
            ms = timed_ms(lambda: search(probs), calls, device)
            results.append({"rows": rows, "path": f"cut alone, block {block}, {warps} warps, {parts} parts, "
                                                  f"{fanout} cuts a pass",
                            "ms": round(ms, 4), "equal": bool(equal)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--search", default="", metavar="B:W:P:F[,B:W:P:F...]",
                        help="search layouts to time alone: block, warps, programs per row, cuts per pass")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default="bench_out/sampling-rule.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layouts = [tuple(int(x) for x in item.split(":")) for item in args.search.split(",") if item]
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        results += run(rows, args.vocab, args.top_p, args.calls, device, layouts)
    print("| rows | path | ms per call | equal to the reference |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['path']} | {r['ms']:.3f} | {r['equal']} |")
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    write_json(args.out, {"card": card, "torch": torch.__version__, "vocab": args.vocab, "top_p": args.top_p,
                          "calls": args.calls, "results": results})
    return 0 if all(r["equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
