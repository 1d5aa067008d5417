"""The pipeline's contracts: output independent of workers, world size and interruptions."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from core.config import AugmentConfig, DataConfig, SourceConfig
from core.exceptions import DataError
from data.hashing import batch_hash, sequence_digest, state_hash
from data.pipeline import build
from data.pipeline.pipeline import read_ahead_tokens
from data.pipeline.plan import make_plan
from data.pipeline.serial import iterate_serial
from data.state import merge_states
from tests.data.children import worker_children
from tests.data.corpus import (data_threads, doc_text, global_hashes, mixture_config,
                               train_local_tokenizer, write_jsonl, write_zst)

G = 8  # global batch: 2 rows per stream for 4 streams


def _hash(batch) -> str:
    return batch_hash([sequence_digest(r) for r in batch.input_ids])


def _run(config, n, *, rank=0, world=1, state=None, seed=7):
    with build(config, seed=seed, global_batch_size=G, rank=rank, world_size=world) as pipe:
        if state is not None:
            pipe.load_state_dict(state)
        return [next(pipe) for _ in range(n)]


def _serial(config, n, seed=7):
    it = iterate_serial(make_plan(config, seed=seed, global_batch_size=G, rank=0, world_size=1))
    return [next(it) for _ in range(n)]


def _bpe_config(corpus, tmp_path, **overrides):
    # A BPE tokenizer is a heavy stage: it gets worker threads (or processes) of its own.
    tokenizer = train_local_tokenizer(tmp_path / "tok", [doc_text(s, r) for s in range(3) for r in range(9)])
    return mixture_config(corpus, tokenizer=str(tokenizer), **overrides)


def test_batches_do_not_depend_on_workers_and_match_the_reference_loop(corpus, tmp_path):
    config = _bpe_config(corpus, tmp_path, augment=AugmentConfig(kind="span_drop", probability=0.5))
    expected = [_hash(b) for b in _serial(config, 30)]
    for workers in (0, 1, 4):
        with build(dataclasses.replace(config, workers=workers), seed=7, global_batch_size=G, rank=0,
                   world_size=1) as pipe:
            got = [next(pipe) for _ in range(30)]
            placement = pipe.stats()["placement"]
        assert [_hash(b) for b in got] == expected, f"workers={workers}"
        assert [b.step for b in got] == list(range(1, 31))
        assert placement["tokenize"] == (f"{workers} worker threads" if workers else "source thread")
    assert _run(mixture_config(corpus), 5)[0].input_ids.max() < 259  # byte tokens differ from BPE


def test_worker_processes_give_the_same_batches_and_are_reaped(corpus, tmp_path):
    # A BPE tokenizer also holds the GIL, so with process_pool its workers are processes.
    config = _bpe_config(corpus, tmp_path, process_pool=True, workers=2)
    expected = [_hash(b) for b in _serial(config, 12)]
    with build(config, seed=7, global_batch_size=G, rank=0, world_size=1) as pipe:
        assert [_hash(next(pipe)) for _ in range(12)] == expected
        assert pipe.stats()["worker_processes"] == 2
        assert len(worker_children()) >= 2
    assert worker_children() == []


def test_mixture_draws_from_both_sources_and_records_provenance(corpus):
    batches = _run(mixture_config(corpus), 30)
    spans = [s for b in batches for row in b.provenance for s in row]
    assert {s.source for s in spans} == {"zst", "pq"}
    for b in batches:
        for row, row_spans in zip(b.input_ids, b.provenance):
            assert row_spans[0].start == 0 and row_spans[-1].end == len(row)
            assert all(a.end == z.start for a, z in zip(row_spans, row_spans[1:]))


@pytest.mark.parametrize("world", [2, 4])
def test_global_batches_are_the_same_for_world_sizes_1_2_4(corpus, world):
    config = mixture_config(corpus)
    single = _run(config, 12)
    ranks = [_run(config, 12, rank=r, world=world) for r in range(world)]
    assert global_hashes(ranks) == [_hash(b) for b in single]
    assert all(len(b.sequence_index) == G // world for rank in ranks for b in rank)
    merged = merge_states([rank[-1].state for rank in ranks])
    assert state_hash(merged) == state_hash(single[-1].state)


def test_resume_at_any_batch_continues_the_uninterrupted_stream(corpus):
    config = mixture_config(corpus)
    full = _run(config, 24)
    mid_pack = mid_unit = False
    for k in (1, 2, 5, 9, 13, 20):
        state = full[k - 1].state
        streams = state["streams"].values()
        mid_pack |= any(s["skip"] > 0 for s in streams)
        mid_unit |= any(p["record"] > 0 for s in streams for p in s["sources"])
        resumed = _run(config, 24 - k, state=state)
        assert [b.step for b in resumed] == list(range(k + 1, 25))
        assert [_hash(b) for b in resumed] == [_hash(b) for b in full[k:]], f"resume after {k}"
        assert [state_hash(b.state) for b in resumed] == [state_hash(b.state) for b in full[k:]]
    assert mid_pack and mid_unit  # the chosen points do resume inside documents and units


def test_resume_on_another_world_size_continues_the_same_global_stream(corpus):
    config = mixture_config(corpus)
    single = [_hash(b) for b in _run(config, 16)]
    two = [_run(config, 6, rank=r, world=2) for r in range(2)]
    state = merge_states([rank[-1].state for rank in two])
    for world in (4, 1):
        ranks = [_run(config, 10, rank=r, world=world, state=state) for r in range(world)]
        assert global_hashes(ranks) == single[6:], f"2 -> {world} ranks"


def test_resume_through_epochs_and_with_on_bad_record_skip(tmp_path):
    write_zst(tmp_path / "small", shards=2, docs=6, frame=2)
    lines = [json.dumps({"text": doc_text(9, i)}) if i % 4 else "{broken" for i in range(12)]
    bad = write_jsonl(tmp_path / "bad" / "b.jsonl", lines)
    config = DataConfig(sources=(SourceConfig(path=str(tmp_path / "small")), SourceConfig(path=str(bad))),
                        seq_len=32, num_streams=4, workers=2, process_pool=False, on_bad_record="skip")
    with build(config, seed=7, global_batch_size=G, rank=0, world_size=1) as pipe:
        full = [next(pipe) for _ in range(60)]
        assert pipe.stats()["bad_records_skipped"] > 0
    epochs = max(p["epoch"] for s in full[-1].state["streams"].values() for p in s["sources"])
    assert epochs >= 2  # the small corpus wraps around its epochs
    assert [_hash(b) for b in _run(config, 20, state=full[39].state)] == [_hash(b) for b in full[40:]]


def test_state_dict_is_the_state_after_the_last_returned_batch(corpus):
    with build(mixture_config(corpus), seed=7, global_batch_size=G, rank=0, world_size=1) as pipe:
        first = pipe.state_dict()
        assert all(s["sequences"] == 0 for s in first["streams"].values())
        batches = [next(pipe) for _ in range(3)]
        time.sleep(0.2)  # let it read ahead
        stats = pipe.stats()
        assert stats["step"] == 3 and stats["tokens_packed"] > 3 * G * 48  # more was prefetched
        assert pipe.state_dict() == batches[-1].state
        assert all(s["sequences"] == 3 * 2 for s in pipe.state_dict()["streams"].values())
        with pytest.raises(DataError, match="before the first next"):
            pipe.load_state_dict(first)


def test_in_flight_documents_never_exceed_the_semaphore_with_a_slow_trainer(corpus, tmp_path):
    config = _bpe_config(corpus, tmp_path, max_in_flight=6, workers=3)
    pipe = build(config, seed=7, global_batch_size=G, rank=0, world_size=1)
    # Buffered sequences per stream: the read-ahead target plus what in-flight documents hold.
    longest_doc = max(len(doc_text(s, r)) for s in range(200) for r in range(30)) + 1
    bound = read_ahead_tokens(pipe._plan) // config.seq_len + config.max_in_flight * longest_doc // config.seq_len + 2
    with pipe:
        peak_sequences = 0
        for _ in range(40):
            next(pipe)
            time.sleep(0.005)  # the source is far faster than this trainer
            stats = pipe.stats()
            assert stats["in_flight"] <= 6
            peak_sequences = max(peak_sequences, max(stats["queues"]["sequences"].values()))
        assert stats["in_flight_peak"] == 6  # the bound was reached, and held
        assert stats["docs_read"] < 132  # it did not read the whole corpus ahead
        assert peak_sequences <= bound


def test_no_thread_is_left_after_close_or_after_an_error(corpus, tmp_path):
    before = data_threads()
    pipe = build(_bpe_config(corpus, tmp_path, workers=3), seed=7, global_batch_size=G, rank=0, world_size=1)
    next(pipe)
    assert len(data_threads()) == len(before) + 5  # source, 3 tokenize workers, pack
    pipe.close()
    assert data_threads() == before
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n' * 50)
    config = dataclasses.replace(mixture_config(corpus), sources=(dataclasses.replace(
        mixture_config(corpus).sources[0], path=str(bad)),))
    pipe = build(config, seed=7, global_batch_size=G, rank=0, world_size=1)
    with pytest.raises(DataError) as err:
        for _ in range(100):
            next(pipe)
    assert "record=2" in str(err.value) and str(bad) in str(err.value)  # its line 2, counted from 1
    assert data_threads() == before
    with pytest.raises(DataError):
        next(pipe)  # a failed pipeline stays failed


def test_eval_split_reads_the_eval_source_from_its_start(corpus):
    config = mixture_config(corpus)
    with build(config, seed=7, global_batch_size=G, rank=0, world_size=1, split="eval") as pipe:
        first = [next(pipe) for _ in range(3)]
    with build(config, seed=7, global_batch_size=G, rank=0, world_size=1, split="eval") as pipe:
        again = [next(pipe) for _ in range(3)]
    assert [_hash(b) for b in first] == [_hash(b) for b in again]
    assert {s.source for b in first for row in b.provenance for s in row} == {"eval"}


@pytest.mark.parametrize("process_pool", [False, True])
def test_a_failure_in_a_worker_reaches_next_with_file_and_record(corpus, tmp_path, process_pool):
    # A lone surrogate passes JSON decoding and fails in the tokenize workers.
    lines = [json.dumps({"text": doc_text(1, i) if i != 5 else "bad \udc80 text"}) for i in range(10)]
    bad = write_jsonl(tmp_path / "bad" / "b.jsonl", lines)
    config = _bpe_config(corpus, tmp_path, workers=2, process_pool=process_pool,
                         sources=(SourceConfig(path=str(bad)),))
    before = data_threads()
    with pytest.raises(DataError) as err:
        _run(config, 50)
    assert "lone surrogate" in err.value.message
    assert err.value.context["file"] == str(bad) and err.value.context["record"] == 6  # line 6
    assert data_threads() == before and worker_children() == []
