"""Defects a probe of the data layer found (issue 63, section 4), each reproduced:

- a lone surrogate (``"\\ud83d"``, valid JSON) in a text, chat, prompt/completion, prompt or
  preference record is a bad record naming file and record (skipped and counted under
  ``data.on_bad_record=skip``), never a "bug in the data pipeline";
"""

from __future__ import annotations

import json

import pytest

from core.config import load
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
        assert pipe.stats()["bad_records_skipped"] >= 1 and pipe.stats()["error"] is None
    assert 3 not in seen and {2, 4} <= seen
