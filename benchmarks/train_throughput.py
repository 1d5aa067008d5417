"""Training throughput of Lockstep itself, through the real entry point, next to the HF baseline.

    python benchmarks/train_throughput.py --shapes qwen2.5-0.5b,qwen3-1.7b --seqs 2048,4096 \
        --gpus 1 --modes fast,bitwise --steps 20 --warmup 5 --out bench_out/tp.json
    python benchmarks/train_throughput.py --report bench_out/a.json bench_out/b.json   # merge + table
    python benchmarks/train_throughput.py --shapes tiny --seqs 128 --gpus 1 --steps 3 --device cpu

Every case (shape x seq x GPUs x determinism mode) is one training run launched exactly as
a user launches it::

    python -m torch.distributed.run --standalone --nproc_per_node=G train.py \
        --config configs/<shape>.yaml <overrides>

with the overrides of ``case_overrides`` (bf16; fsdp on several GPUs, ``none`` on one GPU,
see ``--strategy-1gpu``; the micro-batch per GPU and a global batch of micro x GPUs, so no
accumulation; warmup + steps + 1 optimizer steps; no checkpoints, no eval, no TensorBoard;
metrics every step). The numbers come from what the run wrote: ``metrics.jsonl`` (per-step
records reduced over ranks: each metric as {mean, min, max, sum}) and ``ledger.jsonl``.

Steady state is every step after ``--warmup`` except the last: a run has warmup + steps + 1
steps, because the loop hashes all parameters for the ledger at its last step. tokens/s is
the end-to-end rate: the tokens of the steady steps over the wall time between the metric
records of step ``warmup`` and of the last steady step (so it includes everything the loop
does: data wait, ledger, metric all-reduce). MFU in both conventions of models/flops.py, per
GPU. The data-wait fraction is the time the loop blocked in ``next(batch)`` over the step
time. See benchmarks/README.md.

Variants: ``--variant NAME:KEY=VALUE`` (repeatable; a bare ``--variant NAME`` adds none) runs
every case once per named set of extra overrides, e.g. bf16 against FP8, and ``--micro-batch
16,24`` runs each micro-batch; the report then prints each variant's tokens/s per GPU with its
ratio to the first variant, at every micro-batch and at each variant's fastest one (FP8 needs
less memory and can run a larger micro-batch). With ``--repeat`` the variants alternate on the
same GPUs, so a drift of the card or host touches them alike.

Several-GPU runs of one setting on one host differ by several points of per-GPU scaling from
run to run (docs/performance.md). ``--repeat N`` runs the whole case list N times, round the
list, and adds a table of each case's scaling over its runs (median, lowest, highest), each
against the median of its 1-GPU runs.

After the cases, the transformers baseline (benchmarks/hf_baseline.py, eager and compiled)
runs for each shape and seq on GPU 0 of the same machine, with the same micro-batch.

Failing cases are recorded (return code, stderr tail, the run's failure file) and the next
case runs. The JSON is rewritten after every case, so a run killed by a time limit keeps
what finished; ``--budget`` stops starting cases that would not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import hf_baseline as hfb  # noqa: E402  (the benchmarks folder is not a package)

GIB = hfb.GIB
PYTHON = sys.executable
DATASET_DIR = ROOT / "datasets" / "stdlib"
STDERR_TAIL = 4000
MIN_CASE_SECONDS = 45  # under --budget, do not start a case with less time than this left

# The host's CPU too: several-GPU runs at small steps are bound by it, and the same run has
# scaled 9 points apart on two hosts with the same GPUs (docs/performance.md, 2026-11-28b).
# Hosts whose CPUs report the same model name are told apart by host_boot: a hash of the
# machine id and the boot id (different on another machine, or after a reboot).
ENV_PROBE = r"""
import glob, hashlib, importlib.util, json, os, platform, shutil, socket, subprocess
import torch
out = {"python": platform.python_version(), "host": socket.gethostname(), "torch": torch.__version__,
       "cuda": torch.version.cuda, "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
out["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(out["gpu_count"])]
try:
    with open("/proc/cpuinfo") as f:
        out["cpu_model"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
except OSError:
    out["cpu_model"] = ""
out["cpu_model"] = out["cpu_model"] or platform.processor() or platform.machine()
out["cpu_count"] = os.cpu_count()
out["numa_nodes"] = len(glob.glob("/sys/devices/system/node/node[0-9]*"))
out["load_avg_1m"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
ids = []
for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
    try:
        with open(path) as f:
            ids.append(f.read().strip())
    except OSError:
        pass
out["host_boot"] = hashlib.sha256("/".join(ids).encode()).hexdigest()[:12] if ids else None
if out["gpu_count"] and shutil.which("nvidia-smi"):
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60)
    out["gpu_driver"] = (smi.stdout.splitlines() or [None])[0] if smi.returncode == 0 else None
for name in ("transformers", "zstandard", "pyarrow", "git"):
    out["has_" + name] = importlib.util.find_spec(name) is not None
if out["has_transformers"]:  # its version from the installed metadata: importing it costs seconds
    import importlib.metadata
    out["transformers"] = importlib.metadata.version("transformers")
print(json.dumps(out))
"""


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    shape: str
    seq: int
    gpus: int
    mode: str  # determinism.mode: fast | bitwise
    micro_batch: int
    compile: str  # preset | on | off (parallel.compile)
    variant: str = ""  # a --variant name ("" without variants)

    @property
    def name(self) -> str:
        compile_tag = "" if self.compile == "preset" else f"-compile_{self.compile}"
        variant_tag = f"-{self.variant}" if self.variant else ""
        return f"{self.shape}-s{self.seq}-b{self.micro_batch}-g{self.gpus}-{self.mode}{compile_tag}{variant_tag}"

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.gpus  # accumulation 1


def plan_cases(args: argparse.Namespace) -> list[Case]:
    """Every shape x seq x GPUs x mode x compile x micro-batch x variant, variants innermost
    (so the variants of one case run one after the other)."""
    cases = []
    for shape, seq, gpus, mode, comp in itertools.product(
        args.shapes, args.seqs, args.gpus, args.modes, args.compile
    ):
        if args.micro_batch:
            micros = args.micro_batch
        elif args.tokens_per_micro_batch:
            micros = [max(1, args.tokens_per_micro_batch // seq)]
        else:
            micros = [hfb.default_micro_batch(shape, seq)]
        for micro, variant in itertools.product(micros, args.variants or [""]):
            cases.append(Case(shape, seq, gpus, mode, micro, comp, variant))
    return cases


VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,23}")


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """``--variant NAME[:KEY=VALUE]`` items -> {name: overrides}, in the order first named.
    Raises ValueError naming the item that is not of that form."""
    variants: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, override = spec.partition(":")
        if not VARIANT_NAME.fullmatch(name):
            raise ValueError(f"--variant {spec!r}: the name must match {VARIANT_NAME.pattern} "
                             "(it goes into the run name)")
        if sep and "=" not in override:
            raise ValueError(f"--variant {spec!r}: after the name comes KEY=VALUE, e.g. fp8:parallel.float8=tensorwise")
        variants.setdefault(name, [])
        if sep:
            variants[name].append(override)
    return variants


def strategy_for(gpus: int, args: argparse.Namespace) -> str:
    # One GPU: `none` by default. Our FSDP is not applied in a single process (no mesh), and
    # training.precision turns autocast off for strategy=fsdp, so a one-process "fsdp" run
    # would compute in fp32. `none` is bf16 autocast over fp32 master weights, the same
    # numerics as FSDP's bf16 MixedPrecisionPolicy on several GPUs.
    return args.strategy_1gpu if gpus == 1 else args.strategy


def case_overrides(case: Case, args: argparse.Namespace, env: dict[str, Any], run_root: Path) -> list[str]:
    config_path, extra = hfb.preset_args(case.shape)
    overrides = [
        *extra,
        f"run.name=bench-{case.name}",
        f"run.root={run_root}",
        f"parallel.strategy={strategy_for(case.gpus, args)}",
        "parallel.precision=bf16",
        f"parallel.device={args.device}",
        f"data.seq_len={case.seq}",
        f"data.num_streams={num_streams(case, config_path, extra)}",
        f"train.micro_batch_size={case.micro_batch}",
        f"train.global_batch_size={case.global_batch}",
        # +1: the last step also hashes every parameter for the ledger (seconds for 1.7B),
        # so it is run but left out of the measured window.
        f"train.max_steps={args.warmup + args.steps + 1}",
        "train.eval_interval=0",
        "checkpoint.interval=0",
        "checkpoint.at_end=false",
        "metrics.tensorboard=false",
        "metrics.log_interval=1",
        f"determinism.mode={case.mode}",
        # A slow first step (compilation) must not trip the watchdog; our timeout covers hangs.
        f"runtime.watchdog_timeout_s={max(600, int(args.timeout))}",
        # Random init at a high LR may blow up in a few steps; a skipped update costs the
        # same compute, so the measurement stays valid (skips are counted in the result).
        "runtime.on_nonfinite=skip",
        *data_overrides(env, args.data_sources),
    ]
    if case.compile != "preset":
        overrides.append(f"parallel.compile={'true' if case.compile == 'on' else 'false'}")
    return merge_overrides(overrides, extra_overrides(case, args))


def extra_overrides(case: Case, args: argparse.Namespace) -> list[str]:
    """The user's overrides of this case: every --override, then its variant's (which win).
    Other benchmarks build cases with their own arguments, without variants."""
    variants = getattr(args, "variant_overrides", {})
    return merge_overrides(list(args.override), list(variants.get(case.variant, [])))


def merge_overrides(base: list[str], later: list[str]) -> list[str]:
    """``base`` then ``later``, where a key set in ``later`` replaces its entry in ``base``."""
    replaced = {item.split("=", 1)[0] for item in later}
    return [item for item in base if item.split("=", 1)[0] not in replaced] + list(later)


def num_streams(case: Case, config_path: str, extra: list[str]) -> int:
    """The preset's data.num_streams if it fits this batch and world size, else the global batch.

    A global batch takes the same number of sequences from every stream, and every rank
    runs a whole number of streams.
    """
    from core.config import load

    preset = load(ROOT / config_path, extra).data.num_streams
    if case.global_batch % preset == 0 and preset % case.gpus == 0:
        return preset
    return case.global_batch


def data_overrides(env: dict[str, Any], sources: str = "auto") -> list[str]:
    """Eval off. Sources: the preset's, or the Parquet shards only (``auto``: Parquet only
    when zstandard, which the .jsonl.zst shards need, is not installed)."""
    overrides = ["data.eval_source=null"]
    if sources == "parquet" or (sources == "auto" and not env.get("has_zstandard", True)):
        overrides.append(f'data.sources=[{{path: "{parquet_source()}", format: parquet, name: stdlib-parquet}}]')
    return overrides


def parquet_source() -> str:
    """The prepared Parquet shards: a directory of them (current layout) or a glob (older one)."""
    directory = DATASET_DIR / "train" / "parquet"
    if directory.is_dir():
        return str(directory.relative_to(ROOT))
    return str((DATASET_DIR / "train").relative_to(ROOT)) + "/*.parquet"


def train_command(case: Case, overrides: list[str], config_path: str, launcher_args: list[str] = ()) -> list[str]:
    return [
        PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.gpus}", *launcher_args,
        "train.py", "--config", config_path, *overrides,
    ]


# --------------------------------------------------------------------------- environment


def probe_environment() -> dict[str, Any]:
    """Versions and GPUs, asked of a child process so this one never holds a CUDA context."""
    proc = subprocess.run([PYTHON, "-c", ENV_PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr[-STDERR_TAIL:], "gpu_count": 0, "gpu_names": []}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ensure_dataset(timeout: float) -> dict[str, Any]:
    """Run ``python -m data prepare`` when no prepared shards exist yet."""
    if any((DATASET_DIR / "train").rglob("*.parquet")):
        return {"prepared": False, "path": str(DATASET_DIR)}
    started = time.monotonic()
    cmd = [PYTHON, "-m", "data", "prepare"]
    print(f"[bench] {DATASET_DIR} is missing: {shlex.join(cmd)}", flush=True)
    done = launch(cmd, timeout=timeout)
    info = {"prepared": True, "command": shlex.join(cmd), "returncode": done.returncode,
            "seconds": time.monotonic() - started}
    if done.returncode != 0 or done.timed_out:
        info["stderr_tail"] = (done.stdout + done.stderr)[-STDERR_TAIL:]
        print(f"[bench] data prepare failed ({done.returncode}); it writes .jsonl.zst shards and needs "
              f"zstandard: install it or copy a prepared datasets/ here.\n{info['stderr_tail']}", flush=True)
    return info


def warn_missing_packages(env: dict[str, Any]) -> None:
    if not env.get("has_zstandard", True):
        print("[bench] warning: zstandard is not installed. The cases train on the Parquet shards "
              "only, but train.py still fails if the data layer imports zstandard at module level "
              "(data/sources/zstd.py); install it or make that import lazy.", file=sys.stderr, flush=True)
    if not env.get("has_pyarrow", True):
        print("[bench] warning: pyarrow is not installed; the Parquet shards cannot be read.", file=sys.stderr)


# --------------------------------------------------------------------------- launching


@dataclass
class Launch:
    command: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    started_at: float  # unix time
    timed_out: bool


def launch(
    cmd: list[str], *, timeout: float, env_extra: dict[str, str] | None = None, log_path: Path | None = None
) -> Launch:
    """Run ``cmd`` from the repo root in its own session; on timeout kill that whole group."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    started_at = time.time()
    started = time.monotonic()
    print(f"[bench] $ {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_job(proc)
        stdout, stderr = proc.communicate()
    result = Launch(cmd, proc.returncode, stdout, stderr, time.monotonic() - started, started_at, timed_out)
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"$ {shlex.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n")
    return result


def kill_job(proc: subprocess.Popen, escalation=((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0))) -> None:
    """End a torchrun job whole: each ``(signal, grace seconds)`` in turn goes to torchrun's
    process group and to every rank (torchrun starts the ranks in sessions of their own, out
    of the group's reach), until all have exited (zombies count). A rank left running would
    hold the GPU, the run dir's lock and the job's output pipes."""
    import psutil

    try:
        job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        job = []

    def ended() -> bool:
        try:
            return all(not m.is_running() or m.status() == psutil.STATUS_ZOMBIE for m in job)
        except psutil.NoSuchProcess:
            return False  # vanished between the two checks: look again

    for sig, grace in escalation:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        for member in reversed(job):
            with contextlib.suppress(psutil.NoSuchProcess):
                member.send_signal(sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
            if proc.returncode is not None and ended():
                return


def find_run_dir(stdout: str, run_root: Path, run_name: str) -> Path | None:
    for line in stdout.splitlines():
        if line.startswith("run_dir: "):
            path = Path(line.split(": ", 1)[1].strip())
            return path if path.is_absolute() else ROOT / path
    matches = sorted(run_root.glob(f"{run_name}-*"))
    return matches[-1] if matches else None


def failure_text(launch_result: Launch, run_dir: Path | None) -> dict[str, Any]:
    """What the job said when it failed: stderr/stdout tails and the run's failure files."""
    out: dict[str, Any] = {
        "returncode": launch_result.returncode,
        "timed_out": launch_result.timed_out,
        "stderr_tail": launch_result.stderr[-STDERR_TAIL:],
        "stdout_tail": launch_result.stdout[-1500:],
    }
    if run_dir is not None and (run_dir / "diagnostics").is_dir():
        failures = sorted((run_dir / "diagnostics").glob("rank*_failure.txt"))
        if failures:
            out["failure_file"] = str(failures[0])
            out["failure_tail"] = failures[0].read_text(errors="replace")[-STDERR_TAIL:]
    # train.py's one-line reason ("[rank R] ..."), else the last non-empty line.
    lines = [l.strip() for l in (launch_result.stderr + "\n" + launch_result.stdout).splitlines() if l.strip()]
    reason = next((l for l in lines if l.startswith("[rank")), None)
    reason = reason or (lines[-1] if lines else "no output")
    out["error"] = ("timed out; " if launch_result.timed_out else "") + reason
    return out


# --------------------------------------------------------------------------- reading a run


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a kill
    return rows


def metric(record: dict[str, Any], name: str, stat: str = "mean") -> float | None:
    value = record.get("metrics", {}).get(name)
    if isinstance(value, dict):
        value = value.get(stat)
    return float(value) if isinstance(value, (int, float)) else None


def step_seconds(record: dict[str, Any], stat: str) -> float | None:
    """The step's duration: the timer's ``time_step`` total, else the loop's ``step_time``."""
    value = metric(record, "time_step", stat)
    return value if value is not None else metric(record, "step_time", stat)


def resolved_config(run_dir: Path):
    import yaml

    from core.config import from_dict

    path = run_dir / "config.yaml"
    return from_dict(yaml.safe_load(path.read_text())) if path.is_file() else None


def profiled_steps(config) -> set[int]:
    """The steps of the run's torch.profiler window (``runtime.profile_start_step``, 0: none)."""
    if config is None or not config.runtime.profile_start_step:
        return set()
    first = config.runtime.profile_start_step
    return set(range(first, first + config.runtime.profile_steps))


def summarize_run(run_dir: Path, *, warmup: int, gpus: int, peak: float | None, started_at: float) -> dict[str, Any]:
    """Steady-state throughput, MFU, memory and phase times of one finished run directory."""
    records = sorted(
        (r for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("metrics"), dict)),
        key=lambda r: r["step"],
    )
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    out: dict[str, Any] = {"run_dir": str(run_dir), "steps_recorded": len(records), "ledger_lines": len(ledger)}
    config = resolved_config(run_dir)
    if config is not None:
        out["resolved"] = {
            "strategy": config.parallel.strategy,
            "precision": config.parallel.precision,
            "compile": config.parallel.compile,
            "activation_checkpointing": config.parallel.activation_checkpointing,
            "float8": config.parallel.float8,
            "attention": config.model.attention,
            "sdpa_backends": config.model.sdpa_backends,
            "num_streams": config.data.num_streams,
            "workers": config.data.workers,
            "sources": [s.path for s in config.data.sources],
        }
    if ledger:
        out["loss_first"], out["loss_last"] = ledger[0].get("loss"), ledger[-1].get("loss")
        out["skipped_steps"] = sum(1 for line in ledger if line.get("skipped"))
    if not records:
        out["error"] = "metrics.jsonl has no records"
        return out

    out["first_record_after_launch_s"] = records[0]["time"] - started_at
    out["first_step_s"] = step_seconds(records[0], "max")
    start = next((r for r in records if r["step"] == warmup), None)
    last = max(r["step"] for r in records)
    steady = [r for r in records if warmup < r["step"] < last]  # the last step hashes parameters
    if start is None or not steady or any(r.get("interval_steps", 1) != 1 for r in steady):
        out["error"] = f"no steady-state window after warmup step {warmup} (need metrics.log_interval=1)"
        return out
    profiled = profiled_steps(config)
    if any(r["step"] in profiled for r in steady):
        # The profiler's trace is written at its window's end, inside the wall time between records
        # (a 0.093 s MoE step read as 0.15 s from the wall): those steps are left out and the rate
        # comes from the other steps' own times.
        out["profiled_steps_left_out"] = sorted(r["step"] for r in steady if r["step"] in profiled)
        steady = [r for r in steady if r["step"] not in profiled]
        if not steady:
            out["error"] = f"every step after warmup step {warmup} is in the profiler's window {sorted(profiled)}"
            return out

    tokens = sum(metric(r, "tokens", "sum") or 0.0 for r in steady)
    wall = steady[-1]["time"] - start["time"]
    step_max = [step_seconds(r, "max") for r in steady]
    step_mean = [step_seconds(r, "mean") for r in steady]
    from_step_times = (tokens / sum(step_max)) if all(step_max) else None
    out.update(
        steady_steps=len(steady),
        tokens_per_step=tokens / len(steady),
        tokens_per_s=from_step_times if "profiled_steps_left_out" in out else (tokens / wall if wall > 0 else None),
        tokens_per_s_from_step_times=from_step_times,
        step_time_s=(sum(step_max) / len(step_max)) if all(step_max) else None,
        step_time_median_s=statistics.median(step_max) if all(step_max) else None,
        step_times_s=[round(t, 5) for t in step_max] if all(step_max) else None,
        tracker_mfu=_mean([r.get("mfu") for r in steady]),
    )
    out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / gpus if out["tokens_per_s"] else None
    waits = [metric(r, "time_data_wait", "mean") for r in steady]
    waits_max = [metric(r, "time_data_wait", "max") for r in steady]
    if all(w is not None for w in waits) and all(step_mean):
        out["data_wait_fraction"] = sum(waits) / sum(step_mean)
        out["data_wait_fraction_worst_rank"] = max(w / s for w, s in zip(waits_max, step_max))
    out["phases_s"] = {
        name[len("time_"):]: _mean([metric(r, name) for r in steady])
        for name in sorted(steady[-1]["metrics"])
        if name.startswith("time_")
    }
    out.update(peak_memory(records))
    if config is not None:
        flops = hfb.flop_counts(config.model, config.data.seq_len)
        out["flops_per_token"] = flops
        out["mfu_torchtitan"] = hfb.mfu(flops["torchtitan"], out["tokens_per_s"], peak, gpus)
        out["mfu_all_matmuls"] = hfb.mfu(flops["all_matmuls"], out["tokens_per_s"], peak, gpus)
    return out


def peak_memory(records: list[dict[str, Any]]) -> dict[str, float]:
    """Largest per-rank peak over the run (bytes metrics from runtime.memory, or GiB ones)."""
    out = {}
    for key, names in (
        ("peak_mem_allocated_gib", ("cuda_max_allocated_bytes", "mem/cuda_max_allocated_gib")),
        ("peak_mem_reserved_gib", ("cuda_max_reserved_bytes", "mem/cuda_max_reserved_gib", "mem/cuda_reserved_gib")),
        ("peak_rss_gib", ("rss_bytes", "mem/rss_gib")),
    ):
        for name in names:
            values = [metric(r, name, "max") for r in records]
            values = [v for v in values if v is not None]
            if values:
                out[key] = max(values) / (GIB if name.endswith("_bytes") else 1.0)
                break
    return out


def _mean(values: Iterable[Any]) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, (int, float))]
    return sum(numbers) / len(numbers) if numbers else None


