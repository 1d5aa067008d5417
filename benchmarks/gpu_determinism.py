"""Bitwise determinism on GPUs through the real entry point: repeat, kill/resume, world size.

    python benchmarks/gpu_determinism.py --config configs/qwen2.5-0.5b.yaml --gpus 1,2 \
        --steps 10 --interval 4 --out bench_out/gpu_determinism.json

For every GPU count G (``parallel.strategy=none`` on one GPU, ``fsdp`` on several), with
``determinism.mode=bitwise`` and bf16:

1. ``repeat``: two fresh runs of the same config; their ledgers must be equal line for line
   (loss, grad_norm, batch_hash, data_state_hash, param_hash at checkpoint steps).
2. ``kill_resume``: a third run is SIGKILLed (the whole torchrun job) at a random moment
   after its first checkpoint is intact (``LATEST`` written, recorded as ``latest_at_kill``), then resumed with ``--resume RUN_ID``; its ledger must equal
   the first run's.
3. ``replay``: ``--replay RUN_ID --step S`` of the first run, S the step after its last
   checkpoint before the end; it restores that checkpoint, re-executes step S and exits 0
   only if loss, grad_norm, batch and data-state hashes equal the ledger's (exit 5 if not).
4. ``resume_on_<G'>gpu`` (``--resume-on G'``): a copy of the first run, cut back to its first
   checkpoint, resumed by run ID on G' GPUs. It keeps the run's ``parallel.strategy`` (FSDP2
   runs on one GPU too), so a frozen model's forward and the policy's log-probs run the same
   arithmetic; ``--resume-strategy auto`` takes ``none`` on one GPU instead. The data-state
   hashes of every step must equal the first run's, and so must the batch hashes: of every
   step where the batch is data and a frozen model's outputs (SFT, DPO's reference log-probs,
   distillation), of the first resumed step where it is sampled from the trained weights
   (GRPO, PPO: later steps sample weights that were updated with another reduction order;
   whether they still matched is reported as ``all_steps_same_batches``). The largest
   relative loss gap is reported.

``--method ppo`` runs PPO (``METHODS["ppo"]``: the embedded RL prompts, the byte tokenizer, two
completions per prompt, exact-answer and format rewards, a critic, a k1 KL penalty with its
reference, two epochs of two minibatches per rollout batch) instead of language modelling: the ledgers then hold the rollout hashes, the
critic's gradient norm and parameter hash, the KL and the value statistics, and a SIGKILL lands
anywhere in a step (rollout, scoring, or between two of its four updates)::

    python benchmarks/gpu_determinism.py --method ppo --gpus 1 --seq 256 --steps 6 --interval 2 \
        --no-replay --out bench_out/gpu_determinism_ppo.json
    python benchmarks/gpu_determinism.py --method ppo --config tests/configs/e2e.yaml --gpus 1 --seq 112 \
        --steps 5 --interval 2 --override parallel.device=cpu --override parallel.precision=fp32   # CPU smoke

Across GPU counts the batch_hash and data_state_hash sequences must be equal (the data order
does not depend on the world size) and the losses close (reduction order differs, so not
bitwise). The global batch is the same for every G (``--global-batch``), split into
micro-batches of global / G. Prints the results and writes JSON (with each G's reference
ledger); exit code 1 if a check failed. GPU counts run on different machines compare with
``--compare a.json b.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_throughput import kill_job as _end_job  # noqa: E402  (the benchmarks folder is not a package)
from train_throughput import probe_environment  # noqa: E402


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank at once, and wait until each has exited: a rank
    tearing down its CUDA context takes seconds after SIGKILL, and its run-dir lock is live
    until then."""
    _end_job(proc, escalation=((signal.SIGKILL, 60.0),))


# What a method adds to the config (before --override, which may change any of it).
METHODS: dict[str, tuple[str, ...]] = {
    "lm": (),
    "ppo": ("objective.kind=ppo", "data.sources=[{path: datasets/tasks/rl/train, name: tasks-rl, record: prompt}]",
            "data.tokenizer=byte", "data.packing=whole", "objective.ppo.group_size=2",
            "objective.ppo.max_new_tokens=32", "objective.ppo.kl_coef=0.05", "objective.ppo.ppo_epochs=2",
            "objective.ppo.minibatches=2",
            # an untrained model's answers are never exact: a format reward makes the scores vary
            "objective.ppo.rewards=[{name: exact_answer}, {name: format_regex, pattern: '.*[a-z].*', weight: 0.5}]"),
}


