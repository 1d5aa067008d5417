"""Chat records -> token ids and a per-token loss mask, through the model's own chat template.

The template is the ``chat_template`` of the tokenizer directory's ``tokenizer_config.json``
(or ``data.chat_template``), rendered with Jinja2 the way Hugging Face renders it: a
sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter, ``raise_exception`` and ``strftime_now``, and the special
tokens of ``tokenizer_config.json`` as variables. Without one, the built-in ChatML template
applies. The rendered string is tokenized as a whole (no special tokens added), which is
exactly what ``transformers``' ``apply_chat_template(..., tokenize=True)`` does, so the ids
are the same (tests/data/test_chat_template.py checks it).

Which tokens carry loss is found on the rendered text, not by rendering prefixes (templates
such as Qwen3's render earlier turns differently once later turns exist): the messages'
contents are located in order in the rendered string, and a trained message's span runs
from the start of its content to the end of the end-of-turn marker that follows it
(``<|im_end|>`` for ChatML templates, else the tokenizer's EOS), when the marker follows the
content directly. A token is trained when its characters overlap a trained span.

``data.loss_on``: ``assistant`` trains every assistant turn; ``completion`` trains the last
assistant turn of a conversation (the completion of a prompt/completion record); ``all``
trains every token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import numpy as np

from core.exceptions import ConfigError

ROLES = ("system", "user", "assistant")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message."""

CHATML_END = "<|im_end|>"

LOSS_ON = ("assistant", "completion", "all")


class RecordError(ValueError):
    """A record that does not match its declared kind (a bad record, skippable)."""


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation and the character spans that carry loss."""

    text: str
    spans: tuple[tuple[int, int], ...]


# --------------------------------------------------------------------------- records


def messages_of(record: Any, kind: str) -> tuple[list[dict], int]:
    """(messages, index of the first completion message) of a chat or prompt/completion record.

    Raises RecordError naming what does not match the kind.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record is a {type(record).__name__}, not a JSON object")
    if kind == "chat":
        if "messages" not in record:
            raise RecordError(f"chat record has no 'messages' (keys: {', '.join(list(record)[:8])})")
        messages = _check_messages(record["messages"], "messages")
        return messages, _last_assistant(messages)
    if kind == "prompt_completion":
        for key in ("prompt", "completion"):
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
        return prompt + completion, len(prompt)
    raise RecordError(f"unknown record kind {kind!r}")


def _check_messages(messages: Any, field: str) -> list[dict]:
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
        if not isinstance(content, str):
            raise RecordError(f"{where} ({role}) content is a {type(content).__name__}, not a string")
        if role == "assistant" and not content.strip():
            raise RecordError(f"{where} (assistant) has empty content")
        out.append({"role": role, "content": content})
    return out


def _last_assistant(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            return i
    return len(messages)


# --------------------------------------------------------------------------- template


class ChatTemplate:
    """A Jinja2 chat template, rendered as Hugging Face renders it."""

    def __init__(self, source: str, *, origin: str, special_tokens: Optional[dict[str, str]] = None) -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        self._compiled = None
        if CHATML_END in source:
            self.end_of_turn = CHATML_END
        else:
            self.end_of_turn = self.special_tokens.get("eos_token") or None

    @classmethod
    def for_tokenizer(cls, tokenizer_spec: str, override: Optional[str] = None) -> "ChatTemplate":
        """``override`` (a template file), else the tokenizer directory's template, else ChatML."""
        directory = _tokenizer_dir(tokenizer_spec)
        specials = _special_tokens(directory) if directory is not None else {}
        if override is not None:
            path = Path(override)
            if not path.is_file():
                raise ConfigError(f"chat template file {override!r} does not exist", key="data.chat_template")
            return cls(path.read_text(), origin=str(path), special_tokens=specials)
        if directory is not None:
            config = directory / "tokenizer_config.json"
            template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
            if isinstance(template, list):  # several named templates: the default one
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            if isinstance(template, str):
                return cls(template, origin=str(config), special_tokens=specials)
        return cls(CHATML_TEMPLATE, origin="built-in ChatML", special_tokens=specials)

    def __getstate__(self) -> dict:
        return {"source": self.source, "origin": self.origin, "special_tokens": self.special_tokens}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["source"], origin=state["origin"], special_tokens=state["special_tokens"])

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        try:
            return self._template().render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None,
                **self.special_tokens,
            )
        except RecordError:
            raise
        except Exception as exc:  # jinja2 errors and the template's own raise_exception
            raise RecordError(f"chat template ({self.origin}) failed: {exc}") from None

    def _template(self):
        if self._compiled is None:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise RecordError(f"chat template ({self.origin}) refused the record: {message}")

            def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._compiled = env.from_string(self.source)
            except jinja2.TemplateError as exc:
                raise ConfigError(f"chat template does not compile: {exc}", key="data.chat_template",
                                  file=self.origin) from None
        return self._compiled

    def render_spans(self, messages: list[dict], first_completion: int, loss_on: str) -> Rendered:
        """Render and find the character spans that carry loss (module docstring)."""
        text = self.render(messages)
        if loss_on == "all":
            return Rendered(text, ((0, len(text)),))
        trained = {i for i, m in enumerate(messages) if m["role"] == "assistant"
                   and (loss_on == "assistant" or i >= first_completion)}
        spans, cursor = [], 0
        for i, message in enumerate(messages):
            start, end = _locate(text, message["content"], cursor)
            if start < 0:
                if i in trained:
                    raise RecordError(f"chat template ({self.origin}) does not render message {i}'s content "
                                      "verbatim: cannot tell which tokens to train")
                continue
            cursor = end
            if i in trained:
                marker = self.end_of_turn
                if marker and text.startswith(marker, end):
                    end += len(marker)
                spans.append((start, end))
                cursor = end
        if not spans:
            raise RecordError("the record has no assistant turn to train (data.loss_on="
                              f"{loss_on}); use data.loss_on=all to train every token")
        return Rendered(text, tuple(spans))


