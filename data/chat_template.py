"""Chat records -> token ids and a per-token loss mask, through the model's own chat template.

The template is ``data.chat_template`` (a preset: ``qwen2.5`` and ``qwen3``, the templates of
Qwen2.5-Instruct and Qwen3 stored in data/templates/, or ``chatml``, the built-in ChatML; else a
template file), else the tokenizer's: the ``qwen`` tokenizer renders with ``qwen2.5``, a
tokenizer directory with the ``chat_template`` of its ``tokenizer_config.json``, anything else
with the built-in ChatML. It is rendered with Jinja2 the way Hugging Face renders it: a
sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter, ``raise_exception`` and ``strftime_now``, and the special
tokens of ``tokenizer_config.json`` as variables (data/chat_sandbox.py adds a time and size
budget to every render, and a fixed clock). The rendered string is tokenized as a whole (no special tokens added), which is
exactly what ``transformers``' ``apply_chat_template(..., tokenize=True)`` does, so the ids
are the same (tests/data/test_chat_template.py checks it).
``data.template_thinking`` (unset by default) is passed as the template variable
``enable_thinking``, as ``apply_chat_template(..., enable_thinking=...)`` passes it; a template
that never names that variable is refused (a ConfigError), since the setting would change nothing.

Which tokens carry loss is found from the template's structure, never by searching for a
message's content in the rendered text (an answer such as ``tan`` also occurs in the markup
``assistant``). For each trained message, the conversation is rendered once more with only
that message's content replaced by a probe (private-use characters that occur nowhere in the
record or the template); the characters between the first and the last place where the real
rendering differs from the probed one are what that message's content produced, wherever the
same text also occurs elsewhere. The span then runs on over the end-of-turn marker that
follows it (``<|im_end|>`` for ChatML templates, else the tokenizer's EOS). Templates that render a turn differently depending on where it
stands (Qwen3's think blocks) are rendered whole each time, so this holds for them too:

- an earlier turn's ``<think>...</think>`` is dropped by Qwen3's template and the span is the
  answer the template keeps;
- the last turn's reasoning is kept, and so is the template text between the assistant header
  and the answer that only exists because of it (``<think>\\n``): the span is everything the
  model writes after the generation prompt. An empty think block the template adds to every
  last turn is the template's, not the answer's, and carries no loss.

A trained span must contain the message's answer verbatim (the text after its ``</think>``),
so a template that rewrites the content (``| upper``) is refused rather than trained on.
A token is trained when its characters overlap a trained span.

Tool use: a record may list ``tools`` (JSON-schema function specs); an assistant message may
carry ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments": {...}}}]``,
its content then possibly empty) and ``tool`` messages hold the results, one per call, in the
order of the calls. The template gets ``tools`` as ``apply_chat_template(messages, tools=...)``
passes it. A trained assistant turn is probed whole: it is replaced by a plain turn whose
content is the probe, so the span covers what its content and its calls produced (the
``<tool_call>`` text) up to its end-of-turn marker, and must contain its answer and the name
of every function it calls. Tool results, like system and user turns, are never trained.
A template that ignores ``tools`` (or ``tool_calls``) would drop them without a word: every
render of a record that has them is refused instead (a RecordError: a bad record, named or
skipped under ``data.on_bad_record``), whichever path renders it (SFT, preference, GRPO/PPO
prompts, evaluation prompts, an episode's observation). Whether a template renders them is
found from the template itself: a probe conversation is rendered with and without a probe tool
(a call to it) and must differ, naming the tool.

``data.loss_on``: ``assistant`` trains every assistant turn; ``completion`` trains the
assistant turns of the completion (the last assistant turn of a chat record); ``all`` trains
every token.
"""

from __future__ import annotations

import abc
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from core.exceptions import ConfigError, DataError, LockstepError
from data.chat_sandbox import MAX_CHARS, MAX_SECONDS, Budget, TemplateBudgetError, compile_template, environment, \
    parse_clock, render_within
