"""The Qwen chat template presets (data/templates/; data.chat_template: qwen2.5 | qwen3, and the
``qwen`` tokenizer's own qwen2.5) with tools, and the refusal of tools a template would drop.

- the preset files are the models' templates byte for byte (sha256 pinned), and the ``qwen``
  tokenizer (its preset and its prepared directory) renders with Qwen2.5-Instruct's;
- tool records (``tools``, assistant ``tool_calls``, ``tool`` results) under both presets give the
  ids of ``transformers``' ``apply_chat_template(messages, tools=..., tokenize=True)`` through the
  SFT encoder (chat and prompt/completion records), the GRPO/PPO prompt encoder and an episode's
  observation text;
- a template that ignores tools (plain ChatML, the ``qwen`` preset's template before, or a
  custom file) refuses such a record on every path with a RecordError, and through the pipeline
  names file and record or skips and counts it; records without tools render as before.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from core.config import load
from core.exceptions import ConfigError, DataError
from data import qwen_vocab
from data.calculator import SPEC
from data.chat_template import CHATML_PLAIN, CHATML_TEMPLATE, ChatEncoder, ChatTemplate, RecordError
from data.pipeline.pipeline import build
from data.templates import PRESETS, preset_path
from data.tokenizers import ByteTokenizer, HFTokenizer
from tests.data.test_chat_masks import trained_runs
from tests.data.test_chat_tools import (
    ANSWER, CONVERSATIONS, LOOKUP, ONE_CALL, ONE_RESULT, QUESTION, SYSTEM, TWO_CALLS, TWO_RESULTS,
)

transformers = pytest.importorskip("transformers")

END = "<|im_end|>"

# sha256 of each model's chat_template string (data/templates/README.md).
PRESET_SHA256 = {
    "qwen2.5": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    "qwen3": "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
}

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# A template of another family that ignores `tools` and renders an assistant turn's content only.
NO_TOOLS = (
    "{% for message in messages %}{{ '### ' + message['role'] + ':\\n' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}"
)
# Refuses the probe question (no system turn first): whether it renders tools is then found per record.
SYSTEM_FIRST = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn comes first') }}{% endif %}"


@pytest.fixture(scope="module")
def presets(qwen_vocabulary, tmp_path_factory) -> dict:
    """Per preset: (our ChatTemplate through data.chat_template, our tokenizer, transformers' tokenizer
    of a directory whose tokenizer_config.json holds the preset's template)."""
    out = {}
    for name in PRESETS:
        directory = tmp_path_factory.mktemp(name)
        shutil.copy(qwen_vocabulary / "tokenizer.json", directory / "tokenizer.json")
        config = qwen_vocab.tokenizer_config_json()
        config["chat_template"] = preset_path(name).read_text()
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        out[name] = (ChatTemplate.for_tokenizer(str(qwen_vocabulary), name), HFTokenizer(directory / "tokenizer.json"),
                     transformers.AutoTokenizer.from_pretrained(str(directory)))
    return out


@pytest.fixture(params=list(PRESETS))
def preset(request, presets):
    return (request.param, *presets[request.param])


def _hf_ids(auto, messages, tools, add_generation_prompt=False) -> list[int]:
    out = auto.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if not isinstance(out, list) else out)


# ---------------------------------------------------------------------------- presets


def test_presets_are_the_models_templates_and_the_qwen_tokenizer_renders_with_qwen2_5(qwen_vocabulary, tmp_path):
    for name, digest in PRESET_SHA256.items():
        assert hashlib.sha256(preset_path(name).read_bytes()).hexdigest() == digest
        for spec in ("qwen", "byte", str(qwen_vocabulary)):
            template = ChatTemplate.for_tokenizer(spec, name)
            assert template.source == preset_path(name).read_text() and template.origin == f"data/templates/{PRESETS[name]}"
    qwen25 = preset_path("qwen2.5").read_text()
    assert ChatTemplate.for_tokenizer("qwen").source == qwen25  # whatever the prepared directory holds
    assert qwen_vocab.tokenizer_config_json()["chat_template"] == qwen25  # what prepare writes there
    assert ChatTemplate.for_tokenizer("qwen", "chatml").source == CHATML_TEMPLATE
    assert ChatTemplate.for_tokenizer("byte").source == CHATML_TEMPLATE
    with pytest.raises(ConfigError, match="neither a preset .*qwen2.5, qwen3, chatml.* nor a file") as info:
        ChatTemplate.for_tokenizer("qwen", "qwen4")
    assert info.value.context["key"] == "data.chat_template"
    # A run without tools renders what Qwen2.5-Instruct writes: its default system prompt first.
    text = ChatTemplate.for_tokenizer("qwen").render([QUESTION], add_generation_prompt=True)
    assert text == f"<|im_start|>system\n{QWEN25_SYSTEM}{END}\n<|im_start|>user\nWhat is 4821 * 37?{END}\n" \
                   "<|im_start|>assistant\n"


