"""One PPO step against one GRPO step on one GPU, each split by phase.

    python benchmarks/ppo_step.py --out bench_out/ppo_step.json     # Qwen2.5-0.5B, 64 prompts x 8, 128 new tokens
    python benchmarks/ppo_step.py --device cpu --tiny                # smoke: the tiny model, a few prompts

Both methods run in the same process on the same prompts, the preset's architecture with random
weights (``configs/<shape>.yaml``), the byte tokenizer, bf16 autocast on CUDA for the updates and
fp32 master weights, driven the way the loop drives an objective (``prepare`` under no_grad, then
per update ``loss`` and backward per micro-batch and every optimizer's step):

- GRPO: benchmarks/grpo_step.py's step (rollout, reference, update);
- PPO (training/objectives/ppo.py): the rollout, a reward model's scores (a random reward model of
  the policy's shape, one more frozen model), the policy's log-probs, the critic's values, the
  reference's log-probs, GAE and whitening, then ``ppo_epochs x minibatches`` updates of the actor
  and the critic (``--epochs 2``).

The first step includes the sampler's compilation (CUDA graphs); the last is the steady state.
Prints a table of the last step's phases and writes JSON with every step. The issue's target is a
PPO step at most twice a GRPO step (``ratio``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpo_step  # noqa: E402  (the benchmarks folder is not a package)

PPO_PHASES = ("rollout_s", "reward_model_s", "policy_logps_s", "critic_values_s", "reference_s", "advantages_s",
              "update_s")
GRPO_PHASES = ("rollout_s", "reference_s", "update_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="configs/<shape>.yaml (architecture only)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seq", type=int, default=256, help="data.seq_len: prompt + completion")
    parser.add_argument("--micro-batch", type=int, default=32, help="completion rows per forward")
    parser.add_argument("--kl-coef", type=float, default=0.04)
    parser.add_argument("--epochs", type=int, default=2, help="PPO epochs over one rollout batch")
    parser.add_argument("--minibatches", type=int, default=4, help="PPO minibatches per epoch")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prepare-precision", choices=("fp32", "bf16"), default="bf16",
                        help="prepare's forwards (reference, reward model, old log-probs, values): bf16 autocast, "
                             "as a bf16 run's loop runs them (frozen models under the precision's autocast, PPO's "
                             "policy and critic under the updates'); fp32 to see them without it")
    parser.add_argument("--tiny", action="store_true", help="smoke: the tiny model, 4 prompts x 2, 8 new tokens")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tiny:
        args.shape, args.prompts, args.group, args.max_new_tokens = "tiny", 4, 2, 8
        args.seq, args.micro_batch, args.steps = 128, 4, 1
    report = run(args)
    print(table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def run(args) -> dict:
    import torch

    grpo = grpo_step.run(args)
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    ppo = run_ppo(args)
    last_grpo, last_ppo = grpo["steps"][-1], ppo["steps"][-1]
    return {"benchmark": "ppo_step", "shape": args.shape, "prompts": args.prompts, "group_size": args.group,
            "max_new_tokens": args.max_new_tokens, "seq_len": args.seq, "micro_batch": args.micro_batch,
            "kl_coef": args.kl_coef, "ppo_epochs": args.epochs, "minibatches": args.minibatches,
            "device": grpo["device"], "torch": grpo["torch"], "precision": grpo["precision"], "prepare_precision": grpo["prepare_precision"],
            "ratio": last_ppo["step_s"] / last_grpo["step_s"], "grpo": grpo, "ppo": ppo}


def run_ppo(args) -> dict:
    import torch

    import models
    from core import seeding
    from data.batch import IGNORE_INDEX
    from training.objectives.frozen import FrozenModel
    from training.objectives.model_reward import ModelReward
    from training.objectives.ppo import CRITIC, PPOObjective
    from training.objectives.reward_model import SCORE_INIT_STD

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config = grpo_step.load_config(args, "ppo", [
        f"objective.ppo.group_size={args.group}", f"objective.ppo.max_new_tokens={args.max_new_tokens}",
        f"objective.ppo.kl_coef={args.kl_coef}", f"objective.ppo.ppo_epochs={args.epochs}",
        f"objective.ppo.minibatches={args.minibatches}"])
    model = models.build(config.model, generator=seeding.generator(0, "model_init")).to(device)
    context = grpo_step.objective_context(config, device)
    objective = PPOObjective(config)
    objective.setup(model, context)
    objective.model_rewards = [(1.0, random_reward_model(config, device, FrozenModel, ModelReward, SCORE_INIT_STD))]
    critic = objective.extra_parts(context)[CRITIC].module.to(device)
    parts = {CRITIC: critic}
    optimizers = [torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-6, fused=cuda)
                  for module in (model, critic)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def update(batch) -> tuple[dict, int]:
        totals: dict[str, torch.Tensor] = {}
        counted = 0
        for update in range(objective.updates_per_batch):
            share = objective.update_batch(batch, update)
            count = objective.num_targets(share)
            for micro in share.micro_batches(config.train.micro_batch_size):
                with autocast:
                    out = objective.loss(model, micro, parts)
                (out.sum / count).backward()
                for name, value in out.metrics.items():
                    totals[name] = totals.get(name, 0) + value.detach()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            counted += count
        return totals, counted

    steps = []
    for batch, prepare_s, update_s, (totals, counted) in grpo_step.timed_steps(args, config, objective, update):
        timings = batch.prepared.experience.timings
        tokens = int((batch.document_ids == 0).sum())  # prompt + completion, no padding
        fields = objective.ledger_fields(batch, {k: float(v) for k, v in totals.items()}, counted)
        phases = {name: timings.get(name, 0.0) for name in PPO_PHASES if name != "update_s"}
        steps.append({
            **phases,
            "update_s": update_s,
            "updates": objective.updates_per_batch,
            "update_tokens_per_s": tokens * args.epochs / update_s,
            "prepare_other_s": prepare_s - sum(phases.values()),
            "step_s": prepare_s + update_s,
            "rollout_generated_tokens": timings["rollout_tokens"],
            "rollout_tokens_per_s": timings["rollout_tokens"] / timings["rollout_s"],
            "sequence_tokens": tokens,
            "completion_tokens": int((batch.labels != IGNORE_INDEX).sum()),
            **{name: fields[name] for name in ("completion_len_mean", "reward_mean", "kl", "value_loss",
                                               "clip_fraction", "approx_kl", "explained_variance",
                                               "rollout_hash")},
        })
    return {"peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "steps": steps}


def random_reward_model(config, device, frozen_model, model_reward, init_std: float):
    """A reward model of the policy's shape with random weights (the timing does not depend on them)."""
    import torch

    import models
    from core import seeding
    from distributed import param_hash

    trunk = models.build(config.model, generator=seeding.generator(1, "reward_init")).to(device).eval()
    trunk.requires_grad_(False)
    head = torch.nn.Linear(config.model.hidden_size, 1, bias=False)
    with torch.no_grad():
        head.weight.normal_(0.0, init_std, generator=seeding.generator(1, "score_init"))
    head = head.requires_grad_(False).to(device)
    identity = {"path": "random", "sha256": param_hash(trunk)}
    return model_reward(frozen_model(role="reward", module=trunk, identity=identity,
                                     vocab_size=config.model.vocab_size), head, identity)


def table(report: dict) -> str:
    """The last step of each method, phase by phase (seconds), and the ratio of the step times."""
    grpo, ppo = report["grpo"]["steps"][-1], report["ppo"]["steps"][-1]
    lines = [f"{report['shape']}, {report['prompts']} prompts x {report['group_size']}, "
             f"{report['max_new_tokens']} new tokens, {report['device']}, {report['precision']}",
             f"{'phase':<18}{'GRPO s':>10}{'PPO s':>10}"]
    for name in PPO_PHASES + ("prepare_other_s",):
        theirs = f"{grpo[name]:10.3f}" if name in grpo else f"{'':>10}"
        lines.append(f"{name[:-2]:<18}{theirs}{ppo[name]:10.3f}")
    lines.append(f"{'step':<18}{grpo['step_s']:10.3f}{ppo['step_s']:10.3f}")
    lines.append(f"PPO / GRPO step time: {report['ratio']:.2f}x (PPO: {ppo['updates']} updates, "
                 f"{report['ppo_epochs']} epochs x {report['minibatches']} minibatches)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
