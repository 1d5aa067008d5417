"""One mixture-of-experts training step on one GPU: Lockstep against transformers' Qwen3MoeForCausalLM.

    python benchmarks/moe_step.py --out bench_out/moe_step.json        # Qwen3-30B-A3B cut to 4 layers, seq 4096
    python benchmarks/moe_step.py --smoke --out /tmp/moe_step.json     # the same code on CPU, a tiny shape, seconds

The shape is configs/qwen3-30b-a3b.yaml with ``model.num_layers`` cut (``--layers``, default 4: 3.1B
parameters, 0.85B of them active per token, 0.62B of which the embedding and the output head),
random init, ``--micro-batch`` x ``--seq`` tokens a step (default 1 x 4096), bf16.

- **Lockstep** trains through train.py, as a user runs it (benchmarks/train_throughput.py's overrides):
  ``parallel.strategy=none`` (bf16 autocast over fp32 master weights, fused AdamW on CUDA), the
  default ``determinism.mode=bitwise`` (``--mode fast`` changes it), ``parallel.compile=false``
  (``--compile`` turns it on), no accumulation, no checkpoint, no evaluation, metrics every step,
  ``runtime.on_nonfinite=skip``. Its data is a synthetic text corpus written under the run root (the
  byte tokenizer; the model's vocabulary stays 151,936), so nothing needs ``python -m data prepare``;
  transformers trains on random ids, so the experts' loads differ between the two sides. It runs twice with the same
  settings and seed: the first run is the measurement, and the two ledgers must be equal line for
  line (losses, gradient norms, batch hashes, the last step's parameter hash): the bitwise repeat.
  Steady state is as in train_throughput.py: the steps after ``--warmup`` but the last (which hashes
  every parameter). On CUDA each run is a child process ``python train.py ...`` (so one run's CUDA
  state and process-wide switches reach neither the other nor transformers); ``--in-process`` (the
  default on CPU) calls ``train.main`` with the same arguments here.
- **transformers** (``Qwen3MoeForCausalLM`` from the same shape's config.json, benchmarks/hf_baseline.py's
  recipe: bf16 weights and AdamW state, ``torch.optim.AdamW(fused=True)``, clipping at 1.0, sdpa
  attention, random token ids) runs in this process first, with its default experts implementation,
  and the router's load-balancing loss on (``output_router_logits``) as Lockstep's preset has it. The
  implementation that took effect (``config._experts_implementation``: grouped_mm where torch has
  ``_grouped_mm``, else eager) is recorded and checked to be the one the experts modules dispatch to.

Reported for each: s/step, tokens/s, MFU over the active parameters (models/qwen3_moe/flops.py: router
plus top-k experts per layer; "all matmuls" with the output head, "torchtitan" without) against the
card's dense bf16 peak, peak GiB allocated; Lockstep's experts kernel (``torch._grouped_mm`` or the
per-expert loop: models/qwen3_moe/moe.py decides by ``grouped_mm_supported`` on the run's device and
compute dtype, asked here the same way). Prints a table, writes JSON (``--out``); exits 1 when a part
fails or the repeat differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import hf_baseline as hfb  # noqa: E402  (the benchmarks folder is not a package)
import train_throughput as tt  # noqa: E402

PRESET = "configs/qwen3-30b-a3b.yaml"
GIB = hfb.GIB

# --smoke: the preset's code path at a shape that trains on CPU in seconds.
SMOKE_MODEL = (
    "model.vocab_size=512", "model.hidden_size=64", "model.intermediate_size=128", "model.num_heads=4",
    "model.num_kv_heads=2", "model.head_dim=16", "model.qwen3_moe.num_experts=8",
    "model.qwen3_moe.num_experts_per_tok=2", "model.qwen3_moe.moe_intermediate_size=32",
)
SMOKE_SETTINGS = dict(layers=2, seq=64, micro_batch=1, warmup=1, steps=1, device="cpu", precision="fp32")


# --------------------------------------------------------------------------- settings


def load_config(args: argparse.Namespace):
    """The preset with the model overrides of this call (layers, --smoke's shape), the shape both sides
    train, and Lockstep's precision and determinism mode (what its experts kernel depends on)."""
    from core.config import load

    return load(ROOT / PRESET, [*model_overrides(args), "parallel.strategy=none", f"parallel.precision={args.precision}",
                                f"parallel.device={args.device}", f"determinism.mode={args.mode}"])


def model_overrides(args: argparse.Namespace) -> list[str]:
    return [f"model.num_layers={args.layers}", *(SMOKE_MODEL if args.smoke else ())]


def train_overrides(args: argparse.Namespace, name: str, run_root: Path, corpus: Path) -> list[str]:
    """train.py's overrides for one Lockstep run (module docstring)."""
    source = f'[{{path: "{corpus}/*.jsonl", format: jsonl, name: synthetic}}]'
    return [
        *model_overrides(args),
        f"run.name={name}",
        f"run.root={run_root}",
        "parallel.strategy=none",
        f"parallel.precision={args.precision}",
        f"parallel.device={args.device}",
        f"parallel.compile={'true' if args.compile else 'false'}",
        f"data.sources={source}",
        "data.eval_source=null",
        "data.tokenizer=byte",
        f"data.seq_len={args.seq}",
        "data.num_streams=1",
        "data.workers=1",
        "data.process_pool=false",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch}",
        f"train.max_steps={args.warmup + args.steps + 1}",
        "train.eval_interval=0",
        "checkpoint.interval=0",
        "checkpoint.at_end=false",
        "metrics.tensorboard=false",
        "metrics.log_interval=1",
        f"determinism.mode={args.mode}",
        f"runtime.watchdog_timeout_s={max(600, int(args.timeout))}",
        "runtime.on_nonfinite=skip",
        *args.override,
    ]


