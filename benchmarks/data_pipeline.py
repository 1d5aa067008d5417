"""Data pipeline throughput on the tiny config, against single-threaded loops over the same data.

    python benchmarks/data_pipeline.py [--batches 3000] [--bpe-batches 300] [--repeat 3]

Two tokenizers, because they put the cost in different places:

- ``byte`` (the tiny config's): tokenizing is nearly free (~200 M tokens/s), so packing and
  batching dominate; every stage is light and runs in the source thread, and data.workers
  has nothing to parallelize. Compare the pipeline with the ``naive`` loop doing the same work.
- ``bpe`` (an 8192-token byte-level BPE tokenizer.json trained here on the stdlib):
  tokenizing dominates (~2.5 MB/s a core) and holds the GIL, so the tokenize stage runs
  on data.workers worker processes. Compare the pipeline with the ``bare`` tokenizer loop.

Prints the tables of ``python -m data bench`` and writes bench_out/data_pipeline.json.
"""

from __future__ import annotations

import argparse

from data_common import bpe_tokenizer, tiny_config, write_report

from data.bench import render, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--bpe-batches", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    byte = run(tiny_config(), batches=args.batches, workers=[0, 1, 2], repeat=args.repeat)
    print("byte tokenizer (configs/tiny.yaml)\n" + render(byte) + "\n")
    bpe_config = tiny_config(f"data.tokenizer={bpe_tokenizer()}")
    bpe = run(bpe_config, batches=args.bpe_batches, workers=[1, 2, 3], repeat=args.repeat)
    print("BPE tokenizer, worker processes\n" + render(bpe) + "\n")
    threads = run(tiny_config(f"data.tokenizer={bpe_tokenizer()}", "data.process_pool=false"),
                  batches=args.bpe_batches, workers=[2], repeat=args.repeat)
    print("BPE tokenizer, worker threads (data.process_pool=false)\n" + render(threads))
    path = write_report("data_pipeline", {"byte": byte, "bpe_processes": bpe, "bpe_threads": threads})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
