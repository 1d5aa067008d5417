"""The four optimizers (and, on GPU, FP8 linears) on one preset: same data, same steps.

    python benchmarks/optimizers.py --preset tiny --device cpu --steps 40 \
        --override data.seq_len=128 train.global_batch_size=8 train.micro_batch_size=8 \
        --out docs/bench/optimizers-tiny-cpu.json
    python benchmarks/optimizers.py --preset qwen2.5-0.5b --gpus 1 --steps 300 --float8 tensorwise,rowwise \
        --out docs/bench/optimizers-0.5b-h100.json

Every case is one real ``train.py`` run of ``configs/<preset>.yaml`` with ``train.optimizer``
set (and ``parallel.float8`` for the FP8 cases, which train with AdamW): the same seed, so
the same initial weights and the same batches (the ledgers' ``batch_hash`` sequences are
checked equal). Per optimizer, only what it needs differs:

- ``lion``: ``train.lr`` times ``--lion-lr-scale`` (0.3) and ``train.weight_decay`` divided by
  it, the paper's advice (the sign update moves every coordinate by the full lr);
- ``schedule_free_adamw``: ``train.schedule=constant`` (its averaging replaces the decay;
  the warmup stays);
- ``muon``: the preset's lr as is (``train.muon_adjust_lr=match_rms_adamw`` scales Muon's
  update to AdamW's RMS).

Written: the JSON (``--out``: per case the command, the loss of every step from the ledger,
the final loss averaged over the last 10% of steps, and the median of the optimizer phase
per step from ``metrics.jsonl``: gradient clipping plus ``optimizer.step()``, device-synced
by the loop's read of the norm) and a PNG of the loss curves next to it (same name,
``.png``). Checkpoints and evaluation are off. One process per GPU; ``--gpus 2+`` runs FSDP.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adamw", "muon", "lion", "schedule_free_adamw")


def base_overrides(args: argparse.Namespace, run_root: Path) -> list[str]:
    strategy = "none" if args.gpus == 1 else "fsdp"
    return [
        f"run.root={run_root}",
        f"parallel.strategy={strategy}",
        f"parallel.device={args.device}",
        f"train.max_steps={args.steps}",
        "train.eval_interval=0",
        "checkpoint.interval=0",
        "checkpoint.at_end=false",
        "metrics.tensorboard=false",
        "metrics.log_interval=1",
        *args.override,
    ]


FP8_RECIPES = ("tensorwise", "rowwise")
FP8_OPTIONS = {"backward_fast_accum": "parallel.float8_backward_fast_accum=true", "head": "parallel.float8_head=true"}


def fp8_case(mode: str) -> str:
    """``--float8`` entry (``tensorwise``, ``rowwise+backward_fast_accum``, ``tensorwise+backward_fast_accum+head``,
    ...) -> case name."""
    recipe, *options = mode.split("+")
    if recipe not in FP8_RECIPES or any(o not in FP8_OPTIONS for o in options) or len(set(options)) < len(options):
        options = ", ".join(f"+{o}" for o in FP8_OPTIONS)
        raise ValueError(f"--float8 {mode!r}: expected one of {', '.join(FP8_RECIPES)}, optionally with {options}")
    return f"adamw+fp8-{mode}"


def case_overrides(name: str, args: argparse.Namespace, preset: dict) -> list[str]:
    if name.startswith("adamw+fp8-"):
        recipe, *options = name.removeprefix("adamw+fp8-").split("+")
        out = ["train.optimizer=adamw", f"parallel.float8={recipe}", "parallel.precision=bf16"]
        return out + [FP8_OPTIONS[option] for option in options]
    out = [f"train.optimizer={name}"]
    if name == "lion":
        out += [f"train.lr={preset['lr'] * args.lion_lr_scale}", f"train.weight_decay={preset['weight_decay'] / args.lion_lr_scale}"]
    if name == "schedule_free_adamw":
        out += ["train.schedule=constant"]
    return out


def resolved_train_keys(args: argparse.Namespace) -> dict:
    """train.lr and train.weight_decay of the preset after --override (for lion's scaling)."""
    sys.path.insert(0, str(ROOT))
    from core import config as config_lib

    # Every override: the preset's keys are validated together (e.g. batch vs data.num_streams).
    config = config_lib.load(ROOT / "configs" / f"{args.preset}.yaml", list(args.override))
    return {"lr": config.train.lr, "weight_decay": config.train.weight_decay}


def run_case(name: str, args: argparse.Namespace, preset: dict, run_root: Path, log_dir: Path) -> dict:
    train_args = ["--config", str(ROOT / "configs" / f"{args.preset}.yaml"), f"run.name=opt-{name.replace('+', '-')}",
                  *base_overrides(args, run_root), *case_overrides(name, args, preset)]
    if args.gpus == 1:
        command = [sys.executable, str(ROOT / "train.py"), *train_args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
                   str(ROOT / "train.py"), *train_args]
    before = set(run_root.glob("*/ledger.jsonl"))
    started = time.perf_counter()
    log = log_dir / f"{name}.log"
    with log.open("w") as handle:
        code = subprocess.call(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=args.timeout)
    made = sorted(set(run_root.glob("*/ledger.jsonl")) - before)
    result = {"case": name, "command": command, "exit_code": code, "seconds": time.perf_counter() - started}
    if code != 0 or not made:
        result["log_tail"] = log.read_text(errors="replace")[-3000:]
        return result
    run_dir = made[0].parent
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tail = max(1, len(ledger) // 10)
    optimizer_s = [m["metrics"]["time_optimizer"]["mean"] for m in metrics[args.skip_steps :] if "time_optimizer" in m["metrics"]]
    step_s = [m["metrics"]["step_time"]["mean"] for m in metrics[args.skip_steps :] if "step_time" in m["metrics"]]
    result.update(
        losses=[r["loss"] for r in ledger],
        batch_hashes=[r["batch_hash"] for r in ledger],
        final_loss=statistics.fmean(r["loss"] for r in ledger[-tail:]),
        optimizer_ms=1000 * statistics.median(optimizer_s) if optimizer_s else None,
        step_ms=1000 * statistics.median(step_s) if step_s else None,
    )
    return result


def plot(results: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for result in results:
        if "losses" in result:
            ax.plot(range(1, len(result["losses"]) + 1), result["losses"], label=result["case"], linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
           "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def table(results: list[dict]) -> str:
    rows = ["| case | final loss (last 10%) | optimizer ms/step (median) | step ms (median) |", "|---|---|---|---|"]
    for r in results:
        if "losses" not in r:
            rows.append(f"| {r['case']} | failed (exit {r['exit_code']}) | | |")
            continue
        opt = f"{r['optimizer_ms']:.1f}" if r["optimizer_ms"] is not None else "-"
        step = f"{r['step_ms']:.0f}" if r["step_ms"] is not None else "-"
        rows.append(f"| {r['case']} | {r['final_loss']:.4f} | {opt} | {step} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="configs/<preset>.yaml")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=1, help="ranks (1: parallel.strategy=none; more: fsdp)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--float8", default="", help="comma list of tensorwise,rowwise, each optionally +backward_fast_accum and/or +head: "
                        "extra AdamW cases with FP8 (CUDA)")
    parser.add_argument("--lion-lr-scale", type=float, default=0.3)
    parser.add_argument("--skip-steps", type=int, default=3, help="steps left out of the timing medians (warmup, compile)")
    parser.add_argument("--override", nargs="*", default=[], help="more key=value overrides for every case")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per case")
    parser.add_argument("--out", default="bench_out/optimizers.json")
    args = parser.parse_args(argv)
    try:
        args.fp8_cases = [fp8_case(mode) for mode in args.float8.split(",") if mode]
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = [c for c in args.optimizers.split(",") if c]
    cases += args.fp8_cases
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    preset = resolved_train_keys(args)
    with tempfile.TemporaryDirectory(prefix="optbench-") as tmp:
        run_root, log_dir = Path(tmp) / "runs", out.parent / (out.stem + "-logs")
        log_dir.mkdir(parents=True, exist_ok=True)
        results = []
        for name in cases:
            print(f"running {name} ...", flush=True)
            results.append(run_case(name, args, preset, run_root, log_dir))
    hashes = {tuple(r["batch_hashes"]) for r in results if "batch_hashes" in r}
    payload = {
        "preset": args.preset,
        "steps": args.steps,
        "gpus": args.gpus,
        "overrides": args.override,
        "same_batches": len(hashes) == 1,
        "environment": environment(),
        "results": [{k: v for k, v in r.items() if k != "batch_hashes"} for r in results],
    }
    out.write_text(json.dumps(payload, indent=1))
    plot(results, f"{args.preset}: {args.steps} steps, {args.gpus} x {payload['environment'].get('gpu', 'CPU')}",
         out.with_suffix(".png"))
    print(table(results))
    print(f"same batches in every case: {payload['same_batches']}; wrote {out} and {out.with_suffix('.png')}")
    return 0 if all("losses" in r for r in results) and payload["same_batches"] else 1


if __name__ == "__main__":
    sys.exit(main())
