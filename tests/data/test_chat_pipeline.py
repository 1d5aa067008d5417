"""Chat records through the pipeline: whole-document packing, masks, bad records, overlong ones.

- rows hold whole conversations (never cut across rows), padded; padding and prompts carry no
  loss; the masks survive packing and enter the batch hash;
- the global batches (ids and masks) are the same for every world size and worker count;
- a bad record is a DataError naming file and record, or a counted skip;
- a conversation longer than data.seq_len is truncated or dropped, and counted;
- packing efficiency on the embedded task data at seq_len 2048 is at least 95%.
"""

from __future__ import annotations

import json

import pytest
import torch

from core.config import load
from core.exceptions import DataError
from data.batch import IGNORE_INDEX
from data.pipeline.packing import PAD_SOURCE
from data.pipeline.pipeline import build
from data.pipeline.plan import make_plan
from data.pipeline.serial import iterate_serial
from data.tasks import write_task_datasets


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    write_task_datasets(root, seed=0, train_n=600, eval_n=20)
    return root


def _config(path, *overrides, seq_len=128, streams=4, batch=8):
    return load(None, [f"data.sources=[{{path: {path}, record: chat}}]", f"data.seq_len={seq_len}",
                       f"data.num_streams={streams}", f"train.global_batch_size={batch}", *overrides])


def _global_batches(config, steps, world_size=1, workers=None):
    """Every rank's batches merged into global order: (ids, labels, masks, hashes) per step."""
    out = []
    pipes = [build(config.data if workers is None else _with_workers(config, workers).data, seed=0,
                   global_batch_size=config.train.global_batch_size, rank=r, world_size=world_size)
             for r in range(world_size)]
    try:
        for _ in range(steps):
            rows = {}
            for pipe in pipes:
                batch = next(pipe)
                for r, index in enumerate(batch.sequence_index):
                    rows[index] = (batch.input_ids[r], batch.labels[r], batch.extras["target_mask"][r],
                                   dict(batch.row_digests())[index])
            out.append([rows[i] for i in sorted(rows)])
    finally:
        for pipe in pipes:
            pipe.close()
    return out


def _with_workers(config, workers):
    import dataclasses

    return dataclasses.replace(config, data=dataclasses.replace(config.data, workers=workers))


def test_rows_hold_whole_conversations_and_only_answers_train(tasks):
    config = _config(tasks / "sft" / "train.jsonl")
    plan = make_plan(config.data, seed=0, global_batch_size=8, rank=0, world_size=1)
    batch = next(iterate_serial(plan))
    for r, spans in enumerate(batch.provenance):
        docs = [s for s in spans if s.source != PAD_SOURCE]
        assert docs and all(s.doc_offset == 0 for s in docs)  # nothing continues from another row
        text = bytes(t for t in batch.input_ids[r].tolist() if t < 256).decode()
        assert text.count("<|im_start|>user") >= len(docs)
        trained = [int(batch.input_ids[r, t]) for t in range(1, 128) if batch.labels[r, t - 1] != IGNORE_INDEX]
        assert bytes(t for t in trained if t < 256).decode().endswith("<|im_end|>")
        for s in spans:
            if s.source == PAD_SOURCE:  # padding: no targets, not even at its first position
                assert (batch.labels[r, max(s.start - 1, 0):s.end] == IGNORE_INDEX).all()
                assert not batch.extras["target_mask"][r, s.start:s.end].any()


def test_global_batches_do_not_depend_on_world_size_or_workers(tasks):
    config = _config(tasks / "sft" / "train.jsonl")
    one = _global_batches(config, 3, world_size=1, workers=0)
    for world, workers in ((2, 1), (4, 2)):
        other = _global_batches(config, 3, world_size=world, workers=workers)
        for a_step, b_step in zip(one, other):
            for a, b in zip(a_step, b_step):
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
                assert a[3] == b[3]


def test_the_mask_enters_the_row_digest(tasks):
    config = _config(tasks / "sft" / "train.jsonl")
    batch = next(iterate_serial(make_plan(config.data, seed=0, global_batch_size=8, rank=0, world_size=1)))
    flipped = batch.with_extras(target_mask=~batch.extras["target_mask"])
    assert [d for _, d in batch.row_digests()] != [d for _, d in flipped.row_digests()]


def test_resume_from_a_batch_state_continues_identically(tasks):
    config = _config(tasks / "sft" / "train.jsonl")
    with build(config.data, seed=0, global_batch_size=8, rank=0, world_size=1) as pipe:
        batches = [next(pipe) for _ in range(5)]
    with build(config.data, seed=0, global_batch_size=8, rank=0, world_size=1) as pipe:
        pipe.load_state_dict(batches[1].state)
        again = [next(pipe) for _ in range(3)]
    for a, b in zip(batches[2:], again):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


def _bad_file(tmp_path, bad):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good] * 3 + [bad] + [good] * 400))
    return path


@pytest.mark.parametrize(("bad", "message"), [
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}, "empty content"),
    ({"prompt": "q", "completion": "a"}, "no 'messages'"),
    ("just a string", "not an object"),
])
def test_a_bad_chat_record_names_file_and_record_or_is_skipped_and_counted(tmp_path, bad, message):
    path = _bad_file(tmp_path, bad)
    config = _config(path, streams=1, batch=2)
    with pytest.raises(DataError, match=message) as info:
        with build(config.data, seed=0, global_batch_size=2, rank=0, world_size=1) as pipe:
            for _ in range(4):
                next(pipe)
    assert info.value.context["file"] == str(path) and info.value.context["record"] == 4  # line 4
    skipping = _config(path, "data.on_bad_record=skip", streams=1, batch=2)
    with build(skipping.data, seed=0, global_batch_size=2, rank=0, world_size=1) as pipe:
        for _ in range(4):
            next(pipe)
        assert pipe.stats()["bad_records_skipped"] == 1


@pytest.mark.parametrize("rule", ["truncate", "drop"])
def test_an_overlong_conversation_is_truncated_or_dropped_and_counted(tmp_path, rule):
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    long_answer = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y" * 300}]}
    long_prompt = {"messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [short, long_answer, long_prompt] + [short] * 400))
    config = _config(path, f"data.overlong={rule}", streams=1, batch=2)
    with build(config.data, seed=0, global_batch_size=2, rank=0, world_size=1) as pipe:
        first = next(pipe)
        stats = pipe.stats()
    # A truncated prompt leaves nothing to train: it is dropped under either rule.
    assert (stats["overlong_truncated"], stats["overlong_dropped"]) == ((1, 1) if rule == "truncate" else (0, 2))
    records = [s.record for row in first.provenance for s in row if s.source != PAD_SOURCE]
    assert (1 in records) == (rule == "truncate") and 2 not in records
    if rule == "truncate":  # the truncated conversation fills a row and trains its answer's start
        row = next(r for r, spans in enumerate(first.provenance) if any(s.record == 1 for s in spans))
        assert first.provenance[row][0].end == 128
        assert (first.labels[row] != IGNORE_INDEX).sum() > 50


def test_packing_efficiency_on_the_task_data_at_2048(tasks):
    config = _config(tasks / "sft" / "train.jsonl", seq_len=2048, streams=2, batch=4)
    with build(config.data, seed=0, global_batch_size=4, rank=0, world_size=1) as pipe:
        batches = [next(pipe) for _ in range(4)]
    total = sum(b.input_ids.numel() for b in batches)
    padding = sum(s.end - s.start for b in batches for row in b.provenance for s in row if s.source == PAD_SOURCE)
    assert 1 - padding / total >= 0.95, f"packing efficiency {1 - padding / total:.3f}"
