"""What a generation command needs around the Sampler: prompts in, keyed samples, records out.

``python -m training generate`` (the training layer) loads the weights, renders chat prompts
with the model's template and tokenizes them (data/), then samples through the training
layer's ``Generator`` (training/rollout/generator.py, which calls ``sample_prompts``; GRPO's
rollouts use the same) and writes ``sample_record`` lines. This module holds the parts that need neither a tokenizer
nor a run directory:

- ``read_prompts(path)``: a JSONL file, one prompt per line: ``{"prompt": "text"}``,
  ``{"prompt": [messages]}`` or ``{"messages": [messages]}`` (a chat prompt: render it with
  ``add_generation_prompt``). A prompt's index is its line number (from 0), which is also
  its ``SampleKey.prompt_index``, so a sample does not depend on which other lines a file
  holds or how they are batched. A line may list ``"images": ["cat.png", ...]``, paths
  relative to the file (``Prompt.images``, resolved): the images its ``<image>``
  placeholders show, which a vision-language model's generate loads (training/cli/generate.py).
- ``context_length``: the Sampler's ``max_len`` for a set of prompts, rounded up to a
  multiple, so that most prompt files share one (a sample is bitwise reproducible for the
  same Sampler settings; docs/models.md, Generation).
- ``sample_prompts``: one SampleKey per (prompt, sample index), then ``Sampler.generate``.
- ``sample_record``: the JSON line for one sample.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from core.exceptions import DataError
from models.generation.sampler import Sample, SampleKey, Sampler, SamplingParams

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a prompts file: plain text or chat messages (exactly one is set)."""

    index: int
    """Line number in the file, from 0; the prompt_index of its samples' keys."""
    text: Optional[str] = None
    messages: Optional[tuple[dict[str, str], ...]] = None
    """Chat messages (rendered with the generation prompt)."""
    images: tuple[Path, ...] = ()
    """The images the prompt shows, in the order of its ``<image>`` placeholders (paths resolved against the file's directory)."""


PROMPTS_MAX_BYTES = 64 * 1024**2
"""A prompts file is read whole; a larger one (or an endless one such as /dev/zero) is refused."""


def read_prompts(path: str | Path, *, max_bytes: int = PROMPTS_MAX_BYTES) -> list[Prompt]:
    """Parse a prompts JSONL file; a bad line is a DataError naming the file and line (from 1)."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            raw = file.read(max_bytes + 1)  # bounded: a device or a pipe may never end
    except OSError as exc:
        raise DataError(f"cannot read prompts file {path}: {exc.strerror or exc}", file=str(path)) from None
    if len(raw) > max_bytes:
        raise DataError(f"prompts file {path} is larger than {max_bytes // 1024**2} MiB", file=str(path),
                        hint="split it into several files and run generate on each")
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise DataError(f"{path.name} line {line}: not UTF-8 ({exc.reason} at byte {exc.start})", file=str(path),
                        record=line, hint="save the prompts file as UTF-8") from None
    prompts = []
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        prompts.append(_parse_prompt(line, number, path))
    if not prompts:
        raise DataError(f"prompts file {path} holds no prompt", file=str(path),
                        hint='one JSON object per line, e.g. {"prompt": "Hello"}')
    return prompts


def _parse_prompt(line: str, number: int, path: Path) -> Prompt:
    def fail(message: str) -> DataError:
        return DataError(f"{path.name} line {number + 1}: {message}", file=str(path), record=number + 1,
                         hint='each line: {"prompt": "text"}, {"prompt": [messages]} or {"messages": [messages]}')

    try:
        record = json.loads(line)
    except ValueError as exc:
        raise fail(f"not JSON ({exc})") from exc
    if not isinstance(record, dict):
        raise fail(f"a {type(record).__name__}, not a JSON object")
    images = _images(record.get("images", []), path, fail)
    value = record.get("prompt", record.get("messages"))
    if isinstance(value, str):
        if not value:
            raise fail("the prompt is empty")
        _check_text(value, "the prompt", fail)
        return Prompt(index=number, text=value, images=images)
    if isinstance(value, list) and value:
        for i, message in enumerate(value):
            if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
                raise fail(f"message {i} is not {{'role': one of {', '.join(ROLES)}, 'content': str}}")
            _check_text(message["content"], f"message {i}'s content", fail)
        return Prompt(index=number, messages=tuple({"role": m["role"], "content": m["content"]} for m in value),
                      images=images)
    raise fail("has no non-empty 'prompt' (text or messages) or 'messages'")


def _images(value: Any, path: Path, fail) -> tuple[Path, ...]:
    """A line's ``images``: a list of non-empty path strings, each resolved against the file's directory."""
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise fail(f"'images' must be a list of non-empty paths relative to the file, got {value!r}")
    return tuple(path.parent / item for item in value)


def _check_text(text: str, what: str, fail) -> None:
    """``"\\ud83d"`` is valid JSON and a valid Python string, but no text: no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise fail(f"{what} holds a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start} "
                   "(a \\ud800-\\udfff escape not paired with another), which is not text") from None


def context_length(prompt_lengths: Sequence[int], max_new_tokens: int, *, limit: int, multiple: int = 256) -> int:
    """max_len for these prompts: longest prompt + max_new_tokens, rounded up to ``multiple``, at most ``limit``.

    Prompts that do not fit are the Sampler's to reject (DataError naming the prompt).
    """
    needed = max(prompt_lengths) + max_new_tokens
    return max(2, min(limit, -(-needed // multiple) * multiple))


def sample_prompts(
    sampler: Sampler,
    token_ids: Sequence[Sequence[int]],
    prompt_indices: Sequence[int],
    params: SamplingParams,
    *,
    seed: int,
    purpose: str = "generate",
    step: int = 0,
    samples_per_prompt: int = 1,
    media: Optional[Sequence[Optional[Mapping[str, Sequence[Any]]]]] = None,
) -> list[tuple[int, int, Sample]]:
    """(prompt index, sample index, sample) for every prompt and sample index, prompt-major; ``media``:
    each prompt's, as ``Sampler.generate`` takes them (None: text prompts)."""
    if len(token_ids) != len(prompt_indices):
        raise ValueError(f"{len(token_ids)} token lists but {len(prompt_indices)} prompt indices")
    pairs = [(p, s) for p in range(len(token_ids)) for s in range(samples_per_prompt)]
    keys = [SampleKey(seed, purpose, step, prompt_indices[p], s) for p, s in pairs]
    per_sample = None if media is None else [media[p] for p, _ in pairs]
    samples = sampler.generate([token_ids[p] for p, _ in pairs], keys, params, media=per_sample)
    return [(prompt_indices[p], s, sample) for (p, s), sample in zip(pairs, samples)]


def sample_record(prompt_index: int, sample_index: int, sample: Sample, *, completion: str) -> dict[str, Any]:
    """The output line of one sample (``completion`` is the decoded text of sample.tokens)."""
    return {
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "completion": completion,
        "token_ids": sample.tokens,
        "logprobs": sample.logprobs,
        "finish_reason": sample.finish_reason,
    }
