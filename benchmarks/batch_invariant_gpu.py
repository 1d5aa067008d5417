"""The batch-invariant kernels on one CUDA GPU (``determinism.batch_invariant``): the chain, exact, and its cost.

    python benchmarks/batch_invariant_gpu.py --out bench_out/batch_invariant_gpu.json \
        [--parts chain,kernels,sampler,grpo] [--grpo-steps 4] [--grpo-timeout 300] [--work /tmp/lockstep-bi]
    python benchmarks/batch_invariant_gpu.py --out bench_out/bi-cpu.json --parts grpo --grpo-steps 2 \
        --grpo-config tests/configs/e2e-grpo.yaml --set parallel.device=cpu   # the GRPO part, CPU smoke

1. ``chain``: models/batch_invariant.py's kernels on CUDA (models/batch_invariant_triton.py), every
   comparison ``torch.equal``, at the Qwen3-0.6B shapes (hidden 1024, 16 heads over 8 key/value
   heads of 128, vocabulary 151,936), random inputs:
   - ``linear``: a row of ``x @ W.T`` computed among 1, 7, 64 and 1000 rows, and moved to row 500,
     for the q, gate, down and output-head weights; under bf16 autocast (fp32 inputs, as the
     trainer's) and in fp32.
   - ``attention``: 8 documents of 1 to 200 tokens attended as a training forward (packed rows at
     micro-batch 1, 2 and 8, each document at another offset beside other neighbours), as the
     sampler's prefill (chunks of 64 into a cache whose later slots hold stale values) and as its
     cached decode (one token a step, 8 rows over 512 slots, and 3 rows in another order over 384):
     every token's output the same bits in all six. Two dtype cases: the bf16 autocast trainer's
     (q and k fp32 after the rotary, v bf16, an fp32 cache) and bf16 throughout (FSDP2's bf16
     parameters, a bf16 cache).
   - ``control``: the same comparisons with the stock kernels (``F.linear``'s cuBLAS; SDPA in
     training, the cached path's SDPA or fp32 matmuls in the cache): they break.
2. ``kernels``: forward times (CUDA events, median of 20) of the invariant kernels and the stock
   ones at the GRPO recipe's sizes.
3. ``sampler``: the Sampler alone at the Qwen3-0.6B shape (random weights, bf16 parameters and no
   autocast as under the recipe's FSDP2 policy, 128 rows of 20-59 random prompt tokens, 64 new
   tokens each at temperature 1, 192 slots): two timed ``generate`` calls (the first compiles the
   Triton kernels), then one under torch's profiler, whose 12 busiest operators by host time and
   its launch count are reported.
4. ``grpo``: configs/qwen3-0.6b-grpo.yaml from random weights (``model.init_from=null``, the byte
   tokenizer), ``objective.grpo.max_new_tokens=64``, ``--grpo-steps`` steps, no checkpoints or
   evaluation, with ``determinism.batch_invariant`` true and then false: each step's time, its
   phases and ``logprob_parity`` from the run's ledger and metrics.

Prints a table and writes ``--out`` after each part (a call cut short keeps what finished). Exit 1 if
a chain comparison failed or a run with batch_invariant on wrote a nonzero ``logprob_parity``.
Needs a CUDA device, Triton, and for ``grpo`` the embedded tasks (datasets/tasks, ``python -m data
prepare``) in the repository root.
"""

from __future__ import annotations

import argparse
import json
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

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 16, 8, 128, 1024
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
            results[f"{name}/{case}"] = same
    return results


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
            from models import batch_invariant_triton

            gaps = []
            for doc, out in zip(docs, anchor):
                positions = torch.arange(doc["q"].shape[1], device=CUDA)[None]
                allowed = batch_invariant_triton.allowed_keys(positions, None, True, 1, doc["q"].shape[1])
                dense = batch_invariant_triton.dense_attention(doc["q"][None], doc["k"][None], doc["v"][None], allowed)
                gaps.append((dense[0].float() - out.float()).abs().max().item())
            result["max_abs_vs_dense_fp32"] = max(gaps)
    return result


def run_chain() -> dict[str, Any]:
    chain = {"linear": linear_chain(True), "attention": {c: attention_chain(c, True) for c in ATTENTION_CASES}}
    control = {"linear": linear_chain(False), "attention": {c: attention_chain(c, False) for c in ATTENTION_CASES}}
    return {"invariant": chain, "control_stock_kernels": control}


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


def run_kernel_times() -> dict[str, Any]:
    generator = torch.Generator(device=CUDA).manual_seed(4)
    out: dict[str, Any] = {}
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


# ---------------------------------------------------------------------------- 3. the sampler