# --------------------------------------------------------------------------- running


class Budget:
    """Seconds left of ``--budget`` (unlimited when 0)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()

    def left(self) -> float:
        return float("inf") if not self.seconds else self.seconds - (time.monotonic() - self.started)

    def timeout(self, wanted: float) -> float | None:
        """The timeout to give a case, or None when the case should not start."""
        left = self.left() - 10  # leave time to write the results
        return None if left < MIN_CASE_SECONDS else min(wanted, left)


def run_case(
    case: Case, args: argparse.Namespace, env: dict[str, Any], run_root: Path, budget: Budget, repeat: int = 0
) -> dict[str, Any]:
    config_path, _ = hfb.preset_args(case.shape)
    overrides = case_overrides(case, args, env, run_root)
    cmd = train_command(case, overrides, config_path, args.launcher_arg)
    result: dict[str, Any] = {"kind": "lockstep", "case": case.name, **asdict(case),
                              "strategy": strategy_for(case.gpus, args), "overrides": extra_overrides(case, args),
                              "repeat": repeat, "command": shlex.join(cmd)}
    if args.device == "cuda" and case.gpus > env.get("gpu_count", 0):
        return {**result, "status": "skipped", "error": f"needs {case.gpus} GPUs, found {env.get('gpu_count', 0)}"}
    timeout = budget.timeout(args.timeout)
    if timeout is None:
        return {**result, "status": "skipped", "error": "not started: --budget exhausted"}
    if args.dry_run:
        return {**result, "status": "dry-run"}
    log_name = case.name if args.repeat == 1 else f"{case.name}-r{repeat}"
    done = launch(cmd, timeout=timeout, log_path=args.log_dir / f"{log_name}.log")
    run_dir = find_run_dir(done.stdout, run_root, f"bench-{case.name}")
    result["seconds"] = done.seconds
    if run_dir is not None:
        result.update(summarize_run(run_dir, warmup=args.warmup, gpus=case.gpus, peak=env.get("peak_flops"),
                                    started_at=done.started_at))
    ok = done.returncode == 0 and not done.timed_out and result.get("tokens_per_s")
    result["status"] = "ok" if ok else ("timeout" if done.timed_out else "failed")
    if not ok:
        result.update(failure_text(done, run_dir))
    return result


def run_baseline(shape: str, seq: int, micro: int, compiled: bool, args: argparse.Namespace,
                 run_root: Path, budget: Budget) -> dict[str, Any]:
    name = f"hf-{'compile' if compiled else 'eager'}-{shape}-s{seq}-b{micro}"
    out_path = run_root / f"{name}.json"
    cmd = [
        PYTHON, "benchmarks/hf_baseline.py", "--shape", shape, "--seq", str(seq), "--micro-batch", str(micro),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--compile" if compiled else "--no-compile",
        "--device", args.device, "--out", str(out_path),
    ]
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    result: dict[str, Any] = {
        "kind": "hf_baseline", "case": name, "shape": shape, "seq": seq, "gpus": 1, "micro_batch": micro,
        "mode": "compile" if compiled else "eager", "command": shlex.join(cmd),
    }
    timeout = budget.timeout(args.timeout)
    if timeout is None:
        return {**result, "status": "skipped", "error": "not started: --budget exhausted"}
    if args.dry_run:
        return {**result, "status": "dry-run"}
    # GPU 0 only, whatever the machine has: the baseline is a one-GPU number.
    env_extra = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    done = launch(cmd, timeout=timeout, env_extra=env_extra if args.device != "cpu" else None,
                  log_path=args.log_dir / f"{name}.log")
    result["seconds"] = done.seconds
    if out_path.is_file():
        measured = json.loads(out_path.read_text())
        result.update({k: v for k, v in measured.items() if k not in ("shape", "tool")})
        result["tokens_per_s_per_gpu"] = measured.get("tokens_per_s")
    if done.returncode != 0 or done.timed_out:
        measured_status, measured_error = result.get("status"), result.get("error")
        result.update(failure_text(done, None))
        # hf_baseline's own verdict (oom/failed and its exception) is the more precise one.
        result["status"] = "timeout" if done.timed_out else (
            measured_status if measured_status in ("oom", "failed") else "failed")
        result["error"] = measured_error or result["error"]
    return result


def baselines_wanted(cases: list[Case], args: argparse.Namespace) -> list[tuple[str, int, int, bool]]:
    seen = []
    for case in cases:
        for compiled in args.baseline_modes:
            key = (case.shape, case.seq, case.micro_batch, compiled)
            if key not in seen:
                seen.append(key)
    return seen


# --------------------------------------------------------------------------- report


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(results: list[dict[str, Any]]) -> str:
    head = ("| run | status | tokens/s | tokens/s/GPU | MFU torchtitan | MFU all matmuls | "
            "peak mem GiB | data wait | step s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        wait = r.get("data_wait_fraction")
        lines.append("| " + " | ".join([
            r.get("case", "?"),
            r.get("status", "?"),
            fmt(r.get("tokens_per_s"), ",.0f"),
            fmt(r.get("tokens_per_s_per_gpu"), ",.0f"),
            fmt(r.get("mfu_torchtitan"), ".1%"),
            fmt(r.get("mfu_all_matmuls"), ".1%"),
            fmt(r.get("peak_mem_allocated_gib"), ".1f"),
            fmt(wait, ".1%"),
            fmt(r.get("step_time_s"), ".3f"),
        ]) + " |")
    return "\n".join(lines)


def comparison_table(results: list[dict[str, Any]]) -> str:
    """Per shape/seq/micro-batch on one GPU: our tokens/s next to the baseline's."""
    rows = {}
    for r in results:
        if r.get("status") != "ok" or r.get("gpus") != 1:
            continue
        key = (r.get("shape"), r.get("seq"), r.get("micro_batch"))
        label = f"lockstep {r['mode']}" if r["kind"] == "lockstep" else f"hf {r['mode']}"
        if r["kind"] == "lockstep" and r.get("compile") not in (None, "preset"):
            label += f" compile={r['compile']}"
        if r["kind"] == "lockstep" and variant_label(r) != "base":
            label += f" {variant_label(r)}"
        rows.setdefault(key, {})[label] = r.get("tokens_per_s")
    if not rows:
        return ""
    labels = sorted({label for row in rows.values() for label in row})
    lines = ["| shape | seq | micro | " + " | ".join(labels) + " |", "|" + "---|" * (3 + len(labels))]
    for (shape, seq, micro), row in sorted(rows.items(), key=lambda kv: str(kv[0])):
        lines.append(f"| {shape} | {seq} | {micro} | " + " | ".join(fmt(row.get(l), ",.0f") for l in labels) + " |")
    return "1-GPU tokens/s, same card:\n\n" + "\n".join(lines)


