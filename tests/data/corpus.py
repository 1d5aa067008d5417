"""Tiny generated corpora and helpers shared by the data tests."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.config import DataConfig, SourceConfig
from data.hashing import batch_hash, sequence_digest
from data.sources.zstd import write_indexed_jsonl_zst


def doc_text(shard: int, record: int) -> str:
    """Documents of very different lengths, some longer than a sequence."""
    body = " ".join(f"w{shard}.{record}.{k}" for k in range((record * 37 + shard * 11) % 90 + 1))
    return f"<doc {shard}:{record}> {body}"


def write_zst(directory: Path, shards: int, docs: int, frame: int = 4, start: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for s in range(start, start + shards):
        lines = (json.dumps({"text": doc_text(s, r)}).encode() for r in range(docs))
        write_indexed_jsonl_zst(directory / f"part-{s:03d}.jsonl.zst", lines, frame_records=frame)
    return directory


def write_parquet(directory: Path, shards: int, docs: int, row_group: int = 4, start: int = 100) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for s in range(start, start + shards):
        table = pa.table({"id": list(range(docs)), "body": [doc_text(s, r) for r in range(docs)]})
        pq.write_table(table, directory / f"part-{s:03d}.parquet", row_group_size=row_group)
    return directory


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> dict:
    """A two-source mixture (indexed jsonl.zst + parquet) and an eval shard."""
    return {
        "zst": write_zst(tmp_path / "zst", shards=3, docs=24),
        "parquet": write_parquet(tmp_path / "parquet", shards=2, docs=30),
        "eval": write_zst(tmp_path / "eval", shards=1, docs=20, frame=2, start=50),
    }


def mixture_config(corpus: dict, **overrides) -> DataConfig:
    base = dict(
        sources=(
            SourceConfig(path=str(corpus["zst"]), weight=0.6, name="zst"),
            SourceConfig(path=str(corpus["parquet"]), weight=0.4, name="pq", text_column="body"),
        ),
        eval_source=SourceConfig(path=str(corpus["eval"]), name="eval"),
        seq_len=48, num_streams=4, workers=2, process_pool=False, prefetch_batches=2,
    )
    base.update(overrides)
    return DataConfig(**base)


def row_digests(batch) -> dict[int, bytes]:
    return {i: sequence_digest(row) for i, row in zip(batch.sequence_index, batch.input_ids)}


def global_hashes(per_rank_batches: list[list]) -> list[str]:
    """Batch hashes from every rank's batches, gathered as the trainer does."""
    hashes = []
    for step_batches in zip(*per_rank_batches):
        digests: dict[int, bytes] = {}
        for b in step_batches:
            digests.update(row_digests(b))
        hashes.append(batch_hash([digests[i] for i in sorted(digests)]))
    return hashes


def train_local_tokenizer(directory: Path, texts: list[str] | None = None, vocab_size: int = 300) -> Path:
    """A small byte-level BPE tokenizer.json trained here (tests never download one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts or ["def f(x):\n    return x + 1\n"] * 50, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory


def data_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lockstep-data")]
