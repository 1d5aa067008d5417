"""LoRA and QLoRA through the real training loop on one GPU: kill/resume equality, speed, checkpoint size.

    python benchmarks/lora_train.py --out bench_out/lora_train.json

The CPU suite (tests/training/test_lora_e2e.py) cannot cover compiled blocks and compiled
flex attention (its CPU backward is missing), nor NF4 bases in a run. This runs
``configs/tiny-lora.yaml`` widened to NF4-compatible shapes (every projection a multiple of
16,384 weights) with bf16 autocast on one GPU, per case:

1. ``train.py`` for ``--steps`` steps, checkpoints every ``--steps // 2``;
2. a copy of that run cut back to its middle checkpoint, resumed to the end: its ledger must
   equal the first one line for line (bitwise, dropout masks included).

Cases: ``lora`` (adapters of rank 16 with dropout 0.1, per-block compile, flex attention) and
``qlora`` (the same adapters without dropout on an NF4 base, flex attention, no compile), and
``qlora_compiled`` (``qlora`` with per-block compile: the NF4 dequantization fused into the
compiled blocks, models/nf4.py; not in the default list).
Reported per case: exit codes, whether the ledgers are equal, tokens/s of the uninterrupted
run (its summary line), wall seconds, and the bytes of the last checkpoint's tensors (the
adapters and their AdamW state; the base is identified, not saved).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = ["model.hidden_size=1024", "model.intermediate_size=2816", "model.num_layers=4",
         "model.num_heads=16", "model.num_kv_heads=8", "model.head_dim=64"]
CASES = {
    "lora": ["model.lora.rank=16", "model.lora.alpha=32", "model.lora.dropout=0.1",
             "parallel.compile=true", "model.attention=flex"],
    "qlora": ["model.lora.rank=16", "model.lora.alpha=32", "model.quantize_base=nf4", "model.attention=flex"],
    "qlora_compiled": ["model.lora.rank=16", "model.lora.alpha=32", "model.quantize_base=nf4", "model.attention=flex",
                       "parallel.compile=true"],
}


def _train(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout)
    return result, time.perf_counter() - started


def _run_dir(result: subprocess.CompletedProcess) -> Path | None:
    found = re.search(r"^run_dir: (.+)$", result.stdout, re.MULTILINE)
    return (ROOT / found.group(1).strip()) if found else None


def _ledger(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if line.strip()]


def run_case(name: str, overrides: list[str], steps: int, root: Path, timeout: float, device: str,
             extra: list[str]) -> dict:
    from core.layout import step_dir_name

    half = steps // 2
    common = ["--config", "configs/tiny-lora.yaml", f"run.root={root}", f"run.name=bench-{name}",
              f"train.max_steps={steps}", f"checkpoint.interval={half}", "checkpoint.keep=0",
              f"parallel.device={device}", "parallel.strategy=none",
              f"parallel.precision={'bf16' if device == 'cuda' else 'fp32'}",
              "train.eval_interval=0", "metrics.log_interval=1", *SHAPE, *overrides, *extra]
    first, seconds = _train(common, timeout)
    report: dict = {"overrides": overrides, "exit_code": first.returncode, "seconds": round(seconds, 1)}
    run_dir = _run_dir(first)
    if first.returncode != 0 or run_dir is None:
        report["stderr_tail"] = first.stderr[-2000:]
        return report
    speed = re.search(r"([\d,]+) tokens/s", first.stdout)
    report["tokens_per_s"] = float(speed.group(1).replace(",", "")) if speed else None
    last = run_dir / "checkpoints" / step_dir_name(steps) / "dcp"
    report["checkpoint_tensor_bytes"] = sum(f.stat().st_size for f in last.iterdir() if f.suffix == ".distcp")

    copy = run_dir.parent / f"{run_dir.name}-resumed"
    shutil.copytree(run_dir, copy)
    for path in (copy / "checkpoints").glob("step_*"):
        if int(path.name.split("_")[1]) > half:
            shutil.rmtree(path)
    (copy / "checkpoints" / "LATEST").write_text(step_dir_name(half))  # the resume voids later ledger lines
    resumed, seconds = _train(["--resume", copy.name, f"run.root={root}"], timeout)
    report["resume_exit_code"] = resumed.returncode
    report["resume_seconds"] = round(seconds, 1)
    if resumed.returncode != 0:
        report["resume_stderr_tail"] = resumed.stderr[-2000:]
        return report
    reference, got = _ledger(run_dir), _ledger(copy)
    report["ledgers_equal"] = reference == got
    if reference != got:
        report["first_difference"] = next(
            ({"step": a["step"], "reference": a, "resumed": b} for a, b in zip(reference, got) if a != b), None)
    report["losses"] = [line["loss"] for line in reference]
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="lora,qlora", help=f"comma-separated, of {','.join(CASES)}")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per train.py process")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "lora_train.json")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke test of the script (sdpa attention, no compile, fp32)")
    parser.add_argument("--set", action="append", default=[], help="extra override for every run")
    args = parser.parse_args()

    from data_common import ensure_stdlib  # benchmarks/, on the path as the script's directory

    ensure_stdlib()  # the stdlib shards and the chat tasks tiny-lora trains on
    root = ROOT / "bench_out" / "lora_train_runs"
    shutil.rmtree(root, ignore_errors=True)
    report = {"steps": args.steps, "shape": SHAPE, "device": args.device, "cases": {}}
    for name in args.cases.split(","):
        extra = ["model.attention=sdpa", "parallel.compile=false", *args.set] if args.device == "cpu" else args.set
        report["cases"][name] = run_case(name, CASES[name], args.steps, root, args.timeout, args.device, extra)
        print(name, json.dumps({k: v for k, v in report["cases"][name].items() if k != "losses"}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    ok = all(case.get("ledgers_equal") for case in report["cases"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