def write_corpus(directory: Path, tokens: int, *, seed: int = 0) -> Path:
    """At least ``tokens`` bytes of text (the byte tokenizer's tokens) as JSONL shards of documents made
    of words drawn from a fixed list: the same files for the same arguments."""
    words = ("expert", "router", "token", "layer", "gate", "weight", "sum", "step", "loss", "batch",
             "mixture", "matrix", "shard", "norm", "head", "rank", "seed", "ledger", "block", "value")
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    shards, written, index = 4, 0, 0
    files = [(directory / f"shard-{i:05d}.jsonl").open("w") for i in range(shards)]
    try:
        while written < tokens:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(50, 400))) + "."
            files[index % shards].write(json.dumps({"text": text}) + "\n")
            written += len(text.encode())
            index += 1
    finally:
        for handle in files:
            handle.close()
    return directory


def active_params(model_config) -> int:
    """Parameters a token uses: the active matmul weights of models/flops.py (its FLOPs at seq 0 over 6,
    the output head included) plus the embedding row it looks up (the model card's "activated")."""
    from models.flops import flops_per_token

    head = 0 if model_config.tie_embeddings else model_config.vocab_size * model_config.hidden_size
    return flops_per_token(model_config, 0, include_embedding_head=True) // 6 + head


# --------------------------------------------------------------------------- Lockstep


