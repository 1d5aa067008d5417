"""The ``prompt_completion`` record kind: ``{"prompt", "completion"}``. Two strings are text, joined
without a template (the completion trained); a prompt (string or messages) with completion
messages is a conversation rendered with the chat template (data/chat_template.py)."""

from __future__ import annotations

from typing import Any

from data.chat_template import RecordError, Rendered, TemplateEncoder, _check_messages, _check_tool_turns, \
    token_mask, tools_of
from data.fields import TARGET_MASK
from data.record_kinds import RecordKind

FIELDS = ("prompt", "completion")


def prompt_completion_messages(record: Any) -> tuple[list[dict], int]:
    """(messages, index of the completion's first message); RecordError if malformed."""
    if not isinstance(record, dict):
        raise RecordError(f"record is a {type(record).__name__}, not a JSON object")
    for key in FIELDS:
        if key not in record:
            raise RecordError(f"prompt_completion record has no {key!r} (keys: {', '.join(list(record)[:8])})")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise RecordError("'completion' is empty: nothing to train")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], 1
    prompt = _check_messages(prompt, "prompt") if not isinstance(prompt, str) else [
        {"role": "user", "content": prompt}]
    completion = _check_messages(completion, "completion")
    _check_tool_turns(prompt + completion, "prompt+completion", tools_of(record))
    return prompt + completion, len(prompt)


class PromptCompletionDocuments(TemplateEncoder):
    """A prompt/completion record -> its ids and target mask."""

    def encode(self, record: Any):
        messages, first_completion = prompt_completion_messages(record)
        prompt, completion = record["prompt"], record["completion"]
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            return self.conversation(messages, first_completion, tools_of(record))
        # Plain prompt/completion strings are text, not a conversation: no template.
        text = prompt + completion
        spans = ((0, len(text)),) if self.loss_on == "all" else ((len(prompt), len(text)),)
        rendered = Rendered(text, spans)
        ids, offsets = self.tokenizer.encode_offsets(rendered.text)
        return ids, token_mask(offsets, rendered.spans)


KIND = RecordKind(name="prompt_completion", summary='{"prompt", "completion"}: the completion trained',
                  columns=FIELDS, encoder=PromptCompletionDocuments, uses_template=True, fields=(TARGET_MASK,))
