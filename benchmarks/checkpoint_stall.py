"""How long a checkpoint of the 1.7B shape blocks the training loop, asynchronous vs synchronous.

    python benchmarks/checkpoint_stall.py --shape qwen3-1.7b --gpus 1 --interval 5 --steps 12 \
        --modes async,sync --out bench_out/checkpoint_stall.json

One training run per mode through the real entry point (``torchrun ... train.py``, the
same overrides as benchmarks/train_throughput.py) with ``checkpoint.async_save`` on or off,
``checkpoint.interval=K``, ``checkpoint.keep=1`` (a 1.7B checkpoint with AdamW state is about
20 GB: fp32 weights + two fp32 moments) and no checkpoint at the end.

What is read, per checkpoint step, from ``metrics.jsonl`` (slowest rank):

- ``time_checkpoint``: the step's ``checkpoint`` phase. It holds the save call (async: the
  device-to-host copy and staging; sync: the whole write, fsync, hashing and publish) *and*
  the ledger's ``param_hash``, which the loop computes at every checkpoint step and at the
  last step. The last step is therefore kept off the checkpoint cadence (``--steps`` not a
  multiple of ``--interval``): its ``time_checkpoint`` is the hash alone, and
  ``stall_s = time_checkpoint - hash_s`` is the save's own share.
- ``extra_step_s``: the step's time minus the median step before the first checkpoint.
- ``after_steps_extra_s``: the mean extra time of the two steps after it (an async write
  competing with the loop for host CPU, memory bandwidth and the GIL shows here).
- ``visible_after_s``: when ``checkpoints/step_N`` appeared (renamed into place, so durable),
  watched by polling, minus the time the step's metric record was written. Async: how long
  the background write took past the step; sync: negative (it was done before the record).
  A save that starts while the previous one is still writing first waits for it; the JSON
  marks such checkpoints ``waited_for_previous`` and the summary leaves them out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import hf_baseline as hfb  # noqa: E402
import train_throughput as tt  # noqa: E402


class CheckpointWatcher:
    """Polls ``<run_root>/*/checkpoints/step_*`` and records when each step dir first appears."""

    def __init__(self, run_root: Path, period: float = 0.1) -> None:
        self.run_root = run_root
        self.period = period
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="checkpoint-watcher", daemon=True)

    def __enter__(self) -> "CheckpointWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for path in self.run_root.glob("*/checkpoints/step_*"):
                try:
                    step = int(path.name.split("_", 1)[1])
                except ValueError:
                    continue
                self.seen.setdefault(step, now)
            self._stop.wait(self.period)


def dir_size_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9


def analyze(run_dir: Path, *, interval: int, steps: int, seen: dict[int, float]) -> dict[str, Any]:
    records = {r["step"]: r for r in tt.read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("metrics"), dict)}

    def step_s(step: int) -> float | None:
        return tt.step_seconds(records[step], "max") if step in records else None

    def ckpt_s(step: int) -> float | None:
        return tt.metric(records[step], "time_checkpoint", "max") if step in records else None

    reference = [step_s(s) for s in range(2, interval) if step_s(s) is not None]
    ref = statistics.median(reference) if reference else None
    hash_s = ckpt_s(steps) if steps % interval else None
    out: dict[str, Any] = {
        "reference_step_s": ref,
        "reference_steps": list(range(2, interval)),
        "hash_only_step": steps if steps % interval else None,
        "param_hash_s": hash_s,
        "checkpoints": [],
    }
    previous_visible = None
    for step in range(interval, steps + 1, interval):
        if step not in records:
            continue
        total = ckpt_s(step)
        record_time = records[step]["time"]
        step_time = step_s(step)
        after = [step_s(s) for s in (step + 1, step + 2) if s in records and s % interval and s != steps]
        step_started = record_time - (step_time or 0.0)
        entry = {
            "step": step,
            "time_checkpoint_s": total,
            "stall_s": (total - hash_s) if total is not None and hash_s is not None else None,
            "step_s": step_time,
            "extra_step_s": (step_time - ref) if step_time is not None and ref is not None else None,
            "after_steps_extra_s": (statistics.mean(after) - ref) if after and ref is not None else None,
            "visible_after_s": (seen[step] - record_time) if step in seen else None,
            "waited_for_previous": previous_visible is not None and previous_visible > step_started,
        }
        previous_visible = seen.get(step)
        out["checkpoints"].append(entry)
    clean = [c for c in out["checkpoints"] if not c["waited_for_previous"]]
    for key in ("stall_s", "time_checkpoint_s", "extra_step_s", "after_steps_extra_s", "visible_after_s"):
        values = [c[key] for c in clean if c[key] is not None]
        out[f"mean_{key}"] = statistics.mean(values) if values else None
    remaining = sorted((run_dir / "checkpoints").glob("step_*"))
    if remaining:
        out["checkpoint_gb"] = dir_size_gb(remaining[-1])
    out["checkpoint_saved_events"] = [
        e for e in tt.read_jsonl(run_dir / "events.jsonl") if e.get("event") == "checkpoint_saved"
    ]
    return out


