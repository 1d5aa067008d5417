"""Tool environments: the policy may call tools for several turns, then answers.

A ``ToolEnvironment`` holds named tools (``fn(**arguments) -> str``) and the reward functions
that score the final answer (training/rollout/rewards.py). Each turn of an episode:

- the turn's calls are parsed (training/rollout/tool_calls.py). A turn that calls nothing, one
  cut off without a stop (``turn.truncated``) or the last turn the runner allows (``last=True``)
  is the answer: its text is scored by the rewards' weighted sum and the episode ends;
- otherwise each call is answered, in the order written, by one tool message: the tool's
  result, or ``error: <why>`` for a malformed call, a call beyond ``max_calls_per_turn`` or
  arguments the tool does not take. The episode continues with reward 0.

``resolve_environment`` builds the configured environment: a built-in by name (``calculator``:
data/calculator.py's tool) or a user class ``package.module:Class``, constructed without
arguments, whose objects have ``tools`` (a list of JSON-schema specs, possibly empty) and
``reset(task, *, where) -> episode`` with ``episode.step(turn, *, last) -> Transition``
(training/rollout/environment.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from core.exceptions import ConfigError, LockstepError
from data import calculator
from training.rollout.environment import Task, Transition
from training.rollout.generator import Completion
from training.rollout.rewards import RewardFunction, refuse_code_in_run_dir, score
from training.rollout.tool_calls import MalformedCall, parse_tool_calls

BUILTIN_ENVIRONMENTS = ("calculator",)


@dataclass(frozen=True)
class ToolEpisode:
    task: Task
    where: str
    environment: "ToolEnvironment"

    @property
    def observation(self) -> list[int]:
        return self.task.prompt_ids

    def step(self, turn: Completion, *, last: bool = False) -> Transition:
        env = self.environment
        calls = parse_tool_calls(turn.text, env.functions)
        if not calls or last or turn.truncated:
            value, failed = score(list(env.rewards), turn.text, self.task.answer, self.task.prompt_text,
                                  on_error=env.on_reward_error, where=self.where)
            return Transition(reward=value, done=True, reward_errors=failed,
                              calls=tuple(_name(call) for call in calls),
                              malformed=sum(isinstance(call, MalformedCall) for call in calls))
        messages = []
        for i, call in enumerate(calls):
            if i >= env.max_calls_per_turn:
                content = f"error: more than {env.max_calls_per_turn} tool calls in one turn"
            elif isinstance(call, MalformedCall):
                content = f"error: {call.reason}"
            else:
                content = _answer(env.functions[call.name], call.arguments)
            messages.append({"role": "tool", "content": content})
        return Transition(reward=0.0, done=False, messages=tuple(messages),
                          calls=tuple(_name(call) for call in calls),
                          malformed=sum(isinstance(call, MalformedCall) for call in calls))


class ToolEnvironment:
    """Named tools and the rewards of the final answer (module docstring)."""

    def __init__(self, functions: dict[str, Callable[..., str]], tools: list[dict], rewards: list[RewardFunction], *,
                 on_reward_error: str, max_calls_per_turn: int) -> None:
        self.functions, self.tools, self.rewards = dict(functions), list(tools), tuple(rewards)
        self.on_reward_error, self.max_calls_per_turn = on_reward_error, max_calls_per_turn

    def reset(self, task: Task, *, where: str) -> ToolEpisode:
        return ToolEpisode(task, where, self)


def resolve_environment(name: str, *, rewards: list[RewardFunction], on_reward_error: str, max_calls_per_turn: int,
                        key: str):
    """The environment ``name`` names: ``calculator``, or an instance of ``package.module:Class``
    (imported now; never from a run directory). An unknown name, a path that does not import, a
    class that is not there or whose constructor raises is a ConfigError naming ``key``."""
    if name == "calculator":
        return ToolEnvironment({calculator.NAME: calculator.calculate}, [calculator.SPEC], rewards,
                               on_reward_error=on_reward_error, max_calls_per_turn=max_calls_per_turn)
    module_name, sep, attr = name.partition(":")
    if not sep or not all(part.isidentifier() for part in module_name.split(".")) or not attr.isidentifier():
        raise ConfigError(f"unknown environment {name!r}", key=key,
                          hint=f"use one of {', '.join(BUILTIN_ENVIRONMENTS)} or a class as 'package.module:Class'")
    refuse_code_in_run_dir(module_name, what=f"environment {name!r}", key=key)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"environment {name!r}: module {module_name!r} does not import ({exc})", key=key,
                          hint="install its package or put its directory on PYTHONPATH (never a run directory)") from None
    cls = getattr(module, attr, None)
    if not callable(cls):
        raise ConfigError(f"environment {name!r}: module {module_name!r} has no class {attr!r}", key=key,
                          hint="name a class whose objects have tools and reset(task, *, where)")
    try:
        environment = cls()
    except LockstepError:
        raise  # already typed and named (a config error of its own, a data error)
    except Exception as exc:  # user code may raise anything: named with the key, before any run dir
        raise ConfigError(f"environment {name!r}: constructing {attr}() raised {type(exc).__name__}: {exc}", key=key,
                          hint="fix the environment class (it is built with no arguments, once per rank)") from exc
    if not callable(getattr(environment, "reset", None)):
        raise ConfigError(f"environment {name!r}: {attr} objects have no reset(task, *, where) method", key=key)
    return environment


def _answer(function: Callable[..., str], arguments: dict) -> str:
    try:
        return str(function(**arguments))
    except TypeError as exc:  # arguments the tool does not take: the model's mistake
        return f"error: bad arguments ({exc})"


def _name(call) -> str:
    return "" if isinstance(call, MalformedCall) else call.name
