"""The agent task set (data/agent_tasks.py): pinned draws, disjoint splits, answers that are the
calculator's results, and tool transcripts whose loss covers the call and the answer only."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from data import calculator
from data.agent_tasks import make_agent_task, write_agent_datasets
from data.chat_template import ChatEncoder, ChatTemplate
from data.tokenizers import ByteTokenizer
from tests.data.test_chat_masks import trained_runs
from training.rollout.rewards import REWARDS

FILES = [f"{name}/{split}.jsonl" for name in ("sft", "rl") for split in ("train", "eval")]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    return root, write_agent_datasets(root, seed=3, train_n=600, eval_n=100)


def _records(root, name):
    return [json.loads(line) for line in (root / name).read_text().splitlines()]


def _solve(prompt: str) -> str:
    """The answer worked out from the prompt's wording, without the calculator."""
    if m := re.fullmatch(r"What is (\d{3}) \* (\d{2})\?", prompt):
        return str(int(m[1]) * int(m[2]))
    if m := re.fullmatch(r"What is (\d{3}) \+ (\d{3}) \+ (\d{3})\?", prompt):
        return str(int(m[1]) + int(m[2]) + int(m[3]))
    raise AssertionError(f"unexpected prompt {prompt!r}")


def test_generator_is_pinned_and_the_bytes_depend_on_the_seed_only(written, tmp_path):
    assert [(t.family, t.prompt, t.answer) for t in map(lambda i: make_agent_task(0, i), range(3))] == [
        ("sum3", "What is 254 + 340 + 619?", "1213"),
        ("product", "What is 114 * 48?", "5472"),
        ("product", "What is 969 * 14?", "13566"),
    ]
    root, counts = written
    assert counts == {name: 600 if "train" in name else 100 for name in FILES}
    write_agent_datasets(tmp_path, seed=3, train_n=600, eval_n=100)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (root / name).read_bytes(), name
    assert hashlib.sha256((root / "rl/eval.jsonl").read_bytes()).hexdigest()[:16] == "c51ac692cc0389da"


def test_splits_are_disjoint_and_every_answer_is_the_tools_result(written):
    root, _ = written
    prompts = {}
    for split in ("train", "eval"):
        rl, sft = _records(root, f"rl/{split}.jsonl"), _records(root, f"sft/{split}.jsonl")
        prompts[split] = [r["prompt"] for r in rl]
        assert len(set(prompts[split])) == len(rl)
        assert {r["task"] for r in rl} == {"product", "sum3"}
        for record, chat in zip(rl, sft, strict=True):
            answer = _solve(record["prompt"])
            assert record == {"prompt": record["prompt"], "answer": answer, "task": record["task"],
                              "reward": "exact_answer", "tools": [calculator.SPEC]}
            assert REWARDS[record["reward"]](answer, record["answer"]) == 1.0
            expression = record["prompt"].removeprefix("What is ").removesuffix("?")
            assert chat["tools"][0]["function"]["name"] == "calculator"
            assert chat["messages"] == [
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]},
                {"role": "tool", "content": answer},
                {"role": "assistant", "content": answer},
            ]
    assert not set(prompts["train"]) & set(prompts["eval"])


def test_shards_split_the_records_round_robin(written, tmp_path):
    root, _ = written
    counts = write_agent_datasets(tmp_path, seed=3, train_n=600, eval_n=100, shards=4)
    assert counts["sft/train/part-003.jsonl"] == 150 and counts["rl/eval/part-000.jsonl"] == 25
    whole = (root / "rl/eval.jsonl").read_text().splitlines()
    assert (tmp_path / "rl/eval/part-001.jsonl").read_text().splitlines() == whole[1::4]


def test_transcripts_train_the_call_and_the_answer_never_the_tool_result(written):
    root, _ = written
    encoder = ChatEncoder(ChatTemplate.for_tokenizer("byte"), ByteTokenizer(), kind="chat", loss_on="assistant")
    longest = 0
    for record in _records(root, "sft/eval.jsonl"):
        ids, mask = encoder.encode(record)
        expression = record["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"]
        answer = record["messages"][3]["content"]
        assert trained_runs(ids, mask, ByteTokenizer()) == [
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'
            "<|im_end|>", answer + "<|im_end|>"]
        longest = max(longest, len(ids))
    assert longest <= 720  # configs/tiny-agent-sft.yaml's data.seq_len holds a whole transcript
