"""Held-out evaluation of a method that scores rollouts (GRPO, PPO): decode each held-out prompt,
score the completions with the configured rewards and with ``exact_answer`` (of the text after the
think block where a configured reward sets ``strip_thinking``: ``answer_strips_thinking``).

A prompt's index in the evaluation is ``(eval batch - 1) * global_batch_size + row`` (eval batches
count from 1, rows within the global batch): the same for every world size and at every
evaluation. Sample ``j`` of held-out prompt ``i`` is keyed ``(seed, purpose, 0, i, j)``: the same
streams at every evaluation (greedy decoding draws nothing from its key).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from data.batch import Batch
from models.generation.sampler import SamplingParams
from training.rollout.environment import Environment, Task
from training.rollout.episodes import EpisodeRunner
from training.rollout.generator import Decoder, Generator
from training.rollout.reward_settings import RewardSettings
from training.rollout.rewards import exact_answer_of


def answer_strips_thinking(rewards: tuple[RewardSettings, ...]) -> bool:
    """Whether held-out accuracy reads a completion's answer after its think block: where any configured
    reward compares the answer that way (``strip_thinking``), so a reasoning model's greedy accuracy
    is not 0 for its think block."""
    return any(reward.strip_thinking for reward in rewards)


def held_out_indices(batch: Batch, tasks: list[Task], global_batch_size: int) -> list[int]:
    """Each task's index in the evaluation (module docstring)."""
    return [(batch.step - 1) * global_batch_size + task.index for task in tasks]


def evaluation_scores(generator: Generator, model: nn.Module, decoder: Decoder, environment: Environment,
                      batch: Batch, tasks: list[Task], held_out: list[int], params: SamplingParams, *,
                      purpose: str, samples: int, episodes: EpisodeRunner | None = None,
                      strip_thinking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(P,) float32 each: per prompt, the mean configured reward and the mean exact-answer score of
    ``samples`` completions sampled with ``params`` (keys in the module docstring). With
    ``episodes`` (a method with an environment), each sample is an episode, its reward the
    environment's and its answer the last turn's text. ``strip_thinking``: the exact-answer score
    of the text after the completion's last ``</think>`` (``answer_strips_thinking``)."""
    rewards = np.zeros((len(tasks), samples), dtype=np.float64)
    exact = np.zeros((len(tasks), samples), dtype=np.float64)
    if episodes is not None:
        results = episodes.play(
            model, tasks, held_out, params, purpose=purpose, step=0, samples=samples,
            where=lambda task, s: f"evaluation batch {batch.step}, prompt row {task.index}, sample {s}")
        for i, (task, result) in enumerate(zip([t for t in tasks for _ in range(samples)], results)):
            rewards[i // samples, i % samples] = result.reward
            exact[i // samples, i % samples] = exact_answer_of(result.text, task.answer,
                                                                 strip_thinking=strip_thinking)
        return (torch.tensor(rewards.mean(axis=1), dtype=torch.float32),
                torch.tensor(exact.mean(axis=1), dtype=torch.float32))
    flat = generator.generate_from(model, [t.prompt_ids for t in tasks], held_out, params,
                                   purpose=purpose, step=0, samples=samples, media=[t.media for t in tasks])
    for p, task in enumerate(tasks):
        for s in range(samples):
            completion = decoder.completion(flat[p * samples + s])
            episode = environment.reset(
                task, where=f"evaluation batch {batch.step}, prompt row {task.index}, sample {s}")
            rewards[p, s] = episode.step(completion).reward
            exact[p, s] = exact_answer_of(completion.text, task.answer, strip_thinking=strip_thinking)
    return (torch.tensor(rewards.mean(axis=1), dtype=torch.float32),
            torch.tensor(exact.mean(axis=1), dtype=torch.float32))


def evaluation_sums(extras: dict[str, torch.Tensor], *, sampled: bool) -> tuple[torch.Tensor, int, dict]:
    """(loss sum, prompts, metric sums) of held-out rows whose extras ``prepare`` filled: the loss is
    minus the greedy reward; the sums ``reward_mean`` and ``accuracy`` (greedy) and, ``sampled``,
    ``sampled_reward_mean`` and ``sampled_accuracy`` (per-prompt means over the sampled completions)."""
    reward, exact = extras["eval_reward"], extras["eval_exact"]
    metrics = {"reward_mean": reward.sum(), "accuracy": exact.sum()}
    if sampled:
        metrics["sampled_reward_mean"] = extras["eval_sampled_reward"].sum()
        metrics["sampled_accuracy"] = extras["eval_sampled_exact"].sum()
    return -reward.sum(), int(reward.shape[0]), metrics