from data.fields import TARGET_MASK
from data.qwen_vocab import QWEN_SPEC
from data.qwen_vocab import TEMPLATE_PRESET as QWEN_TEMPLATE_PRESET
from data.record_kinds import Encoded, EncoderSetup, record_kind
from data.templates import PRESETS, preset_path

ROLES = ("system", "user", "assistant", "tool")

CHATML_PLAIN = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The built-in ChatML as it was before it rendered tools; what it renders is what
CHATML_TEMPLATE renders for every record without tools, tool calls or tool results."""

CHATML_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou can call these functions:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nTo call one, write its name and arguments as JSON inside <tool_call></tool_call>:\n'"
    " + '<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n</tool_call>'"
    " + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['tool_calls'] %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, and tools in Qwen's
format: the record's ``tools`` listed as JSON inside ``<tools></tools>`` in a system turn (after
the record's own system prompt), an assistant's calls as ``<tool_call>\\n{"name": ..., "arguments":
...}\\n</tool_call>`` after its content, one per line, and consecutive tool results as
``<tool_response>\\n...\\n</tool_response>`` lines of one user turn. A record without tools
renders exactly as CHATML_PLAIN renders it."""

CHATML_END = "<|im_end|>"

THINKING_VARIABLE = "enable_thinking"
"""The template variable ``data.template_thinking`` sets, as ``apply_chat_template(..., enable_thinking=...)``
passes it (Qwen3's template: false renders an empty think block into the generation prompt)."""

CHATML_PRESET = "chatml"
"""``data.chat_template: chatml``: the built-in ChatML, whatever the tokenizer's own template."""

TEMPLATE_PRESETS = (*PRESETS, CHATML_PRESET)
"""The names ``data.chat_template`` takes instead of a file path."""

