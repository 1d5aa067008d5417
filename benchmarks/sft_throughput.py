"""SFT against pretraining at the same shape, and the packing efficiency of chat data.

    python benchmarks/sft_throughput.py --shape qwen2.5-0.5b --seq 2048 --out bench_out/sft.json
    python benchmarks/sft_throughput.py --shape tiny --seq 256 --device cpu --steps 3 --warmup 1   # smoke

1. Packing: the embedded chat tasks (``datasets/tasks/sft/train``, written by
   ``python -m data prepare``) through the real pipeline with the preset's tokenizer at
   ``--seq``: non-padding tokens / all tokens, and trained tokens / all tokens.
2. Throughput: two runs of ``benchmarks/train_throughput.py`` on one GPU, the same preset,
   sequence length, micro-batch, precision and determinism mode: pretraining on the preset's
   data, and ``objective.kind=sft`` on the chat tasks. SFT tokens/s counts every processed
   token (trained, context and padding), as pretraining's does; the context-token rate
   (padding left out) is the packing efficiency times that. Target: SFT within 5% of
   pretraining, packing efficiency >= 95%.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SFT_SOURCE = "datasets/tasks/sft/train"


def packing(preset: str, seq: int, batches: int) -> dict:
    from core.config import load
    from data.pipeline.packing import PAD_SOURCE
    from data.pipeline.pipeline import build

    config = load(ROOT / "configs" / f"{preset}.yaml", [
        f"data.sources=[{{path: {SFT_SOURCE}, record: chat}}]", "data.eval_source=null",
        f"data.seq_len={seq}", "data.num_streams=4", "train.global_batch_size=8"])
    total = padding = trained = 0
    with build(config.data, seed=0, global_batch_size=8, rank=0, world_size=1) as pipe:
        for _ in range(batches):
            batch = next(pipe)
            total += batch.input_ids.numel()
            trained += batch.num_target_tokens()
            padding += sum(s.end - s.start for row in batch.provenance for s in row if s.source == PAD_SOURCE)
        stats = pipe.stats()
    return {"tokenizer": config.data.tokenizer, "seq_len": seq, "tokens": total,
            "packing_efficiency": 1 - padding / total, "trained_fraction": trained / total,
            "overlong_truncated": stats.get("overlong_truncated"), "overlong_dropped": stats.get("overlong_dropped")}


def throughput(args, label: str, overrides: list[str]) -> dict:
    out = Path(args.out).with_name(Path(args.out).stem + f"-{label}.json")
    command = [sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--shapes", args.shape,
               "--seqs", str(args.seq), "--gpus", "1", "--modes", args.mode, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--device", args.device, "--no-baseline", "--out", str(out)]
    if args.micro_batch:
        command += ["--micro-batch", str(args.micro_batch)]
    for item in overrides:
        command += ["--override", item]
    subprocess.run(command, cwd=ROOT, check=False)
    results = json.loads(out.read_text())["results"] if out.is_file() else []
    return results[0] if results else {"status": "missing"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--mode", default="bitwise", choices=("bitwise", "fast"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--packing-batches", type=int, default=8)
    p.add_argument("--sft-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra overrides of the SFT run (e.g. data.workers=4)")
    p.add_argument("--out", default="bench_out/sft_throughput.json")
    args = p.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    report = {"shape": args.shape, "seq": args.seq, "mode": args.mode}
    report["packing"] = packing(args.shape, args.seq, args.packing_batches)
    print(f"[sft] packing: {json.dumps(report['packing'])}", flush=True)
    report["pretrain"] = throughput(args, "pretrain", [])
    report["sft"] = throughput(args, "sft", [
        "objective.kind=sft", f"data.sources=[{{path: {SFT_SOURCE}, record: chat}}]", "data.loss_on=assistant",
        # Chat records are a few hundred bytes: many documents in flight (configs/tiny-sft.yaml).
        "data.max_in_flight=4096", *args.sft_override])
    pre, sft = report["pretrain"].get("tokens_per_s"), report["sft"].get("tokens_per_s")
    if pre and sft:
        report["sft_over_pretrain"] = sft / pre
        report["sft_context_tokens_per_s"] = sft * report["packing"]["packing_efficiency"]
    Path(args.out).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print("| case | tokens/s | MFU | data wait | peak GiB |")
    print("|---|---|---|---|---|")
    for label in ("pretrain", "sft"):
        r = report[label]
        print(f"| {label} | {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('mfu_torchtitan'), '.1%')} | "
              f"{_fmt(r.get('data_wait_fraction'), '.2%')} | {_fmt(r.get('peak_mem_allocated_gib'), '.1f')} |")
    print(f"SFT / pretraining tokens/s: {_fmt(report.get('sft_over_pretrain'), '.3f')}; packing efficiency "
          f"{report['packing']['packing_efficiency']:.3f}; trained fraction {report['packing']['trained_fraction']:.3f}")
    return 0 if pre and sft else 1


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
