"""Data pipeline throughput, against single-threaded loops over the same data.

    python benchmarks/data_pipeline.py [--tokenizers byte,bpe,qwen] [--workers 1,2,3] [--repeat 3]
    python benchmarks/data_pipeline.py --tokenizers qwen --preset qwen3-1.7b --qwen-batches 60

Three tokenizers, because they put the cost in different places:

- ``byte`` (configs/tiny.yaml's): tokenizing is nearly free (~200 M tokens/s), so packing and
  batching dominate; every stage is light and runs in the source thread, and data.workers
  has nothing to parallelize. Compare the pipeline with the ``naive`` loop doing the same work.
- ``bpe`` (an 8192-token byte-level BPE tokenizer.json trained here on the stdlib), on the
  tiny config: tokenizing dominates and holds the GIL, so the tokenize stage runs on
  data.workers worker processes. Compare the pipeline with the ``bare`` tokenizer loop.
- ``qwen`` (the real 151,669-token Qwen vocabulary, ``python -m data prepare --tokenizer qwen``),
  with the data and train sections of a GPU preset (default configs/qwen2.5-0.5b.yaml: seq 2048,
  32 sequences per step, i.e. 65,536 tokens a step): what the GPU runs are fed. Its tokens/s
  next to the GPU's tokens/s (docs/performance.md) is the headroom of the data pipeline.

Prints the tables of ``python -m data bench`` and writes bench_out/data_pipeline.json.
"""

from __future__ import annotations

import argparse

from data_common import bpe_tokenizer, preset_config, qwen_tokenizer, tiny_config, write_report

from data.bench import render, run

TOKENIZERS = ("byte", "bpe", "qwen")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", default=",".join(TOKENIZERS),
                        help=f"comma-separated, of {', '.join(TOKENIZERS)}")
    parser.add_argument("--workers", default="1,2,3", help="worker counts for the BPE tokenizers")
    parser.add_argument("--batches", type=int, default=3000, help="global batches (byte)")
    parser.add_argument("--bpe-batches", type=int, default=300, help="global batches (bpe, tiny config)")
    parser.add_argument("--qwen-batches", type=int, default=30, help="global batches (qwen, the preset's)")
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="configs/<preset>.yaml for qwen")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    chosen = args.tokenizers.split(",")
    unknown = set(chosen) - set(TOKENIZERS)
    if unknown:
        parser.error(f"unknown tokenizers {sorted(unknown)}; choose from {', '.join(TOKENIZERS)}")
    workers = [int(w) for w in args.workers.split(",")]

    report: dict = {}
    if "byte" in chosen:
        report["byte"] = run(tiny_config(), batches=args.batches, workers=[0, 1, 2], repeat=args.repeat)
        print("byte tokenizer (configs/tiny.yaml)\n" + render(report["byte"]) + "\n")
    if "bpe" in chosen:
        bpe = f"data.tokenizer={bpe_tokenizer()}"
        report["bpe_processes"] = run(tiny_config(bpe), batches=args.bpe_batches, workers=workers,
                                      repeat=args.repeat)
        print("BPE tokenizer, worker processes\n" + render(report["bpe_processes"]) + "\n")
        report["bpe_threads"] = run(tiny_config(bpe, "data.process_pool=false"), batches=args.bpe_batches,
                                    workers=[2], repeat=args.repeat)
        print("BPE tokenizer, worker threads (data.process_pool=false)\n" + render(report["bpe_threads"]) + "\n")
    if "qwen" in chosen:
        config = preset_config(args.preset, f"data.tokenizer={qwen_tokenizer()}")
        report["qwen"] = run(config, batches=args.qwen_batches, workers=workers, repeat=args.repeat)
        print(f"Qwen tokenizer, configs/{args.preset}.yaml's data (seq {config.data.seq_len}, "
              f"{config.train.global_batch_size} sequences a batch), worker processes\n" + render(report["qwen"]))
    path = write_report("data_pipeline", report)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
