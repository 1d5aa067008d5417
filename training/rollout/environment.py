"""What the policy acts in: an environment is reset with a task and answers each turn.

    episode = environment.reset(task, where=...)      # episode.observation: the prompt's tokens
    transition = episode.step(turn, last=False)       # the policy's completion of the observation
    transition.reward, transition.done, transition.messages

One ``Environment`` serves many episodes at once (a rollout batch holds ``group_size`` of each
prompt), so what belongs to one trajectory (its conversation so far, a tool's sandbox) lives in
its ``Episode``, never in the environment. A single-turn environment ends every episode at its
first turn; a multi-turn one (tool calls, training/rollout/tool_environment.py) answers a turn
with the tool messages to append (``{"role": "tool", "content": ...}``, rendered by the chat
template into the observation's ids by the episode runner, training/rollout/episodes.py) and
``done=False``, and the runner feeds the trajectory back to the policy. ``last=True`` says the
runner will not sample another turn (a limit is reached): the episode must end (``done=True``)
and give its reward.

``RewardEnvironment`` is today's environment: the task is a prompt record with a checkable
answer, the one turn is scored with the configured reward functions (training/rollout/rewards.py,
``objective.grpo.rewards``): their weighted sum is the reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from core.exceptions import DataError, DeterminismError
from data.batch import Batch, DocSpan, prompt_and_answer
from training.rollout.generator import Completion
from training.rollout.rewards import RewardFunction, score


@dataclass(frozen=True)
class Task:
    """One prompt record of a batch."""

    index: int
    """The prompt's global row in its batch (its samples' ``SampleKey.prompt_index`` in training)."""
    prompt_ids: list[int]
    prompt_text: str
    answer: str
    """The expected answer's text (the record's target tokens, decoded)."""
    source: DocSpan
    """The record the prompt comes from (named by errors about it)."""
    media: Optional[dict[str, list[torch.Tensor]]] = None
    """What the prompt's tokens show (its row of ``Batch.media``: per field its items, the images of an
    ``image_prompt`` record), handed to the sampler with them; None for a text prompt."""


def batch_tasks(batch: Batch, tokenizer) -> list[Task]:
    """The tasks of a batch of prompt records (data record kind ``prompt``), one per row; a row
    whose prompt renders to no token is a DataError naming its file and record."""
    tasks = []
    for r, index in enumerate(batch.sequence_index):
        span = batch.provenance[r][0]
        prompt, answer = prompt_and_answer(batch, r)
        if not prompt:
            raise DataError("prompt record renders to no prompt token", file=span.shard, record=span.record + 1,
                            step=batch.step)
        media = {name: list(rows[r]) for name, rows in batch.media.items()}
        tasks.append(Task(index, prompt, tokenizer.decode(prompt), tokenizer.decode(answer), span,
                          media if any(media.values()) else None))
    return tasks


@dataclass(frozen=True)
class Transition:
    """The environment's answer to one turn."""

    reward: float
    done: bool
    observation: tuple[int, ...] = ()
    """Tokens appended before the policy's next turn (none once done); when empty and ``messages``
    are given, the runner renders the messages with the chat template."""
    reward_errors: int = 0
    """Reward functions that failed and were scored 0 (``on_reward_error=zero``)."""
    messages: tuple[dict, ...] = ()
    """The tool messages answering the turn (``{"role": "tool", "content": str}``), in call order."""
    calls: tuple[str, ...] = ()
    """The tools the turn called, in order (``""`` for a malformed call): recorded with the episode."""
    malformed: int = 0
    """Calls of the turn that did not parse (training/rollout/tool_calls.py), answered with an error."""


class Episode(Protocol):
    """One trajectory's state in an environment."""

    observation: list[int]
    """The tokens the policy continues first (the rendered prompt)."""

    def step(self, turn: Completion, *, last: bool = False) -> Transition: ...


class Environment(Protocol):
    tools: list[dict]
    """The JSON-schema specs of its tools, handed to the chat template with the observations (may be empty)."""

    def reset(self, task: Task, *, where: str) -> Episode:
        """A new episode of ``task``; ``where`` names it in errors (step, prompt row, sample, record)."""
        ...


@dataclass(frozen=True)
class RewardEpisode:
    """A single-turn episode: the prompt, then one completion scored by the reward functions."""

    task: Task
    where: str
    rewards: tuple[RewardFunction, ...]
    on_error: str

    @property
    def observation(self) -> list[int]:
        return self.task.prompt_ids

    def step(self, turn: Completion, *, last: bool = False) -> Transition:
        value, failed = score(list(self.rewards), turn.text, self.task.answer, self.task.prompt_text,
                              on_error=self.on_error, where=self.where)
        return Transition(reward=value, done=True, reward_errors=failed)


class RewardEnvironment:
    """Single-turn prompts with checkable answers, scored by ``rewards`` (weighted sum); a reward
    function that fails stops the run (``on_error="error"``) or scores 0 and is counted (``"zero"``)."""

    tools: list[dict] = []

    def __init__(self, rewards: list[RewardFunction], *, on_error: str) -> None:
        self.rewards, self.on_error = tuple(rewards), on_error

    def reset(self, task: Task, *, where: str) -> RewardEpisode:
        return RewardEpisode(task, where, self.rewards, self.on_error)


class EnvironmentFailure(DataError):
    """An environment raised, answered with something other than a ``Transition``, or took longer
    than objective.<kind>.environment.tool_timeout_s (``on_env_error=error``): exit 3, naming the
    environment, step, prompt row, sample and turn."""

    skippable = False


class NondeterministicToolError(DeterminismError):
    """A resumed step sampled the same turn as the recorded one, and the environment answered it
    with other observation ids: the tool is not a function of its call (exit 5)."""
