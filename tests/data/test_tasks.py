"""The task generator: same seed same bytes, disjoint splits, right answers, wrong rejected answers."""

from __future__ import annotations

import json
import re

import pytest

from core.exceptions import DataError
from data.tasks import write_task_datasets
from training.rollout.rewards import REWARDS

FILES = [f"{name}/{split}.jsonl" for name in ("sft", "completion", "pref", "rl") for split in ("train", "eval")]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    counts = write_task_datasets(root, seed=7, train_n=1500, eval_n=300)
    return root, counts


def _records(root, name):
    return [json.loads(line) for line in (root / name).read_text().splitlines()]


def _solve(prompt: str) -> str:
    """The answer, worked out from the prompt's wording independently of the generator."""
    if m := re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", prompt):
        a, op, b = int(m[1]), m[2], int(m[3])
        return str({"+": a + b, "-": a - b, "*": a * b}[op])
    if m := re.fullmatch(r"Reverse the word '([a-z]+)'\.", prompt):
        return "".join(reversed(m[1]))
    if m := re.fullmatch(r"Write '([a-z]+)' in upper case\.", prompt):
        return m[1].upper()
    if m := re.fullmatch(r"Sort the letters of '([a-z]+)' alphabetically\.", prompt):
        return "".join(sorted(m[1]))
    if m := re.fullmatch(r"How many times does '([a-z])' appear in '([a-z]+)'\?", prompt):
        return str(sum(c == m[1] for c in m[2]))
    if m := re.fullmatch(r"How many letters are in '([a-z]+)'\?", prompt):
        return str(len(m[1]))
    raise AssertionError(f"unexpected prompt {prompt!r}")


def test_same_seed_same_bytes_other_seed_other_bytes(written, tmp_path):
    root, counts = written
    assert sorted(counts) == sorted(FILES)
    again = write_task_datasets(tmp_path / "again", seed=7, train_n=1500, eval_n=300)
    assert again == counts
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (root / name).read_bytes(), name
    write_task_datasets(tmp_path / "other", seed=8, train_n=1500, eval_n=300)
    assert (tmp_path / "other" / "rl/train.jsonl").read_bytes() != (root / "rl/train.jsonl").read_bytes()
    assert not list(tmp_path.rglob("*.tmp"))


def test_generator_is_pinned():
    # The draws come from sha256, not Python's random: these must not change with the platform.
    from data.tasks import make_task

    assert [(t.prompt, t.answer) for t in map(lambda i: make_task(0, i), range(3))] == [
        ("Write 'dut' in upper case.", "DUT"),
        ("How many letters are in 'wdw'?", "3"),
        ("How many times does 's' appear in 'sdusa'?", "2"),
    ]


def test_sizes_and_disjoint_distinct_prompts(written):
    root, counts = written
    for name in FILES:
        assert len(_records(root, name)) == counts[name] == (1500 if "train" in name else 300)
    train = [r["prompt"] for r in _records(root, "rl/train.jsonl")]
    evals = [r["prompt"] for r in _records(root, "rl/eval.jsonl")]
    # ~225 of 1,800 draws are multiplications, of which there are only 162: without
    # de-duplication some prompts would repeat.
    assert len(set(train)) == len(train) and len(set(evals)) == len(evals)
    assert not set(train) & set(evals)
    for split in ("train", "eval"):  # every format of a split holds the same tasks
        prompts = [r["prompt"] for r in _records(root, f"rl/{split}.jsonl")]
        assert [r["prompt"] for r in _records(root, f"pref/{split}.jsonl")] == prompts
        assert [r["prompt"] for r in _records(root, f"completion/{split}.jsonl")] == prompts
        chats = _records(root, f"sft/{split}.jsonl")
        first_user = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in chats]
        assert first_user == prompts


def test_every_answer_is_right_and_passes_its_checker(written):
    root, _ = written
    for split in ("train", "eval"):
        for record in _records(root, f"rl/{split}.jsonl"):
            assert record["answer"] == _solve(record["prompt"]), record
            assert REWARDS[record["reward"]](record["answer"], record["answer"]) == 1.0
            assert len(record["answer"]) <= 6  # short enough for a tiny byte-level model
        for record in _records(root, f"completion/{split}.jsonl"):
            assert record["completion"] == _solve(record["prompt"])


def test_rejected_answers_never_pass(written):
    root, _ = written
    for split in ("train", "eval"):
        rl = _records(root, f"rl/{split}.jsonl")
        for pref, task in zip(_records(root, f"pref/{split}.jsonl"), rl):
            assert pref["chosen"] == task["answer"]
            assert pref["rejected"] != pref["chosen"]
            assert REWARDS[task["reward"]](pref["rejected"], task["answer"]) == 0.0, pref
            assert REWARDS[task["reward"]](pref["chosen"], task["answer"]) == 1.0


def test_chat_records_have_system_prompts_and_several_turns(written):
    root, _ = written
    records = _records(root, "sft/train.jsonl")
    shapes = {"system": 0, "multi": 0}
    for record in records:
        messages = record["messages"]
        if messages[0]["role"] == "system":
            shapes["system"] += 1
            messages = messages[1:]
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
        shapes["multi"] += len(messages) > 2
        for user, assistant in zip(messages[::2], messages[1::2]):
            assert assistant["content"] == _solve(user["content"])
    assert 0.15 < shapes["system"] / len(records) < 0.35 and 0.15 < shapes["multi"] / len(records) < 0.35


def test_one_empty_split_and_bad_sizes(tmp_path):
    counts = write_task_datasets(tmp_path, seed=1, train_n=20, eval_n=0)
    assert counts["rl/eval.jsonl"] == 0 and (tmp_path / "rl/eval.jsonl").read_bytes() == b""
    with pytest.raises(DataError, match="sizes"):
        write_task_datasets(tmp_path, seed=1, train_n=-1, eval_n=5)
    with pytest.raises(DataError, match="sizes"):
        write_task_datasets(tmp_path, seed=1, train_n=0, eval_n=0)
