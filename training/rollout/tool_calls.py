"""The tool calls an assistant turn writes, parsed into typed results.

A turn calls tools in Qwen's format: each call is one JSON object between ``<tool_call>`` and
``</tool_call>`` (the newlines around it are optional), several calls one after another::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "4821 * 37"}}
    </tool_call>

``parse_tool_calls(text, tools)`` returns one result per opening tag, in the order written: a
``ToolCall`` (a known tool's name and its arguments object) or a ``MalformedCall`` saying what is
wrong (the JSON does not parse, it is not an object, the name is missing or not a string, the
arguments are not an object, the tool is unknown, the tag is never closed). It never raises: a
malformed call is the model's mistake, which the environment answers with an error observation
and counts. Text outside the tags is not a call; a turn without any tag calls no tool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Collection, Union

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    reason: str
    """What is wrong, one short clause (the error observation quotes it)."""
    text: str
    """The call's text between the tags (after the opening tag when it is never closed)."""


ParsedCall = Union[ToolCall, MalformedCall]


def parse_tool_calls(text: str, tools: Collection[str]) -> list[ParsedCall]:
    """Every call of ``text`` in order (module docstring); ``tools`` are the names a call may use."""
    calls: list[ParsedCall] = []
    position = text.find(OPEN)
    while position >= 0:
        start = position + len(OPEN)
        end = text.find(CLOSE, start)
        following = text.find(OPEN, start)
        if end < 0 or 0 <= following < end:  # no closing tag before the next call or the end
            stop = following if following >= 0 else len(text)
            calls.append(MalformedCall(f"{OPEN} is not closed by {CLOSE}", text[start:stop].strip()))
            position = following
            continue
        calls.append(_parsed(text[start:end].strip(), tools))
        position = text.find(OPEN, end + len(CLOSE))
    return calls


def _parsed(body: str, tools: Collection[str]) -> ParsedCall:
    try:
        value = json.loads(body)
    except ValueError as exc:
        return MalformedCall(f"the call is not JSON ({exc.args[0] if exc.args else exc})", body)
    except RecursionError:  # nesting deeper than the parser goes
        return MalformedCall("the call is not JSON (nested too deeply)", body)
    if not isinstance(value, dict):
        return MalformedCall(f"the call is a JSON {type(value).__name__}, not an object", body)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall("the call has no string 'name'", body)
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return MalformedCall(f"the call's 'arguments' is a JSON {type(arguments).__name__}, not an object", body)
    if name not in tools:
        known = ", ".join(sorted(tools)) or "none"
        return MalformedCall(f"unknown tool {name!r} (tools: {known})", body)
    return ToolCall(name, arguments)