# ---------------------------------------------------------------------------- ids equal transformers'


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_sft_tool_records_equal_transformers_and_train_the_calls_and_answers(preset, conversation):
    name, template, tokenizer, auto = preset
    record, trained = CONVERSATIONS[conversation]
    ids, mask = ChatEncoder(template, tokenizer, kind="chat", loss_on="assistant").encode(record)
    assert ids.tolist() == _hf_ids(auto, record["messages"], record["tools"])
    assert trained_runs(ids, mask, tokenizer) == [text + END for text in trained]
    untrained = tokenizer.decode(ids[~mask].tolist())
    assert "<tools>" in untrained and "<tool_response>" in untrained and (QWEN25_SYSTEM in untrained) == (
        name == "qwen2.5" and "system" not in conversation)


def test_prompt_completion_tool_records_equal_transformers(preset):
    name, template, tokenizer, auto = preset
    record = {"tools": [LOOKUP, SPEC], "prompt": [SYSTEM, QUESTION], "completion": [ONE_CALL, ONE_RESULT, ANSWER]}
    ids, mask = ChatEncoder(template, tokenizer, kind="prompt_completion", loss_on="completion").encode(record)
    assert ids.tolist() == _hf_ids(auto, record["prompt"] + record["completion"], record["tools"])
    assert trained_runs(ids, mask, tokenizer)[-1] == "178377" + END


@pytest.mark.parametrize("prompt", [
    QUESTION["content"], [SYSTEM, QUESTION], [QUESTION, ONE_CALL, ONE_RESULT],
    [QUESTION, TWO_CALLS, *TWO_RESULTS]], ids=["string", "system", "after-one-result", "after-two-results"])
def test_grpo_prompt_records_render_their_tools_as_transformers_does(preset, prompt):
    name, template, tokenizer, auto = preset
    record = {"prompt": prompt, "answer": "178377", "tools": [LOOKUP, SPEC]}
    ids, mask = ChatEncoder(template, tokenizer, kind="prompt", loss_on="assistant").encode(record)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    expected = _hf_ids(auto, messages, [LOOKUP, SPEC], add_generation_prompt=True)
    assert ids[~mask].tolist() == expected and ids[mask].tolist() == tokenizer.encode("178377")
    assert mask.tolist() == [False] * len(expected) + [True] * int(mask.sum())
    assert "<tools>" in tokenizer.decode(expected) and '"name": "lookup"' in tokenizer.decode(expected)


@pytest.mark.parametrize("results", [[ONE_RESULT], TWO_RESULTS], ids=["one-result", "two-results"])
@pytest.mark.parametrize("system", [False, True], ids=["no-system", "system"])
def test_observation_text_is_what_the_whole_conversation_renders(preset, results, system):
    """prompt + sampled turn + end marker + observation == the conversation rendered at once, and
    its ids are transformers': what a multi-turn episode appends."""
    name, template, tokenizer, auto = preset
    tools = [LOOKUP, SPEC]
    question = [SYSTEM, QUESTION] if system else [QUESTION]
    turn = ONE_CALL if len(results) == 1 else TWO_CALLS
    prompt = template.render(question, add_generation_prompt=True, tools=tools)
    whole = template.render([*question, turn, *results], add_generation_prompt=True, tools=tools)
    observation = template.observation_text(results, tools=tools)
    assert observation == "\n<|im_start|>user" + "".join(
        f"\n<tool_response>\n{r['content']}\n</tool_response>" for r in results) + f"{END}\n<|im_start|>assistant\n"
    sampled = whole[len(prompt):len(whole) - len(END + observation)]
    assert whole == prompt + sampled + END + observation and sampled.endswith("</tool_call>")
    assert tokenizer.encode(whole) == _hf_ids(auto, [*question, turn, *results], tools, add_generation_prompt=True)
    assert tokenizer.encode(prompt) == _hf_ids(auto, question, tools, add_generation_prompt=True)


# ---------------------------------------------------------------------------- refusal


def _ignoring_templates(tmp_path) -> dict[str, ChatTemplate]:
    """Templates that ignore tools: plain ChatML (the qwen preset's before), another family's
    template as a data.chat_template file, and one that refuses the probe question."""
    path = tmp_path / "no_tools.jinja"
    path.write_text(NO_TOOLS)
    return {"chatml-plain": ChatTemplate(CHATML_PLAIN, origin="plain ChatML"),
            "file": ChatTemplate.for_tokenizer("byte", str(path)),
            "system-first": ChatTemplate(SYSTEM_FIRST + CHATML_PLAIN, origin="system-first")}


TOOLS_DROPPED = r"does not render the record's 'tools'"
CALLS_DROPPED = r"does not render an assistant turn's 'tool_calls'"