def overrides(args: argparse.Namespace, gpus: int, run_root: Path) -> list[str]:
    micro = args.global_batch // gpus
    return [
        "--config", args.config,
        f"run.root={run_root}",
        f"parallel.strategy={'none' if gpus == 1 else 'fsdp'}",
        "parallel.precision=bf16",
        "determinism.mode=bitwise",
        f"data.seq_len={args.seq}",
        f"data.num_streams={args.global_batch}",
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={args.global_batch}",
        f"train.max_steps={args.steps}",
        "train.eval_interval=0",
        "data.eval_source=null",
        f"checkpoint.interval={args.interval}",
        "checkpoint.async_save=true",
        "metrics.tensorboard=false",
        "runtime.watchdog_timeout_s=600",
        *METHODS[args.method],
        *args.override,
    ]


def command(gpus: int, train_args: list[str]) -> list[str]:
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
            str(ROOT / "train.py"), *train_args]


WORKDIR = ROOT  # where the runs start (relative data paths resolve there): --workdir


def start(gpus: int, train_args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    handle = log.open("a")
    return subprocess.Popen(command(gpus, train_args), cwd=WORKDIR, env=env, stdout=handle,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        return -9


def run_dirs(run_root: Path) -> set[Path]:
    return set(run_root.glob("*/ledger.jsonl"))


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def new_run(gpus: int, args: argparse.Namespace, run_root: Path, name: str, log: Path) -> tuple[int, Path | None]:
    before = run_dirs(run_root)
    code = finish(start(gpus, overrides(args, gpus, run_root) + [f"run.name={name}"], log), args.timeout)
    made = sorted(run_dirs(run_root) - before)
    return code, made[0].parent if made else None


def killed_and_resumed(gpus: int, args: argparse.Namespace, run_root: Path, log: Path, rng: random.Random) -> dict:
    before = run_dirs(run_root)
    proc = start(gpus, overrides(args, gpus, run_root) + ["run.name=killed"], log)
    deadline = time.monotonic() + args.timeout
    kill_after = rng.randint(args.interval + 1, max(args.interval + 1, args.steps - 2))
    run_dir = None
    while time.monotonic() < deadline and proc.poll() is None:
        made = sorted(run_dirs(run_root) - before)
        # Killed once a checkpoint is intact (LATEST written; an asynchronous save may finish
        # steps after its ledger line), so the resume restores one rather than starting over.
        if made and len(ledger(made[0].parent)) >= kill_after and (made[0].parent / "checkpoints" / "LATEST").is_file():
            run_dir = made[0].parent
            time.sleep(rng.uniform(0.0, 0.3))
            break
        time.sleep(0.02)
    if run_dir is None or proc.poll() is not None:
        finish(proc, 1)
        return {"ok": False, "error": "the run ended before it could be killed"}
    kill_job(proc)
    lines_at_kill = len(ledger(run_dir))
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    code = finish(start(gpus, ["--resume", run_dir.name, f"run.root={run_root}"], log), args.timeout)
    out = {"ok": code == 0, "killed_after_lines": lines_at_kill, "latest_at_kill": latest, "resume_exit": code,
           "run_dir": str(run_dir)}
    if code != 0:
        out["log_tail"] = log.read_text(errors="replace")[-4000:]
    return out


def replayed(gpus: int, run_dir: Path, args: argparse.Namespace, run_root: Path, log: Path) -> dict:
    """Replay the step after the run's last checkpoint before its end (``--replay``): exit 0
    means the re-executed step matched the ledger bit for bit."""
    checkpointed = list(range(args.interval, args.steps, args.interval))
    if not checkpointed:
        return {"ok": False, "error": f"no checkpoint before step {args.steps} with interval {args.interval}"}
    step = checkpointed[-1] + 1
    code = finish(start(gpus, ["--replay", run_dir.name, "--step", str(step), f"run.root={run_root}"], log),
                  args.timeout)
    out = {"ok": code == 0, "step": step, "exit": code}
    if code != 0:
        out["log_tail"] = log.read_text(errors="replace")[-4000:]
    return out


def resumed_on_other_count(gpus: int, other: int, run_dir: Path, args: argparse.Namespace, run_root: Path,
                           log: Path) -> dict:
    """Resume a copy of ``run_dir`` (a ``gpus``-GPU run), cut back to its first checkpoint, on
    ``other`` GPUs; its steps must see the same batches and data states."""
    copy = run_dir.parent / f"{run_dir.name}-on{other}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run_dir, copy)
    checkpoints = copy / "checkpoints"
    for path in checkpoints.glob("step_*"):
        if int(path.name.split("_")[1]) > args.interval:
            shutil.rmtree(path)
    (checkpoints / "LATEST").write_text(f"step_{args.interval:08d}")
    # The micro-batch is not resumable: the same global batch in more or fewer micro-batches.
    resume = ["--resume", copy.name, f"run.root={run_root}"]
    if args.resume_strategy == "auto":
        resume.append(f"parallel.strategy={'none' if other == 1 else 'fsdp'}")
    code = finish(start(other, resume, log), args.timeout)
    out: dict = {"ok": False, "from_gpus": gpus, "resumed_at_step": args.interval, "exit": code,
                 "strategy": args.resume_strategy}
    if code != 0:
        out["log_tail"] = log.read_text(errors="replace")[-4000:]
        return out
    ref, got = ledger(run_dir), ledger(copy)
    out.update(resume_verdict(ref, got, sampled=samples_from_weights(run_dir), resumed_at=args.interval))
    first = args.interval  # the first resumed step's line: every field that differs there
    if len(got) > first and len(ref) > first:
        out["first_resumed_step_differs"] = sorted(k for k in set(ref[first]) | set(got[first])
                                                   if ref[first].get(k) != got[first].get(k))
    out["resumed_ledger"] = got
    return out


def resume_verdict(ref: list[dict], got: list[dict], *, sampled: bool, resumed_at: int) -> dict:
    """Whether a run resumed at step ``resumed_at`` on another GPU count kept the batches: the
    data states of every step, the batches of every step, or of the first resumed step only where
    they are ``sampled`` from the trained weights (module docstring, check 4)."""
    checked = resumed_at + 1 if sampled else len(ref)  # steps 1..checked must see the same batches
    same = len(got) == len(ref) and same_data(ref[:checked], got[:checked]) and same_states(ref, got)
    return {"ok": same, "same_batches": same, "samples_from_weights": sampled, "checked_steps": checked,
            "all_steps_same_batches": same_data(ref, got), "lines": len(got),
            "first_difference": first_batch_difference(ref, got), "max_rel_loss_diff": max_rel_loss_gap(ref, got)}


SAMPLING_KINDS = ("grpo", "ppo")


def samples_from_weights(run_dir: Path) -> bool:
    """Whether the run's batches are sampled from the trained weights (its recorded objective)."""
    import yaml

    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
    return recorded.get("objective", {}).get("kind") in SAMPLING_KINDS


def same_states(ref: list[dict], got: list[dict]) -> bool:
    return len(ref) == len(got) and all(a["data_state_hash"] == b["data_state_hash"] for a, b in zip(ref, got))


def first_batch_difference(ref: list[dict], got: list[dict]) -> str | None:
    """The first step whose batch hash (or rollout/episodes hash) differs, or None."""
    for a, b in zip(ref, got):
        for key in ("batch_hash", "rollout_hash", "episodes_hash"):
            if a.get(key) != b.get(key):
                return f"step {a['step']}: {key}"
    return None if len(ref) == len(got) else f"{len(ref)} lines vs {len(got)}"


def same_data(ref: list[dict], got: list[dict]) -> bool:
    """Two ledgers of one run's steps saw the same batches and data states, step for step."""
    return len(ref) == len(got) and all(
        a["step"] == b["step"] and a["batch_hash"] == b["batch_hash"] and a["data_state_hash"] == b["data_state_hash"]
        for a, b in zip(ref, got))


def max_rel_loss_gap(ref: list[dict], got: list[dict]) -> float | None:
    """The largest relative loss difference of two ledgers' steps (None for no steps)."""
    return max((abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12) for a, b in zip(ref, got)), default=None)


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    if len(a) != len(b):
        return f"{len(a)} lines vs {len(b)}"
    for x, y in zip(a, b):
        if x != y:
            field = next((k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)), "?")
            return f"step {x.get('step')}: {field} {x.get(field)!r} != {y.get(field)!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/qwen2.5-0.5b.yaml")
    p.add_argument("--method", choices=sorted(METHODS), default="lm",
                   help="lm: the config's own objective; ppo: PPO on the embedded RL prompts (METHODS)")
    p.add_argument("--gpus", default="1,2")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=0, help="of the kill moment")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-replay", action="store_true", help="skip the replay check")
    p.add_argument("--resume-on", type=int, default=0, metavar="G",
                   help="also resume each run's first checkpoint on G GPUs (same batches expected)")
    p.add_argument("--resume-strategy", choices=("keep", "auto"), default="keep",
                   help="keep: the run's parallel.strategy on the other GPU count; auto: none on one GPU, fsdp on more")
    p.add_argument("--run-root", default="/tmp/lockstep-determinism")
    p.add_argument("--workdir", default=str(ROOT), help="the runs' working directory (default: the repository)")
    p.add_argument("--out", default="bench_out/gpu_determinism.json")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="only compare the ledgers of earlier results")
    args = p.parse_args(argv)
    global WORKDIR
    WORKDIR = Path(args.workdir).resolve()
    if args.compare:
        return compare(args.compare)
    rng = random.Random(args.seed)
    # The evidence names its machine: GPUs, driver, torch, host CPU (train_throughput's probe).
    results: dict = {"env": probe_environment(), "config": args.config, "method": args.method,
                     "overrides": [*METHODS[args.method], *args.override], "seq": args.seq,
                     "global_batch": args.global_batch, "steps": args.steps, "interval": args.interval, "cases": {}}
    reference: dict[int, list[dict]] = {}
    failed = False
    for gpus in [int(g) for g in args.gpus.split(",")]:
        run_root = Path(args.run_root) / f"g{gpus}"
        run_root.mkdir(parents=True, exist_ok=True)
        log = run_root / "train.log"
        case: dict = {}
        code_a, dir_a = new_run(gpus, args, run_root, "repeat-a", log)
        code_b, dir_b = new_run(gpus, args, run_root, "repeat-b", log)
        if code_a or code_b or dir_a is None or dir_b is None:
            case["repeat"] = {"ok": False, "error": f"exit codes {code_a}, {code_b}; see {log}",
                              "log_tail": log.read_text()[-3000:]}
        else:
            a, b = ledger(dir_a), ledger(dir_b)
            diff = first_difference(a, b)
            case["repeat"] = {"ok": diff is None and len(a) == args.steps, "lines": len(a), "difference": diff,
                              "param_hash_steps": [r["step"] for r in a if "param_hash" in r]}
            reference[gpus] = a
            killed = killed_and_resumed(gpus, args, run_root, log, rng)
            if killed.get("ok"):
                diff = first_difference(a, ledger(Path(killed["run_dir"])))
                killed.update(ok=diff is None, difference=diff)
            case["kill_resume"] = killed
            if not args.no_replay:
                case["replay"] = replayed(gpus, dir_a, args, run_root, log)
            if args.resume_on and args.resume_on != gpus:
                case[f"resume_on_{args.resume_on}gpu"] = resumed_on_other_count(gpus, args.resume_on, dir_a, args,
                                                                                run_root, log)
        results["cases"][f"{gpus}gpu"] = case
        failed |= not all(check.get("ok") for check in case.values())
        print(f"[determinism] {gpus} GPU(s): " + ", ".join(f"{k}: {'ok' if v.get('ok') else 'FAILED'}"
                                                          for k, v in case.items()), flush=True)
    results["ledgers"] = {str(g): rows for g, rows in reference.items()}
    cross = across_world_sizes(reference)
    if cross:
        results["across_world_sizes"] = cross
        failed |= not all(entry["same_batches"] for entry in cross.values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "ledgers"}, indent=2))
    return 1 if failed else 0


def across_world_sizes(reference: dict[int, list[dict]]) -> dict:
    """Same batch and data-state hashes for every GPU count; the largest relative loss gap."""
    cross = {}
    if len(reference) > 1:
        counts = sorted(reference)
        base = reference[counts[0]]
        for gpus in counts[1:]:
            other = reference[gpus]
            cross[f"{counts[0]}v{gpus}"] = {"same_batches": same_data(base, other),
                                            "max_rel_loss_diff": max_rel_loss_gap(base, other)}
    return cross


def compare(paths: list[str]) -> int:
    reference = {}
    for path in paths:
        for gpus, rows in json.loads(Path(path).read_text()).get("ledgers", {}).items():
            reference[int(gpus)] = rows
    cross = across_world_sizes(reference)
    print(json.dumps(cross, indent=2))
    return 0 if cross and all(entry["same_batches"] for entry in cross.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