TOOL_PROBE = {"type": "function", "function": {
    "name": "lockstep_probe_tool", "description": "A probe.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
"""The tool a probe conversation lists and calls: a template that renders it (its name appears,
and the text differs from the conversation without it) renders tools."""

LOSS_ON = ("assistant", "completion", "all")

PROBE_CHARS = range(0xE000, 0xF900)
"""Private-use characters: the stand-in content that locates a message's span is a pair of
them that occurs in neither the record nor the template."""


class RecordError(DataError, ValueError):
    """A record that does not match its declared kind (a bad record, skippable).

    The pipeline names the file and record around it; ``str()`` is the bare message so that
    it reads in that frame, and a tool that lets it through still prints one line (exit 3)."""

    def __str__(self) -> str:
        return self.message


class TemplateLimitError(RecordError):
    """A render ran past the template's time or size budget (data/chat_sandbox.py)."""


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation and the character spans that carry loss."""

    text: str
    spans: tuple[tuple[int, int], ...]


# --------------------------------------------------------------------------- records


def tools_of(record: dict) -> Optional[list[dict]]:
    """A record's ``tools`` (JSON-schema function specs, ``{"type": "function", "function":
    {"name": ..., ...}}``), passed to the template as they are; None when the record has none.
    RecordError naming the entry that is not such a spec."""
    tools = record.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise RecordError("'tools' must be a non-empty list of function specs "
                          '({"type": "function", "function": {"name": ..., "parameters": {...}}})')
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise RecordError(f"tools[{i}] is not a function spec with a name "
                              '({"type": "function", "function": {"name": ..., "parameters": {...}}}), '
                              f"got {_short(tool)}")
    return tools


def _check_messages(messages: Any, field: str) -> list[dict]:
    """The messages in the form the template sees: ``role`` and ``content`` (a string; ``""`` for an
    assistant turn that only calls tools), an assistant's ``tool_calls`` as ``{"type": "function",
    "function": {"name", "arguments"}}`` (with its ``id`` when it has one), a tool result's
    ``name`` and ``tool_call_id`` when it has them. Other keys are dropped."""
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"{field!r} must be a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise RecordError(f"{where} is a {type(message).__name__}, not an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RecordError(f"{where} has unknown role {role!r} (expected one of {', '.join(ROLES)})")
        calls = message.get("tool_calls")
        if calls is not None and role != "assistant":
            raise RecordError(f"{where} ({role}) has 'tool_calls': only assistant turns call tools")
        if calls is not None and content is None:
            content = ""  # a turn that only calls tools
        if not isinstance(content, str):
            raise RecordError(f"{where} ({role}) content is a {type(content).__name__}, not a string")
        if role == "assistant" and calls is None and not content.strip():
            raise RecordError(f"{where} (assistant) has empty content and no tool_calls")
        checked = {"role": role, "content": content}
        if calls is not None:
            checked["tool_calls"] = [_check_call(call, f"{where}.tool_calls[{k}]")
                                     for k, call in enumerate(_non_empty_list(calls, f"{where}.tool_calls"))]
        if role == "tool":
            for key in ("name", "tool_call_id"):
                if message.get(key) is not None:  # a columnar source fills absent keys with null
                    if not isinstance(message[key], str):
                        raise RecordError(f"{where} (tool) {key!r} is a {type(message[key]).__name__}, not a string")
                    checked[key] = message[key]
        out.append(checked)
    return out


def _non_empty_list(value: Any, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise RecordError(f"{where} must be a non-empty list of calls "
                          '([{"type": "function", "function": {"name": ..., "arguments": {...}}}])')
    return value


def _check_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise RecordError(f'{where} is not {{"type": "function", "function": {{"name": ..., "arguments": {{...}}}}}}, '
                          f"got {_short(call)}")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise RecordError(f"{where} has no function name (function.name), got {_short(function)}")
    if not isinstance(arguments, dict):
        raise RecordError(f"{where} ({name}) arguments are a {type(arguments).__name__}, not an object "
                          "(a JSON string of the arguments must be parsed first)")
    checked = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise RecordError(f"{where} ({name}) 'id' is a {type(call['id']).__name__}, not a string")
        checked["id"] = call["id"]
    return checked


def _check_tool_turns(messages: list[dict], field: str, tools: Optional[list[dict]]) -> None:
    """Tool results answer calls: each run of ``tool`` messages follows an assistant turn that
    made as many calls, and every call names one of the record's ``tools`` (when it lists them)."""
    names = None if tools is None else {tool["function"]["name"] for tool in tools}
    calls = 0
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            if calls == 0:
                raise RecordError(f"{field}[{i}] (tool) answers no call: a tool result must follow an assistant "
                                  "turn with tool_calls (one result per call, in the order of the calls)")
            calls -= 1
            continue
        if calls:
            raise RecordError(f"{field}[{i}] ({message['role']}) comes before the results of {calls} more "
                              f"tool call(s) of the assistant turn before it: give one tool result per call")
        for k, call in enumerate(message.get("tool_calls", ())):
            name = call["function"]["name"]
            if names is not None and name not in names:
                raise RecordError(f"{field}[{i}].tool_calls[{k}] calls {name!r}, which is not in the record's "
                                  f"'tools' ({', '.join(sorted(names))})")
            calls += 1


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _last_assistant(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            return i
    return len(messages)


# --------------------------------------------------------------------------- template


class ChatTemplate:
    """A Jinja2 chat template, rendered as Hugging Face renders it, within a time and size budget."""

    def __init__(self, source: str, *, origin: str, special_tokens: Optional[dict[str, str]] = None,
                 clock: Optional[str] = None, thinking: Optional[bool] = None,
                 max_seconds: float = MAX_SECONDS, max_chars: int = MAX_CHARS) -> None:
        self.source = source
        hashed = (CHATML_PLAIN if source == CHATML_TEMPLATE else source) + _thinking_suffix(thinking)
        self.fingerprint = hashlib.sha256(hashed.encode()).hexdigest()[:16]
        """What the data state records of the template (its compat): a hash of the source, and of
        ``thinking`` where it is set. The built-in ChatML keeps the one it had before it rendered
        tools, since every record without tools renders to the same text: data states written
        before stay valid."""
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        self.clock = clock
        self.thinking = thinking
        """``data.template_thinking``: the template's ``enable_thinking`` variable (None: left undefined)."""
        self._budget = Budget(origin, max_seconds, max_chars)
        self._compiled = None
        self._header: Optional[tuple[Optional[str]]] = None
        self._tool_support: Optional[dict[str, Optional[bool]]] = None
        self._source_chars = frozenset(source)
        if CHATML_END in source:
            self.end_of_turn = CHATML_END
        else:
            self.end_of_turn = self.special_tokens.get("eos_token") or None

    @classmethod
    def for_tokenizer(cls, tokenizer_spec: str, override: Optional[str] = None, *,
                      clock: Optional[str] = None, thinking: Optional[bool] = None) -> "ChatTemplate":
        """``override`` (``data.chat_template``: a preset name, else a template file), else the
        tokenizer's: the ``qwen`` tokenizer's preset (Qwen2.5-Instruct's template, whatever the
        prepared directory holds), a tokenizer directory's template, else ChatML. ``clock`` is
        ``data.template_clock`` (what ``strftime_now`` reads), ``thinking`` ``data.template_thinking``
        (the template's ``enable_thinking``; None leaves it undefined, the template's default)."""
        directory = _tokenizer_dir(tokenizer_spec)
        specials = _special_tokens(directory) if directory is not None else {}
        if override is None and tokenizer_spec == QWEN_SPEC:
            override = QWEN_TEMPLATE_PRESET
        if override == CHATML_PRESET:
            return cls(CHATML_TEMPLATE, origin="built-in ChatML", special_tokens=specials, clock=clock,
                       thinking=thinking)
        if override in PRESETS:
            source = preset_path(override).read_text(encoding="utf-8")
            return cls(source, origin=f"data/templates/{PRESETS[override]}", special_tokens=specials, clock=clock,
                       thinking=thinking)
        if override is not None:
            path = Path(override)
            if not path.is_file():
                raise ConfigError(f"chat template {override!r} is neither a preset ({', '.join(TEMPLATE_PRESETS)}) "
                                  "nor a file", key="data.chat_template",
                                  hint="name a preset, or the path of a Jinja2 template file")
            return cls(path.read_text(), origin=str(path), special_tokens=specials, clock=clock, thinking=thinking)
        if directory is not None:
            config = directory / "tokenizer_config.json"
            template = read_tokenizer_config(config).get("chat_template") if config.is_file() else None
            if isinstance(template, list):  # several named templates: the default one
                template = next((t.get("template") for t in template
                                 if isinstance(t, dict) and t.get("name") == "default"), None)
            if isinstance(template, str):
                return cls(template, origin=str(config), special_tokens=specials, clock=clock, thinking=thinking)
        return cls(CHATML_TEMPLATE, origin="built-in ChatML", special_tokens=specials, clock=clock,
                       thinking=thinking)

    def __getstate__(self) -> dict:
        return {"source": self.source, "origin": self.origin, "special_tokens": self.special_tokens,
                "clock": self.clock, "thinking": self.thinking, "max_seconds": self._budget.max_seconds,
                "max_chars": self._budget.max_chars}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["source"], origin=state["origin"], special_tokens=state["special_tokens"],
                      clock=state["clock"], thinking=state["thinking"], max_seconds=state["max_seconds"],
                      max_chars=state["max_chars"])

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False,
               tools: Optional[list[dict]] = None) -> str:
        """The conversation's text; a RecordError where the template fails on it, or would drop its
        ``tools`` or an assistant turn's ``tool_calls`` (module docstring)."""
        text = self._render(messages, add_generation_prompt, tools)
        if tools is not None and not self._renders("tools", lambda: text != self._render(
                messages, add_generation_prompt, None)):
            raise RecordError(f"chat template ({self.origin}) does not render the record's 'tools': it writes the "
                              "same text without them, so the model would never see them; use a template that "
                              f"renders tools (data.chat_template={' or '.join(PRESETS)} with the Qwen vocabulary, "
                              f"{CHATML_PRESET} with any) or records without 'tools'")
        if any("tool_calls" in m for m in messages) and not self._renders("tool_calls", lambda: text != self._render(
                [_without_calls(m) for m in messages], add_generation_prompt, tools)):
            raise RecordError(f"chat template ({self.origin}) does not render an assistant turn's 'tool_calls': it "
                              "writes the same text without them; use a template that renders tool calls "
                              f"(data.chat_template={' or '.join(PRESETS)} with the Qwen vocabulary, "
                              f"{CHATML_PRESET} with any) or records without them")
        return text

    def _renders(self, what: str, this_record) -> bool:
        """Whether the template renders ``what`` (``tools`` or ``tool_calls``), from its probe;
        where the probe itself fails, whether it rendered them for this record (``this_record()``)."""
        known = self._probe_tool_support()[what]
        return this_record() if known is None else known

    def _probe_tool_support(self) -> dict[str, Optional[bool]]:
        """``{"tools": ..., "tool_calls": ...}``: whether the probe tool's name occurs more often in a
        probe question rendered with the tool listed than without it, and in a probe turn calling
        the tool than in the same turn without the call (the tool listed both times); None where
        the template refuses the probe (each record is then compared instead)."""
        if self._tool_support is None:
            name = TOOL_PROBE["function"]["name"]
            question = [{"role": "user", "content": "?"}]
            calling = [*question, {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": {"x": "?"}}}]}]
            pairs = {"tools": ((question, [TOOL_PROBE]), (question, None)),
                     "tool_calls": ((calling, [TOOL_PROBE]), ([_without_calls(m) for m in calling], [TOOL_PROBE]))}
            self._tool_support = {}
            for what, ((messages, tools), (bare_messages, bare_tools)) in pairs.items():
                try:
                    with_it = self._render(messages, True, tools).count(name)
                    self._tool_support[what] = with_it > self._render(bare_messages, True, bare_tools).count(name)
                except RecordError:
                    self._tool_support[what] = None
        return self._tool_support

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: Optional[list[dict]]) -> str:
        template = self._template()  # a template that does not compile is a ConfigError, not a bad record
        variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                         documents=None, **self.special_tokens)
        if self.thinking is not None:
            variables[THINKING_VARIABLE] = self.thinking
        try:
            return render_within(template, self._budget, variables)
        except TemplateBudgetError as exc:
            raise TemplateLimitError(str(exc)) from None
        except LockstepError:
            raise
        except Exception as exc:  # jinja2 errors, and what the template's own code raised
            raise RecordError(f"chat template ({self.origin}) failed: {type(exc).__name__}: {exc}") from None

    def _template(self):
        if self._compiled is None:
            import jinja2

            def raise_exception(message):
                raise RecordError(f"chat template ({self.origin}) refused the record: {message}")

            env = environment(self._budget, parse_clock(self.clock), raise_exception)
            try:
                compiled, uses_clock = compile_template(env, self.source)
            except jinja2.TemplateError as exc:
                raise ConfigError(f"chat template does not compile: {exc}", key="data.chat_template",
                                  file=self.origin) from None
            if self.thinking is not None and not _reads_variable(env, self.source, THINKING_VARIABLE):
                raise ConfigError(
                    f"data.template_thinking={str(self.thinking).lower()} sets the chat template's "
                    f"{THINKING_VARIABLE}, but this template never reads it: the setting would change nothing",
                    key="data.template_thinking", file=self.origin,
                    hint="use a template that reads enable_thinking (data.chat_template=qwen3), or leave "
                         "data.template_thinking unset")
            if self.clock is None and uses_clock:
                raise ConfigError(
                    "the chat template calls strftime_now: its text would depend on the day it is rendered",
                    key="data.template_clock", file=self.origin,
                    hint="set data.template_clock to a fixed date-time (e.g. data.template_clock=2026-01-01T00:00:00)"
                         "; it is recorded with the run, so resume and replay render the same text")
            self._compiled = compiled
        return self._compiled

    def observation_text(self, tool_results: list[dict], *, tools: Optional[list[dict]] = None) -> str:
        """The text the template writes after an assistant turn's end-of-turn marker for the tool
        messages ``tool_results`` (``{"role": "tool", "content": ...}``), up to and including the
        next assistant turn's generation prompt: what an episode appends, as ids, between a
        sampled end-of-turn token and the model's next turn. It starts with whatever the template
        writes right after the marker (ChatML's ``\n``), so that the episode's ids are the ids of
        the whole conversation rendered at once.

        Found from the template itself: a conversation of a placeholder user and assistant turn
        and then ``tool_results`` is rendered with the generation prompt, and the text after the
        placeholder assistant turn's end-of-turn marker is returned."""
        probe = self._probe(list(tool_results), tools)
        messages = [{"role": "user", "content": probe[0]}, {"role": "assistant", "content": probe[1]},
                    *tool_results]
        text = self.render(messages, add_generation_prompt=True, tools=tools)
        marker = self.end_of_turn
        if not marker:
            raise RecordError(f"chat template ({self.origin}) has no end-of-turn marker (no <|im_end|> and "
                              "no eos_token): cannot tell where an assistant turn ends")
        end = text.rfind(probe[1])
        if end < 0 or not text.startswith(marker, end + 1):
            raise RecordError(f"chat template ({self.origin}) does not end an assistant turn with {marker!r} "
                              "right after its content: cannot append tool results to a sampled turn")
        return text[end + 1 + len(marker):]

    def render_spans(self, messages: list[dict], first_completion: int, loss_on: str, *,
                     tools: Optional[list[dict]] = None) -> Rendered:
        """Render (with the record's ``tools``) and find the character spans that carry loss
        (module docstring)."""
        text = self.render(messages, tools=tools)
        if loss_on == "all":
            return Rendered(text, ((0, len(text)),))
        trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"
                   and (loss_on == "assistant" or i >= first_completion)]
        if not trained:
            raise RecordError("the record has no assistant turn to train (data.loss_on="
                              f"{loss_on}); use data.loss_on=all to train every token")
        spans = [self._turn_span(messages, i, text, tools) for i in trained]
        for (_, end), (start, _), i in zip(spans, spans[1:], trained[1:]):
            if start < end:
                raise RecordError(f"chat template ({self.origin}) renders message {i}'s content inside an "
                                  "earlier turn: cannot tell which tokens to train")
        return Rendered(text, tuple(spans))

    def _turn_span(self, messages: list[dict], i: int, text: str,
                   tools: Optional[list[dict]]) -> tuple[int, int]:
        """[start, end) of what message ``i`` (its content and its tool calls) produced in
        ``text``, with its end-of-turn marker. The probe replaces the whole message by a plain
        turn whose content is the probe, so the calls' text differs too."""
        probe = self._probe(messages, tools)
        probed = self.render(_replace_message(messages, i, probe), tools=tools)
        start = _common_prefix(text, probed)
        end = len(text) - _common_suffix(text, probed, start)
        answer = _answer(messages[i]["content"])
        names = [call["function"]["name"] for call in messages[i].get("tool_calls", ())]
        if end <= start or any(part not in text[start:end] for part in [answer, *names] if part):
            raise RecordError(f"chat template ({self.origin}) does not render message {i}'s content "
                              "and tool calls verbatim: cannot tell which tokens to train")
        start = self._turn_start(text, start, probed, probed.find(probe))
        marker = self.end_of_turn
        if marker and text.startswith(marker, end):
            end += len(marker)
        return start, end

    def _probe(self, messages: list[dict], tools: Optional[list[dict]] = None) -> str:
        """A stand-in content whose characters occur nowhere else: where the rendering with it
        first and last differs from the real one bounds what the real content produced."""
        used = self._source_chars.union(json.dumps([messages, tools], ensure_ascii=False, default=str))
        free = (chr(c) for c in PROBE_CHARS if chr(c) not in used)
        probe = next(free, "") + next(free, "")
        if len(probe) < 2:
            raise RecordError("the record uses every private-use character: cannot locate its turns")
        return probe

    def _turn_start(self, text: str, start: int, probed: str, probe_start: int) -> int:
        """Move ``start`` back to the end of the assistant header when the template text between
        them exists because of this content (Qwen3's ``<think>\\n`` before kept reasoning): it is
        then part of what the model writes. Text the template writes whatever the content (an
        empty think block) stays untrained."""
        header = self._turn_header()
        if header is None or probe_start < 0:
            return start
        at, probe_at = text.rfind(header, 0, start), probed.rfind(header, 0, probe_start)
        if at < 0 or probe_at < 0:
            return start
        at, probe_at = at + len(header), probe_at + len(header)
        return at if text[at:start] != probed[probe_at:probe_start] else start

    def _turn_header(self) -> Optional[str]:
        """What the template writes to open an assistant turn: its generation prompt."""
        if self._header is None:
            question = [{"role": "user", "content": "?"}]
            try:
                bare, opened = self.render(question), self.render(question, add_generation_prompt=True)
            except RecordError:  # a template that refuses a lone user turn: no header to go by
                bare, opened = "", ""
            self._header = (opened[len(bare):] or None,) if opened.startswith(bare) else (None,)
        return self._header[0]


