"""Resume cost at batch 10 vs batch 10,000 of the tiny config: should be O(1) in the position.

    python benchmarks/data_resume.py [--far 10000] [--repeat 5]

Runs the pipeline once to batch ``--far``, keeping the data state after batch 10 and after
batch ``--far``; then, ``--repeat`` times each, times what a resumed run pays before its
first batch: build the pipeline, load the state, take one batch. For scale it also prints
how long replaying to the far batch takes (what a resume without data state would cost).
Writes bench_out/data_resume.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from data_common import tiny_config, write_report

from data.hashing import batch_hash, sequence_digest
from data.pipeline import build


def _pipeline(config):
    return build(config.data, seed=config.train.seed, global_batch_size=config.train.global_batch_size,
                 rank=0, world_size=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--near", type=int, default=10)
    parser.add_argument("--far", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    config = tiny_config()

    states, expected = {}, {}
    t0 = time.perf_counter()
    with _pipeline(config) as pipe:
        for step in range(1, args.far + 2):
            batch = next(pipe)
            if step in (args.near, args.far):
                states[step] = batch.state
            if step - 1 in (args.near, args.far):
                expected[step - 1] = batch_hash([sequence_digest(r) for r in batch.input_ids])
    replay_s = time.perf_counter() - t0

    rows = []
    for _ in range(args.repeat):
        for step, state in states.items():
            t0 = time.perf_counter()
            with _pipeline(config) as pipe:
                pipe.load_state_dict(state)
                batch = next(pipe)
                seconds = time.perf_counter() - t0
            assert batch.step == step + 1
            assert batch_hash([sequence_digest(r) for r in batch.input_ids]) == expected[step]
            rows.append((step, seconds))
    result = {
        str(step): {"min_s": min(s for k, s in rows if k == step),
                    "median_s": statistics.median(s for k, s in rows if k == step),
                    "epochs": max(p["epoch"] for st in states[step]["streams"].values() for p in st["sources"])}
        for step in states
    }
    ratio = result[str(args.far)]["median_s"] / result[str(args.near)]["median_s"]
    print(f"{'resume after batch':>20}{'min s':>10}{'median s':>10}{'epoch':>7}")
    for step, r in result.items():
        print(f"{step:>20}{r['min_s']:>10.3f}{r['median_s']:>10.3f}{r['epochs']:>7}")
    print(f"\nbatch {args.far} / batch {args.near} (median): {ratio:.2f}x   "
          f"(replaying {args.far} batches instead: {replay_s:.1f} s)")
    path = write_report("data_resume", {"resume": result, "ratio_far_near": ratio, "replay_far_s": replay_s,
                                        "repeat": args.repeat})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
