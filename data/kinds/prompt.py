"""The ``prompt`` record kind: GRPO/PPO prompts ``{"prompt", "answer"}`` (and optionally ``tools``),
one a row: the prompt rendered with the chat template and its generation prompt, then the
answer's tokens, which the target mask marks; the objective splits them again
(``data.batch.prompt_and_answer``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from data.chat_template import RecordError, TemplateEncoder, _check_messages, _check_tool_turns, tools_of
from data.fields import TARGET_MASK
from data.record_kinds import RecordKind


def prompt_parts(record: Any) -> tuple[list[dict], str, Any]:
    """A prompt record's messages (a string prompt is one user message; a prompt of messages may hold
    earlier tool calls and their results, checked as a chat record's are), its answer's text and its
    tools; RecordError naming what is wrong."""
    if not isinstance(record, dict):
        raise RecordError(f"record is a {type(record).__name__}, not a JSON object")
    prompt, answer = record.get("prompt"), record.get("answer")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RecordError("'prompt' is empty")
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = _check_messages(prompt, "prompt")
    tools = tools_of(record)
    _check_tool_turns(messages, "prompt", tools)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise RecordError(f"prompt record needs a non-empty 'answer' (string or number), got {answer!r}")
    if isinstance(answer, float) and not np.isfinite(answer):
        raise RecordError(f"prompt record's 'answer' is {answer!r}, not a finite number")  # JSON NaN/Infinity
    return messages, str(answer), tools


class PromptDocuments(TemplateEncoder):
    """A prompt record -> the rendered prompt's ids then the answer's, the answer's marked."""

    def encode(self, record: Any) -> tuple[np.ndarray, np.ndarray]:
        """The record's checked parts (``prompt_parts``), rendered with the generation prompt."""
        messages, answer, tools = prompt_parts(record)
        text = self.template.render(messages, add_generation_prompt=True, tools=tools)
        prompt_ids = self.tokenizer.encode_array(text)
        answer_ids = self.tokenizer.encode_array(answer)
        mask = np.concatenate([np.zeros(len(prompt_ids), dtype=bool), np.ones(len(answer_ids), dtype=bool)])
        return np.concatenate([prompt_ids, answer_ids]).astype(np.int32), mask


KIND = RecordKind(name="prompt", summary='{"prompt", "answer"}: a GRPO/PPO prompt, one a row', encoder=PromptDocuments,
                  uses_template=True, one_per_row=True, fields=(TARGET_MASK,))
