"""The byte tokenizer, and a local Hugging Face tokenizer.json (trained here, never downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.exceptions import DataError
from data.tokenizers import ByteTokenizer, build_tokenizer, tokenizer_directory
from tests.data.corpus import train_local_tokenizer


def test_byte_tokenizer_round_trips_utf8_and_fits_a_512_vocab():
    tok = build_tokenizer("byte")
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.encode_array(text).tolist() == ids
    assert tok.decode(ids) == text
    assert tok.vocab_size < 512 and tok.eos_id >= 256
    assert tok.decode([104, 105, tok.eos_id]) == "hi" + ByteTokenizer.SPECIALS[0]


def test_local_hugging_face_tokenizer_directory(tmp_path):
    train_local_tokenizer(tmp_path / "tok")
    tok = build_tokenizer(str(tmp_path / "tok"))
    text = "def g(y):\n    return y\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == 0 and tok.vocab_size <= 300
    assert tok.fingerprint.startswith("hf-") and tok.fingerprint == build_tokenizer(str(tmp_path / "tok" / "tokenizer.json")).fingerprint


def test_a_tokenizer_file_is_parsed_once_a_process_and_again_once_its_bytes_change(tmp_path):
    """The builds of one file share its parse (data/tokenizers.py ``_PARSED``); another file
    (here, retrained in place with another vocabulary) is parsed anew and encodes as itself."""
    directory = train_local_tokenizer(tmp_path / "tok")
    first, second = build_tokenizer(str(directory)), build_tokenizer(str(directory / "tokenizer.json"))
    assert first._tok is second._tok
    train_local_tokenizer(directory, ["abc abc abd\n"] * 50, vocab_size=270)
    third = build_tokenizer(str(directory))
    assert third._tok is not first._tok and third.fingerprint != first.fingerprint
    assert third.encode("abc") != first.encode("abc") and third.decode(third.encode("abc abd")) == "abc abd"


def test_missing_tokenizer_is_a_data_error_that_says_nothing_is_downloaded(tmp_path):
    with pytest.raises(DataError, match="never downloads"):
        build_tokenizer("Qwen/Qwen3-0.6B")


def test_tokenizer_directory_names_where_a_spec_lives(tmp_path):
    train_local_tokenizer(tmp_path / "tok")
    assert tokenizer_directory("byte") is None
    assert tokenizer_directory("qwen") == Path("datasets/tokenizers/qwen")
    assert tokenizer_directory(str(tmp_path / "tok")) == tmp_path / "tok"
    assert tokenizer_directory(str(tmp_path / "tok" / "tokenizer.json")) == tmp_path / "tok"
