"""Small checkable tasks, generated from a seed (no download), and the post-training datasets built from them.

A task is a prompt with one short correct answer that a rule can check: arithmetic on small
integers (``What is 37 + 45?`` -> ``82``) or a transformation of a 3-6 letter word
(reverse, upper-case, sort its letters, count a letter, count its letters). Answers are a
few bytes, so a tiny byte-level model learns them in a few hundred CPU steps.

Every draw is ``data.rng.derive(seed, purpose, index, k)`` (sha256-based, not Python's
``random``), so the same seed gives the same bytes on any platform and Python version.
Task ``i`` depends only on ``(seed, i)``; prompts are de-duplicated as they are drawn, and
each prompt lands in at most one split (train or eval), so the splits are disjoint.

``write_task_datasets`` writes, for each split, JSONL files of the record formats of the
design's post-training table:

- ``sft/``: chat records ``{"messages": [...]}``: one user/assistant exchange, some with a
  system prompt first, some two exchanges long;
- ``completion/``: ``{"prompt", "completion"}`` strings;
- ``pref/``: ``{"prompt", "chosen", "rejected"}``, the rejected answer a corrupted one that
  fails the task's checker (never equal to the chosen one);
- ``rl/``: ``{"prompt", "answer", "task", "reward"}``, ``reward`` naming the checker in
  ``training/rollout/rewards.py`` (``exact_answer`` or ``numeric_tolerance`` with tol 0).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from core.exceptions import DataError
from data.rng import derive

EXACT, NUMERIC = "exact_answer", "numeric_tolerance"
SPLITS = ("train", "eval")
SYSTEM_PROMPTS = (
    "You are a precise assistant. Reply with the answer only.",
    "Answer briefly.",
)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Task:
    family: str
    """Which generator made it (``add``, ``reverse``, ...)."""
    prompt: str
    answer: str
    reward: str
    """Name of the checker that accepts ``answer``: ``exact_answer`` or ``numeric_tolerance``."""


class Draws:
    """Integers fixed by ``(seed, purpose, index)`` and the draw's position ``k``."""

    def __init__(self, seed: int, purpose: str, index: int) -> None:
        self._coords = (seed, purpose, index)
        self._k = 0

    def below(self, n: int) -> int:
        """An integer in [0, n) (modulo bias below 2^-50 for the small n used here)."""
        seed, purpose, index = self._coords
        self._k += 1
        return derive(seed, purpose, index, self._k) % n

    def between(self, low: int, high: int) -> int:
        """An integer in [low, high]."""
        return low + self.below(high - low + 1)

    def choice(self, items):
        return items[self.below(len(items))]

    def word(self, low: int = 3, high: int = 6) -> str:
        return "".join(self.choice(LETTERS) for _ in range(self.between(low, high)))


# --- task families: (draws) -> (prompt, answer) -------------------------------------------


def _add(d: Draws) -> tuple[str, str]:
    a, b = d.between(10, 99), d.between(10, 99)
    return f"What is {a} + {b}?", str(a + b)


def _sub(d: Draws) -> tuple[str, str]:
    a, b = d.between(10, 99), d.between(10, 99)
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", str(a - b)


def _mul(d: Draws) -> tuple[str, str]:
    a, b = d.between(2, 19), d.between(2, 9)
    return f"What is {a} * {b}?", str(a * b)


def _reverse(d: Draws) -> tuple[str, str]:
    word = d.word()
    return f"Reverse the word '{word}'.", word[::-1]


def _upper(d: Draws) -> tuple[str, str]:
    word = d.word()
    return f"Write '{word}' in upper case.", word.upper()


def _sort(d: Draws) -> tuple[str, str]:
    word = d.word()
    return f"Sort the letters of '{word}' alphabetically.", "".join(sorted(word))


def _count(d: Draws) -> tuple[str, str]:
    word = d.word(4, 6)
    letter = d.choice(word) if d.below(4) else d.choice(LETTERS)  # mostly a letter it has
    return f"How many times does '{letter}' appear in '{word}'?", str(word.count(letter))


def _length(d: Draws) -> tuple[str, str]:
    word = d.word()
    return f"How many letters are in '{word}'?", str(len(word))


FAMILIES: dict[str, tuple[Callable[[Draws], tuple[str, str]], str]] = {
    "add": (_add, NUMERIC),
    "sub": (_sub, NUMERIC),
    "mul": (_mul, NUMERIC),
    "reverse": (_reverse, EXACT),
    "upper": (_upper, EXACT),
    "sort": (_sort, EXACT),
    "count": (_count, NUMERIC),
    "length": (_length, NUMERIC),
}


def make_task(seed: int, index: int) -> Task:
    """Task ``index`` of the stream for ``seed``."""
    draws = Draws(seed, "task", index)
    family = draws.choice(list(FAMILIES))
    generate, reward = FAMILIES[family]
    prompt, answer = generate(draws)
    return Task(family, prompt, answer, reward)


