"""The output head in FP8 (``parallel.float8_head``): what it saves a step, and how it rounds.

    python benchmarks/float8_head.py --out bench_out/float8_head.json       # CUDA, Qwen3-1.7B's head
    python benchmarks/float8_head.py --device cpu --tokens 512 --hidden 64 --vocab 1024 --chunk 256

It times the output head as the training loop runs it, ``linear_cross_entropy``
(training/linear_cross_entropy.py: per chunk of tokens the logits, the loss and its gradient,
folded at once into the gradients of the hidden states and the weight), forward and backward,
in bf16 and with ``float8=True``, the path ``parallel.float8_head`` takes: the three matmuls
in FP8 tensorwise, the casts and the transposed copies they need included in the time.

Numerics, on the same inputs: the loss and both gradients of bf16 and of FP8 against an fp32
run of the same loop. The inputs are random (hidden states of unit scale, a weight of std
0.02, uniform labels), so the errors say how FP8 rounds, not how a trained model's loss moves:
that takes a training run (``benchmarks/optimizers.py --float8 tensorwise+head``).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.linear_cross_entropy import FLOAT8_MULTIPLE, linear_cross_entropy  # noqa: E402


def head(hidden, weight, labels, *, chunk: int, dtype: torch.dtype, compiled: bool, float8: bool = False):
    """The training path: linear_cross_entropy forward and backward (loss, grads)."""
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, chunk_tokens=chunk, compute_dtype=dtype, compiled=compiled,
                                float8=float8)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def timed(fn, *, warmup: int, repeat: int, device: torch.device) -> tuple[list[float], tuple]:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    result = None
    for _ in range(warmup):
        result = fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times, result


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return float((x - ref).norm() / ref.norm().clamp(min=1e-12))  # an all-zero reference stays finite


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=32768, help="tokens a step (Qwen3-1.7B at micro-batch 16, seq 2048)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=8192, help="tokens per chunk, as train.loss_chunk_tokens")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_out/float8_head.json"))
    args = p.parse_args(argv)
    for name in ("tokens", "chunk"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    for name in ("hidden", "vocab"):
        value = getattr(args, name)
        if value <= 0 or value % FLOAT8_MULTIPLE:
            p.error(f"--{name} must be a positive multiple of {FLOAT8_MULTIPLE} (torch._scaled_mm's requirement), got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu with small shapes")
    device = torch.device(args.device)
    compiled = device.type == "cuda"

    gen = torch.Generator(device=device).manual_seed(args.seed)
    dtype = torch.bfloat16
    hidden = torch.randn(args.tokens, args.hidden, generator=gen, device=device).to(dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen, device=device) * 0.02).to(dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen, device=device)

    bf16_ms, (bf16_loss, bf16_gh, bf16_gw) = timed(
        lambda: head(hidden, weight, labels, chunk=args.chunk, dtype=dtype, compiled=compiled),
        warmup=args.warmup, repeat=args.repeat, device=device)
    fp8_ms, (fp8_loss, fp8_gh, fp8_gw) = timed(
        lambda: head(hidden, weight, labels, chunk=args.chunk, dtype=dtype, compiled=compiled, float8=True),
        warmup=args.warmup, repeat=args.repeat, device=device)
    ref_loss, ref_gh, ref_gw = head(hidden.float(), weight.float(), labels, chunk=args.chunk, dtype=torch.float32,
                                    compiled=False)

    def errors(loss, gh, gw) -> dict:
        return {"loss": float(loss), "loss_rel_to_fp32": float((loss - ref_loss).abs() / ref_loss.abs()),
                "grad_hidden_rel_err": rel_err(gh, ref_gh), "grad_weight_rel_err": rel_err(gw, ref_gw)}

    bf16_median, fp8_median = statistics.median(bf16_ms), statistics.median(fp8_ms)
    result = {
        "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "chunk": args.chunk},
        "device": torch.cuda.get_device_name(device) if compiled else "cpu",
        "torch": torch.__version__,
        "warmup": args.warmup, "repeat": args.repeat,
        "bf16": {"ms": bf16_ms, "ms_median": bf16_median, **errors(bf16_loss, bf16_gh, bf16_gw)},
        "float8": {"ms": fp8_ms, "ms_median": fp8_median, **errors(fp8_loss, fp8_gh, fp8_gw)},
        "fp32_loss": float(ref_loss),
        "saved_ms": bf16_median - fp8_median,
        "speedup": bf16_median / fp8_median,
    }
    print(f"output head, {args.tokens} tokens x {args.hidden} -> {args.vocab}, chunks of {args.chunk}, "
          f"{result['device']}, torch {torch.__version__}")
    print("\n| head | ms (median of %d) | loss vs fp32 | grad hidden vs fp32 | grad weight vs fp32 |" % args.repeat)
    print("|---|---|---|---|---|")
    for name in ("bf16", "float8"):
        r = result[name]
        print(f"| {name} | {r['ms_median']:.2f} | {r['loss_rel_to_fp32']:.2e} | {r['grad_hidden_rel_err']:.2e} "
              f"| {r['grad_weight_rel_err']:.2e} |")
    print(f"\nFP8 saves {result['saved_ms']:.2f} ms a step ({result['speedup']:.2f}x the bf16 head)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
