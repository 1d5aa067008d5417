"""Chat templates are code from a model directory: every render has a time and a size budget, the
clock a template reads is fixed and recorded in the config, and a template failure in the tools
is one line with its exit code (data/chat_sandbox.py, data/chat_template.py).

The probe's inputs: nested loops that hung start-up with no output, a string multiplication
that reached 4.2 GB, a template calling ``strftime_now`` that made an untampered run fail replay.
"""

from __future__ import annotations

import json
import pickle
import time

import pytest
import yaml

from core.config import load
from core.exceptions import ConfigError, DataError, ExitCode
from data.chat_template import CHATML_TEMPLATE, ChatEncoder, ChatTemplate, RecordError, TemplateLimitError
from data.pipeline.plan import check_chat_config
from data.tokenizers import ByteTokenizer
from tests.launch import ROOT

CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
LOOP = "{% for m in messages %}<{{ m.role }}>{{ m.content }}<|im_end|>{% endfor %}"

HANGING = {
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + LOOP,
    "nested lists": "{% set xs = range(100000) | list %}{% for i in xs %}{% for j in xs %}{% endfor %}{% endfor %}"
                    + LOOP,
    "recursive macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}"
                       + LOOP,
}
HUGE = {
    "string multiplication": "{{ 'x' * 5000000000 }}" + LOOP,
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}" + LOOP,
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}" + LOOP,
    "list multiplication": "{% set xs = [1] * 5000000000 %}" + LOOP,
    "padding method": "{{ 'x'.center(5000000000) }}" + LOOP,
    "padding filter": "{{ 'x' | center(5000000000) }}" + LOOP,
    "integer squaring": "{% set ns = namespace(n=3) %}{% for i in range(60) %}{% set ns.n = ns.n * ns.n %}"
                        "{% endfor %}" + LOOP,
    "integer power": "{{ 7 ** 100000000 }}" + LOOP,
    "output": "{% for i in range(100000) %}{{ 'y' * 50 }}{% endfor %}" + LOOP,
    "percent width": "{{ '%5000000000s' % 'x' }}" + LOOP,
    "format width": "{{ '{:>5000000000}'.format('x') }}" + LOOP,
    "format filter width": "{{ '%5000000000s' | format('x') }}" + LOOP,
    "lipsum": "{{ lipsum(5000000000) }}" + LOOP,
}


def _encoder(source: str, **budget) -> ChatEncoder:
    return ChatEncoder(ChatTemplate(source, origin="tokenizer_config.json", **budget), ByteTokenizer(),
                       kind="chat", loss_on="assistant")


@pytest.mark.parametrize("name", sorted(HANGING))
def test_a_hanging_template_stops_at_its_time_budget_with_a_config_error(name):
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"tokenizer_config.json\) ran longer than its time budget of 0.5 s") as info:
        _encoder(HANGING[name], max_seconds=0.5).check()
    assert time.monotonic() - started < 5  # stopped near the budget, not after 10^10 iterations
    assert info.value.exit_code == ExitCode.CONFIG and "\n" not in str(info.value)


@pytest.mark.parametrize("name", sorted(HUGE))
def test_a_template_building_a_huge_value_is_refused_at_its_size_budget(name):
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"over its size budget of 1,000,000") as info:
        _encoder(HUGE[name], max_chars=1_000_000).check()
    assert time.monotonic() - started < 5  # refused before computing, not after allocating gigabytes
    assert "tokenizer_config.json" in str(info.value) and info.value.exit_code == ExitCode.CONFIG


def test_a_record_that_blows_the_budget_is_a_bad_record_naming_the_limit():
    """A template that is fine at start-up but loops on one record's content: that record is a
    bad record (a DataError the pipeline names with file and record, or skips)."""
    source = ("{% for m in messages %}{% if m.content == 'spin' %}{% for i in range(100000) %}"
              "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
              "<{{ m.role }}>{{ m.content }}<|im_end|>{% endfor %}")
    encoder = _encoder(source, max_seconds=0.5)
    encoder.check()
    assert encoder.encode({"messages": CHAT})[1].any()
    with pytest.raises(TemplateLimitError, match="time budget of 0.5 s") as info:
        encoder.encode({"messages": [{"role": "user", "content": "spin"}, {"role": "assistant", "content": "x"}]})
    assert isinstance(info.value, RecordError) and isinstance(info.value, DataError)


