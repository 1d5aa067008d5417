"""Where a training run makes the host wait for the GPU: every synchronising CUDA call, by call site.

    python benchmarks/host_syncs.py --out bench_out/host_syncs.json -- --config configs/qwen3-0.6b.yaml \\
        train.max_steps=6 checkpoint.interval=0
    python benchmarks/host_syncs.py --out bench_out/host_syncs.json -- --config configs/qwen3-30b-a3b.yaml \\
        model.num_layers=4 parallel.strategy=none parallel.compile=true train.max_steps=8 checkpoint.interval=0

Everything after ``--`` is train.py's command line (one process: no ``--nproc``; the presets read the data
that ``make data`` prepares). The run goes through
``train.main`` in this process under ``torch.cuda.set_sync_debug_mode("warn")``: PyTorch then warns at
each call that waits for the device (a ``.item()``, a ``.tolist()``, a copy to or from pageable host
memory, ``torch.cuda.synchronize``, an operator whose output size depends on the data). Each warning's
Python stack is kept (the innermost frames, ``--frames``), and the sites are counted. A site whose
stack passes through the trainer's step (training/loop.py ``_run_step``) is a step's; the others are the
run's start and end (model build, restore, the last step's parameter hash).

A step's wait stops the host from queuing the next kernels while the GPU drains, so the GPU idles
for the host's launch time after each (2026-12-03: nine a Qwen3-MoE step, all in one function).
Prints the sites, most frequent first, with their count per step, and writes JSON; exits 1 when a
step has any. On a machine without CUDA there is nothing to find: it says so and exits 2.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MESSAGE = "called a synchronizing CUDA operation"
"""The warning PyTorch gives in ``set_sync_debug_mode("warn")``."""
STEP_FRAME = ("training/loop.py", "_run_step")


class Sites:
    """The synchronising calls seen, by the innermost ``frames`` frames of their Python stack."""

    def __init__(self, frames: int) -> None:
        self.frames = frames
        self.counts: collections.Counter[tuple[str, ...]] = collections.Counter()
        self.in_step: set[tuple[str, ...]] = set()

    def record(self, stack: list[traceback.FrameSummary]) -> None:
        stack = [f for f in stack if not f.filename.endswith("warnings.py") and Path(f.filename) != Path(__file__)]
        key = tuple(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack[-self.frames:]))
        self.counts[key] += 1
        if any(_short(f.filename) == STEP_FRAME[0] and f.name == STEP_FRAME[1] for f in stack):
            self.in_step.add(key)

    def hook(self, previous):
        """A ``warnings.showwarning`` that records a synchronising call and shows any other warning
        through ``previous``."""
        def show(message, category, filename, lineno, file=None, line=None) -> None:
            if MESSAGE in str(message):
                self.record(traceback.extract_stack())
            else:
                previous(message, category, filename, lineno, file, line)
        return show

    def report(self, steps: int) -> dict[str, Any]:
        rows = [{"count": n, "per_step": n / max(steps, 1) if key in self.in_step else None,
                 "in_step": key in self.in_step, "stack": list(key)} for key, n in self.counts.most_common()]
        return {"steps": steps, "in_step_calls": sum(r["count"] for r in rows if r["in_step"]),
                "other_calls": sum(r["count"] for r in rows if not r["in_step"]), "sites": rows}


def _short(filename: str) -> str:
    """A path from the repository root, or from the installed package's folder."""
    path = Path(filename)
    with contextlib.suppress(ValueError):
        return path.resolve().relative_to(ROOT).as_posix()
    return "/".join(path.parts[-2:])


def table(report: dict[str, Any]) -> str:
    lines = [f"{report['in_step_calls']} synchronising calls in {report['steps']} steps, "
             f"{report['other_calls']} outside them", "", "| where | calls | a step |", "|---|---|---|"]
    for row in report["sites"]:
        per_step = f"{row['per_step']:.2f}" if row["in_step"] else "(start/end)"
        lines.append(f"| {' <- '.join(row['stack'][:4])} | {row['count']} | {per_step} |")
    return "\n".join(lines)


def steps_run(run_dir: Path | None) -> int:
    ledger = run_dir / "ledger.jsonl" if run_dir is not None else None
    return sum(1 for line in ledger.read_text().splitlines() if line.strip()) if ledger and ledger.is_file() else 0


def run_dir_of(output: str) -> Path | None:
    for line in output.splitlines():
        if line.startswith("run_dir: "):
            return Path(line.split(": ", 1)[1].strip())
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_out/host_syncs.json")
    parser.add_argument("--frames", type=int, default=8, help="innermost stack frames that name a site")
    args = parser.parse_args(ours)
    if not train_argv:
        parser.error("give train.py's command line after --")
    import torch

    if not torch.cuda.is_available():
        print("host_syncs: no CUDA device: nothing waits for one here", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    import train

    sites = Sites(args.frames)
    previous = warnings.showwarning
    warnings.showwarning = sites.hook(previous)
    captured = _Tee()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with contextlib.redirect_stdout(captured):
                code = train.main(train_argv)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = previous
    report = {"tool": "host_syncs", "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
              "train_argv": train_argv, "returncode": code,
              **sites.report(steps_run(run_dir_of(captured.text())))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report), flush=True)
    if code != 0:
        print(f"host_syncs: the run exited {code} (its error is above): the counts cover what ran", flush=True)
    print(f"host_syncs: results: {out}", flush=True)
    return 1 if code != 0 or report["in_step_calls"] else 0


class _Tee:
    """stdout that is also kept (train.py prints the run dir there)."""

    def __init__(self) -> None:
        self._parts: list[str] = []

    def write(self, text: str) -> int:
        self._parts.append(text)
        return sys.__stdout__.write(text)

    def flush(self) -> None:
        sys.__stdout__.flush()

    def text(self) -> str:
        return "".join(self._parts)

    def __getattr__(self, name: str):
        """The rest of a stream's interface (``isatty``, ``fileno``, ``encoding``: the console asks) is
        stdout's."""
        return getattr(sys.__stdout__, name)


if __name__ == "__main__":
    sys.exit(main())