def run_lockstep(args: argparse.Namespace, name: str, run_root: Path, corpus: Path, peak: float | None,
                 budget: tt.Budget) -> dict[str, Any]:
    """One train.py run (a child process, or ``train.main`` here with ``--in-process``) and its summary."""
    argv = ["--config", PRESET, *train_overrides(args, name, run_root, corpus)]
    command = [tt.PYTHON, "train.py", *argv]
    result: dict[str, Any] = {"name": name, "command": shlex.join(command), "in_process": args.in_process}
    timeout = budget.timeout(args.timeout)
    if timeout is None:
        return {**result, "status": "skipped", "error": "not started: --budget exhausted"}
    started_at = time.time()
    if args.in_process:
        import train

        started = time.monotonic()
        code, timed_out, output = train.main(argv), False, None
        result["seconds"] = time.monotonic() - started
    else:
        done = tt.launch(command, timeout=timeout, log_path=args.log_dir / f"{name}.log")
        code, timed_out, output = done.returncode, done.timed_out, done
        result["seconds"] = done.seconds
    run_dir = next(iter(sorted(run_root.glob(f"{name}-*"))), None)
    if run_dir is not None:
        result.update(tt.summarize_run(run_dir, warmup=args.warmup, gpus=1, peak=peak, started_at=started_at))
        result["ledger"] = tt.read_jsonl(run_dir / "ledger.jsonl")
    ok = code == 0 and not timed_out and result.get("tokens_per_s")
    result["returncode"] = code
    result["status"] = "ok" if ok else ("timeout" if timed_out else "failed")
    if not ok:
        result["error"] = tt.failure_text(output, run_dir)["error"] if output is not None else (
            result.get("error") or f"train.main returned {code}")
    return result