def test_each_thread_has_its_own_deadline():
    """The pipeline's worker threads render with one template object: a thread that keeps starting
    renders must not push back the deadline of one that hangs."""
    import threading

    source = ("{% for m in messages %}{% if m.content == 'spin' %}{% for i in range(100000) %}"
              "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
              "<{{ m.role }}>{{ m.content }}<|im_end|>{% endfor %}")
    encoder = _encoder(source, max_seconds=0.5)
    done = threading.Event()

    def busy():  # for 12 s at most, so that a shared deadline fails the test instead of hanging it
        until = time.monotonic() + 12
        while not done.is_set() and time.monotonic() < until:
            encoder.encode({"messages": CHAT})

    other = threading.Thread(target=busy)
    other.start()
    try:
        started = time.monotonic()
        with pytest.raises(TemplateLimitError):
            encoder.encode({"messages": [{"role": "user", "content": "spin"}, {"role": "assistant", "content": "x"}]})
        assert time.monotonic() - started < 10
    finally:
        done.set()
        other.join()


def test_real_templates_render_well_inside_the_default_budget():
    encoder = _encoder(CHATML_TEMPLATE)
    encoder.check()
    ids, mask = encoder.encode({"messages": CHAT * 200})
    assert mask.sum() == 200 * len("4<|im_end|>")


def test_a_budget_error_in_the_data_config_is_exit_2_naming_the_template_file(tmp_path):
    template = tmp_path / "huge.jinja"
    template.write_text(HUGE["string multiplication"])
    config = load(None, [f"data.sources=[{{path: {tmp_path / 'x.jsonl'}, record: chat}}]",
                         f"data.chat_template={template}"])
    with pytest.raises(ConfigError, match="size budget") as info:
        check_chat_config(config.data)
    assert str(template) in str(info.value) and info.value.exit_code == ExitCode.CONFIG


# --------------------------------------------------------------------------- the clock

DATED = "Today is {{ strftime_now('%d %b %Y') }}.\n" + LOOP


def test_strftime_now_without_a_fixed_clock_is_refused_at_start_up(tmp_path):
    template = tmp_path / "dated.jinja"
    template.write_text(DATED)
    config = load(None, [f"data.sources=[{{path: {tmp_path / 'x.jsonl'}, record: chat}}]",
                         f"data.chat_template={template}"])
    with pytest.raises(ConfigError, match="strftime_now") as info:
        check_chat_config(config.data)
    assert info.value.context["key"] == "data.template_clock" and "data.template_clock=" in info.value.hint
    assert info.value.exit_code == ExitCode.CONFIG


def test_strftime_now_reads_the_configured_clock_in_every_process(tmp_path):
    template = tmp_path / "dated.jinja"
    template.write_text(DATED)
    config = load(None, [f"data.sources=[{{path: {tmp_path / 'x.jsonl'}, record: chat}}]",
                         f"data.chat_template={template}", 'data.template_clock="1999-12-31T23:59:00"'])
    assert config.data.template_clock == "1999-12-31T23:59:00"
    check_chat_config(config.data)
    chat = ChatTemplate.for_tokenizer("byte", str(template), clock=config.data.template_clock)
    text = chat.render(CHAT)
    assert text.startswith("Today is 31 Dec 1999.\n")
    # A worker process gets the template pickled: the same clock, the same text.
    assert pickle.loads(pickle.dumps(chat)).render(CHAT) == text
    encoder = ChatEncoder(chat, ByteTokenizer(), kind="chat", loss_on="assistant")
    ids, mask = encoder.encode({"messages": CHAT})
    assert bytes(ids[mask].tolist()).decode() == "4<|im_end|>"


