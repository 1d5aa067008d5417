"""One mixture-of-experts training step on one GPU: Lockstep against transformers' Qwen3MoeForCausalLM.

    python benchmarks/moe_step.py --out bench_out/moe_step.json        # Qwen3-30B-A3B cut to 4 layers, seq 4096
    python benchmarks/moe_step.py --smoke --out /tmp/moe_step.json     # the same code on CPU, a tiny shape, seconds

The shape is configs/qwen3-30b-a3b.yaml with ``model.num_layers`` cut (``--layers``, default 4: 3.1B
parameters, 0.85B of them active per token, 0.62B of which the embedding and the output head),
random init, ``--micro-batch`` x ``--seq`` tokens a step (default 1 x 4096), bf16.

- **Lockstep** trains through train.py, as a user runs it (benchmarks/lockstep_runs.py's overrides):
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
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import hf_baseline as hfb  # noqa: E402  (the benchmarks folder is not a package)
import lockstep_runs as lr  # noqa: E402
import train_throughput as tt  # noqa: E402

PRESET = "configs/qwen3-30b-a3b.yaml"

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
    return lr.train_overrides(args, name, run_root, model_overrides(args), [
        f"data.sources={source}",
        "data.eval_source=null",
        "data.tokenizer=byte",
        f"data.seq_len={args.seq}",
        "data.num_streams=1",
        "data.workers=1",
        "data.process_pool=false",
    ])


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
    return lr.run_lockstep(args, name, run_root, argv, peak, budget)


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

    lr.prepare_device(device)
    started = time.perf_counter()
    hf_model, class_name = hfb.build_hf_model(config.model, device)
    result: dict[str, Any] = {"hf_class": class_name, "build_s": time.perf_counter() - started,
                              "hf_params": sum(p.numel() for p in hf_model.parameters()),
                              "attn_implementation": hf_model.config._attn_implementation,
                              "output_router_logits": True, "compile": False}
    implementation = experts_implementation(hf_model)
    result["experts_implementation"] = implementation
    optimizer = lr.hf_optimizer(hf_model, device)
    generator = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, config.model.vocab_size, (args.micro_batch, args.seq), device=device,
                             generator=generator) for _ in range(min(4, args.warmup + args.steps))]

    def loss_of(i: int) -> torch.Tensor:
        ids = batches[i % len(batches)]
        return hf_model(input_ids=ids, labels=ids, output_router_logits=True).loss  # (B, T) -> scalar

    result.update(lr.timed_steps(hf_model, optimizer, loss_of, args, device))
    flops = hfb.flop_counts(config.model, args.seq)
    result.update(flops_per_token=flops, mfu_all_matmuls=hfb.mfu(flops["all_matmuls"], result["tokens_per_s"], peak, 1),
                  mfu_torchtitan=hfb.mfu(flops["torchtitan"], result["tokens_per_s"], peak, 1))
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
             "|---|---|---|---|---|---|---|---|",
             lr.table_row(f"lockstep ({report['settings']['mode']})", report["lockstep"],
                          str(report["lockstep_experts"]["kernel"])),
             lr.table_row("transformers", report["transformers"],
                          str(report["transformers"].get("experts_implementation")))]
    return "\n".join([*lines, *lr.table_tail(report)])


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    lr.add_common_args(p, layers=4, layers_help="model.num_layers of the preset")
    lr.add_run_args(p)
    lr.add_launch_args(p, run_root_help="where the runs go (default: a temporary directory, deleted)",
                       out="bench_out/moe_step.json")
    return lr.finish_args(p, p.parse_args(argv), SMOKE_SETTINGS,
                          ("--layers", "--seq", "--micro-batch", "--warmup", "--steps"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import models

    started = lr.header("moe_step", args)
    if started is None:
        return 2
    device, peak, report = started
    config = load_config(args)
    flops = hfb.flop_counts(config.model, args.seq)
    report["shape"] = {"preset": PRESET, "num_layers": config.model.num_layers,
                       "params_total": models.num_params(config.model),
                       "params_active": active_params(config.model),
                       "flops_per_token": flops}
    budget = tt.Budget(args.budget)
    with lr.run_root_of(args, "lockstep-moe-step-", report) as run_root:
        report["transformers"] = lr.guarded_transformers(lambda: run_transformers(args, config, device, peak), device)
        report["lockstep_experts"] = lockstep_expert_kernel(config, device)
        tokens = 2 * (args.warmup + args.steps + 1) * args.micro_batch * args.seq
        corpus = write_corpus(run_root / "corpus", tokens)
        lr.compare(report, lambda name: run_lockstep(args, name, run_root, corpus, peak, budget),
                   ("moe-step-a", "moe-step-b"))
    return lr.finish("moe_step", args, report, table(report))


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
