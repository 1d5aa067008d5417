"""The harness one-GPU step benchmarks share (moe_step.py, vl_step.py): Lockstep trained through train.py
twice with the same settings and seed (the bitwise repeat), transformers timed in this process with
hf_baseline.py's recipe, their common arguments, table rows and exit status.

A benchmark supplies what differs: its preset, model and data overrides, how it builds and feeds the
transformers model, and its table's header and last column.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import hf_baseline as hfb  # noqa: E402  (the benchmarks folder is not a package)
import train_throughput as tt  # noqa: E402

PARTS = ("lockstep", "lockstep_repeat", "transformers")
"""The report's parts that must each end with status ok."""


# --------------------------------------------------------------------------- arguments


def add_common_args(p: argparse.ArgumentParser, *, layers: int, layers_help: str) -> None:
    """The arguments every step benchmark takes before its own: the shape, the steps and Lockstep's switches."""
    p.add_argument("--layers", type=int, default=layers, help=layers_help)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The steps, device and Lockstep's precision, mode and compile switches."""
    p.add_argument("--warmup", type=int, default=3, help="steps not measured")
    p.add_argument("--steps", type=int, default=10, help="measured steps (Lockstep runs one more: the last hashes)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="Lockstep's parallel.precision")
    p.add_argument("--mode", choices=("bitwise", "fast"), default="bitwise", help="Lockstep's determinism.mode")
    p.add_argument("--compile", action="store_true", help="Lockstep with parallel.compile=true")


def add_launch_args(p: argparse.ArgumentParser, *, run_root_help: str, out: str) -> None:
    """Extra overrides, in-process runs, the peak, the time limits, where the runs go and --smoke."""
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="one more train.py override for Lockstep's runs (repeatable)")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run train.main in this process (default: on CPU only)")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the card's dense bf16 peak")
    p.add_argument("--timeout", type=float, default=540, help="seconds per Lockstep run (child processes)")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for the whole call: a Lockstep run is given what is left, not started under 45 s")
    p.add_argument("--run-root", help=run_root_help)
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, 1 + 1 steps: seconds")
    p.add_argument("--out", default=out)


def finish_args(p: argparse.ArgumentParser, args: argparse.Namespace, smoke: dict[str, Any],
                positive: tuple[str, ...]) -> argparse.Namespace:
    """``args`` with --smoke's settings applied, the ``positive`` ones checked, --in-process defaulted and
    the child processes' log folder beside --out."""
    if args.smoke:
        for key, value in smoke.items():
            setattr(args, key, value)
    if min(getattr(args, name.lstrip("-").replace("-", "_")) for name in positive) < 1:
        p.error(f"{', '.join(positive[:-1])} and {positive[-1]} must be >= 1")
    if args.in_process is None:
        args.in_process = args.device == "cpu"
    args.log_dir = Path(args.out).resolve().parent / "logs"
    return args


# --------------------------------------------------------------------------- Lockstep


def train_overrides(args: argparse.Namespace, name: str, run_root: Path, model: list[str],
                    data: list[str]) -> list[str]:
    """train.py's overrides for one Lockstep run: ``model`` and ``data`` (the benchmark's), one rank with no
    sharding, no accumulation, checkpoint or evaluation, metrics every step, then ``--override``."""
    return [
        *model,
        f"run.name={name}",
        f"run.root={run_root}",
        "parallel.strategy=none",
        f"parallel.precision={args.precision}",
        f"parallel.device={args.device}",
        f"parallel.compile={'true' if args.compile else 'false'}",
        *data,
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch}",
        f"train.max_steps={args.warmup + args.steps + 1}",
        "train.eval_interval=0",
        "checkpoint.interval=0",
        "checkpoint.at_end=false",
        "metrics.tensorboard=false",
        "metrics.log_interval=1",
        f"determinism.mode={args.mode}",
        f"runtime.watchdog_timeout_s={max(600, int(args.timeout))}",
        "runtime.on_nonfinite=skip",
        *args.override,
    ]