def _thinking_suffix(thinking: Optional[bool]) -> str:
    """What ``thinking`` adds to the hashed source: nothing when unset (fingerprints stay as they were)."""
    return "" if thinking is None else f"\n{{# {THINKING_VARIABLE}={str(thinking).lower()} #}}"


def _reads_variable(env, source: str, name: str) -> bool:
    """Whether the template's syntax tree names the variable ``name`` anywhere (read or tested)."""
    from jinja2 import nodes

    return any(node.name == name for node in env.parse(source).find_all(nodes.Name))


def _without_calls(message: dict) -> dict:
    return {k: v for k, v in message.items() if k != "tool_calls"}


def _replace_message(messages: list[dict], i: int, content: str) -> list[dict]:
    """``messages`` with message ``i`` a plain turn of the same role whose content is ``content``."""
    return [{"role": m["role"], "content": content} if j == i else m for j, m in enumerate(messages)]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slices (C speed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _common_suffix(a: str, b: str, floor: int) -> int:
    """Length of the common suffix of ``a[floor:]`` and ``b[floor:]``."""
    return _common_prefix(a[floor:][::-1], b[floor:][::-1])


def _answer(content: str) -> str:
    """The part of an assistant content that every template keeps: the text after its reasoning."""
    return content.split("</think>")[-1].strip()


def read_tokenizer_config(path: Path) -> dict:
    """A tokenizer directory's tokenizer_config.json: a DataError naming it if it is not a JSON object."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path.name} is not valid JSON: {exc}", file=str(path),
                        hint="repair the file or copy it again from its source") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path.name} must hold a JSON object, got {type(raw).__name__}", file=str(path),
                        hint="repair the file or copy it again from its source")
    return raw


def _tokenizer_dir(spec: str) -> Optional[Path]:
    from data.tokenizers import tokenizer_directory

    path = tokenizer_directory(spec)
    return path if path is not None and path.is_dir() else None


def _special_tokens(directory: Path) -> dict[str, str]:
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return {}
    raw = read_tokenizer_config(config)
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = raw.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


# --------------------------------------------------------------------------- tokens


def token_mask(offsets: np.ndarray, spans: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Which tokens overlap a trained span; ``offsets`` is (N, 2) character [start, end)."""
    mask = np.zeros(len(offsets), dtype=bool)
    for lo, hi in spans:
        mask |= (offsets[:, 0] < hi) & (offsets[:, 1] > lo)
    return mask


class TemplateEncoder(abc.ABC):
    """Base of the encoders of record kinds rendered with the chat template (data/kinds/): a record ->
    (int32 ids, bool target mask) by ``encode``, a pipeline document by ``document``."""

    def __init__(self, setup: EncoderSetup) -> None:
        if setup.loss_on not in LOSS_ON:
            raise ConfigError(f"data.loss_on must be one of {LOSS_ON}, got {setup.loss_on!r}", key="data.loss_on")
        self.template = setup.template
        self.tokenizer = setup.tokenizer
        self.loss_on = setup.loss_on

    @abc.abstractmethod
    def encode(self, record: Any) -> tuple[np.ndarray, np.ndarray]:
        """The record's ids and target mask; RecordError naming what is wrong with it."""

    def document(self, record: Any) -> Encoded:
        ids, mask = self.encode(record)
        return Encoded(ids, {TARGET_MASK.name: mask})

    def conversation(self, messages: list[dict], first_completion: int,
                     tools: Optional[list[dict]]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of the rendered conversation and which of them carry loss (``loss_on``)."""
        rendered = self.template.render_spans(messages, first_completion, self.loss_on, tools=tools)
        ids, offsets = self.tokenizer.encode_offsets(rendered.text)
        return ids, token_mask(offsets, rendered.spans)


class ChatEncoder:
    """Record of a template kind (``kind``: chat, prompt_completion, prompt) -> (int32 ids, bool target
    mask), with a tokenizer that reports character offsets; ``check`` refuses a template that renders
    no assistant span."""

    def __init__(self, template: ChatTemplate, tokenizer, *, kind: str, loss_on: str) -> None:
        row = record_kind(kind)
        encoder = row.encoder(EncoderSetup(template, tokenizer, loss_on)) if row.encoder is not None else None
        if not isinstance(encoder, TemplateEncoder):
            raise ConfigError(f"record kind {kind!r} is not one conversation rendered with the chat template",
                              key="data.sources[i].record")
        self.template = template
        self.tokenizer = tokenizer
        self.kind = kind
        self.loss_on = loss_on
        self._encoder = encoder

    def encode(self, record: Any) -> tuple[np.ndarray, np.ndarray]:
        return self._encoder.encode(record)

    def check(self) -> None:
        """Refuse a template that renders no assistant span (``check_template``)."""
        check_template(self.template, self.tokenizer)


def check_template(template: ChatTemplate, tokenizer) -> None:
    """Refuse a template that renders no assistant span (a ConfigError naming the file): checked once
    per run where a source's record kind is rendered with it."""
    probe = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "Four."}]
    try:
        rendered = template.render_spans(probe, 1, "assistant")
    except TemplateLimitError as exc:
        raise ConfigError(str(exc), key="data.chat_template", file=template.origin,
                          hint="fix the template's loops or the values it builds") from None
    except RecordError as exc:
        raise ConfigError(f"the chat template renders no assistant span: {exc}", key="data.chat_template",
                          file=template.origin,
                          hint="use a template that renders message contents verbatim, "
                               "or set data.loss_on=all") from None
    ids, offsets = tokenizer.encode_offsets(rendered.text)
    if not token_mask(offsets, rendered.spans).any():
        raise ConfigError("the chat template's assistant span holds no token", key="data.chat_template",
                          file=template.origin)
