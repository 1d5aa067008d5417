"""The embedded agent tasks: arithmetic a tiny model cannot do in its head, and can with the calculator.

A task is a question on 3-digit integers whose answer is the calculator's result
(data/calculator.py): a product ``What is 725 * 95?`` (a 3-digit factor times a 2-digit one)
or a sum of three ``What is 512 + 307 + 988?``. A tiny byte-level model cannot compute
such answers, but it can learn to copy the expression into a ``calculator`` call and the
tool's result into its answer.

Draws are keyed like data/tasks.py (``data.rng.derive(seed, purpose, index, k)``), and the
train and eval splits are disjoint the same way (each prompt lands in one split).
``write_agent_datasets`` writes, for each split:

- ``sft/``: tool-use transcripts ``{"tools": [SPEC], "messages": [user, assistant calling
  calculator(expression), the tool's result, assistant answering with that result]}``;
- ``rl/``: prompts for agent rollouts ``{"prompt", "answer", "task", "reward": "exact_answer",
  "tools": [SPEC]}``: the prompt is rendered with the tools, as the transcripts are, so that the
  policy sees the same tool block in rollouts as in SFT.

Each split is a directory of ``shards`` files (``sft/train/part-000.jsonl``, ...), as for the
other embedded tasks: a source with fewer files than ``data.num_streams`` repeats them.
"""

from __future__ import annotations

from pathlib import Path

from data import calculator
from data.tasks import EXACT, Draws, Task, write_jsonl, split_tasks


def _product(d: Draws) -> tuple[str, str]:
    a, b = d.between(100, 999), d.between(10, 99)
    return f"What is {a} * {b}?", f"{a} * {b}"


def _sum3(d: Draws) -> tuple[str, str]:
    a, b, c = d.between(100, 999), d.between(100, 999), d.between(100, 999)
    return f"What is {a} + {b} + {c}?", f"{a} + {b} + {c}"


FAMILIES = {"product": _product, "sum3": _sum3}


def make_agent_task(seed: int, index: int) -> Task:
    """Agent task ``index`` of the stream for ``seed``; its answer is what the calculator returns."""
    draws = Draws(seed, "agent-task", index)
    family = draws.choice(list(FAMILIES))
    prompt, expression = FAMILIES[family](draws)
    return Task(family, prompt, calculator.calculate(expression), EXACT)


def expression_of(task: Task) -> str:
    """The calculator expression the task's prompt asks for (``What is X?`` -> ``X``)."""
    return task.prompt.removeprefix("What is ").removesuffix("?")


def sft_record(task: Task) -> dict:
    call = {"type": "function", "function": {"name": calculator.NAME,
                                             "arguments": {"expression": expression_of(task)}}}
    return {"tools": [calculator.SPEC], "messages": [
        {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": calculator.calculate(expression_of(task))},
        {"role": "assistant", "content": task.answer},
    ]}


def rl_record(task: Task) -> dict:
    return {"prompt": task.prompt, "answer": task.answer, "task": task.family, "reward": task.reward,
            "tools": [calculator.SPEC]}


def write_agent_datasets(root: Path, *, seed: int, train_n: int, eval_n: int, shards: int = 1) -> dict[str, int]:
    """Write ``{sft,rl}/{train,eval}`` under ``root`` (``.jsonl`` files, or directories of
    ``shards`` part files, record ``i`` in part ``i % shards``); returns records per file."""
    root = Path(root)
    counts: dict[str, int] = {}
    for split, tasks in split_tasks(seed, train_n, eval_n, make=make_agent_task).items():
        datasets = {"sft": [sft_record(t) for t in tasks], "rl": [rl_record(t) for t in tasks]}
        for name, records in datasets.items():
            parts = {f"{name}/{split}.jsonl": records} if shards == 1 else {
                f"{name}/{split}/part-{k:03d}.jsonl": records[k::shards] for k in range(shards)}
            for part, chunk in parts.items():
                write_jsonl(root / part, chunk)
                counts[part] = len(chunk)
    return counts