def run_mode(mode: str, args: argparse.Namespace, env: dict[str, Any], budget: tt.Budget) -> dict[str, Any]:
    run_root = Path(tempfile.mkdtemp(prefix=f"lockstep-ckpt-{mode}-", dir=args.run_root)).resolve()
    micro = args.micro_batch or hfb.default_micro_batch(args.shape, args.seq)
    case = tt.Case(args.shape, args.seq, args.gpus, args.determinism, micro, "preset")
    config_path, _ = hfb.preset_args(args.shape)
    overrides = tt.merge_overrides(tt.case_overrides(case, args, env, run_root), [
        f"run.name=ckpt-{mode}-{case.name}",
        f"train.max_steps={args.steps}",
        f"checkpoint.interval={args.interval}",
        f"checkpoint.async_save={'true' if mode == 'async' else 'false'}",
        "checkpoint.keep=1",
        "checkpoint.at_end=false",
    ])
    cmd = tt.train_command(case, overrides, config_path)
    result: dict[str, Any] = {"mode": mode, "case": case.name, "command": shlex.join(cmd), "run_root": str(run_root)}
    timeout = budget.timeout(args.timeout)
    if timeout is None:
        return {**result, "status": "skipped", "error": "not started: --budget exhausted"}
    try:
        with CheckpointWatcher(run_root) as watcher:
            done = tt.launch(cmd, timeout=timeout, log_path=args.log_dir / f"ckpt-{mode}-{case.name}.log")
        run_dir = tt.find_run_dir(done.stdout, run_root, f"ckpt-{mode}-{case.name}")
        result["seconds"] = done.seconds
        if run_dir is not None:
            result.update(analyze(run_dir, interval=args.interval, steps=args.steps, seen=watcher.seen))
        ok = done.returncode == 0 and not done.timed_out and result.get("checkpoints")
        result["status"] = "ok" if ok else ("timeout" if done.timed_out else "failed")
        if not ok:
            result.update(tt.failure_text(done, run_dir))
    finally:
        if not args.keep_runs:  # 20 GB per checkpoint: free the disk before the next mode
            shutil.rmtree(run_root, ignore_errors=True)
    return result


