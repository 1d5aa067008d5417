"""Peak memory of the pipeline when the dataset grows 10x: streaming should keep it flat.

    python benchmarks/data_memory.py [--batches 3000] [--factor 10]

Makes a dataset ``--factor`` times the prepared stdlib training shards (copies under new
names, so there are ``factor`` times the shards and units), then runs the tiny config's
pipeline on each dataset for ``--batches`` batches in a fresh process and reports its
resident memory: after imports (torch dominates), peak, and the difference. Writes
bench_out/data_memory.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from data_common import OUT, ROOT, ensure_stdlib, tiny_config, write_report


def _grow(source: Path, factor: int) -> Path:
    target = OUT / f"stdlib-x{factor}"
    if (target / ".complete").is_file():
        return target
    shutil.rmtree(target, ignore_errors=True)
    (target / "train").mkdir(parents=True)
    for copy in range(factor):
        for shard in sorted((source / "train").iterdir()):
            shutil.copyfile(shard, target / "train" / f"c{copy:02d}-{shard.name}")
    (target / ".complete").touch()
    return target


def _child(dataset: str, batches: int) -> None:
    import psutil

    from data.pipeline import build

    config = tiny_config(
        f'data.sources=[{{path: "{dataset}/train/*.jsonl.zst", weight: 2.0}}, {{path: "{dataset}/train/*.parquet"}}]')
    me = psutil.Process()
    base = me.memory_info().rss
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, me.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    with build(config.data, seed=0, global_batch_size=config.train.global_batch_size, rank=0, world_size=1) as pipe:
        for _ in range(batches):
            next(pipe)
        units = sum(len(s.units()) for s in pipe._plan.sources)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    print(json.dumps({"rss_base_mb": base / 2**20, "rss_peak_mb": peak / 2**20,
                      "pipeline_mb": (peak - base) / 2**20, "units": units, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--factor", type=int, default=10)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.child[0], int(args.child[1]))
    stdlib = ROOT / ensure_stdlib()
    datasets = {"1x": stdlib, f"{args.factor}x": _grow(stdlib, args.factor)}
    results = {}
    for name, path in datasets.items():
        out = subprocess.run([sys.executable, __file__, "--child", str(path), str(args.batches)],
                             check=True, capture_output=True, text=True, cwd=ROOT)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        results[name]["bytes_on_disk"] = sum(p.stat().st_size for p in (path / "train").iterdir())
    print(f"{'dataset':>8}{'MB on disk':>12}{'units':>8}{'RSS base MB':>13}{'RSS peak MB':>13}{'pipeline MB':>13}")
    for name, r in results.items():
        print(f"{name:>8}{r['bytes_on_disk'] / 1e6:>12.1f}{r['units']:>8}{r['rss_base_mb']:>13.0f}"
              f"{r['rss_peak_mb']:>13.0f}{r['pipeline_mb']:>13.0f}")
    names = list(results)
    ratio = results[names[1]]["rss_peak_mb"] / results[names[0]]["rss_peak_mb"]
    print(f"\npeak RSS {names[1]} / {names[0]}: {ratio:.2f}x")
    print(f"wrote {write_report('data_memory', {'results': results, 'peak_ratio': ratio, 'batches': args.batches})}")


if __name__ == "__main__":
    main()
