"""GPU check of the document-masked attention paths (models/attention.py).

For packed sequences (several documents per row) it checks, per sequence length:

- agreement: flex (compiled flex_attention + BlockMask) against the exact sdpa path
  (boolean mask, deterministic backends), forward output and the q/k/v gradients, each
  measured against an fp32 reference and required to be within bf16 tolerance; on CUDA also
  ``varlen``, torch's flash-attention kernel over the rows flattened into their documents
  (``torch.nn.attention.varlen``), as a reference for what flash attention would give;
- speed: forward and forward+backward time of each path, and the mask build time;
- repeatability: forward+backward run several times from the same inputs must give
  bitwise-identical outputs and gradients (with torch.use_deterministic_algorithms on by
  default, as Lockstep's bitwise mode runs);
- model: the whole model with attention=flex vs attention=sdpa, eager and with compiled
  blocks, including that a new batch's document layout does not trigger a recompile.

varlen is not a model kernel: measured here it was no faster than flex (docs/performance.md)
and its backward is not bitwise repeatable. Its cases run with deterministic algorithms off,
as a fast-mode kernel would, and its repeatability is reported, not required.

Every case is caught and reported on its own; the table is printed and everything is
written as JSON to --out. Exit status 1 if any case failed or errored.

    python benchmarks/attention_check.py --out attention_check.json
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

# cuBLAS needs this before CUDA initializes to run deterministically (matmuls of the math
# backend and of the model check).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models.attention import attend, causal_document_block_mask, causal_document_bool_mask  # noqa: E402
from models.forward import ModelInputs, model_forward  # noqa: E402
from models.numerics import Numerics  # noqa: E402


def varlen_document_mask(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Flash attention's variable-length layout of the same documents: the (B, T) rows read
    as one stream of B*T tokens, the int32 offsets where each document starts (then B*T),
    and the row length T as the bound of any document's length."""
    batch, seq_len = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    offsets = starts.flatten().nonzero().flatten().to(torch.int32)
    return torch.cat([offsets, offsets.new_tensor([batch * seq_len])]), seq_len


