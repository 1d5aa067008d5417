"""The assistant loss mask lands on the answer's own tokens, wherever else the answer's text occurs
(data/chat_template.py locates spans by rendering, never by searching for the content).

Templates: the built-in ChatML with the byte tokenizer, and Qwen2.5-Instruct's and Qwen3's own
chat templates (tests/data/templates/, as their tokenizer_config.json ship them) with the Qwen
vocabulary; the rendered ids of every case equal ``transformers``' ``apply_chat_template``.
Answers occur in the template's markup (``tan`` in ``assistant``, ``a``, ``end``, ``hi``,
``art``, ``ist``), in the system prompt, in the user's turn and in an earlier assistant turn;
each ``data.loss_on`` mode trains exactly the answers it should, each with its ``<|im_end|>``.
Qwen3 reasoning traces: an earlier turn's think block is dropped by the template and its answer
trained; the last turn's is kept and trained. Last, every embedded chat and preference record
(``python -m data prepare``'s 20,512 tasks) trains exactly its answers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from data.chat_template import ChatEncoder, ChatTemplate
from data.preference import PreferenceEncoder
from data.tokenizers import ByteTokenizer, HFTokenizer

TEMPLATES = Path(__file__).parent / "templates"
END = "<|im_end|>"

# Answers that also occur in the markup of ChatML/Qwen (<|im_start|>assistant, <|im_end|>, <think>)
# or in the embedded data's prompts (the four SFT records the str.find mask got wrong: "art", "ist").
ANSWERS = ["tan", "a", "end", "hi", "art", "ist", "im", "system", "think", "You are Qwen"]


def placements(answer: str) -> dict[str, list[dict]]:
    """Conversations in which ``answer`` also occurs before the turn that answers with it."""
    return {
        "template": [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": answer}],
        "system": [{"role": "system", "content": f"Always reply {answer}"},
                   {"role": "user", "content": "Go."}, {"role": "assistant", "content": answer}],
        "user": [{"role": "user", "content": answer}, {"role": "assistant", "content": answer}],
        "earlier_assistant": [{"role": "user", "content": "One?"}, {"role": "assistant", "content": answer},
                              {"role": "user", "content": f"{answer} again?"},
                              {"role": "assistant", "content": answer}],
    }


@pytest.fixture(scope="module", params=["chatml-byte", "qwen2_5_instruct", "qwen3"])
def setup(request, qwen_vocabulary, tmp_path_factory):
    """(template, tokenizer, Hugging Face tokenizer directory or None) for each template the tests know."""
    if request.param == "chatml-byte":
        return request.param, ChatTemplate.for_tokenizer("byte"), ByteTokenizer(), None
    directory = tmp_path_factory.mktemp(request.param)
    shutil.copy(qwen_vocabulary / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((qwen_vocabulary / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / f"{request.param}.jinja").read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return request.param, ChatTemplate.for_tokenizer(str(directory)), HFTokenizer(directory / "tokenizer.json"), \
        directory


@pytest.fixture(scope="module")
def reference(setup):
    """``transformers``' apply_chat_template ids for a conversation (None for the byte tokenizer)."""
    directory = setup[3]
    if directory is None:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))

    def ids(messages):
        out = tok.apply_chat_template(messages, tokenize=True)
        return list(out["input_ids"] if not isinstance(out, list) else out)

    return ids


def trained_runs(ids: np.ndarray, mask: np.ndarray, tokenizer) -> list[str]:
    """The decoded text of each run of consecutive trained tokens."""
    runs, current = [], []
    for token, on in zip(ids.tolist(), mask.tolist()):
        if on:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [_decode(tokenizer, run) for run in runs]


def _decode(tokenizer, ids: list[int]) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return bytes(ids).decode("utf-8")
    return tokenizer.decode(ids)


@pytest.mark.parametrize("answer", ANSWERS)
def test_answers_that_occur_elsewhere_train_only_their_own_tokens(setup, reference, answer):
    _, template, tokenizer, _ = setup
    for where, messages in placements(answer).items():
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        for loss_on, expected in (("assistant", answers), ("completion", answers[-1:])):
            encoder = ChatEncoder(template, tokenizer, kind="chat", loss_on=loss_on)
            ids, mask = encoder.encode({"messages": messages})
            assert trained_runs(ids, mask, tokenizer) == [a + END for a in expected], (where, loss_on)
            if reference is not None:
                assert ids.tolist() == reference(messages), where
        ids, mask = ChatEncoder(template, tokenizer, kind="chat", loss_on="all").encode({"messages": messages})
        assert mask.all() and len(mask) == len(ids)


