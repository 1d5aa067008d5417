"""The packer (data/pipeline/packing.py) and the tensors a Batch derives from its spans."""

from __future__ import annotations

import numpy as np
import pytest

from data.batch import IGNORE_INDEX, Batch
from data.pipeline.items import Doc
from data.pipeline.packing import PackedSequence, StreamFailure, StreamPacker
from data.state import Position, StreamState

EOS = 99


def _docs(lengths: list[int], start: int = 0, first_token: int = 1) -> list[Doc]:
    docs, token = [], first_token
    for i, n in enumerate(lengths, start=start):
        ids = np.arange(token, token + n, dtype=np.int32) % 90
        token += n
        docs.append(Doc(i, 0, "shard", i, "utf8", Position(0, 0, i), Position(0, 0, i + 1), ids))
    return docs


def _packer(state: StreamState | None = None, seq_len: int = 8, skip_bad: bool = False) -> StreamPacker:
    return StreamPacker(0, state or StreamState.start(1), seq_len=seq_len, eos_id=EOS,
                        source_names=["src"], skip_bad=skip_bad)


def test_documents_are_concatenated_with_eos_and_split_across_sequences():
    seqs = _packer().accept(_docs([3, 10, 2]))
    flat = np.concatenate([s.tokens for s in seqs])
    docs = _docs([3, 10, 2])
    expected = np.concatenate([np.append(d.payload, EOS) for d in docs])  # 18 tokens -> 2 full rows
    assert len(seqs) == 2 and all(len(s.tokens) == 8 for s in seqs)
    np.testing.assert_array_equal(flat, expected[:16])
    spans = [[(s.record, s.start, s.end, s.doc_offset) for s in seq.spans] for seq in seqs]
    assert spans == [[(0, 0, 4, 0), (1, 4, 8, 0)], [(1, 0, 7, 4), (2, 7, 8, 0)]]


def test_state_after_each_sequence_points_at_the_first_unfinished_document():
    seqs = _packer().accept(_docs([3, 10, 2]))
    # After row 0: document 1 is unfinished with 4 of its tokens packed.
    assert seqs[0].state == StreamState((Position(0, 0, 1),), docs=1, skip=4, sequences=1)
    # After row 1: document 2 has 1 token packed.
    assert seqs[1].state == StreamState((Position(0, 0, 2),), docs=2, skip=1, sequences=2)


def test_resuming_from_any_sequence_state_continues_identically():
    lengths = [5, 17, 1, 0, 9, 30, 2, 7]
    full = _packer().accept(_docs(lengths))
    tokens = [s.tokens.tobytes() for s in full]
    for k, seq in enumerate(full):
        st = seq.state
        resumed = _packer(st).accept(_docs(lengths[st.docs:], start=st.docs,
                                           first_token=1 + sum(lengths[:st.docs])))
        assert [s.tokens.tobytes() for s in resumed] == tokens[k + 1:len(tokens)], k
        assert [s.state for s in resumed] == [s.state for s in full[k + 1:]]


def test_bad_document_fails_the_stream_or_is_skipped_and_counted():
    docs = _docs([3, 3, 3])
    docs[1].error, docs[1].payload = "invalid JSON line", None
    out = _packer().accept(docs)
    assert isinstance(out[-1], StreamFailure)
    assert out[-1].error.context["record"] == 2 and "invalid JSON" in str(out[-1].error)  # counted from 1
    docs = _docs([3, 3, 3])
    docs[1].error, docs[1].payload = "invalid JSON line", None
    packer = _packer(skip_bad=True)
    out = packer.accept(docs)
    assert packer.bad_records == 1 and all(isinstance(s, PackedSequence) for s in out)
    assert [sp.record for s in out for sp in s.spans] == [0, 2]


def test_fatal_errors_are_not_skipped():
    docs = _docs([3])
    docs[0].error, docs[0].fatal, docs[0].payload = "tokenize stage failed", True, None
    out = _packer(skip_bad=True).accept(docs)
    assert isinstance(out[0], StreamFailure)


def test_out_of_order_documents_are_a_bug_not_silently_packed():
    with pytest.raises(RuntimeError, match="expected 0"):
        _packer().accept(_docs([3], start=1))


def test_labels_positions_and_document_ids_follow_the_spans():
    seqs = _packer().accept(_docs([3, 10, 2]))
    batch = Batch.from_rows(1, [s.tokens for s in seqs], [s.spans for s in seqs], [0, 1], {})
    ids, labels = batch.input_ids, batch.labels
    assert ids.dtype == labels.dtype == batch.position_ids.dtype == batch.document_ids.dtype
    # Row 0: doc A = ids[0:4] (3 tokens + EOS), doc B starts at 4.
    assert labels[0].tolist() == [ids[0, 1], ids[0, 2], ids[0, 3], IGNORE_INDEX,
                                  ids[0, 5], ids[0, 6], ids[0, 7], IGNORE_INDEX]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert batch.document_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # Row 1 starts with the rest of doc B (positions reset), then doc C.
    assert batch.position_ids[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 0]
    assert batch.document_ids[1].tolist() == [0, 0, 0, 0, 0, 0, 0, 1]
    assert labels[1, -1] == IGNORE_INDEX and labels[1, 5] == ids[1, 6]
    assert batch.num_target_tokens() == int((labels != IGNORE_INDEX).sum()) == 6 + 6


def test_micro_batches_slice_rows_and_keep_step_and_state():
    seqs = _packer().accept(_docs([40]))
    batch = Batch.from_rows(7, [s.tokens for s in seqs], [s.spans for s in seqs], [10, 11, 12, 13, 14],
                            {"version": 1})
    micro = batch.micro_batches(2)
    assert [m.input_ids.shape[0] for m in micro] == [2, 2, 1]
    assert [m.sequence_index for m in micro] == [[10, 11], [12, 13], [14]]
    assert all(m.step == 7 and m.state is batch.state for m in micro)
    assert sum(m.num_target_tokens() for m in micro) == batch.num_target_tokens()
