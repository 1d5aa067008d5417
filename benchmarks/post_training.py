"""DPO and distillation step time vs an SFT step over the same tokens, on one GPU.

    python benchmarks/post_training.py --out bench_out/post_training.json        # both presets, seq 2048
    python benchmarks/post_training.py --shapes tiny --seq 256 --rows 2 --device cpu --steps 2 --warmup 1  # smoke

Per preset (``configs/<shape>.yaml``: the architecture with its seeded random init, no download)
and in one process, the cases run on the same synthetic batches: ``--rows`` rows of ``--seq``
tokens, each row one preference pair (prompt + chosen, prompt + rejected: two documents of
``seq/2`` tokens, the second half of each a response that carries the loss), ``--micro-batch``
rows per forward/backward (default 1), fp32 master weights, bf16 autocast on CUDA, the fused
chunked output projection, AdamW, and the preset's ``parallel.compile`` (``--no-compile`` turns it off): with it, the
blocks of the trained model and of the frozen reference/teacher are compiled, as the loop
compiles them. The objectives are the ones the loop runs (training/objectives), driven as the loop
drives them: ``prepare`` under no_grad, then ``loss`` and backward per micro-batch, then the
optimizer step; a step's time includes ``prepare``.

- ``sft``: next-token loss on the responses (the ``sft`` objective's math) over the same rows;
- ``dpo_online``: DPO (sigmoid) with the reference (a frozen copy of the initial weights) run
  in every step's ``prepare``;
- ``dpo_cached``: the same with ``cache_reference``: the cache is filled once before timing,
  then ``prepare`` reads it;
- ``distill``: forward KL (alpha 0.5) from a same-size teacher (the seeded initial weights).

Targets (docs/performance.md): dpo_online <= 1.6x sft, dpo_cached <= 1.15x, distill <= 1.5x.
Reported: the median step seconds over the timed steps, tokens/s, ratio to sft, peak memory per case
(``torch.cuda.max_memory_allocated``, reset before each case; it includes model, optimizer
state and the frozen model of the case). JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = ("sft", "dpo_online", "dpo_cached", "distill")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen3-1.7b", help="configs/<shape>.yaml, comma-separated")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4, help="rows (pairs) per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=1,
                        help="rows per forward/backward (the step accumulates over rows / micro-batch of them)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="eager blocks whatever the preset says")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.micro_batch <= 0 or args.rows % args.micro_batch:
        parser.error(f"--micro-batch must divide --rows ({args.rows}), got {args.micro_batch}")
    report = {"benchmark": "post_training", "seq_len": args.seq, "rows": args.rows, "steps": args.steps,
              "micro_batch": args.micro_batch,
              "presets": [run_preset(shape, args) for shape in args.shapes.split(",")]}
    import torch

    report.update(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


def synthetic_batches(config, count: int, rows: int, seq: int):
    """``count`` batches of ``rows`` rows, one preference pair per row (module docstring)."""
    import numpy as np

    from data.batch import Batch, DocSpan
    from data.fields import TARGET_MASK
    from data.preference import PAIR_ROLE

    rng = np.random.default_rng(0)
    half, vocab = seq // 2, config.model.vocab_size
    batches = []
    for step in range(count):
        tokens, spans, masks, roles = [], [], [], []
        for r in range(rows):
            record = step * rows + r
            prompt = rng.integers(0, vocab, half // 2)
            sides = [np.concatenate([prompt, rng.integers(0, vocab, half - half // 2)]) for _ in range(2)]
            tokens.append(np.concatenate(sides).astype(np.int32))
            spans.append([DocSpan("bench", "synthetic", record, 0, half, 0),
                          DocSpan("bench", "synthetic", record, half, seq, half)])
            side_mask = np.arange(half) >= half // 2
            masks.append(np.concatenate([side_mask, side_mask]))
            roles.append(np.concatenate([np.full(half, 1), np.full(half, 2)]).astype(np.int8))
        batches.append(Batch.from_rows(step + 1, tokens, spans, list(range(rows)), {}, {TARGET_MASK: masks, PAIR_ROLE: roles}))
    return batches


def run_preset(shape: str, args) -> dict:
    import torch

    import models
    from core import seeding
    from core.config import load

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    tmp = Path(tempfile.mkdtemp(prefix="post-training-bench-"))
    cache_dir = tmp / "reference_cache"
    pairs = tmp / "pairs.jsonl"  # only named by the cache's fingerprint: the batches are synthetic
    pairs.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    preset = load(ROOT / "configs" / f"{shape}.yaml")
    compiled = preset.parallel.compile and not args.no_compile
    config = load(ROOT / "configs" / f"{shape}.yaml", [
        f"data.sources=[{{path: {pairs}, record: preference}}]", "data.tokenizer=byte",
        "data.eval_source=null", f"data.seq_len={args.seq}", "data.num_streams=1",
        f"train.global_batch_size={args.rows}", f"train.micro_batch_size={args.micro_batch}", "train.loss_chunk_tokens=4096",
        f"parallel.precision={'bf16' if cuda else 'fp32'}", "parallel.strategy=none", f"parallel.compile={str(compiled).lower()}",
        "model.init_from=null", "objective.dpo.loss=sigmoid", "objective.dpo.reference=init",
        f"objective.dpo.cache_dir={cache_dir}", "objective.distill.teacher=init",
        "objective.distill.loss=forward_kl", "objective.distill.alpha=0.5",
    ])
    batches = synthetic_batches(config, args.warmup + args.steps, args.rows, args.seq)
    model = models.build(config.model, generator=seeding.generator(config.train.seed, "model_init")).to(device)
    if compiled:
        from distributed.compile import apply_compile

        apply_compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)
    results, shared = {}, {}
    for case in args.cases.split(","):
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        objective = make_objective(case, config, model, device, shared)
        if case == "dpo_cached":  # fill the cache once, untimed
            with torch.no_grad():
                for batch in batches:
                    objective.prepare(batch)
        times = [train_step(objective, model, optimizer, batch, device, args.micro_batch) for batch in batches]
        median = statistics.median(times[args.warmup:])  # the host-bound small presets are noisy
        results[case] = {
            "step_s": median, "tokens_per_s": args.rows * args.seq / median,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "step_times_s": times,
        }
        del objective
    for case, result in results.items():
        if "sft" in results:
            result["ratio_to_sft"] = result["step_s"] / results["sft"]["step_s"]
    del model, optimizer
    return {"shape": shape, "compiled": compiled, "cases": results,
            "targets": {"dpo_online": 1.6, "dpo_cached": 1.15, "distill": 1.5}}


def make_objective(case: str, config, model, device, shared: dict):
    """The case's objective, set up as ``setup`` does, with one frozen copy of the initial
    weights built once per preset (after the sft case, so sft's peak memory excludes it) and
    used as the DPO reference and the distillation teacher."""
    import dataclasses

    import torch

    from training.objectives.base import ObjectiveContext
    from training.objectives.causal_lm import CausalLMObjective
    from training.objectives.distill import DistillObjective
    from training.objectives.dpo import DPOObjective
    from training.objectives.frozen import build_frozen

    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=device, backend="none",
                           all_gather_object=lambda obj: [obj])
    context = ObjectiveContext(config=config, dist=dist, parallel=SimpleNamespace(device=device),
                               place=lambda t: t.to(device, non_blocking=True), fuse_head=True)
    if case == "sft":
        objective = CausalLMObjective(config)
        objective.setup(model, context)
        return objective
    if "frozen" not in shared:
        shared["frozen"] = build_frozen(config, "init", role="reference", dist=dist, key="objective.dpo.reference")
    frozen = shared["frozen"]
    if case in ("dpo_online", "dpo_cached"):
        dpo = dataclasses.replace(config.objective.dpo, cache_reference=case == "dpo_cached")
        objective = DPOObjective(dataclasses.replace(config, objective=dataclasses.replace(config.objective, dpo=dpo)))
        objective._context, objective.fuse_head, objective.reference = context, True, frozen
        if dpo.cache_reference:
            objective.cache = objective._open_cache(context)
        return objective
    # The teacher is the seeded init: a same-size model (a benchmark-only source).
    objective = DistillObjective(config)
    objective._context, objective.fuse_head, objective.teacher = context, True, frozen
    weight = frozen.module.lm_head.weight.detach()
    objective._teacher_weight = weight.to(torch.bfloat16 if device.type == "cuda" else weight.dtype)
    return objective


def train_step(objective, model, optimizer, batch, device, micro_batch: int) -> float:
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.no_grad():
        batch = objective.prepare(batch)
    count = max(objective.num_targets(batch), 1)
    for micro in batch.micro_batches(micro_batch):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = objective.loss(model, micro)
        (out.sum / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