def _locate(text: str, content: str, cursor: int) -> tuple[int, int]:
    for candidate in (content, content.strip()):
        if candidate:
            at = text.find(candidate, cursor)
            if at >= 0:
                return at, at + len(candidate)
    return -1, -1


def _tokenizer_dir(spec: str) -> Optional[Path]:
    from data.tokenizers import tokenizer_directory

    path = tokenizer_directory(spec)
    return path if path is not None and path.is_dir() else None


def _special_tokens(directory: Path) -> dict[str, str]:
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return {}
    raw = json.loads(config.read_text())
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


class ChatEncoder:
    """Record -> (int32 ids, bool target mask) with a tokenizer that reports character offsets."""

    def __init__(self, template: ChatTemplate, tokenizer, *, kind: str, loss_on: str) -> None:
        if loss_on not in LOSS_ON:
            raise ConfigError(f"data.loss_on must be one of {LOSS_ON}, got {loss_on!r}", key="data.loss_on")
        self.template = template
        self.tokenizer = tokenizer
        self.kind = kind
        self.loss_on = loss_on

    def encode(self, record: Any) -> tuple[np.ndarray, np.ndarray]:
        if self.kind == "prompt":
            return self._encode_prompt(record)
        messages, first_completion = messages_of(record, self.kind)
        if self.kind == "prompt_completion" and isinstance(record.get("prompt"), str) \
                and isinstance(record.get("completion"), str):
            # Plain prompt/completion strings are text, not a conversation: no template.
            prompt, completion = record["prompt"], record["completion"]
            text = prompt + completion
            spans = ((0, len(text)),) if self.loss_on == "all" else ((len(prompt), len(text)),)
            rendered = Rendered(text, spans)
        else:
            rendered = self.template.render_spans(messages, first_completion, self.loss_on)
        ids, offsets = self.tokenizer.encode_offsets(rendered.text)
        return ids, token_mask(offsets, rendered.spans)

    def _encode_prompt(self, record: Any) -> tuple[np.ndarray, np.ndarray]:
        """A GRPO prompt record ``{"prompt", "answer"}``: the prompt rendered with the template and
        ``add_generation_prompt`` (a string prompt is one user message), then the answer's tokens,
        which the mask marks; the objective splits them again (training/objectives/grpo.py)."""
        if not isinstance(record, dict):
            raise RecordError(f"record is a {type(record).__name__}, not a JSON object")
        prompt, answer = record.get("prompt"), record.get("answer")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise RecordError("'prompt' is empty")
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = _check_messages(prompt, "prompt")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
            raise RecordError(f"prompt record needs a non-empty 'answer' (string or number), got {answer!r}")
        prompt_ids = self.tokenizer.encode_array(self.template.render(messages, add_generation_prompt=True))
        answer_ids = self.tokenizer.encode_array(str(answer))
        mask = np.concatenate([np.zeros(len(prompt_ids), dtype=bool), np.ones(len(answer_ids), dtype=bool)])
        return np.concatenate([prompt_ids, answer_ids]).astype(np.int32), mask

    def check(self) -> None:
        """Refuse a template that renders no assistant span (a ConfigError naming the file)."""
        probe = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "Four."}]
        try:
            rendered = self.template.render_spans(probe, 1, "assistant")
        except RecordError as exc:
            raise ConfigError(f"the chat template renders no assistant span: {exc}", key="data.chat_template",
                              file=self.template.origin,
                              hint="use a template that renders message contents verbatim, "
                                   "or set data.loss_on=all") from None
        ids, offsets = self.tokenizer.encode_offsets(rendered.text)
        if not token_mask(offsets, rendered.spans).any():
            raise ConfigError("the chat template's assistant span holds no token", key="data.chat_template",
                              file=self.template.origin)
