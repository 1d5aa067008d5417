"""Defects a probe of the data layer found (issue 63, section 4), each reproduced:

- a lone surrogate (``"\\ud83d"``, valid JSON) in a text, chat, prompt/completion, prompt or
  preference record is a bad record naming file and record (skipped and counted under
  ``data.on_bad_record=skip``), never a "bug in the data pipeline";
- ``bad_records_skipped`` counts each bad record once (not once per stream, epoch and read-ahead),
  and only when a batch the pipeline returned has read past it: the same count for any timing.
"""

from __future__ import annotations

import json

import pytest

from core.config import DataConfig, SourceConfig, load
from core.exceptions import DataError
from data.pipeline.pipeline import build
from data.tokenizers import ByteTokenizer, HFTokenizer, UnencodableTextError

# --------------------------------------------------------------------------- lone surrogates

SURROGATE = "\\ud83d"
"""A JSON escape of half an emoji's surrogate pair: valid JSON, a valid Python string, no UTF-8."""

GOOD = {
    "text": {"text": "hello there"},
    "chat": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    "prompt_completion": {"prompt": "q", "completion": "a"},
    "prompt": {"prompt": "What is 2 + 2?", "answer": "4"},
    "preference": {"prompt": "Say hi.", "chosen": "hi", "rejected": "ho"},
}
BAD = {  # the JSON line of each kind, with the surrogate in a different field each time
    "text": '{"text": "hello ' + SURROGATE + ' there"}',
    "chat": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "y' + SURROGATE
            + 'o"}]}',
    "prompt_completion": '{"prompt": "q' + SURROGATE + '", "completion": "a"}',
    "prompt": '{"prompt": "What is 2 + 2?", "answer": "' + SURROGATE + '"}',
    "preference": '{"prompt": "Say hi.", "chosen": "hi", "rejected": "h' + SURROGATE + 'o"}',
}


def _records_file(path, kind, bad_at=(3,), n=600):
    """``n`` good records of ``kind`` with BAD[kind] at the 0-based indices ``bad_at``."""
    lines = [BAD[kind] if i in bad_at else json.dumps(GOOD[kind]) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _data_config(path, kind, *overrides, streams=1, batch=2):
    return load(None, [f"data.sources=[{{path: {path}, record: {kind}}}]", "data.seq_len=256",
                       f"data.num_streams={streams}", f"train.global_batch_size={batch}", "data.workers=0",
                       *overrides]).data


@pytest.fixture
def hf_tokenizer_dir(tmp_path):
    """A Hugging Face tokenizer.json (the byte vocabulary): the ``tokenizers`` library's encode path."""
    directory = tmp_path / "hf-tokenizer"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(ByteTokenizer().hf_tokenizer_json())
    return directory


def test_both_tokenizers_refuse_unencodable_text_with_a_record_error(hf_tokenizer_dir):
    text = json.loads('"ab' + SURROGATE + 'c"')
    for tokenizer in (ByteTokenizer(), HFTokenizer(hf_tokenizer_dir / "tokenizer.json")):
        for encode in (tokenizer.encode, tokenizer.encode_array, tokenizer.encode_offsets):
            with pytest.raises(UnencodableTextError, match="lone surrogate U\\+D83D at character 2"):
                encode(text)
        assert list(tokenizer.encode("ab\U0001F600c")) == list(tokenizer.encode_array("ab\U0001F600c"))


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_a_lone_surrogate_is_a_bad_record_naming_file_and_record_or_a_counted_skip(tmp_path, kind, tokenizer,
                                                                                   hf_tokenizer_dir):
    path = _records_file(tmp_path / f"{kind}.jsonl", kind)
    spec = "byte" if tokenizer == "byte" else str(hf_tokenizer_dir)
    with pytest.raises(DataError) as info:
        with build(_data_config(path, kind, f"data.tokenizer={spec}"), seed=0, global_batch_size=2, rank=0,
                   world_size=1) as pipe:
            for _ in range(8):
                next(pipe)
    error = info.value
    assert "lone surrogate" in error.message and "bug" not in str(error), str(error)
    assert error.context["file"] == str(path) and error.context["record"] == 4  # line 4
    assert error.exit_code == 3 and "on_bad_record=skip" in str(error)

    with build(_data_config(path, kind, f"data.tokenizer={spec}", "data.on_bad_record=skip"), seed=0,
               global_batch_size=2, rank=0, world_size=1) as pipe:
        seen = {span.record for _ in range(8) for row in next(pipe).provenance for span in row}
        assert pipe.stats()["bad_records_skipped"] == 1 and pipe.stats()["error"] is None
    assert 3 not in seen and {2, 4} <= seen


# --------------------------------------------------------------------------- the skipped count

def _with_bad_lines(path, good: int, bad_at: list[int]):
    lines = [b'{"text": "document number %d, a few words long"}' % i for i in range(good + len(bad_at))]
    for i in bad_at:
        lines[i] = b'{"text": "unterminated'
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _skip_counts(path, batches: int, **data) -> list[int]:
    """``bad_records_skipped`` after each of ``batches`` batches of 8 streams (one unit: every
    stream reads the same records, epoch after epoch)."""
    config = DataConfig(sources=(SourceConfig(path=str(path)),), seq_len=32, num_streams=8,
                        on_bad_record="skip", **data)
    with build(config, seed=0, global_batch_size=16, rank=0, world_size=1) as pipe:
        counts = []
        for _ in range(batches):
            next(pipe)
            counts.append(pipe.stats()["bad_records_skipped"])
        assert pipe.stats()["error"] is None
    return counts


def test_each_bad_record_is_counted_once_whatever_the_epochs_streams_and_timing(tmp_path):
    path = _with_bad_lines(tmp_path / "data.jsonl", good=40, bad_at=[1, 5, 9, 17, 23, 30, 41, 47])
    counts = _skip_counts(path, 60, workers=0)  # 60 batches: every stream reads the file ~5 times
    assert counts[-1] == 8  # was 140-147 (per stream and epoch, plus whatever was read ahead)
    assert counts == sorted(counts) and counts[0] < 8  # batch 1 has not read every record yet
    for data in ({"workers": 2, "process_pool": False}, {"workers": 1, "prefetch_batches": 1}):
        assert _skip_counts(path, 60, **data) == counts


def test_a_bad_record_read_ahead_is_not_counted_before_a_batch_reads_past_it(tmp_path):
    # The bad records are the file's last two lines: batch 1 (16 rows of 32 tokens over 8
    # streams, ~3 documents a stream) reads none of them, though the read-ahead does.
    path = _with_bad_lines(tmp_path / "data.jsonl", good=60, bad_at=[60, 61])
    counts = _skip_counts(path, 40, workers=0)
    assert counts[0] == 0 and counts[-1] == 2
