"""The stateless stages: decode errors, tokenization, and the seeded augmentations."""

from __future__ import annotations


import numpy as np
import pytest

from core.config import AugmentConfig
from core.exceptions import ConfigError
from data.pipeline.items import Chunk, Doc
from data.pipeline.augment import AugmentStage
from data.pipeline.stages import DecodeStage, TokenizeStage, each_doc
from data.state import Position
from data.tokenizers import ByteTokenizer


def _chunk(payloads, codec="json", stream=0):
    return Chunk(stream, 0, [Doc(i, 0, "f", i, codec, Position(), Position(), p) for i, p in enumerate(payloads)])


@pytest.mark.parametrize("payload,message", [
    (b'{"text": "ok"', "invalid JSON line"),
    (b'{"body": "x"}', "no text key 'text'"),
    (b'{"text": 3}', "not a string"),
    (b'[1, 2]', "not an object"),
    (b'{"text": "caf\xe9"}', "invalid UTF-8 at byte 13"),
])
def test_decode_marks_bad_records_with_the_reason(payload, message):
    (doc,) = DecodeStage(["text"]).process(_chunk([payload])).docs
    assert doc.payload is None and message in doc.error and not doc.fatal


def test_decode_and_tokenize_a_good_record():
    chunk = TokenizeStage(ByteTokenizer()).process(DecodeStage(["text"]).process(_chunk([b'{"text": "hi"}'])))
    assert chunk.docs[0].payload.tolist() == [104, 105] and chunk.docs[0].error is None


def test_tokenize_rejects_lone_surrogates_as_bad_records():
    chunk = TokenizeStage(ByteTokenizer()).process(_chunk(["a\udc80b"], codec="utf8"))
    assert "lone surrogate" in chunk.docs[0].error


def _tokens(n=200):
    return np.frombuffer(bytes(range(65, 65 + 26)) * (n // 26 + 1), dtype=np.uint8)[:n].astype(np.int32)


@pytest.mark.parametrize("kind", ["span_drop", "case_flip"])
def test_augmentation_is_seeded_per_document_and_bounded(kind):
    stage = AugmentStage(AugmentConfig(kind=kind, probability=1.0, max_fraction=0.2), seed=1,
                         tokenizer=ByteTokenizer())
    first = stage.process(_chunk([_tokens(), _tokens()], codec="utf8")).docs
    again = stage.process(_chunk([_tokens(), _tokens()], codec="utf8")).docs
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.payload, b.payload)
    assert not np.array_equal(first[0].payload, first[1].payload)  # different documents differ
    for doc in first:
        changed = 200 - len(doc.payload) if kind == "span_drop" else int((doc.payload != _tokens()).sum())
        assert 1 <= changed <= 40
    other_stream = stage.process(_chunk([_tokens()], codec="utf8", stream=1)).docs[0]
    assert not np.array_equal(other_stream.payload, first[0].payload)


def test_augmentation_is_off_by_default_and_probability_zero_is_identity():
    assert not AugmentStage.enabled(AugmentConfig())
    stage = AugmentStage(AugmentConfig(kind="span_drop", probability=0.0), seed=1, tokenizer=ByteTokenizer())
    np.testing.assert_array_equal(stage.process(_chunk([_tokens()], codec="utf8")).docs[0].payload, _tokens())


def test_case_flip_needs_the_byte_tokenizer():
    class Other:
        pass

    with pytest.raises(ConfigError, match="case_flip"):
        AugmentStage(AugmentConfig(kind="case_flip", probability=1.0), seed=0, tokenizer=Other())


def test_an_unexpected_exception_marks_the_document_fatal_with_the_stage():
    def broken(doc):
        raise KeyError("oops")

    (doc,) = each_doc("tokenize", _chunk([b"x"]), broken).docs
    assert doc.fatal and doc.error.startswith("tokenize stage failed: KeyError")
