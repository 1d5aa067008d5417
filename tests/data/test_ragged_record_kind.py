"""A record kind defined here, with a ragged field, goes through the real pipeline unchanged.

The kind ``blob_text`` (``{"text": str, "blob": [float, ...]}``, a blob of any length per record)
is a row registered by this module only: nothing outside it names it. Its blobs must travel with
their documents through backpressure, packing and batching into ``Batch.media``; resume mid-epoch
gives the same next batches; 1 and 2 ranks give the same global rows; and each blob is in its
row's digest, so a replay that read another blob would not verify.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import DataConfig, SourceConfig, load
from core.exceptions import ConfigError, DataError
from data.chat_template import RecordError
from data.fields import DocField, Pack
from data.hashing import batch_hash, sequence_digest, state_hash
from data.pipeline import build
from data.pipeline.packing import PAD_SOURCE
from data.pipeline.plan import make_plan
from data.pipeline.serial import iterate_serial
from data.record_kinds import Encoded, EncoderSetup, RecordKind, register_record_kind, unregister_record_kind

G = 8  # global batch: 2 rows per stream for 4 streams
BLOB = DocField("blob", Pack.RAGGED)


class BlobDocuments:
    """A ``blob_text`` record -> its text's ids, and its blob as the one item of the ragged field."""

    def __init__(self, setup: EncoderSetup) -> None:
        self.tokenizer = setup.tokenizer

    def document(self, record) -> Encoded:
        text, blob = record.get("text"), record.get("blob")
        if not isinstance(text, str) or not isinstance(blob, list) or not all(isinstance(v, float) for v in blob):
            raise RecordError("a blob_text record holds a 'text' string and a 'blob' list of numbers")
        return Encoded(self.tokenizer.encode_array(text), {BLOB.name: [np.asarray(blob, dtype=np.float32)]})


KIND = RecordKind(name="blob_text", summary='{"text", "blob"}: text with a blob of floats', encoder=BlobDocuments,
                  fields=(BLOB,))


def _blob(shard: int, record: int) -> list[float]:
    return [shard + record / 100 + k / 1000 for k in range((record * 7 + shard) % 5 + 1)]


def _record(shard: int, record: int, blob: list[float] | None = None) -> dict:
    words = " ".join(f"w{k}" for k in range((record * 13 + shard * 5) % 17 + 1))
    return {"text": f"<{shard}:{record}> {words}", "blob": blob if blob is not None else _blob(shard, record)}