def repeat_check(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Whether two runs of the same settings wrote the same ledger, line for line."""
    a, b = first.get("ledger") or [], second.get("ledger") or []
    differing = [line_a.get("step") for line_a, line_b in zip(a, b) if line_a != line_b]
    equal = bool(a) and len(a) == len(b) and not differing
    return {"equal": equal, "lines": [len(a), len(b)], "first_differing_step": differing[0] if differing else None,
            "losses": [[line.get("loss") for line in a], [line.get("loss") for line in b]],
            "last_param_hash": [(a[-1] if a else {}).get("param_hash"), (b[-1] if b else {}).get("param_hash")]}


def lockstep_expert_kernel(config, device) -> dict[str, Any]:
    """Which kernel Lockstep's experts run here: models/qwen3_moe/moe.py's own test, asked for the run's
    device and compute dtype (the run's Precision's autocast) and the experts' widths."""
    import torch

    from models.qwen3_moe.moe import grouped_mm_supported
    from training.determinism import numerics
    from training.precision import Precision

    settings = config.model.qwen3_moe
    widths = (config.model.hidden_size, settings.moe_intermediate_size)
    probe = torch.zeros(1, config.model.hidden_size, device=device)
    with Precision(numerics(config), device=device, wrapper_casts=False).autocast():
        grouped = grouped_mm_supported(probe, widths)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return {"kernel": "grouped" if grouped else "loop", "torch_grouped_mm": grouped,
            "has_torch_grouped_mm": hasattr(torch, "_grouped_mm"), "compute_capability": capability,
            "decided_by": "models.qwen3_moe.moe.grouped_mm_supported (CUDA, capability >= 9.0, bf16, widths % 8)"}


# --------------------------------------------------------------------------- transformers


def run_transformers(args: argparse.Namespace, config, device, peak: float | None) -> dict[str, Any]:
    """hf_baseline.py's recipe on Qwen3MoeForCausalLM of the same shape, with its default experts
    implementation and the load-balancing loss on; timed as hf_baseline.py times."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    hf_model, class_name = hfb.build_hf_model(config.model, device)
    result: dict[str, Any] = {"hf_class": class_name, "build_s": time.perf_counter() - started,
                              "hf_params": sum(p.numel() for p in hf_model.parameters()),
                              "attn_implementation": hf_model.config._attn_implementation,
                              "output_router_logits": True, "compile": False}
    implementation = experts_implementation(hf_model)
    result["experts_implementation"] = implementation
    optimizer = torch.optim.AdamW(hf_model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  **({"fused": True} if cuda else {"foreach": True}))
    generator = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, config.model.vocab_size, (args.micro_batch, args.seq), device=device,
                             generator=generator) for _ in range(min(4, args.warmup + args.steps))]

    def step(i: int) -> torch.Tensor:
        ids = batches[i % len(batches)]
        loss = hf_model(input_ids=ids, labels=ids, output_router_logits=True).loss  # (B, T) -> scalar
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    losses = [step(i) for i in range(args.warmup)]
    sync()
    started = time.perf_counter()
    losses += [step(args.warmup + i) for i in range(args.steps)]
    sync()
    window = time.perf_counter() - started
    losses = [float(x) for x in losses]
    tokens_per_s = args.micro_batch * args.seq * args.steps / window
    flops = hfb.flop_counts(config.model, args.seq)
    result.update(
        status="ok", step_time_s=window / args.steps, tokens_per_s=tokens_per_s, flops_per_token=flops,
        mfu_all_matmuls=hfb.mfu(flops["all_matmuls"], tokens_per_s, peak, 1),
        mfu_torchtitan=hfb.mfu(flops["torchtitan"], tokens_per_s, peak, 1),
        loss_first=losses[0], loss_last=losses[-1], loss_finite=all(math.isfinite(x) for x in losses),
        peak_mem_allocated_gib=torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
    )
    return result  # the model, its optimizer state and the batches go with this frame


def experts_implementation(model) -> str:
    """The experts implementation transformers chose for ``model`` (``config._experts_implementation``;
    eager where the installed transformers has no choice of one), checked against what every experts
    module dispatches to. Raises RuntimeError where they differ or the name is not a registered one."""
    chosen = getattr(model.config, "_experts_implementation", None) or "eager"
    modules = [m for m in model.modules() if hasattr(m, "config") and type(m).__name__.endswith("Experts")]
    dispatched = {getattr(m.config, "_experts_implementation", None) or "eager" for m in modules}
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        known = {"eager", *ALL_EXPERTS_FUNCTIONS.keys()}
    except ImportError:  # a transformers without experts implementations: a loop over the experts
        known = {"eager"}
    if chosen not in known or (modules and dispatched != {chosen}):
        raise RuntimeError(f"transformers' experts implementation {chosen!r} (its experts modules: "
                           f"{sorted(dispatched)}) is not one of {sorted(known)} on every experts module")
    return chosen


# --------------------------------------------------------------------------- report


def table(report: dict[str, Any]) -> str:
    shape = report["shape"]
    lines = [f"Qwen3-30B-A3B shape, {shape['num_layers']} layers ({shape['params_total'] / 1e9:.2f}B parameters, "
             f"{shape['params_active'] / 1e9:.2f}B active), seq {report['settings']['seq']} x micro-batch "
             f"{report['settings']['micro_batch']}, {report['device_name']}; peak: {report['peak_source']}", "",
             "| run | status | s/step | tokens/s | MFU active, all matmuls | MFU active, torchtitan | peak GiB | experts |",
             "|---|---|---|---|---|---|---|---|"]
    for label, part, kernel in ((f"lockstep ({report['settings']['mode']})", report["lockstep"], report["lockstep_experts"]["kernel"]),
                                ("transformers", report["transformers"],
                                 report["transformers"].get("experts_implementation"))):
        lines.append("| " + " | ".join([
            label, part.get("status", "?"), tt.fmt(part.get("step_time_s"), ".3f"),
            tt.fmt(part.get("tokens_per_s"), ",.0f"), tt.fmt(part.get("mfu_all_matmuls"), ".1%"),
            tt.fmt(part.get("mfu_torchtitan"), ".1%"), tt.fmt(part.get("peak_mem_allocated_gib"), ".1f"),
            str(kernel)]) + " |")
    repeat = report["bitwise_repeat"]
    lines.append("")
    lines.append(f"bitwise repeat ({repeat['lines'][0]} steps, same seed): "
                 + ("equal ledgers" if repeat["equal"] else f"DIFFERENT (first at step {repeat['first_differing_step']})"))
    if report.get("speedup") is not None:
        lines.append(f"Lockstep / transformers tokens/s: {report['speedup']:.2f}x")
    for label in ("lockstep", "lockstep_repeat", "transformers"):
        if report[label].get("status") not in ("ok", None):
            lines.append(f"- {label}: {report[label].get('status')}: {str(report[label].get('error', ''))[:300]}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="model.num_layers of the preset")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3, help="steps not measured")
    p.add_argument("--steps", type=int, default=10, help="measured steps (Lockstep runs one more: the last hashes)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="Lockstep's parallel.precision")
    p.add_argument("--mode", choices=("bitwise", "fast"), default="bitwise", help="Lockstep's determinism.mode")
    p.add_argument("--compile", action="store_true", help="Lockstep with parallel.compile=true")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="one more train.py override for Lockstep's runs (repeatable)")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run train.main in this process (default: on CPU only)")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the card's dense bf16 peak")
    p.add_argument("--timeout", type=float, default=540, help="seconds per Lockstep run (child processes)")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for the whole call: a Lockstep run is given what is left, not started under 45 s")
    p.add_argument("--run-root", help="where the runs go (default: a temporary directory, deleted)")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, 1 + 1 steps: seconds")
    p.add_argument("--out", default="bench_out/moe_step.json")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE_SETTINGS.items():
            setattr(args, key, value)
    if min(args.layers, args.seq, args.micro_batch, args.warmup, args.steps) < 1:
        p.error("--layers, --seq, --micro-batch, --warmup and --steps must be >= 1")
    if args.in_process is None:
        args.in_process = args.device == "cpu"
    args.log_dir = Path(args.out).resolve().parent / "logs"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    import models

    if args.device == "cuda" and not torch.cuda.is_available():
        print("moe_step: no CUDA device; --smoke runs on CPU", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak, peak_source = hfb.peak_flops_for(device_name if device.type == "cuda" else None, args.peak_tflops)
    config = load_config(args)
    flops = hfb.flop_counts(config.model, args.seq)
    report: dict[str, Any] = {
        "tool": "moe_step", "device_name": device_name, "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "peak_flops": peak, "peak_source": peak_source,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "shape": {"preset": PRESET, "num_layers": config.model.num_layers,
                  "params_total": models.num_params(config.model),
                  "params_active": active_params(config.model),
                  "flops_per_token": flops},
    }
    budget = tt.Budget(args.budget)
    run_root = Path(args.run_root or tempfile.mkdtemp(prefix="lockstep-moe-step-")).resolve()
    try:
        try:
            report["transformers"] = run_transformers(args, config, device, peak)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the parent keeps its context only while Lockstep's runs train
        except Exception as error:  # an OOM or a failed build is recorded; Lockstep still runs
            report["transformers"] = {"status": "oom" if "out of memory" in str(error).lower() else "failed",
                                      "error": f"{type(error).__name__}: {error}"[:2000],
                                      "traceback_tail": traceback.format_exc()[-4000:]}
        report["lockstep_experts"] = lockstep_expert_kernel(config, device)
        tokens = 2 * (args.warmup + args.steps + 1) * args.micro_batch * args.seq
        corpus = write_corpus(run_root / "corpus", tokens)
        report["lockstep"] = run_lockstep(args, "moe-step-a", run_root, corpus, peak, budget)
        report["lockstep_repeat"] = run_lockstep(args, "moe-step-b", run_root, corpus, peak, budget)
        report["bitwise_repeat"] = repeat_check(report["lockstep"], report["lockstep_repeat"])
        ours, theirs = report["lockstep"].get("tokens_per_s"), report["transformers"].get("tokens_per_s")
        report["speedup"] = ours / theirs if ours and theirs else None
    finally:
        hfb.write_json(args.out, report)
        if not args.run_root:
            shutil.rmtree(run_root, ignore_errors=True)
    print(table(report), flush=True)
    print(f"moe_step: results: {args.out}", flush=True)
    parts_ok = all(report[k].get("status") == "ok" for k in ("lockstep", "lockstep_repeat", "transformers"))
    return 0 if parts_ok and report["bitwise_repeat"]["equal"] else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
