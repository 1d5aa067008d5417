"""Preference records through the pipeline (data/preference.py, WholeDocPacker pairs).

- a pair is two adjacent documents of one row: chosen then rejected, each with the prompt and
  loss on the response only; ``pair_role``/``pair_index`` say which tokens belong to which;
- the global batches (ids, roles, hashes) are the same for world sizes 1, 2 and 4, so a pair
  always lands on one rank and one micro-batch;
- a pair with identical chosen and rejected responses, or a missing field, is a DataError
  naming file and record, or skipped and counted under data.on_bad_record=skip;
- a pair longer than a row is dropped and counted, never cut; a source of only such pairs is a
  DataError naming it, not an endless read.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import pytest

from core.config import load
from core.exceptions import DataError
from data.batch import IGNORE_INDEX
from data.pipeline.pipeline import build
from data.tasks import write_task_datasets


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    write_task_datasets(root, seed=0, train_n=400, eval_n=20)
    return root


def _config(path, *overrides, seq_len=256, streams=4, batch=8):
    return load(None, [f"data.sources=[{{path: {path}, record: preference}}]", f"data.seq_len={seq_len}",
                       f"data.num_streams={streams}", f"train.global_batch_size={batch}", "data.workers=0",
                       *overrides])


def _global_rows(config, steps, world_size=1):
    out = []
    pipes = [build(config.data, seed=0, global_batch_size=config.train.global_batch_size, rank=r,
                   world_size=world_size) for r in range(world_size)]
    try:
        for _ in range(steps):
            rows = {}
            for pipe in pipes:
                batch = next(pipe)
                digests = dict(batch.row_digests())
                for r, index in enumerate(batch.sequence_index):
                    rows[index] = (batch.input_ids[r], batch.labels[r], batch.extras["pair_role"][r],
                                   batch.extras["pair_index"][r], batch.provenance[r], digests[index])
            out.append([rows[i] for i in sorted(rows)])
    finally:
        for pipe in pipes:
            pipe.close()
    return out


def test_a_pair_is_chosen_then_rejected_in_one_row_with_loss_on_the_responses(tasks):
    records = [json.loads(line) for line in (tasks / "pref" / "train.jsonl").read_text().splitlines()]
    by_record = {i: r for i, r in enumerate(records)}
    pairs = 0
    for ids, labels, role, index, spans, _ in _global_rows(_config(tasks / "pref" / "train.jsonl"), 3)[0]:
        docs = [s for s in spans if s.record >= 0]
        assert len(docs) % 2 == 0 and len(docs) >= 2
        for k in range(0, len(docs), 2):
            chosen, rejected = docs[k], docs[k + 1]
            assert chosen.record == rejected.record and rejected.start == chosen.end  # adjacent, same record
            assert (role[chosen.start:chosen.end] == 1).all() and (role[rejected.start:rejected.end] == 2).all()
            assert (index[chosen.start:rejected.end] == k // 2).all()
            record = by_record[chosen.record]
            for span, text in ((chosen, record["chosen"]), (rejected, record["rejected"])):
                trained = labels[span.start:span.end]
                targets = bytes(int(t) for t in trained[trained != IGNORE_INDEX]).decode()
                assert targets == text + "<|im_end|>"  # the response and its end of turn, no prompt
                assert record["prompt"] in bytes(ids[span.start:span.end - 1].tolist()).decode()
            pairs += 1
        assert (role[docs[-1].end:] == 0).all() and (index[docs[-1].end:] == -1).all()
    assert pairs >= 8


@pytest.mark.parametrize("world_size", [2, 4])
def test_pairs_and_batches_do_not_depend_on_world_size(tasks, world_size):
    config = _config(tasks / "pref" / "train.jsonl")
    one = _global_rows(config, 3, world_size=1)
    many = _global_rows(config, 3, world_size=world_size)
    for a_step, b_step in zip(one, many):
        for a, b in zip(a_step, b_step):
            assert all(np.array_equal(x, y) for x, y in zip(a[:4], b[:4]))
            assert a[5] == b[5]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _good(i):
    return {"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i + 2)}


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "Say hi.", "chosen": "hi", "rejected": "hi"}, "identical"),
    ({"prompt": "Say hi.", "chosen": "hi"}, "no 'rejected'"),
    ({"chosen": "hi", "rejected": "ho"}, "no 'prompt'"),
    ({"prompt": "Say hi.", "chosen": "", "rejected": "ho"}, "'chosen' is empty"),
])
def test_bad_pairs_are_errors_naming_the_record_or_counted_skips(tmp_path, bad, message):
    path = _write(tmp_path / "pairs.jsonl", [_good(i) for i in range(5)] + [bad] + [_good(i) for i in range(5, 40)])
    config = _config(path, streams=1, batch=2, seq_len=256)
    pipe = build(config.data, seed=0, global_batch_size=2, rank=0, world_size=1)
    with pytest.raises(DataError) as info:
        for _ in range(10):
            next(pipe)
    pipe.close()
    assert message in str(info.value) and info.value.context["record"] == 6  # line 6
    assert info.value.context["file"].endswith("pairs.jsonl")

    skipping = _config(path, "data.on_bad_record=skip", streams=1, batch=2, seq_len=256)
    pipe = build(skipping.data, seed=0, global_batch_size=2, rank=0, world_size=1)
    try:
        seen = {s.record for _ in range(4) for row in next(pipe).provenance for s in row}
        assert pipe.stats()["bad_records_skipped"] >= 1  # read-ahead may reach the next epoch
    finally:
        pipe.close()
    assert 5 not in seen and {4, 6} <= seen


def test_a_pair_longer_than_a_row_is_dropped_and_counted(tmp_path):
    long = {"prompt": "Repeat: " + "x" * 100, "chosen": "y" * 20, "rejected": "z" * 20}
    path = _write(tmp_path / "pairs.jsonl", [_good(0), long] + [_good(i) for i in range(1, 40)])
    config = _config(path, streams=1, batch=2, seq_len=256)
    pipe = build(config.data, seed=0, global_batch_size=2, rank=0, world_size=1)
    try:
        seen = {s.record for _ in range(4) for row in next(pipe).provenance for s in row}
        assert pipe.stats()["overlong_dropped"] >= 1  # read-ahead may reach the next epoch
    finally:
        pipe.close()
    assert 1 not in seen and {0, 2} <= seen


def test_a_source_whose_every_pair_is_longer_than_a_row_is_a_data_error_not_a_loop(tmp_path):
    # No watchdog here: the pipeline itself stops, after one whole pass that kept nothing.
    long = [{"prompt": f"Repeat {i}: " + "x" * 100, "chosen": "y" * 20, "rejected": "z" * 20} for i in range(6)]
    path = _write(tmp_path / "pairs.jsonl", long)
    config = _config(path, streams=1, batch=2, seq_len=128)
    with pytest.raises(DataError) as info:
        with build(config.data, seed=0, global_batch_size=2, rank=0, world_size=1) as pipe:
            next(pipe)
    assert info.value.exit_code == 3
    assert f"source {str(path)!r} has no usable record" in info.value.message
    assert "longer than data.seq_len" in info.value.message and "data.seq_len=128" in info.value.message


def _batches(config, steps, **kwargs):
    pipe = build(config.data, seed=0, global_batch_size=config.train.global_batch_size, rank=0, world_size=1,
                 **kwargs)
    try:
        return [next(pipe) for _ in range(steps)]
    finally:
        pipe.close()


def test_a_records_margin_travels_with_its_pair_only_where_margins_are_read(tmp_path):
    margins = [0.5 * i - 3 for i in range(40)]  # record i (provenance counts from 0) has margin 0.5 i - 3
    plain = _write(tmp_path / "plain.jsonl", [_good(i) for i in range(40)])
    marked = _write(tmp_path / "marked.jsonl", [{**_good(i), "margin": m} for i, m in enumerate(margins)])
    # Not read: a record with a margin gives the batches (ids, extras, hashes) a record without one gives.
    for ours, theirs in zip(_batches(_config(marked, streams=1, batch=2), 3), _batches(_config(plain, streams=1,
                                                                                               batch=2), 3)):
        assert "pair_margin" not in ours.extras and ours.row_digests() == theirs.row_digests()
    # Read: every token of a pair carries its record's margin, every other token 0.
    read = _batches(_config(marked, streams=1, batch=2), 3, record_fields=("margin",))
    checked = 0
    for batch in read:
        margin, role = batch.extras["pair_margin"], batch.extras["pair_role"]
        assert margin.dtype == torch.float32 and margin.shape == role.shape
        for r, row in enumerate(batch.provenance):
            for span in row:
                if span.record < 0:  # padding
                    assert (margin[r, span.start:span.end] == 0).all()
                    continue
                assert (margin[r, span.start:span.end] == margins[span.record]).all()
                checked += 1
    assert checked >= 12  # both documents of at least six pairs


@pytest.mark.parametrize("value, message", [(None, "no 'margin'"), ("1", "must be a finite number"),
                                            (float("inf"), "must be a finite number"), (True, "must be a finite")])
def test_where_margins_are_read_a_missing_or_bad_margin_names_the_record(tmp_path, value, message):
    bad = _good(5) if value is None else {**_good(5), "margin": value}
    rows = [{**_good(i), "margin": 1.0} for i in range(5)] + [bad] + [{**_good(i), "margin": 1.0} for i in range(6, 40)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row, allow_nan=True) + "\n" for row in rows))
    config = _config(path, streams=1, batch=2)
    with pytest.raises(DataError) as info:
        _batches(config, 10, record_fields=("margin",))
    assert message in str(info.value) and info.value.context["record"] == 6
    _batches(config, 10)  # not read: the same records are good