def _write(directory: Path, changed: tuple[int, int] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for s in range(6):
        lines = []
        for r in range(20):
            blob = [v + 0.5 for v in _blob(s, r)] if (s, r) == changed else None
            lines.append(json.dumps(_record(s, r, blob)))
        (directory / f"part-{s:03d}.jsonl").write_text("\n".join(lines) + "\n")
    return directory


@pytest.fixture
def blob_kind():
    register_record_kind(KIND)
    yield KIND
    unregister_record_kind(KIND.name)


def _config(path: Path, **overrides) -> DataConfig:
    base = dict(sources=(SourceConfig(path=str(path), name="blobs", record=KIND.name),), seq_len=48, num_streams=4,
                workers=2, process_pool=False, prefetch_batches=2)
    base.update(overrides)
    return DataConfig(**base)


def _run(config, n, *, rank=0, world=1, state=None):
    with build(config, seed=3, global_batch_size=G, rank=rank, world_size=world) as pipe:
        if state is not None:
            pipe.load_state_dict(state)
        return [next(pipe) for _ in range(n)]


def _global(per_rank: list[list]) -> list[dict[int, bytes]]:
    """Each step's row digests of every rank, by global row."""
    return [{i: d for b in step for i, d in b.row_digests()} for step in zip(*per_rank)]


def _shard_record(span) -> tuple[int, int]:
    return int(Path(span.shard).stem.split("-")[1]), span.record


def test_blobs_travel_with_their_documents_into_batch_media(blob_kind, tmp_path):
    config = _config(_write(tmp_path / "blobs"))
    batches = _run(config, 6)
    assert [b.row_digests() for b in batches] == [b.row_digests() for b in _serial_batches(config, 6)]
    items = 0
    for batch in batches:
        assert set(batch.media) == {"blob"} and set(batch.extras) == {"target_mask"}
        for row, spans in enumerate(batch.provenance):
            documents = [sp for sp in spans if sp.source != PAD_SOURCE]
            want = [_blob(*_shard_record(sp)) for sp in documents]
            got = batch.media["blob"][row]
            assert [item.tolist() for item in got] == [pytest.approx(w) for w in want]
            assert all(item.dtype == torch.float32 for item in got)
            items += len(got)
    assert items > 6 * G  # rows hold several documents


def _serial_batches(config, n):
    it = iterate_serial(make_plan(config, seed=3, global_batch_size=G, rank=0, world_size=1))
    return [next(it) for _ in range(n)]


def test_backpressure_holds_with_a_slow_trainer_and_the_output_does_not_change(blob_kind, tmp_path):
    config = _config(_write(tmp_path / "blobs"), max_in_flight=3)
    with build(config, seed=3, global_batch_size=G, rank=0, world_size=1) as pipe:
        batches = []
        for _ in range(12):
            batches.append(next(pipe))
            time.sleep(0.005)
            stats = pipe.stats()
            assert stats["in_flight"] <= 3
        assert stats["in_flight_peak"] <= 3
    assert [b.row_digests() for b in batches] == [b.row_digests() for b in _run(_config(config.sources[0].path), 12)]


def test_resume_mid_epoch_gives_the_same_next_batches(blob_kind, tmp_path):
    config = _config(_write(tmp_path / "blobs"))
    full = _run(config, 14)
    inside_a_unit = False
    for k in (1, 4, 9):
        state = full[k - 1].state
        inside_a_unit |= any(p["record"] > 0 for s in state["streams"].values() for p in s["sources"])
        resumed = _run(config, 14 - k, state=state)
        assert [b.row_digests() for b in resumed] == [b.row_digests() for b in full[k:]], f"resume after {k}"
        assert [state_hash(b.state) for b in resumed] == [state_hash(b.state) for b in full[k:]]
        assert [[[i.tolist() for i in row] for row in b.media["blob"]] for b in resumed] == \
            [[[i.tolist() for i in row] for row in b.media["blob"]] for b in full[k:]]
    assert inside_a_unit  # the resume points fall inside a shard, mid-epoch


def test_one_and_two_ranks_give_the_same_global_rows(blob_kind, tmp_path):
    config = _config(_write(tmp_path / "blobs"))
    one = _global([_run(config, 5)])
    two = _global([_run(config, 5, rank=r, world=2) for r in range(2)])
    assert one == two


def test_the_digest_covers_each_blob_and_rows_without_media_digest_as_before(blob_kind, tmp_path):
    batches = _run(_config(_write(tmp_path / "blobs")), 3)
    # the first document of step 2's first row, with its blob changed: that row's digest changes, no other
    first = next(sp for sp in batches[1].provenance[0] if sp.source != PAD_SOURCE)
    changed = _run(_config(_write(tmp_path / "changed", changed=_shard_record(first))), 3)
    assert batch_hash([d for _, d in batches[0].row_digests()]) == batch_hash([d for _, d in changed[0].row_digests()])
    before, after = dict(batches[1].row_digests()), dict(changed[1].row_digests())
    moved = [i for i in before if before[i] != after[i]]
    assert moved == [batches[1].sequence_index[0]]
    assert torch.equal(batches[1].input_ids, changed[1].input_ids)  # the tokens are the same: only the blob differs

    batch = batches[0]
    ids_and_extras = [sequence_digest(batch.input_ids[r], [("target_mask", batch.extras["target_mask"][r])])
                      for r in range(len(batch.sequence_index))]
    assert [d for _, d in dataclasses.replace(batch, media={}).row_digests()] == ids_and_extras  # no media: the digest of before media existed
    assert all(a != b for (_, a), b in zip(batch.row_digests(), ids_and_extras))


def test_micro_batches_select_and_placed_keep_each_rows_items(blob_kind, tmp_path):
    batch = _run(_config(_write(tmp_path / "blobs")), 1)[0]
    digests = dict(batch.row_digests())
    micro = batch.micro_batches(3)
    assert [len(m.media["blob"]) for m in micro] == [3, 3, 2]
    assert {i: d for m in micro for i, d in m.row_digests()} == digests
    picked = batch.select([5, 1])
    assert [d for _, d in picked.row_digests()] == [digests[batch.sequence_index[5]], digests[batch.sequence_index[1]]]
    placed = batch.placed(lambda t: t.to(torch.float64) if t.dtype == torch.float32 else t)
    assert all(item.dtype == torch.float64 for row in placed.media["blob"] for item in row)


def test_a_bad_blob_record_is_a_bad_record_naming_file_and_record(blob_kind, tmp_path):
    directory = _write(tmp_path / "blobs")
    shard = directory / "part-002.jsonl"
    lines = shard.read_text().splitlines()
    lines[3] = json.dumps({"text": "x", "blob": "not a list"})
    shard.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as error:
        _run(_config(directory), 14)
    assert "blob_text record" in str(error.value) and error.value.context["record"] == 4
    assert _run(_config(directory, on_bad_record="skip"), 3)  # skipped and counted instead


def test_data_sources_record_takes_the_names_of_registered_kinds(tmp_path):
    override = f"data.sources=[{{path: {tmp_path}, record: {KIND.name}}}]"
    with pytest.raises(ConfigError) as error:
        load(None, [override])
    assert error.value.context["key"] == "data.sources[0].record" and "'preference'" in str(error.value)
    register_record_kind(KIND)
    try:
        assert load(None, [override]).data.sources[0].record == KIND.name
    finally:
        unregister_record_kind(KIND.name)