def run_sampler(rows: int = 128, new_tokens: int = 64) -> dict[str, Any]:
    import models
    from core.config import ModelConfig
    from models.generation.sampler import SampleKey, Sampler, SamplingParams
    from models.numerics import Numerics
    from torch.profiler import ProfilerActivity, profile

    config = ModelConfig(arch="qwen3", vocab_size=151936, hidden_size=HIDDEN, intermediate_size=3072, num_layers=28,
                         num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_embeddings=True, qk_norm=True, attention="sdpa")
    model = models.build(config, generator=torch.Generator().manual_seed(0)).eval().to(CUDA, torch.bfloat16)
    model.use_numerics(Numerics(batch_invariant=True, precision="bf16", wrapper_casts=True))
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(20, 60, (rows,), generator=generator).tolist()
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    keys = [SampleKey(seed=0, purpose="bench", step=0, prompt_index=i) for i in range(rows)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    sampler = Sampler(model, max_batch=rows, max_len=192)

    def timed() -> tuple[float, int]:
        began = time.perf_counter()
        samples = sampler.generate(prompts, keys, params)
        torch.cuda.synchronize()
        return round(time.perf_counter() - began, 2), sum(len(s.tokens) for s in samples)

    first, _ = timed()
    second, tokens = timed()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed()
    averages = prof.key_averages()
    busiest = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {"first_generate_s": first, "generate_s": second, "tokens": tokens,
            "host_s": round(sum(e.self_cpu_time_total for e in averages) / 1e6, 2),
            "device_s": round(sum(e.self_device_time_total for e in averages) / 1e6, 2),
            "launches": sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx")),
            "busiest_by_host_time": [{"op": e.key, "calls": e.count, "self_host_ms": round(e.self_cpu_time_total / 1e3, 1)}
                                     for e in busiest]}


# ---------------------------------------------------------------------------- 4. GRPO steps


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def grpo_run(invariant: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``args.grpo_config`` with batch_invariant on or off; SIGKILLed (its process group)
    after ``args.grpo_timeout`` seconds, keeping what its ledger and metrics hold."""
    name = f"bi-{'on' if invariant else 'off'}"
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / args.grpo_config), "--root", str(args.work),
           "model.init_from=null", f"train.max_steps={args.grpo_steps}", "objective.grpo.max_new_tokens=64",
           "checkpoint.interval=0", "train.eval_interval=0", "metrics.tensorboard=false", f"run.name={name}",
           f"determinism.batch_invariant={str(invariant).lower()}", *args.set]
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
    later = [s["step_time"] for s in per_step if s.get("step", 0) >= 2 and "step_time" in s]
    return {"command": " ".join(cmd), "exit": code, "wall_s": round(wall, 1),
            "timed_out": wall >= args.grpo_timeout, "steps_in_ledger": len(ledger),
            "logprob_parity": parity, "per_step": per_step,
            "median_step_s_from_step_2": round(statistics.median(later), 3) if later else None,
            "console_tail": lines[-6:]}


# ---------------------------------------------------------------------------- the report


def environment() -> dict[str, Any]:
    import triton

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "commit": commit or None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="chain,kernels,sampler,grpo",
                        help="comma-separated: chain, kernels, sampler, grpo")
    parser.add_argument("--grpo-config", default="configs/qwen3-0.6b-grpo.yaml")
    parser.add_argument("--grpo-steps", type=int, default=4)
    parser.add_argument("--grpo-timeout", type=float, default=300.0, help="seconds per GRPO run")
    parser.add_argument("--set", action="append", default=[], help="another override of both GRPO runs")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lockstep-batch-invariant"))
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts & {"chain", "kernels", "sampler"} and not torch.cuda.is_available():
        print("batch_invariant_gpu.py: the chain, kernels and sampler parts need a CUDA device", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"environment": environment() if torch.cuda.is_available() else {}}
    failed = False

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=1))

    if "chain" in parts:
        began = time.monotonic()
        report["chain"] = run_chain()
        report["chain"]["seconds"] = round(time.monotonic() - began, 1)
        save()
        invariant = _booleans(report["chain"]["invariant"])
        control = _booleans(report["chain"]["control_stock_kernels"])
        print(f"chain (torch.equal): {sum(invariant)} of {len(invariant)} comparisons equal with the invariant "
              f"kernels, {sum(control)} of {len(control)} with the stock ones")
        for part in ("invariant", "control_stock_kernels"):
            for group, cases in report["chain"][part].items():
                for case, checks in cases.items():
                    print(f"  {part:22s} {group:9s} {case:24s} " + " ".join(f"{k}={v}" for k, v in checks.items()))
        failed |= not all(invariant)
    if "kernels" in parts:
        report["kernels"] = run_kernel_times()
        save()
        print(f"{'kernel (median of 20, ms)':55s} {'invariant':>10s} {'stock':>10s} {'ratio':>7s}")
        for name, times in report["kernels"].items():
            print(f"{name:55s} {times['invariant_ms']:10.3f} {times['stock_ms']:10.3f} "
                  f"{times['invariant_ms'] / times['stock_ms']:7.2f}")
    if "sampler" in parts:
        report["sampler"] = run_sampler()
        save()
        sampler = report["sampler"]
        print(f"sampler: {sampler['tokens']} tokens in {sampler['generate_s']} s (first call, compiling: "
              f"{sampler['first_generate_s']} s); profiled: {sampler['host_s']} s of host time, "
              f"{sampler['device_s']} s of GPU time, {sampler['launches']} kernel launches")
        for row in sampler["busiest_by_host_time"]:
            print(f"  {row['op']:40s} {row['calls']:8d} calls {row['self_host_ms']:10.1f} ms host")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if "grpo" in parts:
        report["grpo"] = {}
        for on in (True, False):
            report["grpo"]["on" if on else "off"] = grpo_run(on, args)
            save()
        for label, run in report["grpo"].items():
            print(f"grpo batch_invariant {label}: exit {run['exit']}, {run['steps_in_ledger']} steps, "
                  f"median step {run['median_step_s_from_step_2']} s (from step 2), parity {run['logprob_parity']}")
        failed |= any(value != 0.0 for value in report["grpo"]["on"]["logprob_parity"])
    save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
