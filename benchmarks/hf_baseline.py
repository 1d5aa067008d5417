"""The `transformers` baseline: how fast a plain Hugging Face Qwen model trains on this card.

    python benchmarks/hf_baseline.py --shape qwen2.5-0.5b --seq 2048 --micro-batch 4 \
        --steps 20 --warmup 5 --compile --out hf.json

What runs: ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` built from a config with the same
shape as our preset (``configs/<shape>.yaml``, translated by ``models.hf_config``), random
init, ``attn_implementation="sdpa"``, eager or ``torch.compile(model)`` (whole model, loss
included). The recipe is the common "bf16 AdamW" one, NOT mixed precision: the model is cast
with ``model.to(torch.bfloat16)``, so parameters, gradients and the AdamW moments are all
bf16 (no fp32 master weights), with ``torch.optim.AdamW(fused=True)`` on CUDA (foreach on
CPU), gradients clipped to ``--clip`` (1.0, as our trainer does; 0 disables) and TF32 on.
The loss is transformers' own (logits upcast to fp32). Our trainer keeps fp32 master
weights and fp32 optimizer state, so it does strictly more optimizer work and holds more
memory per parameter; the comparison is of the two *recipes* as people run them.

Input: ``--micro-batch`` x ``--seq`` random token ids, a few batches pre-generated on the
device and cycled (no data loading, no document masking: plain causal attention).
Measurement: ``--warmup`` steps (the first includes compilation), then ``--steps`` steps
timed as one window between two ``cuda.synchronize()`` calls; tokens/s = B*T*steps/window.
Peak memory is ``torch.cuda.max_memory_allocated`` over the whole run.

MFU, in the two conventions of ``models/flops.py`` (see benchmarks/README.md):
``mfu_torchtitan`` (6 x non-embedding params + 12 x layers x heads x head_dim x seq per
token) and ``mfu_all_matmuls`` (every matmul weight incl. lm_head), both over the card's
dense bf16 peak (``peak_flops``; by GPU name, printed; ``--peak-tflops`` overrides).

The other benchmarks import the shape presets, default micro-batches and peak-FLOP table
from here, so this file has no dependency on them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = float(1 << 30)

# Shape name -> preset file. When a preset file is missing (it is being written), the
# config is tiny.yaml with the shape's model fields overridden (FALLBACK_MODEL_OVERRIDES),
# taken from the published Hugging Face config.json of each model.
PRESETS = {
    "tiny": "configs/tiny.yaml",
    "qwen2.5-0.5b": "configs/qwen2.5-0.5b.yaml",
    "qwen3-1.7b": "configs/qwen3-1.7b.yaml",
}
FALLBACK_MODEL_OVERRIDES = {
    "qwen2.5-0.5b": [
        "model.arch=qwen2", "model.vocab_size=151936", "model.hidden_size=896",
        "model.intermediate_size=4864", "model.num_layers=24", "model.num_heads=14",
        "model.num_kv_heads=2", "model.head_dim=64", "model.rope_theta=1000000.0",
        "model.rms_norm_eps=1e-6", "model.tie_embeddings=true",
        "model.max_position_embeddings=32768", "train.lr=3e-4",
    ],
    "qwen3-1.7b": [
        "model.arch=qwen3", "model.vocab_size=151936", "model.hidden_size=2048",
        "model.intermediate_size=6144", "model.num_layers=28", "model.num_heads=16",
        "model.num_kv_heads=8", "model.head_dim=128", "model.rope_theta=1000000.0",
        "model.rms_norm_eps=1e-6", "model.tie_embeddings=true",
        "model.max_position_embeddings=40960", "train.lr=3e-4",
    ],
}

# Default micro-batch: tokens per micro-batch per GPU, chosen so that the fp32 logits of a
# 151,936-token vocabulary (B*T*V*4 bytes, several copies live around the loss) plus
# activations without activation checkpointing fit an 80 GB H100 in both our stack (fp32
# master weights + AdamW state) and the baseline.
DEFAULT_TOKENS_PER_MICRO_BATCH = {"tiny": 512, "qwen2.5-0.5b": 8192, "qwen3-1.7b": 4096}

# Dense (no sparsity) bf16 peak FLOP/s by GPU name; the first key contained in the name wins.
PEAK_BF16_FLOPS = (
    ("H200", 989e12, "H200 SXM dense bf16 (989 TFLOP/s)"),
    ("H100 PCIe", 756e12, "H100 PCIe dense bf16 (756 TFLOP/s)"),
    ("H100 NVL", 835e12, "H100 NVL dense bf16 (835 TFLOP/s)"),
    ("H100", 989e12, "H100 SXM dense bf16 (989 TFLOP/s)"),
    ("A100", 312e12, "A100 dense bf16 (312 TFLOP/s)"),
)


# --------------------------------------------------------------------------- shared helpers


def preset_args(shape: str) -> tuple[str, list[str]]:
    """(config path relative to the repo root, extra overrides) for a shape name."""
    if shape not in PRESETS:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(PRESETS)}")
    path = PRESETS[shape]
    if (ROOT / path).is_file() or shape not in FALLBACK_MODEL_OVERRIDES:
        return path, []
    return PRESETS["tiny"], list(FALLBACK_MODEL_OVERRIDES[shape])


def default_micro_batch(shape: str, seq: int) -> int:
    return max(1, DEFAULT_TOKENS_PER_MICRO_BATCH.get(shape, 8192) // seq)


def peak_flops_for(gpu_name: str | None, override_tflops: float | None = None) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s of ONE device, where the number came from)."""
    if override_tflops:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops:g}"
    if not gpu_name:
        return None, "no GPU: MFU not computed"
    for key, peak, label in PEAK_BF16_FLOPS:
        if key in gpu_name:
            return peak, f"{label}, matched in {gpu_name!r}"
    return None, f"unknown GPU {gpu_name!r}: MFU not computed (pass --peak-tflops)"