def run_lockstep(args: argparse.Namespace, name: str, run_root: Path, argv: list[str], peak: float | None,
                 budget: tt.Budget) -> dict[str, Any]:
    """One train.py run of ``argv`` (a child process, or ``train.main`` here with ``--in-process``) and its
    summary: train_throughput.py's over the steps after ``--warmup``, and the run's ledger."""
    command = [tt.PYTHON, "train.py", *argv]
    result: dict[str, Any] = {"name": name, "command": shlex.join(command), "in_process": args.in_process}
    timeout = budget.timeout(args.timeout)
    if timeout is None:
        return {**result, "status": "skipped", "error": "not started: --budget exhausted"}
    started_at = time.time()
    if args.in_process:
        import train

        started = time.monotonic()
        code, timed_out, output = train.main(argv), False, None
        result["seconds"] = time.monotonic() - started
    else:
        done = tt.launch(command, timeout=timeout, log_path=args.log_dir / f"{name}.log")
        code, timed_out, output = done.returncode, done.timed_out, done
        result["seconds"] = done.seconds
    run_dir = next(iter(sorted(run_root.glob(f"{name}-*"))), None)
    if run_dir is not None:
        result.update(tt.summarize_run(run_dir, warmup=args.warmup, gpus=1, peak=peak, started_at=started_at))
        result["ledger"] = tt.read_jsonl(run_dir / "ledger.jsonl")
    ok = code == 0 and not timed_out and result.get("tokens_per_s")
    result["returncode"] = code
    result["status"] = "ok" if ok else ("timeout" if timed_out else "failed")
    if not ok:
        result["error"] = tt.failure_text(output, run_dir)["error"] if output is not None else (
            result.get("error") or f"train.main returned {code}")
    return result


def repeat_check(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Whether two runs of the same settings wrote the same ledger, line for line."""
    a, b = first.get("ledger") or [], second.get("ledger") or []
    differing = [line_a.get("step") for line_a, line_b in zip(a, b) if line_a != line_b]
    equal = bool(a) and len(a) == len(b) and not differing
    return {"equal": equal, "lines": [len(a), len(b)], "first_differing_step": differing[0] if differing else None,
            "losses": [[line.get("loss") for line in a], [line.get("loss") for line in b]],
            "last_param_hash": [(a[-1] if a else {}).get("param_hash"), (b[-1] if b else {}).get("param_hash")]}


def compare(report: dict[str, Any], run: Callable[[str], dict[str, Any]], names: tuple[str, str]) -> None:
    """Lockstep's two runs (``run(name)``) into ``report``, their repeat check and the speedup over
    the transformers part already there."""
    for key, name in zip(("lockstep", "lockstep_repeat"), names):
        report[key] = run(name)
    report["bitwise_repeat"] = repeat_check(report["lockstep"], report["lockstep_repeat"])
    ours, theirs = report["lockstep"].get("tokens_per_s"), report["transformers"].get("tokens_per_s")
    report["speedup"] = ours / theirs if ours and theirs else None


# --------------------------------------------------------------------------- transformers


def prepare_device(device) -> None:
    """hf_baseline.py's CUDA settings (TF32 matmuls) and a fresh peak-memory count; nothing on CPU."""
    import torch

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)


def hf_optimizer(model, device):
    """hf_baseline.py's AdamW: fused on CUDA, foreach elsewhere."""
    import torch

    return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                             **({"fused": True} if device.type == "cuda" else {"foreach": True}))


def timed_steps(model, optimizer, loss_of: Callable[[int], Any], args: argparse.Namespace, device) -> dict[str, Any]:
    """``--warmup`` then ``--steps`` training steps of ``loss_of(i)`` (clipping at 1.0), the latter timed
    as hf_baseline.py times: s/step, tokens/s, the first and last loss and the peak memory."""
    import torch

    def step(i: int) -> torch.Tensor:
        loss = loss_of(i)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    losses = [step(i) for i in range(args.warmup)]
    sync()
    started = time.perf_counter()
    losses += [step(args.warmup + i) for i in range(args.steps)]
    sync()
    window = time.perf_counter() - started
    losses = [float(x) for x in losses]
    return {"status": "ok", "step_time_s": window / args.steps,
            "tokens_per_s": args.micro_batch * args.seq * args.steps / window,
            "loss_first": losses[0], "loss_last": losses[-1], "loss_finite": all(math.isfinite(x) for x in losses),
            "peak_mem_allocated_gib": torch.cuda.max_memory_allocated(device) / hfb.GIB if cuda else None}