def split_tasks(seed: int, train_n: int, eval_n: int,
                make: Callable[[int, int], Task] = make_task) -> dict[str, list[Task]]:
    """``train_n`` and ``eval_n`` tasks with distinct prompts; no prompt is in both splits.

    Walks the task stream ``make(seed, index)``; a new prompt goes to eval with probability
    ``eval_n / (train_n + eval_n)`` (a draw keyed by the prompt) until that split is full.
    """
    if train_n < 0 or eval_n < 0 or train_n + eval_n == 0:
        raise DataError(f"task dataset sizes must be >= 0 and not both 0, got train_n={train_n}, eval_n={eval_n}")
    wanted = {"train": train_n, "eval": eval_n}
    tasks: dict[str, list[Task]] = {"train": [], "eval": []}
    eval_share = eval_n / (train_n + eval_n)
    seen: set[str] = set()
    limit = 50 * (train_n + eval_n) + 1000
    index = 0
    while any(len(tasks[s]) < wanted[s] for s in SPLITS):
        if index >= limit:
            raise DataError(
                f"only {len(seen)} distinct tasks after {limit} draws",
                hint="ask for fewer tasks (the families hold a few hundred thousand distinct prompts)",
                seed=seed,
            )
        task = make(seed, index)
        index += 1
        if task.prompt in seen:
            continue
        seen.add(task.prompt)
        to_eval = (derive(seed, f"task-split:{task.prompt}") % 1_000_000) < eval_share * 1_000_000
        split = "eval" if to_eval else "train"
        if len(tasks[split]) < wanted[split]:
            tasks[split].append(task)
    return tasks


# --- wrong answers --------------------------------------------------------------------------


def corrupt(task: Task, draws: Draws) -> str:
    """A plausible answer to ``task`` that its checker rejects (never equal to the answer)."""
    answer = task.answer
    if task.reward == NUMERIC:
        value = int(answer)
        offset = draws.choice([-3, -2, -1, 1, 2, 3])
        if value + offset < 0:
            offset = -offset
        return str(value + offset)
    candidates = {
        "reverse": [answer[::-1]],  # the word not reversed
        "upper": [answer.lower(), answer.lower().capitalize()],
        "sort": [answer[::-1]],  # sorted the wrong way round
    }[task.family]
    wrong = draws.choice(candidates)
    if wrong == answer:  # a palindrome, a word already in order, ...
        wrong = _change_one_letter(answer, draws)
    return wrong


def _change_one_letter(text: str, draws: Draws) -> str:
    position = draws.below(len(text))
    alphabet = LETTERS.upper() if text[position].isupper() else LETTERS
    others = [c for c in alphabet if c != text[position]]
    return text[:position] + draws.choice(others) + text[position + 1:]


# --- records ----------------------------------------------------------------------------------


def sft_record(tasks: list[Task], i: int, seed: int, split: str) -> dict:
    """Chat record ``i``: a quarter start with a system prompt, a quarter hold two exchanges."""
    draws = Draws(seed, f"sft-shape:{split}", i)
    shape = draws.below(4)
    messages = []
    if shape == 0:
        messages.append({"role": "system", "content": draws.choice(SYSTEM_PROMPTS)})
    turns = [tasks[i]]
    if shape == 1 and len(tasks) > 1:
        turns.append(tasks[(i + 1 + draws.below(len(tasks) - 1)) % len(tasks)])  # another task of the split
    for task in turns:
        messages += [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": task.answer}]
    return {"messages": messages}


def completion_record(task: Task) -> dict:
    return {"prompt": task.prompt, "completion": task.answer}


def preference_record(task: Task, i: int, seed: int, split: str) -> dict:
    rejected = corrupt(task, Draws(seed, f"pref-corrupt:{split}", i))
    return {"prompt": task.prompt, "chosen": task.answer, "rejected": rejected}


def rl_record(task: Task) -> dict:
    return {"prompt": task.prompt, "answer": task.answer, "task": task.family, "reward": task.reward}


def write_task_datasets(root: Path, *, seed: int, train_n: int, eval_n: int, shards: int = 1) -> dict[str, int]:
    """Write ``{sft,completion,pref,rl}/{train,eval}.jsonl`` under ``root``; returns records per file.

    With ``shards > 1`` each split is a directory of ``shards`` files instead,
    ``{name}/{split}/part-NNN.jsonl``, record ``i`` in part ``i % shards``: a plain JSONL file is
    one unit of the pipeline, and a source with fewer units than ``data.num_streams`` repeats
    them, so every stream would read the same records (docs/data.md, "Streams").
    The bytes depend only on the arguments. Each file is written to a temporary name and
    renamed into place, so a reader never sees a half-written file.
    """
    if shards < 1:
        raise DataError(f"shards must be >= 1, got {shards}")
    root = Path(root)
    counts: dict[str, int] = {}
    for split, tasks in split_tasks(seed, train_n, eval_n).items():
        datasets = {
            "sft": [sft_record(tasks, i, seed, split) for i in range(len(tasks))],
            "completion": [completion_record(task) for task in tasks],
            "pref": [preference_record(task, i, seed, split) for i, task in enumerate(tasks)],
            "rl": [rl_record(task) for task in tasks],
        }
        for name, records in datasets.items():
            if shards == 1:
                write_jsonl(root / name / f"{split}.jsonl", records)
                counts[f"{name}/{split}.jsonl"] = len(records)
                continue
            for k in range(shards):
                part = f"{name}/{split}/part-{k:03d}.jsonl"
                write_jsonl(root / part, records[k::shards])
                counts[part] = len(records[k::shards])
    return counts


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=True, separators=(", ", ": ")) + "\n")
    os.replace(tmp, path)
