"""``python -m data inspect``: what global batch S holds, without a model or a GPU.

It runs the pipeline as one rank of a world of one, which yields every row of every global
batch in global order, so the batch hash it prints is the one the ledger records for step S
at any world size. Walking from the first batch costs O(S); ``--run RUN_DIR`` starts from the
data state of the run's newest checkpoint before S (data states are world-size independent).
"""

from __future__ import annotations

import json
from pathlib import Path

from core.config import Config
from core.exceptions import UsageError
from data.batch import IGNORE_INDEX, Batch
from core.layout import CHECKPOINTS_DIR, list_steps, state_file_name, step_dir_name
from core.objective_kinds import record_fields
from data.hashing import batch_hash, state_hash
from data.pipeline.pipeline import build

PREVIEW_CHARS = 72


def checkpoint_data_state(run_dir: Path, step: int) -> tuple[int, dict] | None:
    """(checkpoint step, data state) of the newest checkpoint of ``run_dir`` before ``step``.

    Only published checkpoints (``checkpoints/step_N``, renamed into place whole) count; the
    manifest is not re-verified here: a damaged state is refused by the pipeline's checks.
    """
    checkpoints = Path(run_dir) / CHECKPOINTS_DIR
    state_files = {s: checkpoints / step_dir_name(s) / state_file_name("data") for s in list_steps(checkpoints) if s < step}
    found = [s for s, path in state_files.items() if path.is_file()]
    if not found:
        return None
    ckpt_step = max(found)
    state_file = state_files[ckpt_step]
    try:
        return ckpt_step, json.loads(state_file.read_text())
    except ValueError as exc:
        raise UsageError(f"{state_file} is not JSON: {exc}", hint="pick another run or drop --run") from exc


def global_batch(config: Config, step: int, start_state: dict | None = None) -> Batch:
    """Global batch ``step`` (1-based) of the training stream.

    ``start_state``: a data state saved before ``step`` (a checkpoint's ``data_state.json``,
    merged over ranks), to start there instead of walking every batch from the first.
    """
    if step < 1:
        raise UsageError(f"--step must be >= 1, got {step}")
    with build(config.data, seed=config.train.seed, global_batch_size=config.train.global_batch_size,
               rank=0, world_size=1, record_fields=record_fields(config)) as pipeline:
        if start_state is not None:
            pipeline.load_state_dict(start_state)
            done = pipeline.stats()["step"]
            if done >= step:
                raise UsageError(
                    f"the data state is after batch {done}, not before batch {step}",
                    hint="pass a checkpoint older than the step (--run picks one itself)",
                )
        for batch in pipeline:
            if batch.step == step:
                return batch
    raise AssertionError("unreachable: the pipeline is endless")


def describe(batch: Batch, tokenizer) -> dict:
    """The JSON report of one batch."""
    digests = [digest for _, digest in batch.row_digests()]
    rows_per_stream = len(batch.sequence_index) // len(batch.state["streams"])
    rows = []
    for i, row in enumerate(batch.input_ids):
        rows.append({
            "index": batch.sequence_index[i],
            "stream": batch.sequence_index[i] // rows_per_stream,
            "digest": digests[i].hex(),
            "target_tokens": int((batch.labels[i] != IGNORE_INDEX).sum()),
            "provenance": [
                {"source": s.source, "shard": s.shard, "record": s.record, "start": s.start,
                 "end": s.end, "doc_offset": s.doc_offset, **_trained(batch, i, s, tokenizer)}
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
                         f"{span['shard']} record {span['record'] + 1}  from token {span['doc_offset']}  "  # from 1, as errors
                         f"trained {span['trained_tokens']}/{span['end'] - span['start']}")
            if 0 < span["trained_tokens"] < span["end"] - span["start"]:
                lines.append(f"        trained: {span['trained_text']!r}")
    return "\n".join(lines)


def _trained(batch: Batch, row: int, span, tokenizer) -> dict:
    """Which tokens of a document span are training targets: token t is one when the label of
    position t-1 (inside the span) is not IGNORE_INDEX. The trained text joins runs with ' | '."""
    labels = batch.labels[row]
    ids = batch.input_ids[row]
    trained = [t for t in range(span.start + 1, span.end) if int(labels[t - 1]) != IGNORE_INDEX]
    runs: list[list[int]] = []
    for t in trained:
        if runs and runs[-1][-1] == t - 1:
            runs[-1].append(t)
        else:
            runs.append([t])
    text = " | ".join(tokenizer.decode([int(ids[t]) for t in run]) for run in runs)
    return {"trained_tokens": len(trained), "trained_text": text[:PREVIEW_CHARS * 4]}