@pytest.mark.parametrize("which", ["chatml-plain", "file", "system-first"])
def test_a_template_that_ignores_tools_refuses_tool_records_on_every_path(tmp_path, which):
    template = _ignoring_templates(tmp_path)[which]
    tokenizer = ByteTokenizer()
    chat, prompts = (ChatEncoder(template, tokenizer, kind=kind, loss_on="assistant") for kind in ("chat", "prompt"))
    completion = ChatEncoder(template, tokenizer, kind="prompt_completion", loss_on="completion")
    first = [SYSTEM, QUESTION]
    cases = [  # (encoder, record, the error)
        (chat, {"tools": [SPEC], "messages": [*first, ONE_CALL, ONE_RESULT, ANSWER]}, TOOLS_DROPPED),
        (chat, {"tools": [SPEC], "messages": [*first, ANSWER]}, TOOLS_DROPPED),  # tools listed, none called
        (chat, {"messages": [*first, ONE_CALL, ONE_RESULT, ANSWER]}, CALLS_DROPPED),
        (completion, {"tools": [SPEC], "prompt": first, "completion": [ONE_CALL, ONE_RESULT, ANSWER]}, TOOLS_DROPPED),
        (completion, {"prompt": [*first, ONE_CALL, ONE_RESULT], "completion": [ANSWER]}, CALLS_DROPPED),
        (prompts, {"prompt": first, "answer": "178377", "tools": [SPEC]}, TOOLS_DROPPED),
        (prompts, {"prompt": [*first, ONE_CALL, ONE_RESULT], "answer": "178377"}, CALLS_DROPPED),
    ]
    for encoder, record, error in cases:
        with pytest.raises(RecordError, match=error):
            encoder.encode(record)
    # An episode's observation (multi-turn GRPO/PPO); system-first refuses its probe turn outright.
    with pytest.raises(RecordError, match=TOOLS_DROPPED if which != "system-first" else "system turn comes first"):
        template.observation_text([ONE_RESULT], tools=[SPEC])
    # Without tools the same template renders as before.
    ids, mask = chat.encode({"messages": [*first, ANSWER]})
    assert tokenizer.decode(ids[mask].tolist()).startswith("178377")
    assert prompts.encode({"prompt": first, "answer": "178377"})[1].sum() == len("178377")


def test_a_template_refusing_the_probe_is_judged_per_record(tmp_path):
    """The probe question has no system turn, so SYSTEM_FIRST refuses it: each record is then
    rendered again without its tools, and accepted where they made a difference."""
    renders = ChatTemplate(SYSTEM_FIRST + CHATML_TEMPLATE, origin="system-first with tools")
    ignores = _ignoring_templates(tmp_path)["system-first"]
    record = {"tools": [SPEC], "messages": [SYSTEM, QUESTION, ONE_CALL, ONE_RESULT, ANSWER]}
    ids, mask = ChatEncoder(renders, ByteTokenizer(), kind="chat", loss_on="assistant").encode(record)
    assert "<tools>" in bytes(ids.tolist()).decode() and mask.any()
    for template in (renders, ignores):
        assert template._probe_tool_support() == {"tools": None, "tool_calls": None}
    with pytest.raises(RecordError, match=TOOLS_DROPPED):
        ChatEncoder(ignores, ByteTokenizer(), kind="chat", loss_on="assistant").encode(record)


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, "qwen2.5", "qwen3"])
def test_templates_that_render_tools_say_so(template):
    chat = ChatTemplate(template, origin="built-in") if template == CHATML_TEMPLATE else \
        ChatTemplate.for_tokenizer("qwen", template)
    assert chat._probe_tool_support() == {"tools": True, "tool_calls": True}


@pytest.mark.parametrize("kind", ["chat", "prompt"])
def test_through_the_pipeline_a_dropped_tool_record_names_file_and_record_or_is_skipped(tmp_path, kind):
    """SFT sources and GRPO/PPO (and evaluation) prompt sources read records through the same
    encoder: a record whose tools the template ignores is a bad record like any other."""
    template = tmp_path / "no_tools.jinja"
    template.write_text(NO_TOOLS)
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    if kind == "chat":
        good = {"messages": [*question, {"role": "assistant", "content": "4"}]}
        bad = {"tools": [SPEC], "messages": [*question, ONE_CALL, ONE_RESULT, ANSWER]}
    else:
        good = {"prompt": question, "answer": "4"}
        bad = {"prompt": question, "answer": "4", "tools": [SPEC]}
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good] * 3 + [bad] + [good] * 200))

    def config(*overrides):
        return load(None, [f"data.sources=[{{path: {path}, record: {kind}}}]", f"data.chat_template={template}",
                           "data.seq_len=128", "data.num_streams=1", "data.process_pool=false",
                           "train.global_batch_size=2", *overrides]).data

    with pytest.raises(DataError, match=TOOLS_DROPPED) as info:
        with build(config(), seed=0, global_batch_size=2, rank=0, world_size=1) as pipe:
            for _ in range(4):
                next(pipe)
    assert info.value.context["file"] == str(path) and info.value.context["record"] == 4
    with build(config("data.on_bad_record=skip"), seed=0, global_batch_size=2, rank=0, world_size=1) as pipe:
        for _ in range(4):
            next(pipe)
        assert pipe.stats()["bad_records_skipped"] == 1