@pytest.mark.parametrize("answer", ["tan", "a", "end", "art"])
def test_prompt_completion_and_preference_records_train_only_the_answer(setup, answer):
    _, template, tokenizer, _ = setup
    prompt = [{"role": "system", "content": answer}, {"role": "user", "content": answer}]
    encoder = ChatEncoder(template, tokenizer, kind="prompt_completion", loss_on="completion")
    ids, mask = encoder.encode({"prompt": prompt, "completion": [{"role": "assistant", "content": answer}]})
    assert trained_runs(ids, mask, tokenizer) == [answer + END]
    ids, mask, rejected_at = PreferenceEncoder(template, tokenizer).encode(
        {"prompt": prompt, "chosen": answer, "rejected": answer + "s"})
    assert trained_runs(ids[:rejected_at], mask[:rejected_at], tokenizer) == [answer + END]
    assert trained_runs(ids[rejected_at:], mask[rejected_at:], tokenizer) == [answer + "s" + END]


REASONING = {
    "earlier": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "<think>add</think>5"},
                {"role": "user", "content": "And 2+4?"}, {"role": "assistant", "content": "6"}],
    "last": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "<think>a</think>5"}],
    "both": [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "<think>\na\n</think>\n\na"},
             {"role": "user", "content": "think?"}, {"role": "assistant", "content": "<think>think</think>think"}],
}
# What each template keeps of the assistant turns: Qwen3 drops the reasoning of turns before the
# last user message and writes the last turn's as "<think>\n...\n</think>\n\n"; the others render
# the content verbatim.
KEPT = {
    "qwen3": {"earlier": ["5", "6"], "last": ["<think>\na\n</think>\n\n5"],
              "both": ["a", "<think>\nthink\n</think>\n\nthink"]},
}


@pytest.mark.parametrize("case", sorted(REASONING))
def test_reasoning_traces_train_what_the_template_keeps(setup, reference, case):
    name, template, tokenizer, _ = setup
    messages = REASONING[case]
    contents = [m["content"] for m in messages if m["role"] == "assistant"]
    kept = KEPT.get(name, {}).get(case, contents)
    for loss_on, expected in (("assistant", kept), ("completion", kept[-1:])):
        ids, mask = ChatEncoder(template, tokenizer, kind="chat", loss_on=loss_on).encode({"messages": messages})
        assert trained_runs(ids, mask, tokenizer) == [k + END for k in expected], loss_on
        if reference is not None:
            assert ids.tolist() == reference(messages)


@pytest.mark.slow  # a sweep of the whole embedded corpus (14-21 CPU-s): in make test, not in the inner loop (make test-fast)
def test_every_embedded_chat_and_preference_record_trains_exactly_its_answers():
    """The 20,512 tasks of ``python -m data prepare`` (train and eval), as chat SFT records and as
    preference pairs, with the byte tokenizer and ChatML (the tiny configs' setup): the trained
    tokens of each are its assistant contents, each with ``<|im_end|>``. About 25 s on one loaded core."""
    from data.__main__ import TASKS_SPEC
    from data.tasks import preference_record, sft_record, split_tasks

    seed = TASKS_SPEC["seed"]
    splits = split_tasks(seed, TASKS_SPEC["train_n"], TASKS_SPEC["eval_n"])
    tokenizer, template = ByteTokenizer(), ChatTemplate.for_tokenizer("byte")
    chat = ChatEncoder(template, tokenizer, kind="chat", loss_on="assistant")
    pairs = PreferenceEncoder(template, tokenizer)
    checked = 0
    for split, tasks in splits.items():
        for i, task in enumerate(tasks):
            record = sft_record(tasks, i, seed, split)
            ids, mask = chat.encode(record)
            answers = [m["content"] + END for m in record["messages"] if m["role"] == "assistant"]
            assert _byte_runs(ids, mask) == answers, (split, i, record)
            record = preference_record(task, i, seed, split)
            ids, mask, rejected_at = pairs.encode(record)
            assert _byte_runs(ids[:rejected_at], mask[:rejected_at]) == [record["chosen"] + END], (split, i)
            assert _byte_runs(ids[rejected_at:], mask[rejected_at:]) == [record["rejected"] + END], (split, i)
            checked += 1
    assert checked == TASKS_SPEC["train_n"] + TASKS_SPEC["eval_n"]


def _byte_runs(ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """trained_runs for the byte tokenizer, vectorized (the corpus test runs it 60,000 times)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    raw = ids.astype(np.uint8).tobytes()
    return [raw[lo:hi].decode("utf-8") for lo, hi in zip(edges[::2], edges[1::2])]
