"""Environments that fail the ways a probe of the agentic rollouts found (tests/training/
test_probe_training_defects.py): a constructor or ``reset()`` that raises, a tool output over the
chat template's size budget, and one holding a lone surrogate (not encodable as UTF-8)."""

from __future__ import annotations

from training.rollout.environment import Transition

HUGE = 16 * 2 ** 20 + 1
"""Characters of ``HugeOutput``'s tool message: one past the chat template's size budget."""


class ConstructorRaises:
    tools: list = []

    def __init__(self) -> None:
        raise RuntimeError("no connection to the tool server")


class ResetRaises:
    tools: list = []

    def reset(self, task, *, where):
        raise RuntimeError(f"could not start the sandbox for {where}")


class _Answers:
    tools: list = []
    content = ""

    def reset(self, task, *, where):
        return self

    def step(self, turn, *, last=False):
        if last:
            return Transition(reward=1.0, done=True)
        return Transition(reward=0.5, done=False, calls=("tool",), messages=({"role": "tool", "content": self.content},))


class HugeOutput(_Answers):
    content = "x" * HUGE


class SurrogateOutput(_Answers):
    content = "half an emoji: \ud83d"
