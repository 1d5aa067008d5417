"""One GRPO step on one GPU: rollouts, reference pass and update, timed apart.

    python benchmarks/grpo_step.py --out bench_out/grpo_step.json                       # Qwen2.5-0.5B, 64 x 8
    python benchmarks/grpo_step.py --shape tiny --prompts 8 --group 4 --max-new-tokens 16 --device cpu   # smoke

The preset's architecture with random weights (``configs/<shape>.yaml``), the byte tokenizer
(its ids are valid in any preset's vocabulary; what the model reads does not matter for the
timings), bf16 autocast on CUDA, fp32 master weights. Prompts are the embedded tasks
(data/tasks.py, generated in memory and written to a temporary ``prompt`` JSONL source), read
through the real data pipeline; the objective is training/objectives/grpo.py, driven the way
the loop drives it: ``prepare`` (rollouts with the keyed sampler, rewards, advantages, the
reference's log-probs), then ``loss`` and backward per micro-batch, then the optimizer step.

Step 1 includes the sampler's compilation (CUDA graphs); the report gives every step, and the
last one is the steady state. Per phase: seconds and tokens/s: rollout = generated tokens,
reference and update = the rollout batch's prompt + completion tokens (padding left out).
One process, JSON out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="configs/<shape>.yaml (architecture only)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seq", type=int, default=256, help="data.seq_len: prompt + completion")
    parser.add_argument("--micro-batch", type=int, default=32, help="completion rows per forward")
    parser.add_argument("--kl-coef", type=float, default=0.04)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prepare-precision", choices=("fp32", "bf16"), default="bf16",
                        help="prepare's forwards (reference, reward model, old log-probs, values): bf16 autocast, "
                             "as a bf16 run's loop runs them (frozen models under the precision's autocast, PPO's "
                             "policy and critic under the updates'); fp32 to see them without it")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


def run(args) -> dict:
    import torch

    import models
    from core import seeding
    from data.batch import IGNORE_INDEX
    from training.objectives.grpo import PARITY, GRPOObjective

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the sampler's fp32 parts stay fp32
    config = load_config(args, "grpo", [f"objective.grpo.group_size={args.group}",
                                        f"objective.grpo.max_new_tokens={args.max_new_tokens}",
                                        f"objective.grpo.kl_coef={args.kl_coef}", "objective.grpo.loss_norm=token"])
    model = models.build(config.model, generator=seeding.generator(0, "model_init")).to(device)
    objective = GRPOObjective(config)
    objective.setup(model, objective_context(config, device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def update(batch) -> tuple[list, int]:
        count = objective.num_targets(batch)
        parity = []  # the loop's maximum over micro-batches (LossOutput.maxima)
        for micro in batch.micro_batches(config.train.micro_batch_size):
            with autocast:
                out = objective.loss(model, micro)
            (out.sum / count).backward()
            parity.append(out.maxima[PARITY])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return parity, count

    steps = []
    for batch, prepare_s, update_s, (parity, count) in timed_steps(args, config, objective, update):
        fields = objective.ledger_fields(batch, {PARITY: float(torch.stack(parity).max())}, count)
        timings = batch.prepared.timings  # the rollouts' Experience (training/rollout/experience.py)
        tokens = int((batch.document_ids == 0).sum())  # prompt + completion, no padding
        steps.append({
            "rollout_s": timings["rollout_s"],
            "rollout_generated_tokens": timings["rollout_tokens"],
            "rollout_tokens_per_s": timings["rollout_tokens"] / timings["rollout_s"],
            "reference_s": timings.get("reference_s", 0.0),
            "reference_tokens_per_s": tokens / timings["reference_s"] if "reference_s" in timings else None,
            "update_s": update_s,
            "update_tokens_per_s": tokens / update_s,
            "prepare_other_s": prepare_s - timings["rollout_s"] - timings.get("reference_s", 0.0),
            "step_s": prepare_s + update_s,
            "sequence_tokens": tokens,
            "completion_tokens": int((batch.labels != IGNORE_INDEX).sum()),
            "completion_len_mean": fields["completion_len_mean"],
            "logprob_parity": fields["logprob_parity"],
            "rollout_hash": fields["rollout_hash"],
        })
    return {
        "benchmark": "grpo_step",
        "shape": args.shape, "prompts": args.prompts, "group_size": args.group,
        "max_new_tokens": args.max_new_tokens, "seq_len": args.seq, "micro_batch": args.micro_batch,
        "kl_coef": args.kl_coef, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "precision": "bf16 autocast" if cuda else "fp32",
        "prepare_precision": getattr(args, "prepare_precision", "fp32") if cuda else "fp32",
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "steps": steps,
    }


# The shared driver (benchmarks/ppo_step.py uses it too): the config, the objective's context and
# the timed step loop.


def load_config(args, kind: str, settings: list[str]):
    """``configs/<args.shape>.yaml`` with random weights, the byte tokenizer, a temporary ``prompt``
    source of embedded tasks (enough for ``args.steps``), no parallelism, ``objective.kind=kind``
    and its ``settings``."""
    from core.config import load
    from data.tasks import make_task, rl_record

    prompts_file = Path(tempfile.mkdtemp(prefix=f"{kind}-bench-")) / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(rl_record(make_task(0, i))) + "\n"
                                    for i in range(args.prompts * (args.steps + 1))))
    cuda = args.device.startswith("cuda")
    return load(ROOT / "configs" / f"{args.shape}.yaml", [
        f"data.sources=[{{path: {prompts_file}, record: prompt}}]", "data.eval_source=null", "data.tokenizer=byte",
        f"data.seq_len={args.seq}", "data.num_streams=1", f"train.global_batch_size={args.prompts}",
        f"train.micro_batch_size={args.micro_batch}", "train.loss_chunk_tokens=4096",
        f"parallel.precision={'bf16' if cuda else 'fp32'}", "parallel.strategy=none", "parallel.compile=false",
        f"objective.kind={kind}", *settings, "model.init_from=null",
    ])


def objective_context(config, device):
    """One process's ObjectiveContext, as the loop builds it under ``parallel.strategy=none``."""
    from training.objectives.base import ObjectiveContext

    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=device,
                           all_gather_object=lambda obj: [obj])
    return ObjectiveContext(config=config, dist=dist, parallel=SimpleNamespace(device=device),
                            place=lambda t: t.to(device, non_blocking=True), fuse_head=True)


def timed_steps(args, config, objective, update):
    """``args.steps`` steps as the loop drives an objective, timed apart: ``prepare`` under no_grad
    (bf16 autocast with ``--prepare-precision bf16`` on CUDA), then ``update(batch)`` (backwards and
    optimizer steps). Yields (batch, prepare seconds, update seconds, what ``update`` returned)."""
    import torch

    from data.pipeline.pipeline import build

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    prepare_autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                                      enabled=cuda and getattr(args, "prepare_precision", "fp32") == "bf16")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    with build(config.data, seed=0, global_batch_size=args.prompts, rank=0, world_size=1) as pipe:
        for _ in range(args.steps):
            prompt_batch = next(pipe)
            sync()
            started = time.perf_counter()
            with torch.no_grad(), prepare_autocast:
                batch = objective.prepare(prompt_batch)
            sync()
            prepare_s = time.perf_counter() - started
            started = time.perf_counter()
            result = update(batch)
            sync()
            yield batch, prepare_s, time.perf_counter() - started, result


if __name__ == "__main__":
    main()
