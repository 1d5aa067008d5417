"""The output head in FP8: what it would save a step, and what it does to the loss.

    python benchmarks/float8_head.py --out bench_out/float8_head.json       # CUDA, Qwen3-1.7B's head
    python benchmarks/float8_head.py --device cpu --tokens 512 --hidden 64 --vocab 1024 --chunk 256

``distributed/float8.py`` keeps the output head (``lm_head``) in bf16 under
``parallel.float8``; the 2026-11-27h profile (docs/performance.md) put its matmuls at 44.5 ms
of a 322 ms FP8 step of Qwen3-1.7B. This measures what FP8 would change there, before anyone
builds it. It times the head as the training loop runs it, ``linear_cross_entropy``
(training/linear_cross_entropy.py: per chunk of tokens the logits, the loss and its gradient,
folded at once into the gradients of the hidden states and the weight), forward and backward,
against the same chunk loop with its three matmuls in FP8 as ``parallel.float8=tensorwise``
runs the block linears: one dynamic scale per tensor, hidden states and weight in e4m3, the
logits' gradient in e5m2, ``torch._scaled_mm`` with fast accumulation in the forward
(``--backward-fast-accum`` for the two gradient matmuls too), the casts and the transposed
copies that the matmuls need included in the time. ``--logits-grad-scale static`` drops the
logits gradient's amax pass: the gradient of a cross entropy in its logits is softmax minus
one-hot, within [-1, 1], so a fixed power-of-two scale (2**15) puts it in e5m2's range, and the
compiled loss kernel writes it in FP8 directly, without a bf16 copy.

Numerics, on the same inputs: the loss and both gradients of bf16 and of FP8 against an fp32
run of the same loop. The inputs are random (hidden states of unit scale, a weight of std
0.02, uniform labels), so the errors say how FP8 rounds, not how a trained model's loss moves:
that takes a training run. A prototype, not a training path: train.py does not use it.
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

from training.linear_cross_entropy import _chunk_kernel, _cross_entropy_chunk, linear_cross_entropy  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao's amax floor
# |softmax - one_hot| <= 1, and e5m2 reaches 57,344: 2**15 keeps every value in range, exactly
# scaled (a power of two), and e5m2's relative precision does not depend on the scale.
LOGITS_GRAD_SCALE = 2.0**15


def to_float8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise dynamic scaling as torchao does it: scale = max / amax, saturated cast. Returns
    the FP8 tensor and the inverse scale that ``torch._scaled_mm`` takes."""
    top = torch.finfo(dtype).max
    scale = top / x.abs().amax().float().clamp(min=EPS)
    return (x.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


def cross_entropy_float8_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The training path's chunk loss, its logits gradient written in e5m2 at LOGITS_GRAD_SCALE."""
    loss, grad = _cross_entropy_chunk(logits.float(), labels)
    return loss, (grad * LOGITS_GRAD_SCALE).to(E5M2)


def float8_head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int,
                backward_fast_accum: bool, cast, ce, static_ce=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear_cross_entropy's forward with its three matmuls in FP8: (loss, d loss/d hidden,
    d loss/d weight). ``torch._scaled_mm`` takes its first operand row-major and its second
    column-major, so the backward's operands are transposed FP8 copies. With ``static_ce``
    (a chunk loss returning its gradient in e5m2 at LOGITS_GRAD_SCALE) ``ce`` is not used."""
    w8, w_inv = cast(weight, E4M3)  # (V, d): the forward's second operand as w8.t()
    w8_t = w8.t().contiguous()  # (d, V): grad_h's second operand as w8_t.t()
    grad_h = torch.empty_like(hidden)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    static_inv = torch.full((), 1.0 / LOGITS_GRAD_SCALE, device=hidden.device)  # once: a copy per chunk would sync
    for start in range(0, hidden.shape[0], chunk):
        h8, h_inv = cast(hidden[start : start + chunk], E4M3)
        logits = torch._scaled_mm(h8, w8.t(), scale_a=h_inv, scale_b=w_inv, out_dtype=hidden.dtype, use_fast_accum=True)
        if static_ce is None:
            loss, grad_logits = ce(logits, labels[start : start + chunk])
            g8, g_inv = cast(grad_logits, E5M2)
        else:
            loss, g8 = static_ce(logits, labels[start : start + chunk])
            g_inv = static_inv
        total += loss
        grad_h[start : start + chunk] = torch._scaled_mm(
            g8, w8_t.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=hidden.dtype, use_fast_accum=backward_fast_accum)
        grad_w += torch._scaled_mm(g8.t().contiguous(), h8.t().contiguous().t(), scale_a=g_inv, scale_b=h_inv,
                                   out_dtype=torch.float32, use_fast_accum=backward_fast_accum)
    return total, grad_h, grad_w.to(weight.dtype)


def bf16_head(hidden, weight, labels, *, chunk: int, dtype: torch.dtype, compiled: bool):
    """The training path: linear_cross_entropy forward and backward (loss, grads)."""
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, chunk_tokens=chunk, compute_dtype=dtype, compiled=compiled)
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
    return float((x - ref).norm() / ref.norm().clamp(min=EPS))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=32768, help="tokens a step (Qwen3-1.7B at micro-batch 16, seq 2048)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=8192, help="tokens per chunk, as train.loss_chunk_tokens")
    p.add_argument("--backward-fast-accum", action="store_true", help="as parallel.float8_backward_fast_accum")
    p.add_argument("--logits-grad-scale", default="dynamic", choices=("dynamic", "static"),
                   help="the e5m2 logits gradient's scale: from its amax, or the fixed bound of a softmax gradient")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_out/float8_head.json"))
    args = p.parse_args(argv)
    for name in ("tokens", "hidden", "vocab", "chunk"):
        value = getattr(args, name)
        if value <= 0 or value % 16:
            p.error(f"--{name} must be a positive multiple of 16 (torch._scaled_mm's requirement), got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu with small shapes")
    device = torch.device(args.device)
    compiled = device.type == "cuda"
    cast = torch.compile(to_float8, dynamic=False) if compiled else to_float8
    ce = _chunk_kernel(compiled)
    static_ce = None
    if args.logits_grad_scale == "static":
        static_ce = torch.compile(cross_entropy_float8_grad, dynamic=False) if compiled else cross_entropy_float8_grad

    gen = torch.Generator(device=device).manual_seed(args.seed)
    dtype = torch.bfloat16
    hidden = torch.randn(args.tokens, args.hidden, generator=gen, device=device).to(dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen, device=device) * 0.02).to(dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen, device=device)

    bf16_ms, (bf16_loss, bf16_gh, bf16_gw) = timed(
        lambda: bf16_head(hidden, weight, labels, chunk=args.chunk, dtype=dtype, compiled=compiled),
        warmup=args.warmup, repeat=args.repeat, device=device)
    fp8_ms, (fp8_loss, fp8_gh, fp8_gw) = timed(
        lambda: float8_head(hidden, weight, labels, chunk=args.chunk, backward_fast_accum=args.backward_fast_accum,
                            cast=cast, ce=ce, static_ce=static_ce),
        warmup=args.warmup, repeat=args.repeat, device=device)
    ref_loss, ref_gh, ref_gw = bf16_head(hidden.float(), weight.float(), labels, chunk=args.chunk, dtype=torch.float32,
                                         compiled=False)

    def errors(loss, gh, gw) -> dict:
        return {"loss": float(loss), "loss_rel_to_fp32": float((loss - ref_loss).abs() / ref_loss.abs()),
                "grad_hidden_rel_err": rel_err(gh, ref_gh), "grad_weight_rel_err": rel_err(gw, ref_gw)}

    bf16_median, fp8_median = statistics.median(bf16_ms), statistics.median(fp8_ms)
    result = {
        "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "chunk": args.chunk},
        "device": torch.cuda.get_device_name(device) if compiled else "cpu",
        "torch": torch.__version__,
        "backward_fast_accum": args.backward_fast_accum,
        "logits_grad_scale": args.logits_grad_scale,
        "warmup": args.warmup, "repeat": args.repeat,
        "bf16": {"ms": bf16_ms, "ms_median": bf16_median, **errors(bf16_loss, bf16_gh, bf16_gw)},
        "float8": {"ms": fp8_ms, "ms_median": fp8_median, **errors(fp8_loss, fp8_gh, fp8_gw)},
        "fp32_loss": float(ref_loss),
        "saved_ms": bf16_median - fp8_median,
        "speedup": bf16_median / fp8_median,
    }
    print(f"output head, {args.tokens} tokens x {args.hidden} -> {args.vocab}, chunks of {args.chunk}, "
          f"{result['device']}, torch {torch.__version__}, logits gradient scale {args.logits_grad_scale}")
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