def flop_counts(model_config, seq: int) -> dict[str, int]:
    """Training FLOPs per token in both conventions (models/flops.py)."""
    from models.flops import flops_per_token

    return {
        "torchtitan": flops_per_token(model_config, seq, include_embedding_head=False),
        "all_matmuls": flops_per_token(model_config, seq, include_embedding_head=True),
    }


def mfu(flops_per_token: float, tokens_per_s: float | None, peak: float | None, devices: int) -> float | None:
    if not tokens_per_s or not peak:
        return None
    return flops_per_token * tokens_per_s / (peak * devices)


def write_json(path: str | Path, payload: Any) -> None:
    """Write atomically, so a killed run leaves the previous complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=repr) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the model


def load_model_config(shape: str, config_path: str | None):
    from core.config import load

    path, extra = (config_path, []) if config_path else preset_args(shape)
    return load(ROOT / path, extra).model


def build_hf_model(model_config, device, *, attn_implementation: str = "sdpa"):
    """A transformers Qwen2/Qwen3 model with our preset's shape, bf16, on ``device``."""
    import torch
    import transformers

    from models.hf_config import hf_config_dict
    from models.hf_weights import empty_model

    dims = empty_model(model_config, device="meta").dims  # the family's resolved shape (ModelFamily.build), no storage
    raw = hf_config_dict(model_config, dims, "bfloat16")
    class_name = raw["architectures"][0]
    config_class = getattr(transformers, class_name.replace("ForCausalLM", "Config"))
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "dtype")}
    hf_config = config_class(**fields)
    hf_config.use_cache = False
    model_class = getattr(transformers, class_name)
    # Build in bf16 directly on the device: a 1.7B fp32 init on the host takes a minute.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = model_class._from_config(hf_config, attn_implementation=attn_implementation)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(device=device, dtype=torch.bfloat16)
    model.train()
    return model, class_name