def guarded_transformers(run: Callable[[], dict[str, Any]], device) -> dict[str, Any]:
    """``run()``'s result, or its failure recorded (an OOM or a failed build: Lockstep still runs); on CUDA
    the cache is emptied after, so the parent keeps only its context while Lockstep's runs train."""
    import torch

    try:
        result = run()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return result
    except Exception as error:
        return {"status": "oom" if "out of memory" in str(error).lower() else "failed",
                "error": f"{type(error).__name__}: {error}"[:2000], "traceback_tail": traceback.format_exc()[-4000:]}


# --------------------------------------------------------------------------- report and exit


def header(tool: str, args: argparse.Namespace):
    """The device, its peak and the report's first fields; None where ``--device cuda`` has no GPU."""
    import torch
    import transformers

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{tool}: no CUDA device; --smoke runs on CPU", file=sys.stderr)
        return None
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak, peak_source = hfb.peak_flops_for(device_name if device.type == "cuda" else None, args.peak_tflops)
    report: dict[str, Any] = {
        "tool": tool, "device_name": device_name, "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "peak_flops": peak, "peak_source": peak_source,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    return device, peak, report


def table_row(label: str, part: dict[str, Any], last: str) -> str:
    """One run's table row: status, s/step, tokens/s, both MFUs, peak GiB and the benchmark's ``last`` column."""
    return "| " + " | ".join([
        label, part.get("status", "?"), tt.fmt(part.get("step_time_s"), ".3f"),
        tt.fmt(part.get("tokens_per_s"), ",.0f"), tt.fmt(part.get("mfu_all_matmuls"), ".1%"),
        tt.fmt(part.get("mfu_torchtitan"), ".1%"), tt.fmt(part.get("peak_mem_allocated_gib"), ".1f"), last]) + " |"


def table_tail(report: dict[str, Any], speedup_note: str = "") -> list[str]:
    """The lines under the table: the bitwise repeat, the speedup (with ``speedup_note``) and each failed part."""
    repeat = report["bitwise_repeat"]
    lines = ["", f"bitwise repeat ({repeat['lines'][0]} steps, same seed): "
             + ("equal ledgers" if repeat["equal"] else f"DIFFERENT (first at step {repeat['first_differing_step']})")]
    if report.get("speedup") is not None:
        lines.append(f"Lockstep / transformers tokens/s: {report['speedup']:.2f}x{speedup_note}")
    for label in PARTS:
        if report[label].get("status") not in ("ok", None):
            lines.append(f"- {label}: {report[label].get('status')}: {str(report[label].get('error', ''))[:300]}")
    return lines


@contextlib.contextmanager
def run_root_of(args: argparse.Namespace, prefix: str, report: dict[str, Any]) -> Iterator[Path]:
    """Where the runs go (``--run-root``, else a temporary directory deleted after); ``report`` is written to
    ``--out`` when the block ends, whether or not it raised."""
    run_root = Path(args.run_root or tempfile.mkdtemp(prefix=prefix)).resolve()
    try:
        yield run_root
    finally:
        hfb.write_json(args.out, report)
        if not args.run_root:
            shutil.rmtree(run_root, ignore_errors=True)


def finish(tool: str, args: argparse.Namespace, report: dict[str, Any], table: str) -> int:
    """Print ``table`` and where the results are; 0 where every part ran and the repeat's ledgers are equal,
    else 1."""
    print(table, flush=True)
    print(f"{tool}: results: {args.out}", flush=True)
    parts_ok = all(report[k].get("status") == "ok" for k in PARTS)
    return 0 if parts_ok and report["bitwise_repeat"]["equal"] else 1