def attend_varlen(q, k, v, mask):
    """Causal attention within each document through torch's flash varlen kernel (CUDA)."""
    from torch.nn.attention.varlen import varlen_attn

    cu_seqlens, max_len = mask
    batch, num_heads, seq_len, head_dim = q.shape
    params = inspect.signature(varlen_attn).parameters
    # Causal as the installed torch spells it: ``is_causal`` (2.9) or a window reaching
    # nothing to the right (2.10+). Grouped kv heads natively where ``enable_gqa`` exists.
    options = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if k.shape[1] != num_heads:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:  # repeat each kv head for its query heads
            k, v = (x.repeat_interleave(num_heads // x.shape[1], dim=1) for x in (k, v))

    def stream(x):  # (B, heads, T, D) -> (B*T, heads, D)
        return x.transpose(1, 2).reshape(batch * seq_len, x.shape[1], head_dim)

    out = varlen_attn(stream(q), stream(k), stream(v), cu_seqlens, cu_seqlens, max_len, max_len, **options)
    return out.view(batch, seq_len, num_heads, head_dim).transpose(1, 2)


def _no_mask(document_ids):
    return None  # plain causal attention over the whole row (what runs without document_ids)


PATHS = {
    # name -> (mask builder, sdpa_backends)
    "flex": (causal_document_block_mask, "deterministic"),
    "varlen": (varlen_document_mask, None),  # flash attention reference (CUDA), attend_varlen
    "sdpa": (causal_document_bool_mask, "deterministic"),
    "sdpa_all": (causal_document_bool_mask, "all"),  # lets torch pick any backend
    # Not document-masked, so not compared for agreement; timed and checked for repeatability.
    "causal": (_no_mask, "deterministic"),
    "causal_all": (_no_mask, "all"),  # flash/cuDNN allowed
}


def device_paths(device: str) -> list[str]:
    return [path for path in PATHS if path != "varlen" or device == "cuda"]


def run_attention(path, q, k, v, mask):
    if path == "varlen":
        return attend_varlen(q, k, v, mask)
    return attend(q, k, v, mask, backends=Numerics(sdpa_backends=PATHS[path][1]).sdpa_backends_on(q.device))


@contextlib.contextmanager
def kernel_mode(path: str):
    """varlen runs as a fast-mode kernel would: deterministic algorithms off."""
    previous = torch.are_deterministic_algorithms_enabled()
    if path == "varlen":
        torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="path of the JSON report")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mean-doc-len", type=int, default=400, help="mean document length in the packing")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5, help="forward+backward runs compared bitwise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-deterministic", action="store_true", help="leave torch.use_deterministic_algorithms off")
    p.add_argument("--skip-model", action="store_true", help="skip the whole-model checks")
    p.add_argument("--device", default="cuda", help="cuda (the point), or cpu for a slow smoke test of the script")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- inputs


def packed_document_ids(batch: int, seq_len: int, mean_len: int, generator: torch.Generator) -> torch.Tensor:
    """(B, T) document ids; row 0 is a single document (edge case), others random lengths."""
    rows = [torch.zeros(seq_len, dtype=torch.int32)]
    for _ in range(batch - 1):
        lengths = []
        while sum(lengths) < seq_len:
            lengths.append(int(torch.randint(1, 2 * mean_len, (1,), generator=generator)))
        ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
        rows.append(ids[:seq_len])
    return torch.stack(rows)


def position_ids_from(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 at every document start, (B, T)."""
    out = torch.empty_like(document_ids, dtype=torch.long)
    for b, row in enumerate(document_ids.tolist()):
        pos, prev = 0, None
        for t, doc in enumerate(row):
            pos = 0 if doc != prev else pos + 1
            out[b, t], prev = pos, doc
    return out


def qkv(args, seq_len, dtype, device, generator):
    shape_q = (args.batch, args.heads, seq_len, args.head_dim)
    shape_kv = (args.batch, args.kv_heads, seq_len, args.head_dim)
    q = torch.randn(shape_q, generator=generator)
    k = torch.randn(shape_kv, generator=generator)
    v = torch.randn(shape_kv, generator=generator)
    dout = torch.randn(shape_q, generator=generator)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def forward_backward(path, q, k, v, dout, mask):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with kernel_mode(path):
        out = run_attention(path, q, k, v, mask)
        out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def median_ms(fn, warmup, iters, device):
    """Median wall time of fn in ms (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    if device != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# --------------------------------------------------------------------------- cases


GRAD_NAMES = ("out", "dq", "dk", "dv")


def case_agreement(args, seq_len, doc):
    g = torch.Generator().manual_seed(args.seed + seq_len)
    q, k, v, dout = qkv(args, seq_len, torch.bfloat16, args.device, g)
    fp32 = [t.float() for t in (q, k, v, dout)]
    reference = forward_backward("sdpa", *fp32, causal_document_bool_mask(doc))
    fast_paths = [path for path in ("flex", "varlen") if path in device_paths(args.device)]
    got = {path: forward_backward(path, q, k, v, dout, PATHS[path][0](doc)) for path in ["sdpa", *fast_paths]}
    rel_err = {
        path: {
            name: (x.float() - r).abs().max().item() / max(r.abs().max().item(), 1e-6)
            for name, x, r in zip(GRAD_NAMES, tensors, reference)
        }
        for path, tensors in got.items()
    }
    direct = {
        path: {name: (a.float() - b.float()).abs().max().item() for name, a, b in zip(GRAD_NAMES, got[path], got["sdpa"])}
        for path in fast_paths
    }
    # Within bf16 tolerance: a fast path's error against fp32 is no worse than twice the
    # exact path's own bf16 error, or below 1% of the largest reference value.
    ok = all(rel_err[p][n] <= max(2 * rel_err["sdpa"][n], 1e-2) for p in fast_paths for n in GRAD_NAMES)
    return ok, {"rel_err_vs_fp32": rel_err, "max_abs_minus_sdpa": direct}


def case_speed(args, seq_len, doc, path):
    g = torch.Generator().manual_seed(args.seed)
    q, k, v, dout = qkv(args, seq_len, torch.bfloat16, args.device, g)
    build_mask = PATHS[path][0]
    mask = build_mask(doc)
    timing = (args.warmup, args.iters, args.device)
    mask_ms = median_ms(lambda: build_mask(doc), *timing)
    with torch.no_grad(), kernel_mode(path):
        fwd_ms = median_ms(lambda: run_attention(path, q, k, v, mask), *timing)
    fwd_bwd_ms = median_ms(lambda: forward_backward(path, q, k, v, dout, mask), *timing)
    return True, {"mask_ms": mask_ms, "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms}


def case_repeatability(args, seq_len, doc, path):
    g = torch.Generator().manual_seed(args.seed + 1)
    q, k, v, dout = qkv(args, seq_len, torch.bfloat16, args.device, g)
    runs = [forward_backward(path, q, k, v, dout, PATHS[path][0](doc)) for _ in range(args.repeats)]
    mismatches = {
        name: sum(not torch.equal(run[i], runs[0][i]) for run in runs[1:])
        for i, name in enumerate(GRAD_NAMES)
    }
    repeatable = all(m == 0 for m in mismatches.values())
    data = {"runs": args.repeats, "mismatching_runs": mismatches, "bitwise_repeatable": repeatable}
    # Which paths must repeat: flex always (measured so, with or without deterministic
    # algorithms); the memory-efficient SDPA backward only with use_deterministic_algorithms
    # on (it accumulates dq with atomics otherwise); any-backend SDPA and the flash varlen
    # reference are informational.
    expected = path == "flex" or (
        path != "varlen" and PATHS[path][1] == "deterministic" and not args.no_deterministic
    )
    return (repeatable if expected else None), data


def case_init_cpu_vs_cuda(args):
    """models.build on CPU and on the device from equal generators gives bit-identical weights."""
    import models
    from core.config import ModelConfig

    config = ModelConfig(arch="qwen2", vocab_size=1000, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
    cpu = models.build(config, generator=torch.Generator().manual_seed(3))
    gpu = models.build(config, generator=torch.Generator().manual_seed(3), device=args.device)
    different = [k for k, v in cpu.state_dict().items() if not torch.equal(v, gpu.state_dict()[k].cpu())]
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits_diff = (cpu(ids) - gpu(ids.to(args.device)).cpu()).abs().max().item()  # fp32, kernels differ
    data = {"differing_tensors": different, "fp32_logits_max_abs_diff": logits_diff}
    return not different and logits_diff < 1e-3, data


def _max_rel_err(got: dict, expected: dict) -> float:
    return max(
        (got[n].float() - expected[n].float()).abs().max().item() / max(expected[n].abs().max().item(), 1e-12)
        for n in expected
    )


def _steps_equal(a, b) -> bool:
    return torch.equal(a[1], b[1]) and all(torch.equal(a[2][n], b[2][n]) for n in a[2])


def case_model(args, seq_len):
    """Whole model, bf16 autocast: flex vs sdpa logits/grads, compiled blocks, repeatability."""
    import dataclasses

    from torch._dynamo.utils import counters

    import models
    from core.config import ModelConfig

    base = ModelConfig(
        arch="qwen3", vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_layers=4,
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
    )
    g = torch.Generator().manual_seed(args.seed + 7)
    batches = []
    for _ in range(3):
        doc = packed_document_ids(2, seq_len, args.mean_doc_len, g)
        ids = torch.randint(0, base.vocab_size, (2, seq_len), generator=g)
        batches.append(tuple(t.to(args.device) for t in (ids, position_ids_from(doc), doc)))

    def step(model, batch):
        """(loss, logits, grads) of one forward+backward."""
        model.zero_grad(set_to_none=True)
        ids, pos, doc = batch
        with torch.autocast(args.device, dtype=torch.bfloat16):
            logits = model_forward(model, ModelInputs(ids, pos, doc)).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())
        loss.backward()
        return loss.item(), logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    def built(attention, compiled):
        config = dataclasses.replace(base, attention=attention)
        model = models.build(config, generator=torch.Generator().manual_seed(1), device=args.device)
        if compiled:
            for block in model.layers:  # fullgraph: a graph break inside a block is an error
                block.compile(fullgraph=True)
        return model

    report, ok = {}, True
    sdpa = step(built("sdpa", False), batches[0])
    for name, compiled in (("flex_eager_blocks", False), ("flex_compiled_blocks", True)):
        model = built("flex", compiled)
        first, again = step(model, batches[0]), step(model, batches[0])
        graphs_before = counters["stats"]["unique_graphs"]
        for batch in batches[1:]:  # new document layouts, same shapes
            step(model, batch)
        new_graphs = counters["stats"]["unique_graphs"] - graphs_before
        entry = {
            "loss": first[0],
            "sdpa_loss": sdpa[0],
            "logits_max_abs_diff_vs_sdpa": (first[1].float() - sdpa[1].float()).abs().max().item(),
            "grad_max_rel_err_vs_sdpa": _max_rel_err(first[2], sdpa[2]),
            "repeat_bitwise_equal": _steps_equal(first, again),
            "new_graphs_for_new_document_layouts": new_graphs,
        }
        report[name] = entry
        ok = ok and (
            abs(first[0] - sdpa[0]) < 2e-2
            and entry["grad_max_rel_err_vs_sdpa"] < 0.1  # bf16, compiled fusion: ~0.02-0.04 seen
            and entry["repeat_bitwise_equal"]
            and new_graphs == 0
        )
    return ok, report


# --------------------------------------------------------------------------- driver


def run_case(results, name, fn, *args):
    start = time.perf_counter()
    try:
        ok, data = fn(*args)
        record = {"case": name, "status": {True: "ok", False: "FAIL", None: "info"}[ok], **data}
    except Exception as exc:  # one broken case must not hide the others
        record = {"case": name, "status": "ERROR", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=8)}
    record["wall_s"] = round(time.perf_counter() - start, 2)
    results.append(record)
    print(f"  {name:<36} {record['status']:<6} {record['wall_s']:>7.1f}s  {_summary(record)}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _summary(record):
    if record["status"] == "ERROR":
        return record["error"][:160]
    if "fwd_ms" in record:
        return (
            f"mask {record['mask_ms']:.3f} ms  fwd {record['fwd_ms']:.3f} ms  "
            f"fwd+bwd {record['fwd_bwd_ms']:.3f} ms"
        )
    if "mismatching_runs" in record:
        return f"mismatching runs of {record['runs']}: {record['mismatching_runs']}"
    if "rel_err_vs_fp32" in record:
        e = record["rel_err_vs_fp32"]
        paths = [p for p in ("flex", "varlen", "sdpa") if p in e]
        pairs = " ".join(f"{n} " + "/".join(f"{e[p][n]:.1e}" for p in paths) for n in GRAD_NAMES)
        return f"rel err vs fp32 {'/'.join(paths)}: {pairs}"
    return json.dumps({k: v for k, v in record.items() if k not in ("case", "status", "wall_s")}, default=str)[:300]


def environment(args):
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "device": args.device,
        "deterministic_algorithms": not args.no_deterministic,
        "shape": {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
        "mean_doc_len": args.mean_doc_len,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("attention_check: no CUDA device; this check is for GPUs (--device cpu: smoke test)", file=sys.stderr)
        return 2
    if not args.no_deterministic:
        torch.use_deterministic_algorithms(True)
    env = environment(args)
    print(json.dumps(env))
    results: list[dict] = []
    run_case(results, "init/cpu_vs_cuda", case_init_cpu_vs_cuda, args)
    for seq_len in args.seq_lens:
        print(f"seq_len {seq_len}")
        generator = torch.Generator().manual_seed(args.seed)
        doc = packed_document_ids(args.batch, seq_len, args.mean_doc_len, generator).to(args.device)
        run_case(results, f"agreement/T={seq_len}", case_agreement, args, seq_len, doc)
        for path in device_paths(args.device):
            run_case(results, f"speed/{path}/T={seq_len}", case_speed, args, seq_len, doc, path)
        for path in device_paths(args.device):
            run_case(results, f"repeatable/{path}/T={seq_len}", case_repeatability, args, seq_len, doc, path)
        if not args.skip_model:
            run_case(results, f"model/T={seq_len}", case_model, args, seq_len)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"environment": env, "results": results}, indent=2, default=str) + "\n")
    failed = [r["case"] for r in results if r["status"] in ("FAIL", "ERROR")]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
