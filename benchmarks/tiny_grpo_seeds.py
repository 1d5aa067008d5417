"""configs/tiny-grpo.yaml on one device in bitwise mode (the batch-invariant kernels) and in fast mode, on
several seeds: does each learn, and what the exact numerics cost.

    python benchmarks/tiny_grpo_seeds.py --out bench_out/tiny-grpo-seeds.json --work /tmp/tiny-grpo-seeds \
        [--device cuda] [--seeds 0,1,2] [--modes bitwise,fast] [--set KEY=VALUE ...] [--timeout 480]
    python benchmarks/tiny_grpo_seeds.py --out bench_out/tg.json --device cpu --seeds 0 \
        --chain-set train.max_steps=2 --set train.max_steps=2 --set train.eval_batches=1   # CPU smoke

The README's chain, once: configs/tiny.yaml pretrained, exported, configs/tiny-sft.yaml from it,
exported (one process each on ``--device``). Then, side by side on the same device: the SFT model's
own evaluation (one step at ``train.lr=0``, ``train.eval_interval=1``: the start) and
configs/tiny-grpo.yaml from the SFT export for every seed (``train.seed``) and mode:

- ``bitwise``: ``determinism.mode: bitwise`` with ``determinism.batch_invariant: true``: the sampler's
  log-probs are the trainer's bit for bit (``logprob_parity`` 0.0 on every ledger line);
- ``fast``: ``determinism.mode: fast``, the stock kernels: ``logprob_parity`` is the gap.

Each run's held-out evaluations (the ``eval`` events of its events.jsonl: ``accuracy``, greedy exact
answers over the 512 held-out prompts, and ``sampled_accuracy``, pass@1 of 8 samples a prompt), its
largest ``logprob_parity``, its first and last ``reward_mean``, its median step time from step 3 and
its wall time. Prints a table and writes ``--out`` after each phase. Exit 1 if a command failed or a
bitwise run wrote a nonzero ``logprob_parity``. Needs the embedded data (``python -m data prepare``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
MODES = {"bitwise": ["determinism.mode=bitwise", "determinism.batch_invariant=true"],
         "fast": ["determinism.mode=fast", "determinism.batch_invariant=false"]}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _start(cmd: list[str], log: Path, threads: int) -> subprocess.Popen:
    print("$ " + " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, log: Path, deadline: float) -> dict[str, Any]:
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        code = proc.wait()
    lines = log.read_text().splitlines()
    run_dir = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("run_dir:")), None)
    return {"exit": code, "run_dir": run_dir, "console_tail": lines[-4:]}


def _run(cmd: list[str], log: Path, threads: int, timeout: float) -> dict[str, Any]:
    began = time.monotonic()
    result = _finish(_start(cmd, log, threads), log, began + timeout)
    result["wall_s"] = round(time.monotonic() - began, 1)
    return result


def _summary(run_dir: str | None) -> dict[str, Any]:
    """What a GRPO run's ledger, metrics and eval events say."""
    if run_dir is None:
        return {}
    directory = Path(run_dir)
    ledger = _jsonl(directory / "ledger.jsonl")
    evals = [{"step": e["step"], **{k: e["metrics"][k] for k in ("accuracy", "sampled_accuracy") if k in e["metrics"]}}
             for e in _jsonl(directory / "events.jsonl") if e.get("event") == "eval" and "metrics" in e]
    times = [m["metrics"]["step_time"]["mean"] for m in _jsonl(directory / "metrics.jsonl")
             if m.get("step", 0) >= 3 and "step_time" in m.get("metrics", {})]
    parity = [line["logprob_parity"] for line in ledger if line.get("logprob_parity") is not None]
    rewards = [line["reward_mean"] for line in ledger if "reward_mean" in line]
    return {"run_id": directory.name, "steps": len(ledger), "evals": evals,
            "logprob_parity_max": max(parity) if parity else None,
            "logprob_parity_zero_lines": sum(p == 0.0 for p in parity), "logprob_parity_lines": len(parity),
            "reward_mean_first_last": [rewards[0], rewards[-1]] if rewards else None,
            "median_step_s_from_step_3": round(statistics.median(times), 4) if times else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/tiny-grpo-seeds"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--modes", default="bitwise,fast")
    parser.add_argument("--set", action="append", default=[],
                        help="another override of every GRPO run (the start's lr, steps and evaluation stay)")
    parser.add_argument("--chain-set", action="append", default=[],
                        help="another override of the pretrain and SFT runs (a smoke test's train.max_steps=2)")
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds for the side-by-side runs")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each process")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {sorted(MODES)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    runs, logs, exports = args.work / "runs", args.work / "logs", args.work / "exports"
    logs.mkdir(parents=True, exist_ok=True)
    common = [f"run.root={runs}", f"parallel.device={args.device}", "metrics.tensorboard=false"]
    report: dict[str, Any] = {"device": args.device, "seeds": seeds, "modes": {m: MODES[m] for m in modes},
                              "overrides": args.set, "command": " ".join([PYTHON, *sys.argv]), "chain": {}, "runs": {}}
    try:
        import torch
        report["gpu"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
        report["torch"] = torch.__version__
    except Exception as exc:  # noqa: BLE001 (a report without the device name is still a report)
        report["gpu"] = f"unknown: {exc}"

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    # The chain: pretrain -> export -> SFT -> export.
    init = []
    for name, config, target in (("pretrain", "configs/tiny.yaml", exports / "tiny"),
                                 ("sft", "configs/tiny-sft.yaml", exports / "tiny-sft")):
        step = _run([PYTHON, "train.py", "--config", config, *common, *init, *args.chain_set], logs / f"{name}.log", args.threads, 900)
        report["chain"][name] = step
        if step["exit"] != 0 or step["run_dir"] is None:
            write()
            print(f"{name} failed (exit {step['exit']}): {step['console_tail']}", flush=True)
            return 1
        exported = _run([PYTHON, "-m", "training", "export", "--run", step["run_dir"], "--to", str(target),
                         "--overwrite"], logs / f"{name}-export.log", args.threads, 300)
        report["chain"][f"{name}_export"] = exported
        if exported["exit"] != 0:
            write()
            print(f"{name} export failed: {exported['console_tail']}", flush=True)
            return 1
        init = [f"model.init_from={target}"]
        write()

    # Side by side: the start's evaluation, then each seed x mode.
    grpo = [PYTHON, "train.py", "--config", "configs/tiny-grpo.yaml", *common, *init, "checkpoint.interval=0"]
    planned = {"start": [*MODES["bitwise"], "train.lr=0", "train.max_steps=1", "train.eval_interval=1"]}
    for mode in modes:
        for seed in seeds:
            planned[f"{mode}-seed{seed}"] = [*MODES[mode], f"train.seed={seed}"]
    began = time.monotonic()
    procs = {label: _start([*grpo, *args.set, *overrides, f"run.name=tiny-grpo-{label}"], logs / f"{label}.log",
                           args.threads) for label, overrides in planned.items()}
    failed = False
    for label, proc in procs.items():
        result = _finish(proc, logs / f"{label}.log", began + args.timeout)
        result["wall_s"] = round(time.monotonic() - began, 1)  # an upper bound: runs finish in any order
        result.update(_summary(result["run_dir"]))
        report["runs"][label] = result
        failed |= result["exit"] != 0
        write()

    print(f"\ntiny-grpo on {report.get('gpu') or args.device}: held-out greedy accuracy / sampled pass@1 (512 prompts)")
    print("| run | steps | evals (step: greedy / pass@1) | reward first -> last | logprob_parity max (zero lines) "
          "| step s (median from 3) |\n|---|---|---|---|---|---|")
    violations = []
    for label, r in report["runs"].items():
        evals = "; ".join(f"{e['step']}: {e.get('accuracy', float('nan')):.4f} / {e.get('sampled_accuracy', float('nan')):.4f}"
                          for e in r.get("evals", []))
        reward = r.get("reward_mean_first_last")
        parity = r.get("logprob_parity_max")
        print(f"| {label} | {r.get('steps')} | {evals} | "
              f"{'' if reward is None else f'{reward[0]:.3f} -> {reward[1]:.3f}'} | "
              f"{parity} ({r.get('logprob_parity_zero_lines')}/{r.get('logprob_parity_lines')}) | "
              f"{r.get('median_step_s_from_step_3')} |")
        if label.startswith("bitwise") and parity not in (None, 0.0):
            violations.append(label)
    if violations:
        print(f"nonzero logprob_parity in bitwise mode: {violations}")
    print(f"wrote {args.out}")
    return 1 if failed or violations else 0


if __name__ == "__main__":
    sys.exit(main())