def print_table(payload: dict[str, Any]) -> None:
    env = payload["env"]
    print(f"\nGPU: {', '.join(env.get('gpu_names', [])) or 'none'}; torch {env.get('torch')}\n")
    print("| mode | step | time_checkpoint s | hash s | stall s | step s (ref) | next steps +s "
          "| visible after s | waited |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in payload["results"]:
        if r.get("status") != "ok":
            print(f"| {r['mode']} | {r.get('status')} | {r.get('error') or r.get('stderr_tail', '')[-200:]!r} |")
            continue
        for c in r["checkpoints"]:
            print("| " + " | ".join([
                r["mode"], str(c["step"]), tt.fmt(c["time_checkpoint_s"], ".2f"), tt.fmt(r["param_hash_s"], ".2f"),
                tt.fmt(c["stall_s"], ".2f"),
                f"{tt.fmt(c['step_s'], '.2f')} ({tt.fmt(r['reference_step_s'], '.2f')})",
                tt.fmt(c["after_steps_extra_s"], "+.2f"), tt.fmt(c["visible_after_s"], ".1f"),
                "yes" if c["waited_for_previous"] else "no",
            ]) + " |")
        print(f"| {r['mode']} | mean (not waiting) | | | {tt.fmt(r.get('mean_stall_s'), '.2f')} | | | "
              f"{tt.fmt(r.get('mean_visible_after_s'), '.1f')} | "
              f"checkpoint {tt.fmt(r.get('checkpoint_gb'), '.1f')} GB |")
    print(flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Checkpoint stall of the training loop, async vs sync.")
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(hfb.PRESETS))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=None, help="per GPU (default: per shape)")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--interval", type=int, default=5, help="checkpoint.interval (>= 3: steps 2..K-1 are the reference)")
    p.add_argument("--steps", type=int, default=12,
                   help="train.max_steps; keep it off the interval (the last step then only hashes)")
    p.add_argument("--modes", type=tt.csv_list(str), default=["async", "sync"])
    p.add_argument("--determinism", default="fast", choices=("fast", "bitwise"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--strategy", default="fsdp", choices=("fsdp", "ddp"))
    p.add_argument("--strategy-1gpu", default="none", choices=("none", "ddp", "fsdp"))
    p.add_argument("--data-sources", default="auto", choices=("auto", "preset", "parquet"))
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--timeout", type=float, default=420, help="seconds per mode")
    p.add_argument("--budget", type=float, default=0, help="total seconds; modes that would not fit are skipped")
    p.add_argument("--run-root", default=None, help="parent of the run dirs (default: the system temp dir)")
    p.add_argument("--keep-runs", action="store_true")
    p.add_argument("--out", default="bench_out/checkpoint_stall.json")
    args = p.parse_args(argv)
    if args.interval < 3 or args.steps < args.interval:
        p.error("need --interval >= 3 and --steps >= --interval")
    if set(args.modes) - {"async", "sync"}:
        p.error("--modes takes async and/or sync")
    if args.steps % args.interval == 0:
        print("[ckpt] note: --steps is a multiple of --interval, so param_hash cannot be separated", file=sys.stderr)
    args.warmup = 0  # tt.case_overrides reads these; train.max_steps is overridden above
    args.log_dir = Path(args.out).resolve().parent / "logs"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = tt.Budget(args.budget)
    env = tt.probe_environment()
    print(f"[ckpt] {json.dumps(env)}", flush=True)
    tt.warn_missing_packages(env)
    if args.device == "cuda" and args.gpus > env.get("gpu_count", 0):
        print(f"[ckpt] needs {args.gpus} GPUs, found {env.get('gpu_count', 0)}", file=sys.stderr)
        return 2
    payload: dict[str, Any] = {
        "tool": "checkpoint_stall",
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "env": env,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "dataset": tt.ensure_dataset(timeout=min(args.timeout, budget.left())),
        "results": [],
    }
    for mode in args.modes:
        result = run_mode(mode, args, env, budget)
        payload["results"].append(result)
        hfb.write_json(args.out, payload)
        stall = tt.fmt(result.get("mean_stall_s"), ".2f")
        print(f"[ckpt] {mode}: {result['status']} mean stall {stall} s", flush=True)
    payload["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    hfb.write_json(args.out, payload)
    print_table(payload)
    print(f"[ckpt] results: {args.out}", flush=True)
    return 0 if all(r.get("status") == "ok" for r in payload["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
