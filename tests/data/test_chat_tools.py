"""Tool calls in chat records (data/chat_template.py): rendering, loss masks, observation text.

Templates: a Qwen2.5-style and a Qwen3-style tool template written here, the Qwen2.5-Instruct
and Qwen3 templates as their tokenizer_config.json ship them (tests/data/templates/), all with
the Qwen vocabulary, and the built-in ChatML (with the Qwen vocabulary for parity, with the byte
tokenizer as the tiny configs use it). Qwen's tool format: the record's tools listed as JSON
inside ``<tools></tools>`` in the system turn, each call ``<tool_call>\\n{"name": ...,
"arguments": ...}\\n</tool_call>``, consecutive tool results grouped into one user turn of
``<tool_response>\\n...\\n</tool_response>`` lines; Qwen3 drops earlier turns' think blocks.

- the ids equal ``transformers``' ``apply_chat_template(messages, tools=...)``, with one and
  with several calls per turn, with and without a system prompt;
- the trained tokens are exactly each assistant turn's content and calls with its
  ``<|im_end|>``, never a tool result, the system turn or the user's text;
- ``observation_text`` is what the whole conversation renders between a sampled turn's end
  marker and the next generation prompt, with one and with several tool results.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from data.calculator import SPEC
from data.chat_template import CHATML_PLAIN, CHATML_TEMPLATE, ChatEncoder, ChatTemplate, RecordError
from data.tokenizers import ByteTokenizer, HFTokenizer
from tests.data.test_chat_masks import trained_runs

TEMPLATES = Path(__file__).parent / "templates"
END = "<|im_end|>"

# Qwen2.5-style: a default system prompt; with tools, the system turn lists them.
QWEN25_TOOLS = """
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}
{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
    {{- '\\n\\n# Tools\\n\\nFunctions you can call, inside <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
    {{- '\\n</tools>\\n\\nCall one as <tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": '
                + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Qwen3-style: no default system prompt; the turns after the last user question keep reasoning
# (the last one always shows a think block), earlier turns lose theirs.
QWEN3_TOOLS = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\nFunctions you can call, inside <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
    {{- '\\n</tools>\\n\\nCall one as <tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set thought = '' %}
        {%- if '</think>' in content %}
            {%- set thought = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_user and (loop.last or thought) %}
            {{- '<think>\\n' + thought + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls or [] %}
            {%- if content or not loop.first %}{{- '\\n' }}{%- endif %}
            {{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": '
                + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

TEMPLATE_SOURCES = {
    "qwen25-style": QWEN25_TOOLS, "qwen3-style": QWEN3_TOOLS, "chatml": CHATML_TEMPLATE,
    "qwen2_5_instruct": (TEMPLATES / "qwen2_5_instruct.jinja").read_text(),
    "qwen3": (TEMPLATES / "qwen3.jinja").read_text(),
}

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The value stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


SYSTEM = {"role": "system", "content": "Use the tools for arithmetic."}
QUESTION = {"role": "user", "content": "What is 4821 * 37?"}
ONE_CALL = {"role": "assistant", "content": "", "tool_calls": [call("calculator", expression="4821 * 37")]}
ONE_RESULT = {"role": "tool", "content": "178377"}
ANSWER = {"role": "assistant", "content": "178377"}
TWO_CALLS = {"role": "assistant", "content": "Two lookups first.",
             "tool_calls": [call("lookup", key="apples"), call("calculator", expression="12 + 30 * 2")]}
TWO_RESULTS = [{"role": "tool", "content": "7"}, {"role": "tool", "content": "72"}]

# (record, the trained text of each assistant turn, in order)
CONVERSATIONS = {
    "one-call": ({"tools": [SPEC], "messages": [QUESTION, ONE_CALL, ONE_RESULT, ANSWER]},
                 ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 37"}}\n</tool_call>', "178377"]),
    "one-call-system": ({"tools": [SPEC], "messages": [SYSTEM, QUESTION, ONE_CALL, ONE_RESULT, ANSWER]},
                        ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 37"}}\n</tool_call>',
                         "178377"]),
    "two-calls": ({"tools": [LOOKUP, SPEC], "messages": [
        {"role": "user", "content": "How many apples, and 12 + 30 * 2?"}, TWO_CALLS, *TWO_RESULTS,
        {"role": "assistant", "content": "7 apples; 72."}]},
        ['Two lookups first.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "apples"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 30 * 2"}}\n</tool_call>',
         "7 apples; 72."]),
    "two-calls-system-two-rounds": ({"tools": [LOOKUP, SPEC], "messages": [
        SYSTEM, QUESTION, ONE_CALL, ONE_RESULT, ANSWER,
        {"role": "user", "content": "How many apples, and 12 + 30 * 2?"}, TWO_CALLS, *TWO_RESULTS,
        {"role": "assistant", "content": "7 apples; 72."}]},
        ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 37"}}\n</tool_call>', "178377",
         'Two lookups first.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "apples"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 30 * 2"}}\n</tool_call>',
         "7 apples; 72."]),
}


@pytest.fixture(scope="module")
def setups(qwen_vocabulary, tmp_path_factory) -> dict:
    """Each template's (name, ChatTemplate, tokenizer, transformers' tokenizer) with the Qwen
    vocabulary, built once for the module."""
    from transformers import AutoTokenizer

    out = {}
    for name, source in TEMPLATE_SOURCES.items():
        directory = tmp_path_factory.mktemp(name)
        shutil.copy(qwen_vocabulary / "tokenizer.json", directory / "tokenizer.json")
        config = json.loads((qwen_vocabulary / "tokenizer_config.json").read_text())
        config["chat_template"] = source
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        out[name] = (name, ChatTemplate.for_tokenizer(str(directory)), HFTokenizer(directory / "tokenizer.json"),
                     AutoTokenizer.from_pretrained(str(directory)))
    return out


@pytest.fixture(params=list(TEMPLATE_SOURCES))
def qwen_setup(request, setups):
    return setups[request.param]


def _hf_ids(auto, messages, tools, add_generation_prompt=False) -> list[int]:
    out = auto.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if not isinstance(out, list) else out)


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_tool_conversations_equal_transformers_and_train_only_the_assistant_turns(qwen_setup, conversation):
    name, template, tokenizer, auto = qwen_setup
    record, trained = CONVERSATIONS[conversation]
    ids, mask = ChatEncoder(template, tokenizer, kind="chat", loss_on="assistant").encode(record)
    assert ids.tolist() == _hf_ids(auto, record["messages"], record["tools"])
    assert trained_runs(ids, mask, tokenizer) == [text + END for text in trained]
    ids, mask = ChatEncoder(template, tokenizer, kind="chat", loss_on="completion").encode(record)
    assert trained_runs(ids, mask, tokenizer) == [trained[-1] + END]
    # A prompt rendered for sampling (the question, tools listed) matches too.
    prompt = [m for m in record["messages"][:2] if m["role"] in ("system", "user")]
    assert template.render(prompt, tools=record["tools"], add_generation_prompt=True) == auto.apply_chat_template(
        prompt, tools=record["tools"], tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("template_name", ["qwen3-style", "qwen3"])
def test_qwen3_drops_an_earlier_turns_reasoning_and_keeps_the_last_turns(setups, template_name):
    name, template, tokenizer, auto = setups[template_name]
    thinking_call = {**ONE_CALL, "content": "<think>\nBig product.\n</think>\n\n"}
    messages = [QUESTION, thinking_call, ONE_RESULT,
                {"role": "assistant", "content": "<think>\nCopy it.\n</think>\n\n178377"},
                {"role": "user", "content": "Thanks."},
                {"role": "assistant", "content": "<think>\nx\n</think>\n\nYou're welcome."}]
    ids, mask = ChatEncoder(template, tokenizer, kind="chat", loss_on="assistant").encode(
        {"tools": [SPEC], "messages": messages})
    assert ids.tolist() == _hf_ids(auto, messages, [SPEC])
    assert trained_runs(ids, mask, tokenizer) == [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 37"}}\n</tool_call>' + END,
        "178377" + END, "<think>\nx\n</think>\n\nYou're welcome." + END]


def test_chatml_renders_tools_in_qwens_format_and_records_without_tools_as_before():
    chat = ChatTemplate(CHATML_TEMPLATE, origin="test")
    record, _ = CONVERSATIONS["one-call-system"]
    text = chat.render(record["messages"], tools=record["tools"])
    assert text == (
        "<|im_start|>system\nUse the tools for arithmetic.\n\n# Tools\n\nYou can call these functions:\n<tools>\n"
        + json.dumps(SPEC) + "\n</tools>\n\nTo call one, write its name and arguments as JSON inside "
        "<tool_call></tool_call>:\n<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n"
        "</tool_call><|im_end|>\n<|im_start|>user\nWhat is 4821 * 37?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "4821 * 37"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n178377\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n178377<|im_end|>\n")
    plain = ChatTemplate(CHATML_PLAIN, origin="plain")
    from tests.data.test_chat_template import CONVERSATIONS as PLAIN_CONVERSATIONS

    for messages in PLAIN_CONVERSATIONS:
        for prompt in (False, True):
            assert chat.render(messages, add_generation_prompt=prompt) == plain.render(
                messages, add_generation_prompt=prompt)
    # The data state's record of the template is the one it had before tools, so old states resume.
    assert chat.fingerprint == plain.fingerprint


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_chatml_with_the_byte_tokenizer_trains_calls_and_answers_only(conversation):
    record, trained = CONVERSATIONS[conversation]
    encoder = ChatEncoder(ChatTemplate.for_tokenizer("byte"), ByteTokenizer(), kind="chat", loss_on="assistant")
    ids, mask = encoder.encode(record)
    text = bytes(ids.tolist()).decode()
    runs = trained_runs(ids, mask, ByteTokenizer())
    assert runs == [t + END for t in trained]
    untrained = bytes(ids[~mask].tolist()).decode()
    after_system = untrained.split(END, 1)[1]
    assert "<tool_response>" in untrained and "<tools>" in untrained and "<tool_call>" not in after_system
    assert sum(mask) == sum(len((t + END).encode()) for t in trained) and len(text) == len(ids)


@pytest.mark.parametrize("results", [[ONE_RESULT], TWO_RESULTS], ids=["one-result", "two-results"])
@pytest.mark.parametrize("system", [False, True], ids=["no-system", "system"])
def test_observation_text_after_a_tool_calling_turn(qwen_setup, results, system):
    """prefix + sampled turn + end marker + observation text == the whole conversation rendered
    with the generation prompt, with the record's tools listed: what an episode appends."""
    name, template, tokenizer, auto = qwen_setup
    tools = [LOOKUP, SPEC]
    question = [SYSTEM, QUESTION] if system else [QUESTION]
    turn = ONE_CALL if len(results) == 1 else TWO_CALLS
    prefix = template.render(question, add_generation_prompt=True, tools=tools)
    whole = template.render([*question, turn, *results], add_generation_prompt=True, tools=tools)
    observation = template.observation_text(results, tools=tools)
    sampled = whole[len(prefix):len(whole) - len(END + observation)]
    assert whole == prefix + sampled + END + observation
    assert sampled.endswith("</tool_call>") and END not in sampled
    expected = "\n<|im_start|>user" + "".join(f"\n<tool_response>\n{r['content']}\n</tool_response>" for r in results) \
        + "<|im_end|>\n<|im_start|>assistant\n"
    assert observation == expected
    assert tokenizer.encode_array(whole).tolist() == _hf_ids(auto, [*question, turn, *results], tools, True)


@pytest.mark.parametrize(("messages", "tools", "message"), [
    ([QUESTION, {"role": "assistant", "content": ""}], None, "empty content and no tool_calls"),
    ([QUESTION, {"role": "assistant", "content": None, "tool_calls": []}], None, r"messages\[1\].tool_calls must be"),
    ([QUESTION, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}], None,
     r"messages\[1\].tool_calls\[0\] has no function name"),
    ([QUESTION, {"role": "assistant", "tool_calls": [{"function": {"name": "calculator", "arguments": "{}"}}]}], None,
     r"tool_calls\[0\] \(calculator\) arguments are a str"),
    ([QUESTION, {"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "c", "arguments": {}}}]}],
     None, r"tool_calls\[0\] is not"),
    ([{**QUESTION, "tool_calls": [call("calculator")]}, ANSWER], None, r"messages\[0\] \(user\) has 'tool_calls'"),
    ([QUESTION, ONE_RESULT, ANSWER], None, r"messages\[1\] \(tool\) answers no call"),
    ([QUESTION, TWO_CALLS, ONE_RESULT, ANSWER], None, r"messages\[3\] \(assistant\) comes before the results of 1"),
    ([QUESTION, ONE_CALL, {"role": "tool", "content": 178377}, ANSWER], None, r"messages\[2\] \(tool\) content is a int"),
    ([QUESTION, ONE_CALL, ONE_RESULT, ANSWER], [LOOKUP], r"tool_calls\[0\] calls 'calculator', which is not in"),
    ([QUESTION, ONE_CALL, ONE_RESULT, ANSWER], [{"name": "calculator"}], r"tools\[0\] is not a function spec"),
    ([QUESTION, ONE_CALL, ONE_RESULT, ANSWER], [], "'tools' must be a non-empty list"),
])
def test_bad_tool_records_are_record_errors_naming_the_field(messages, tools, message):
    record = {"messages": messages} if tools is None else {"messages": messages, "tools": tools}
    encoder = ChatEncoder(ChatTemplate.for_tokenizer("byte"), ByteTokenizer(), kind="chat", loss_on="assistant")
    with pytest.raises(RecordError, match=message):
        encoder.encode(record)
