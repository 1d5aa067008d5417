"""``python -m data inspect``: what global batch S holds, without a model or a GPU.

It runs the pipeline as one rank of a world of one, which yields every row of every global
batch in global order, so the batch hash it prints is the one the ledger records for step S
at any world size.
"""

from __future__ import annotations

from core.config import Config
from core.exceptions import UsageError
from data.batch import Batch
from data.hashing import batch_hash, sequence_digest, state_hash
from data.pipeline.pipeline import build

PREVIEW_CHARS = 72


def global_batch(config: Config, step: int) -> Batch:
    """Global batch ``step`` (1-based) of the training stream."""
    if step < 1:
        raise UsageError(f"--step must be >= 1, got {step}")
    with build(config.data, seed=config.train.seed, global_batch_size=config.train.global_batch_size,
               rank=0, world_size=1) as pipeline:
        for batch in pipeline:
            if batch.step == step:
                return batch
    raise AssertionError("unreachable: the pipeline is endless")


def describe(batch: Batch, tokenizer) -> dict:
    """The JSON report of one batch."""
    digests = [sequence_digest(row) for row in batch.input_ids]
    rows_per_stream = len(batch.sequence_index) // len(batch.state["streams"])
    rows = []
    for i, row in enumerate(batch.input_ids):
        rows.append({
            "index": batch.sequence_index[i],
            "stream": batch.sequence_index[i] // rows_per_stream,
            "digest": digests[i].hex(),
            "target_tokens": int((batch.labels[i] != -100).sum()),
            "provenance": [
                {"source": s.source, "shard": s.shard, "record": s.record, "start": s.start,
                 "end": s.end, "doc_offset": s.doc_offset}
                for s in batch.provenance[i]
            ],
            "preview": tokenizer.decode(row[:PREVIEW_CHARS * 2].tolist())[:PREVIEW_CHARS],
        })
    return {
        "step": batch.step,
        "batch_hash": batch_hash(digests),
        "data_state_hash": state_hash(batch.state),
        "rows": len(rows),
        "tokens": int(batch.input_ids.numel()),
        "target_tokens": batch.num_target_tokens(),
        "sequences": rows,
    }


def render(report: dict) -> str:
    lines = [
        f"step {report['step']}  batch_hash {report['batch_hash']}",
        f"rows {report['rows']}  tokens {report['tokens']}  target tokens {report['target_tokens']}"
        f"  data_state_hash {report['data_state_hash'][:16]}",
    ]
    for row in report["sequences"]:
        lines.append(f"\n[{row['index']}] stream {row['stream']}  digest {row['digest'][:16]}  "
                     f"preview {row['preview']!r}")
        for span in row["provenance"]:
            lines.append(f"    [{span['start']:>5},{span['end']:>5})  {span['source']}  "
                         f"{span['shard']} record {span['record']}  from token {span['doc_offset']}")
    return "\n".join(lines)
