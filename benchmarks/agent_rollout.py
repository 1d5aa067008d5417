"""Multi-turn agent rollouts against single-turn rollouts of the same length, on one device.

    python benchmarks/agent_rollout.py --out bench_out/agent_rollout.json       # Qwen2.5-0.5B, 64 x 8, 4 turns x 64
    python benchmarks/agent_rollout.py --device cpu --tiny [--repeats 7]        # smoke test

The preset's architecture with random weights (``configs/<shape>.yaml``; the Qwen tokenizer of
datasets/tokenizers/qwen and its chat template; ``--tiny``: configs/tiny.yaml with the byte
tokenizer and ChatML), bf16 sampler weights on CUDA. ``--prompts`` prompts of the embedded tasks
(data/tasks.py), rendered with the template and a calculator tool spec, ``--samples`` samples
each, at temperature 1 with no stop token, so every turn samples exactly ``--turn-tokens``.

- **multi-turn**: training/rollout/episodes.py's ``EpisodeRunner`` with a Python tool
  environment that answers every turn but the last with data/calculator.py's result (the turn's
  length times 7) rendered by the template's ``observation_text``: ``--turns`` turns per episode,
  all in one sampler call (each episode continued in its cache row, the observation ids fed
  through the decode step), the tool calls on the runner's daemon threads.
- **single-turn**: one sampler call of ``turns x turn-tokens`` new tokens per sample from the same
  prompts (the same sampled total).

tokens/s = sampled tokens (observations excluded) / wall time of the whole rollout (tool calls,
tokenization and the observations' decode steps included); the sampler's own seconds (the wall
time less the host's work on ended turns) are reported beside it. One warm-up of each (compilation, CUDA graphs) first, then the median of
``--repeats``. The ratio multi/single is the issue's measure (target >= 0.7). JSON out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QWEN_TOKENIZER = "datasets/tokenizers/qwen"


class EveryTurnTool:
    """Answers each turn but the last with the calculator (a Python function), then scores 0."""

    def __init__(self, spec: dict) -> None:
        self.tools = [spec]

    def reset(self, task, *, where):
        return self

    def step(self, turn, *, last=False):
        from data import calculator
        from training.rollout.environment import Transition

        if last:
            return Transition(reward=0.0, done=True)
        result = calculator.calculate(f"{len(turn.sample.tokens)} * 7")
        return Transition(reward=0.0, done=False, messages=({"role": "tool", "content": result},),
                          calls=(calculator.NAME,))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="configs/<shape>.yaml (architecture only)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None, help="measured runs (default 3; 1 with --tiny)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="configs/tiny.yaml, byte tokenizer, 4 x 2, 3 turns x 8")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tiny:
        args.shape, args.prompts, args.samples, args.turns, args.turn_tokens = "tiny", 4, 2, 3, 8
    if args.repeats is None:
        args.repeats = 1 if args.tiny else 3
    report = run(args)
    print_table(report)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    else:
        print(text)


def run(args) -> dict:
    import torch

    import models
    from core import seeding
    from core.config import load
    from data import calculator
    from data.batch import DocSpan
    from data.chat_template import ChatTemplate
    from data.tasks import make_task
    from data.tokenizers import build_tokenizer
    from models.generation.sampler import SamplingParams
    from training.rollout.environment import Task
    from training.rollout.episodes import EpisodeLimits, EpisodeRunner
    from training.rollout.generator import Decoder, Generator

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    tokenizer_name = "byte" if args.tiny else str(ROOT / QWEN_TOKENIZER)
    config = load(ROOT / "configs" / f"{args.shape}.yaml", ["model.init_from=null", f"data.tokenizer={tokenizer_name}"])
    model = models.build(config.model, generator=seeding.generator(0, "model_init")).to(device).eval()
    tokenizer = build_tokenizer(tokenizer_name)
    template = ChatTemplate.for_tokenizer(tokenizer_name, None)
    tasks = []
    for i in range(args.prompts):
        text = template.render([{"role": "user", "content": make_task(0, i).prompt}], add_generation_prompt=True,
                               tools=[calculator.SPEC])
        tasks.append(Task(i, [int(t) for t in tokenizer.encode_array(text)], text, "0",
                          DocSpan("bench", "bench", i, 0, 0, 0)))
    episode_tokens = args.turns * args.turn_tokens + (args.turns - 1) * 256  # room for the observations
    context = max(len(t.prompt_ids) for t in tasks) + episode_tokens
    rows = args.prompts * args.samples
    generator = Generator(rows=rows, max_len=context, seed=0, dtype=torch.bfloat16 if cuda else None)
    decoder = Decoder(tokenizer, template)
    render = lambda messages: [int(t) for t in tokenizer.encode_array(  # noqa: E731
        template.observation_text(messages, tools=[calculator.SPEC]))]
    runner = EpisodeRunner(generator=generator, decoder=decoder, environment=EveryTurnTool(calculator.SPEC),
                           limits=EpisodeLimits("python-tool", max_turns=args.turns, max_observation_tokens=256,
                                                max_episode_tokens=episode_tokens, timeout_s=60.0, on_error="error"),
                           render=render, context=context)
    turn_params = SamplingParams(temperature=1.0, max_new_tokens=args.turn_tokens, stop_token_ids=())
    whole_params = SamplingParams(temperature=1.0, max_new_tokens=args.turns * args.turn_tokens, stop_token_ids=())

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def multi_turn() -> dict:
        timings = {"rollout_s": 0.0, "rollout_tokens": 0}
        sync()
        started = time.perf_counter()
        episodes = runner.play(model, tasks, [t.index for t in tasks], turn_params, purpose="bench", step=0,
                               samples=args.samples, where=lambda task, s: f"prompt {task.index}, sample {s}",
                               timings=timings)
        sync()
        wall = time.perf_counter() - started
        sampled = sum(sum(e.mask) for e in episodes)
        observed = sum(len(e.mask) - sum(e.mask) for e in episodes)
        return {"wall_s": wall, "sampler_s": timings["rollout_s"], "sampled_tokens": sampled,
                "observation_tokens": observed, "turns_mean": statistics.mean(len(e.turns) for e in episodes)}

    def single_turn() -> dict:
        sync()
        started = time.perf_counter()
        generator.load(model)
        samples = generator.generate([t.prompt_ids for t in tasks], [t.index for t in tasks], whole_params,
                                     purpose="bench-single", samples=args.samples)
        sync()
        wall = time.perf_counter() - started
        return {"wall_s": wall, "sampler_s": wall, "sampled_tokens": sum(len(s.tokens) for _, _, s in samples),
                "observation_tokens": 0, "turns_mean": 1.0}

    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "shape": args.shape,
              "tokenizer": tokenizer_name, "prompts": args.prompts, "samples": args.samples, "turns": args.turns,
              "turn_tokens": args.turn_tokens, "repeats": args.repeats, "torch": torch.__version__, "results": {}}
    for name, fn in (("multi_turn", multi_turn), ("single_turn", single_turn)):
        warmup = fn()
        measured = [fn() for _ in range(args.repeats)]
        wall = statistics.median(m["wall_s"] for m in measured)
        last = measured[-1]
        report["results"][name] = {**last, "wall_s": wall, "warmup_s": warmup["wall_s"],
                                   "tokens_per_s": last["sampled_tokens"] / wall}
    multi, single = report["results"]["multi_turn"], report["results"]["single_turn"]
    report["multi_over_single"] = multi["tokens_per_s"] / single["tokens_per_s"]
    return report


def print_table(report: dict) -> None:
    print(f"{report['device']}, {report['shape']}: {report['prompts']} prompts x {report['samples']} samples, "
          f"{report['turns']} turns x {report['turn_tokens']} tokens")
    print(f"{'rollout':<12} {'sampled tok':>12} {'obs tok':>8} {'wall s':>8} {'sampler s':>10} {'tok/s':>10}")
    for name, r in report["results"].items():
        print(f"{name:<12} {r['sampled_tokens']:>12} {r['observation_tokens']:>8} {r['wall_s']:>8.3f} "
              f"{r['sampler_s']:>10.3f} {r['tokens_per_s']:>10.1f}")
    print(f"multi-turn / single-turn tokens/s: {report['multi_over_single']:.3f}")


if __name__ == "__main__":
    main()