def variant_label(result: dict[str, Any]) -> str:
    """A result's variant: its --variant name, or (results without one, e.g. separate
    invocations merged with --report) its overrides, or "base" where it has none."""
    return result.get("variant") or " ".join(result.get("overrides") or []) or "base"


def variant_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each variant's tokens/s per GPU (median over its repeats) next to the first variant's,
    per shape, seq, GPUs, mode and compile setting: at every micro-batch both ran, and at
    each one's fastest micro-batch. The first variant is the one of the first result (the
    first --variant; in merged reports, the first file's). Rows only where two variants ran."""
    ok = [r for r in results if r.get("kind") == "lockstep" and r.get("status") == "ok" and r.get("tokens_per_s_per_gpu")]
    order: list[str] = []
    for r in ok:
        if variant_label(r) not in order:
            order.append(variant_label(r))
    if len(order) < 2:
        return []
    groups: dict[tuple, dict[str, dict[int, list[float]]]] = {}
    for r in ok:
        key = (r.get("shape"), r.get("seq"), r.get("gpus"), r.get("mode"), r.get("compile"))
        runs = groups.setdefault(key, {}).setdefault(variant_label(r), {})
        runs.setdefault(r.get("micro_batch"), []).append(r["tokens_per_s_per_gpu"])
    rows = []
    for (shape, seq, gpus, mode, compile_), by_variant in groups.items():
        labels = [label for label in order if label in by_variant]
        if len(labels) < 2:
            continue
        reference = labels[0]
        medians = {label: {micro: statistics.median(v) for micro, v in by_variant[label].items()} for label in labels}

        def row(label: str, micro, ref_micro, **extra) -> dict[str, Any]:
            value, base = medians[label][micro], medians[reference][ref_micro]
            return {"shape": shape, "seq": seq, "gpus": gpus, "mode": mode, "compile": compile_,
                    "reference": reference, "variant": label, "micro_batch": micro, "reference_micro_batch": ref_micro,
                    "runs": len(by_variant[label][micro]), "reference_runs": len(by_variant[reference][ref_micro]),
                    "tokens_per_s_per_gpu": value, "reference_tokens_per_s_per_gpu": base, "ratio": value / base,
                    **extra}

        for micro in sorted({m for label in labels for m in medians[label]}, key=lambda m: (m is None, m)):
            rows.extend(row(label, micro, micro) for label in labels[1:]
                        if medians[reference].get(micro) and medians[label].get(micro))
        if any(len(medians[label]) > 1 for label in labels):
            fastest = {label: max(medians[label], key=medians[label].get) for label in labels}
            rows.extend(row(label, fastest[label], fastest[reference], fastest=True) for label in labels[1:])
    return rows