def test_a_clock_that_is_not_a_date_is_a_config_error(tmp_path):
    template = tmp_path / "dated.jinja"
    template.write_text(DATED)
    config = load(None, [f"data.sources=[{{path: {tmp_path / 'x.jsonl'}, record: chat}}]",
                         f"data.chat_template={template}", "data.template_clock=yesterday"])
    with pytest.raises(ConfigError, match="ISO 8601") as info:
        check_chat_config(config.data)
    assert info.value.context["key"] == "data.template_clock"


# --------------------------------------------------------------------------- one-line messages in the tools


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Hugging Face directory with the byte tokenizer (its template set per test)."""
    import models
    from core import seeding
    from core.config import ModelConfig
    from models.hf_weights import save_pretrained

    config = ModelConfig(arch="qwen3", vocab_size=512, hidden_size=32, intermediate_size=48, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, attention="sdpa", max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny-hf")
    save_pretrained(models.build(config, generator=seeding.generator(3, "model_init")), path)
    (path / "tokenizer.json").write_text(ByteTokenizer().hf_tokenizer_json())
    return path


BROKEN = {
    "refuses": ("{{ raise_exception('system messages are not supported') }}", ExitCode.DATA, "refused the record"),
    "fails": ("{{ messages[0].content.nope() }}", ExitCode.DATA, "chat template"),
    "does not compile": ("{% for m in messages %}", ExitCode.CONFIG, "does not compile"),
    "huge": (HUGE["string multiplication"], ExitCode.DATA, "size budget"),
    "dated": (DATED, ExitCode.CONFIG, "strftime_now"),
    "malformed config": (None, ExitCode.DATA, "tokenizer_config.json"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_template_errors_in_generate_are_one_line_with_their_exit_code(model_dir, tmp_path, capsys, case):
    from training.__main__ import main

    source, code, words = BROKEN[case]
    config = model_dir / "tokenizer_config.json"
    if source is None:
        config.write_text('{"chat_template": "{{ oops ')
    else:
        config.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                                      "chat_template": source}))
    assert main(["generate", "--from", str(model_dir), "--device", "cpu", "--prompt", "hi", "--chat",
                 "--max-new-tokens", "2", "--out", str(tmp_path / "out.jsonl")]) == code
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and "Traceback" not in err


def test_template_errors_in_the_data_tools_are_one_line(tmp_path, capsys):
    from data.__main__ import main

    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    template = tmp_path / "loop.jinja"
    template.write_text(HUGE["padding filter"])
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({
        "train": {"global_batch_size": 4, "micro_batch_size": 2},
        "data": {"sources": [{"path": str(tmp_path / "chat.jsonl"), "record": "chat"}], "seq_len": 64,
                 "num_streams": 2, "workers": 0, "process_pool": False, "chat_template": str(template)}}))
    assert main(["inspect", "--config", str(config), "--step", "1"]) == ExitCode.CONFIG
    err = capsys.readouterr().err.strip()
    assert "size budget" in err and str(template) in err and "\n" not in err


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_the_rollout_objectives_template_reads_the_configured_clock(tmp_path, kind):
    """GRPO's and PPO's own template (stop ids, episode turns) is built with data.template_clock, as the
    pipeline's is: a template calling strftime_now renders the run's fixed instant there too."""
    from training.objectives.grpo import GRPOObjective
    from training.objectives.ppo import PPOObjective

    template = tmp_path / "dated.jinja"
    template.write_text(DATED)
    config = load(ROOT / "tests" / "configs" / f"e2e-{kind}.yaml",
                  [f"data.chat_template={template}", 'data.template_clock="1999-12-31T23:59:00"'])
    objective = (GRPOObjective if kind == "grpo" else PPOObjective)(config)
    assert objective.template.render(CHAT).startswith("Today is 31 Dec 1999.\n")
