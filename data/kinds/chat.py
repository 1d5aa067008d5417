"""The ``chat`` record kind: ``{"messages": [...], "tools": [...]}`` rendered with the chat template;
the assistant turns ``data.loss_on`` names carry loss (data/chat_template.py)."""

from __future__ import annotations

from typing import Any

from data.chat_template import RecordError, TemplateEncoder, _check_messages, _check_tool_turns, _last_assistant, \
    tools_of
from data.fields import TARGET_MASK
from data.record_kinds import RecordKind


def chat_messages(record: Any) -> tuple[list[dict], int]:
    """(messages, index of the trained completion's first message) of a chat record; RecordError if malformed."""
    if not isinstance(record, dict):
        raise RecordError(f"record is a {type(record).__name__}, not a JSON object")
    if "messages" not in record:
        raise RecordError(f"chat record has no 'messages' (keys: {', '.join(list(record)[:8])})")
    messages = _check_messages(record["messages"], "messages")
    _check_tool_turns(messages, "messages", tools_of(record))
    return messages, _last_assistant(messages)


class ChatDocuments(TemplateEncoder):
    """A chat record -> its rendered conversation's ids and target mask."""

    def encode(self, record: Any):
        messages, first_completion = chat_messages(record)
        return self.conversation(messages, first_completion, tools_of(record))


KIND = RecordKind(name="chat", summary='{"messages": [...]} rendered with the chat template', columns=("messages",),
                  encoder=ChatDocuments, uses_template=True, fields=(TARGET_MASK,))