def variant_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["| shape | seq | GPUs | mode | variant | micro-batch (runs) | tokens/s/GPU | against | "
             "its micro-batch (runs) | its tokens/s/GPU | ratio |", "|" + "---|" * 11]
    for row in rows:
        where = " (each at its fastest)" if row.get("fastest") else ""
        lines.append(
            f"| {row['shape']} | {row['seq']} | {row['gpus']} | {row['mode']} | {row['variant']} | "
            f"{row['micro_batch']} ({row['runs']}){where} | {fmt(row['tokens_per_s_per_gpu'], ',.0f')} | "
            f"{row['reference']} | {row['reference_micro_batch']} ({row['reference_runs']}) | "
            f"{fmt(row['reference_tokens_per_s_per_gpu'], ',.0f')} | {fmt(row['ratio'], '.3f')}x |")
    return ("Variants against the first (tokens/s per GPU, the median of each one's runs; compare "
            "only runs of one card):\n\n" + "\n".join(lines))


def scaling_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-GPU scaling of every several-GPU run against the 1-GPU run of the same shape, seq,
    micro-batch (per GPU), mode and compile setting: its tokens/s per GPU over the 1-GPU
    tokens/s, and the same from the median step times (each GPU does the same work per step,
    so the ratio of step times is the ratio of per-GPU throughput, without the few slow steps
    that move the mean). Merged reports (``--report``) pair runs of different invocations by
    that key (and the variant) alone; compare only runs of one host."""
    def key(r: dict[str, Any]) -> tuple:
        return r.get("shape"), r.get("seq"), r.get("micro_batch"), r.get("mode"), r.get("compile"), r.get("variant", "")

    ok = [r for r in results if r.get("kind") == "lockstep" and r.get("status") == "ok" and r.get("tokens_per_s")]
    singles: dict[tuple, list[dict[str, Any]]] = {}
    for r in ok:
        if r.get("gpus") == 1:
            singles.setdefault(key(r), []).append(r)
    rows = []
    for r in ok:
        runs = singles.get(key(r))
        if r.get("gpus", 1) <= 1 or not runs:
            continue
        # Repeated 1-GPU runs (--repeat): their medians, so no one run of them sets every row.
        base_tokens = statistics.median(b["tokens_per_s"] for b in runs)
        base_steps = [b["step_time_median_s"] for b in runs if b.get("step_time_median_s")]
        by_median = None
        if r.get("step_time_median_s") and base_steps:
            by_median = statistics.median(base_steps) / r["step_time_median_s"]
        rows.append({"case": r["case"], "one_gpu_case": runs[0]["case"], "one_gpu_runs": len(runs),
                     "gpus": r["gpus"], "repeat": r.get("repeat", 0),
                     "strategy": r.get("strategy"), "overrides": r.get("overrides", []),
                     "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                     "one_gpu_tokens_per_s": base_tokens,
                     "scaling": r["tokens_per_s_per_gpu"] / base_tokens,
                     "scaling_by_median_step": by_median})
    return rows


def repeat_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Scaling rows of one case and settings (repeats of one run, ``--repeat``, or the same run
    in merged reports) grouped: how many, and the median, lowest and highest per-GPU scaling.
    Several-GPU runs on one host differ by several points from run to run (docs/performance.md);
    a setting is judged by its median over repeats, not by one run."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["case"], row["strategy"], tuple(row.get("overrides", []))), []).append(row)
    summary = []
    for (case, strategy, overrides), group in groups.items():
        values = [row["scaling"] for row in group]
        by_step = [row["scaling_by_median_step"] for row in group if row["scaling_by_median_step"] is not None]
        summary.append({"case": case, "strategy": strategy, "overrides": list(overrides), "runs": len(group),
                        "one_gpu_runs": group[0]["one_gpu_runs"],
                        "scaling_median": statistics.median(values), "scaling_min": min(values),
                        "scaling_max": max(values),
                        "by_median_step_median": statistics.median(by_step) if by_step else None})
    return summary


def scaling_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["| run | strategy | overrides | tokens/s/GPU | 1-GPU tokens/s | per-GPU scaling | by median step |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        overrides = " ".join(f"`{o}`" for o in row.get("overrides", [])) or "-"
        lines.append(f"| {row['case']} | {row['strategy']} | {overrides} | {fmt(row['tokens_per_s_per_gpu'], ',.0f')} | "
                     f"{fmt(row['one_gpu_tokens_per_s'], ',.0f')} | {fmt(row['scaling'], '.1%')} | "
                     f"{fmt(row['scaling_by_median_step'], '.1%')} |")
    return "Per-GPU scaling against the 1-GPU run of the same shape, seq, micro-batch and mode:\n\n" + "\n".join(lines)


def repeat_table(summary: list[dict[str, Any]]) -> str:
    """The repeat summary, printed where some case ran more than once."""
    if not any(row["runs"] > 1 or row["one_gpu_runs"] > 1 for row in summary):
        return ""
    lines = ["| run | strategy | overrides | runs (1-GPU runs) | per-GPU scaling: median | lowest | highest | "
             "by median step: median |", "|---|---|---|---|---|---|---|---|"]
    for row in summary:
        overrides = " ".join(f"`{o}`" for o in row["overrides"]) or "-"
        lines.append(f"| {row['case']} | {row['strategy']} | {overrides} | {row['runs']} ({row['one_gpu_runs']}) | "
                     f"{fmt(row['scaling_median'], '.1%')} | {fmt(row['scaling_min'], '.1%')} | "
                     f"{fmt(row['scaling_max'], '.1%')} | {fmt(row['by_median_step_median'], '.1%')} |")
    return "Per-GPU scaling over repeated runs (against the median of the 1-GPU runs):\n\n" + "\n".join(lines)


def print_report(payload: dict[str, Any]) -> None:
    env = payload.get("env", {})
    print(f"\nGPU: {', '.join(env.get('gpu_names', [])) or 'none'} (driver {env.get('gpu_driver')}); "
          f"CPU: {host_cpu(env)}; torch {env.get('torch')}; "
          f"transformers {env.get('transformers')}; peak: {env.get('peak_source')}\n")
    print(markdown_table(payload["results"]))
    for r in payload["results"]:
        if r.get("status") not in ("ok", "dry-run"):
            print(f"- {r.get('case')}: {r.get('status')}: {str(r.get('error', ''))[:300]}")
    comparison = comparison_table(payload["results"])
    if comparison:
        print("\n" + comparison)
    rows = scaling_rows(payload["results"])
    scaling = scaling_table(rows)
    if scaling:
        print("\n" + scaling)
    repeats = repeat_table(repeat_summary(rows))
    if repeats:
        print("\n" + repeats)
    variants = variant_table(variant_rows(payload["results"]))
    if variants:
        print("\n" + variants)
    print(flush=True)


def host_cpu(env: dict[str, Any]) -> str:
    """The probe's CPU in a few words (reports written before the probe asked say unknown)."""
    if not env.get("cpu_model"):
        return "unknown"
    return f"{env['cpu_model']}, {env.get('cpu_count')} logical CPUs, {env.get('numa_nodes')} NUMA node(s)"


