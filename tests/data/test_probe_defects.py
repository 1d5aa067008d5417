"""Defects a probe of the data layer found (issue 63, section 4), each reproduced:

- a lone surrogate (``"\\ud83d"``, valid JSON) in a text, chat, prompt/completion, prompt or
  preference record is a bad record naming file and record (skipped and counted under
  ``data.on_bad_record=skip``), never a "bug in the data pipeline";
- the chat template's size budget holds inside filters, methods and blocks: a template that
  would build gigabytes (``([('x' * 16000000)] * 1000) | tojson``: 36 s and 5.9 GB before) is
  refused before it builds them, in well under a second, naming the limit;
- ``bad_records_skipped`` counts each bad record once (not once per stream, epoch and read-ahead),
  and only when a batch the pipeline returned has read past it: the same count for any timing.
"""

from __future__ import annotations

import json
import resource
import time

import pytest

from core.config import DataConfig, SourceConfig, load
from core.exceptions import ConfigError, DataError
from data.chat_template import ChatEncoder, ChatTemplate, TemplateLimitError
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


# --------------------------------------------------------------------------- template size budget

BIG = "[('x' * 16000000)] * 1000"
"""1000 references to one 16 MB string: a small list that renders to 16 GB."""

OVERSIZED = {
    "tojson": "{{ (" + BIG + ") | tojson }}",
    "join filter": "{{ (" + BIG + ") | join }}",
    "string filter": "{{ (" + BIG + ") | string }}",
    "output": "{{ " + BIG + " }}",
    "~": "{{ (" + BIG + ") ~ 'x' }}",
    "replace method": "{{ ('x' * 16000000).replace('x', 'xxxxxxxxxx') }}",
    "replace filter": "{{ ('x' * 16000000) | replace('x', 'xxxxxxxxxx') }}",
    "replace of a list": "{{ (" + BIG + ") | replace('a', 'b') }}",
    "tojson indent": "{{ [1, 2] | tojson(indent=3e9) }}",
    "tojson indent 10**6": "{{ ([[1]] * 1000) | tojson(indent=1000000) }}",
    "format filter": "{{ '%s%s' | format('x' * 16000000, 'x' * 16000000) }}",
    "% arguments": "{{ '%s%s' % ('x' * 16000000, 'x' * 16000000) }}",
    "% star width": "{{ '%*d' % (999999999, 1) }}",
    "% precision": "{{ '%.999999999f' % 1.0 }}",
    "format method": "{{ '{0}{0}'.format('x' * 16000000) }}",
    "format nested width": "{{ '{:{w}}'.format('x', w=999999999) }}",
    "format precision": "{{ '{:.999999999f}'.format(1.0) }}",
    "indent": "{{ ('\\n' * 1000) | indent(16000000) }}",
    "center of a list": "{{ (" + BIG + ") | center(3) }}",
    "upper of a list": "{{ (" + BIG + ") | upper }}",
    "wordwrap": "{{ ('a ' * 1000) | wordwrap(1, wrapstring='x' * 16000000) }}",
    "str.join": "{{ ''.join(" + BIG + ") }}",
    "expandtabs": "{{ ('\\t' * 1000).expandtabs(16000000) }}",
    "translate": "{{ ('x' * 1000).translate({120: 'y' * 16000000}) }}",
    "map then join": "{{ (" + BIG + ") | map('string') | join }}",
    "map then list": "{% set xs = ([('x' * 10000000)] * 1000) | map('upper') | list %}",
    "sum of lists": "{{ ([[1] * 16000] * 1000) | sum(start=[]) }}",
    "shared list literals": "{% set a = ['x' * 16000000] %}{% set b = [a, a] %}{% set c = [b, b] %}{{ c | tojson }}",
    "loop in a macro": "{% macro m() %}{% for i in range(1000) %}{{ 'x' * 16000000 }}{% endfor %}{% endmacro %}"
                       "{% set y = m() %}",
    "loop in a set block": "{% set y %}{% for i in range(1000) %}{{ 'x' * 16000000 }}{% endfor %}{% endset %}",
}
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
LOOP = "{% for m in messages %}<{{ m.role }}>{{ m.content }}<|im_end|>{% endfor %}"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("name", list(OVERSIZED))
def test_a_template_that_would_build_gigabytes_inside_a_filter_is_refused_before_it_builds_them(name):
    template = ChatTemplate(OVERSIZED[name] + LOOP, origin="tokenizer_config.json")
    before, started = _peak_rss_mb(), time.process_time()
    with pytest.raises(TemplateLimitError, match=r"over (4 times )?its size budget of 16,777,216") as info:
        template.render(CHAT)
    # refused, not built (36 s for tojson before); CPU time, which other work on the machine does not
    # stretch (wall time reached 2.4 s on a loaded 2-core machine)
    assert time.process_time() - started < 5
    assert _peak_rss_mb() - before < 400  # a few copies of 16 MB at most (5.9 GB for tojson before)
    assert "tokenizer_config.json" in str(info.value) and info.value.exit_code == 3
    with pytest.raises(ConfigError, match="size budget") as at_start:  # at start-up: exit 2, naming the file
        ChatEncoder(template, ByteTokenizer(), kind="chat", loss_on="assistant").check()
    assert at_start.value.exit_code == 2


def test_values_inside_the_budget_still_render_as_jinja2_renders_them():
    items = "{% set xs = [{'a': 'x' * 1000, 'b': [1, 2.5, none, true]}] * 100 %}"
    source = (items + "{{ xs | tojson(indent=2) | length }} {{ xs | string | length }} {{ '%s-%5d' % ('a', 7) }} "
              "{{ '{0}{1:>4}'.format('b', 'c') }} {{ ('a' * 10) | replace('a', 'bb') }} {{ ' '.join(['x', 'y']) }} "
              "{{ (['p', 'q'] | map('upper') | join('+')) }} {{ 'a\\nb' | indent(2, first=true) }}" + LOOP)
    text = ChatTemplate(source, origin="t").render(CHAT)
    xs = [{"a": "x" * 1000, "b": [1, 2.5, None, True]}] * 100
    expected = (f"{len(json.dumps(xs, indent=2))} {len(str(xs))} a-    7 b   c {'bb' * 10} x y P+Q   a\n  b")
    assert text.startswith(expected), text[:200]