# --------------------------------------------------------------------------- measurement


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    from models.flops import num_params

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    gpu_name = torch.cuda.get_device_name(device) if cuda else None
    peak, peak_source = peak_flops_for(gpu_name, args.peak_tflops)
    card = gpu_name or platform.processor() or "cpu"
    print(f"hf_baseline: device {device} ({card}); peak: {peak_source}", flush=True)

    model_config = load_model_config(args.shape, args.config)
    micro = args.micro_batch or default_micro_batch(args.shape, args.seq)
    result: dict[str, Any] = {
        "tool": "hf_baseline",
        "status": "running",
        "shape": args.shape,
        "seq_len": args.seq,
        "micro_batch_size": micro,
        "tokens_per_step": micro * args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "compile": args.compile,
        "attn_implementation": "sdpa",
        "recipe": (
            "bf16 weights, grads and AdamW state via model.to(torch.bfloat16); "
            f"torch.optim.AdamW({'fused=True' if cuda else 'foreach=True'}); "
            f"clip_grad_norm {args.clip:g}; TF32 on; no fp32 master weights, no autocast"
        ),
        "device": str(device),
        "gpu_name": gpu_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "peak_flops": peak,
        "peak_source": peak_source,
        "params_total": num_params(model_config),
        "params_non_embedding": num_params(model_config, non_embedding=True),
        "flops_per_token": flop_counts(model_config, args.seq),
    }

    started = time.perf_counter()
    model, class_name = build_hf_model(model_config, device)
    result["hf_class"] = class_name
    result["hf_params"] = sum(p.numel() for p in model.parameters())
    result["build_s"] = time.perf_counter() - started
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
        **({"fused": True} if cuda else {"foreach": True}),
    )
    forward = torch.compile(model) if args.compile else model

    generator = torch.Generator(device=device).manual_seed(0)
    batches = [
        torch.randint(0, model_config.vocab_size, (micro, args.seq), device=device, generator=generator)
        for _ in range(min(4, args.steps + args.warmup))
    ]

    def step(i: int) -> torch.Tensor:
        ids = batches[i % len(batches)]
        loss = forward(input_ids=ids, labels=ids).loss  # (B, T) -> scalar, shifted inside
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warmup_times, losses = [], []
    for i in range(args.warmup):
        t0 = time.perf_counter()
        losses.append(step(i))
        sync()
        warmup_times.append(time.perf_counter() - t0)
    result["warmup_step_s"] = warmup_times

    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)] if cuda else []
    sync()
    t0 = time.perf_counter()
    if events:
        events[0].record()
    for i in range(args.steps):
        losses.append(step(args.warmup + i))
        if events:
            events[i + 1].record()
    sync()
    window = time.perf_counter() - t0
    step_times = (
        [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(args.steps)] if events else []
    )

    tokens_per_s = micro * args.seq * args.steps / window
    losses = [float(x) for x in losses]
    result.update(
        status="ok",
        window_s=window,
        step_time_s=window / args.steps,
        step_time_median_s=sorted(step_times)[len(step_times) // 2] if step_times else None,
        tokens_per_s=tokens_per_s,
        mfu_torchtitan=mfu(result["flops_per_token"]["torchtitan"], tokens_per_s, peak, 1),
        mfu_all_matmuls=mfu(result["flops_per_token"]["all_matmuls"], tokens_per_s, peak, 1),
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        loss_finite=all(math.isfinite(x) for x in losses),
    )
    if cuda:
        result["peak_mem_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        result["peak_mem_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    parser.add_argument("--config", help="use this YAML's model section instead of the shape's preset")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--micro-batch", type=int, default=None,
        help="sequences per step (default: per shape, see DEFAULT_TOKENS_PER_MICRO_BATCH)",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm; 0 disables")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the per-GPU dense bf16 peak")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the first warmup step compiles)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = measure(args)
        code = 0
    except BaseException as error:  # record the failure (OOM included) and exit non-zero
        if isinstance(error, KeyboardInterrupt):
            raise
        result = {
            "tool": "hf_baseline",
            "status": "oom" if "out of memory" in str(error).lower() else "failed",
            "shape": args.shape,
            "seq_len": args.seq,
            "micro_batch_size": args.micro_batch or default_micro_batch(args.shape, args.seq),
            "compile": args.compile,
            "error": f"{type(error).__name__}: {error}"[:2000],
            "traceback_tail": traceback.format_exc()[-4000:],
        }
        code = 1
    if args.out:
        write_json(args.out, result)
    summary = {k: result.get(k) for k in (
        "status", "shape", "seq_len", "micro_batch_size", "compile", "tokens_per_s",
        "mfu_torchtitan", "mfu_all_matmuls", "peak_mem_allocated_gib", "error")}
    print("hf_baseline: " + json.dumps(summary, default=repr), flush=True)
    return code


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