def merge_reports(paths: list[str]) -> dict[str, Any]:
    payloads = [json.loads(Path(p).read_text()) for p in paths]
    envs = {json.dumps(p.get("env", {}).get("gpu_names")) for p in payloads}
    if len(envs) > 1:
        print(f"[bench] warning: the reports come from different GPUs: {sorted(envs)}", file=sys.stderr)
    cpus = {host_cpu(p.get("env", {})) for p in payloads}
    if len(cpus) > 1:
        print(f"[bench] warning: the reports come from different host CPUs: {sorted(cpus)}; "
              "several-GPU scaling depends on the host", file=sys.stderr)
    hosts = {p.get("env", {}).get("host_boot") for p in payloads} - {None}
    if len(hosts) > 1:
        print(f"[bench] warning: the reports come from {len(hosts)} hosts or boots (env.host_boot: "
              f"{sorted(hosts)}); compare tokens/s only within one", file=sys.stderr)
    return {"env": payloads[0].get("env", {}), "merged_from": paths,
            "results": [_with_overrides(r, p) for p in payloads for r in p.get("results", [])]}


def _with_overrides(result: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """A result with its invocation's ``--override`` list (results written before the field
    existed take it from the payload's settings), so merged rows say how they differ."""
    if "overrides" in result:
        return result
    return {**result, "overrides": list(payload.get("settings", {}).get("override") or [])}


# --------------------------------------------------------------------------- main


def csv_list(kind):
    def parse(text: str):
        return [kind(x) for x in text.split(",") if x.strip()]
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Lockstep training throughput vs the transformers baseline.")
    p.add_argument("--shapes", type=csv_list(str), default=["qwen2.5-0.5b", "qwen3-1.7b"])
    p.add_argument("--seqs", type=csv_list(int), default=[2048, 4096])
    p.add_argument("--gpus", type=csv_list(int), default=[1, 2])
    p.add_argument("--modes", type=csv_list(str), default=["fast", "bitwise"], help="determinism.mode values")
    p.add_argument("--compile", type=csv_list(str), default=["preset"],
                   help="parallel.compile per case: preset (leave the preset's), on, off; e.g. off,on")
    p.add_argument("--micro-batch", type=csv_list(int), default=None,
                   help="per GPU, one or a list, e.g. 16,24 (default: per shape, see hf_baseline.py)")
    p.add_argument("--tokens-per-micro-batch", type=int, default=None,
                   help="per GPU, micro-batch = this // seq (instead of --micro-batch)")
    p.add_argument("--steps", type=int, default=20, help="measured steps after the warmup")
    p.add_argument("--warmup", type=int, default=5, help="steps not measured (compilation, allocator warmup)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every case this many times, round the case list; the scaling is also "
                        "summarised over the repeats (median, lowest, highest)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--strategy", default="fsdp", choices=("fsdp", "ddp"), help="strategy on several GPUs")
    p.add_argument("--strategy-1gpu", default="none", choices=("none", "ddp", "fsdp"), help="strategy on one GPU")
    p.add_argument("--data-sources", default="auto", choices=("auto", "preset", "parquet"),
                   help="preset's sources, Parquet only, or auto (Parquet only without zstandard)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra train.py override for every case (repeatable)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE]",
                   help="run every case once per variant NAME, with its overrides (repeatable; the same NAME "
                        "again adds an override); ratios are against the first, e.g. --variant bf16 "
                        "--variant fp8:parallel.float8=tensorwise")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also run benchmarks/hf_baseline.py for each shape/seq")
    p.add_argument("--baseline-modes", type=csv_list(str), default=["eager", "compile"])
    p.add_argument("--timeout", type=float, default=480, help="seconds per case")
    p.add_argument("--budget", type=float, default=0, help="total seconds; cases that would not fit are skipped")
    p.add_argument("--launcher-arg", action="append", default=[], metavar="ARG",
                   help="extra torchrun argument for every case (repeatable), e.g. --launcher-arg=--numa-binding=node")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the per-GPU dense bf16 peak")
    p.add_argument("--run-root", help="where the runs go (default: a temporary directory)")
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories")
    p.add_argument("--out", default="bench_out/train_throughput.json")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--report", nargs="+", metavar="JSON", help="only merge these result files and print the table")
    args = p.parse_args(argv)
    bad_modes = set(args.modes) - {"fast", "bitwise"}
    bad_compile = set(args.compile) - {"preset", "on", "off"}
    bad_baseline = set(args.baseline_modes) - {"eager", "compile"}
    if bad_modes or bad_compile or bad_baseline:
        p.error(f"unknown values: {sorted(bad_modes | bad_compile | bad_baseline)}")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.micro_batch is not None and (not args.micro_batch or min(args.micro_batch) < 1):
        p.error("--micro-batch must be one or more integers >= 1")
    try:
        args.variant_overrides = parse_variants(args.variant)
    except ValueError as exc:
        p.error(str(exc))
    args.variants = list(args.variant_overrides)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step compiles)")
    args.baseline_modes = [m == "compile" for m in args.baseline_modes]
    args.log_dir = Path(args.out).resolve().parent / "logs"  # every job's stdout/stderr, kept
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print_report(merge_reports(args.report))
        return 0
    budget = Budget(args.budget)
    env = probe_environment()
    env["peak_flops"], env["peak_source"] = hfb.peak_flops_for(
        env["gpu_names"][0] if env.get("gpu_names") and args.device == "cuda" else None, args.peak_tflops)
    print(f"[bench] {json.dumps(env)}", flush=True)
    warn_missing_packages(env)
    if args.device == "cuda" and not env.get("gpu_count"):
        print("[bench] no CUDA device found; use --device cpu for a smoke test", file=sys.stderr)
        return 2
    run_root = Path(args.run_root or tempfile.mkdtemp(prefix="lockstep-bench-")).resolve()
    run_root.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "tool": "train_throughput",
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "env": env,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "report"},
        "run_root": str(run_root),
        "dataset": None if args.dry_run else ensure_dataset(timeout=min(args.timeout, budget.left())),
        "results": [],
    }
    cases = plan_cases(args)
    try:
        # Repeats go round the whole case list, so that a drift of the host over the
        # invocation touches every case alike.
        for repeat, case in itertools.product(range(args.repeat), cases):
            result = run_case(case, args, env, run_root, budget, repeat)
            payload["results"].append(result)
            hfb.write_json(args.out, payload)
            tag = f" (run {repeat + 1} of {args.repeat})" if args.repeat > 1 else ""
            print(f"[bench] {case.name}{tag}: {result['status']} "
                  f"{fmt(result.get('tokens_per_s'), ',.0f')} tokens/s {result.get('error', '')}", flush=True)
        if args.baseline:
            for shape, seq, micro, compiled in baselines_wanted(cases, args):
                result = run_baseline(shape, seq, micro, compiled, args, run_root, budget)
                payload["results"].append(result)
                hfb.write_json(args.out, payload)
                print(f"[bench] {result['case']}: {result.get('status')} "
                      f"{fmt(result.get('tokens_per_s'), ',.0f')} tokens/s", flush=True)
    finally:
        payload["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        payload["scaling"] = scaling_rows(payload["results"])
        payload["scaling_summary"] = repeat_summary(payload["scaling"])
        payload["variants"] = variant_rows(payload["results"])
        hfb.write_json(args.out, payload)
        if not args.keep_runs and not args.run_root:
            shutil.rmtree(run_root, ignore_errors=True)
    print_report(payload)
    print(f"[bench] results: {args.out}", flush=True)
    return 0 if all(r.get("status") in ("ok", "dry-run", "skipped") for r in payload["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
