"""Group rollouts: ``group_size`` completions of each prompt, run through the environment.

``GroupRollout.collect(model, tasks, step)`` samples the completions with the model's current
weights (``Generator.generate_from``; sample ``s`` of prompt row ``i`` keyed
``(train.seed, purpose, step, i, s)``, so a rollout depends on neither the world size nor the
batch layout), plays each as a single-turn episode of the environment, adds DAPO's overlong
penalty (``overlong_buffer`` > 0) and, with ``resample_rounds`` > 0, re-samples the groups whose
shaped rewards are all equal (DAPO's dynamic sampling): round ``k`` draws fresh completions for
them with purpose ``<purpose>.resample<k>`` and replaces the group in place, until no group on
any rank is uniform or the rounds are spent. Every rank runs every round (generation may be a
collective), a rank without uniform groups on no prompts. The result is an ``Experience``
without advantages (training/rollout/experience.py).

With an ``EpisodeRunner`` (an environment of several turns, training/rollout/episodes.py) each
completion is a whole episode: its tokens are the sampled and observation ids after the prompt,
its mask says which were sampled, its reward is the episode's, and its overlong penalty counts
the sampled tokens against the episode's budget (``max_episode_tokens``).

**Progress.** ``collect`` counts what is done on a ``Progress`` it is handed
(experiments/console.py; ``rollout_progress`` builds the step's, shown on rank 0): the samples of
each sampler call once it returns, every re-sampling round adding its samples to the total, or the
episodes as they end (at the sampler's refill points, where the host reads the rows anyway). It
is host-side counting only: no device sync, no value of the rollout depends on it.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Optional

import numpy as np
from torch import nn

from core.exceptions import ConfigError
from core.logging import get_logger
from experiments.console import Progress
from models.generation.sampler import SamplingParams
from training.rollout.advantages import overlong_penalty
from training.rollout.environment import Environment, Task
from training.rollout.episodes import EpisodeRunner
from training.rollout.experience import Experience, Trajectory
from training.rollout.generator import Decoder, Generator


class GroupRollout:
    """Group rollouts with one generator, decoder, environment and sampling setting (module docstring).
    ``any_rank(flag)`` is True where any rank passed True (every rank calls it at the same point)."""

    def __init__(self, *, generator: Generator, decoder: Decoder, environment: Environment, params: SamplingParams,
                 group_size: int, overlong_buffer: int, resample_rounds: int, any_rank: Callable[[bool], bool],
                 purpose: str, episodes: Optional[EpisodeRunner] = None) -> None:
        self.generator, self.decoder, self.environment, self.params = generator, decoder, environment, params
        self.group_size, self.overlong_buffer, self.resample_rounds = group_size, overlong_buffer, resample_rounds
        self.any_rank, self.purpose, self.episodes = any_rank, purpose, episodes

    def collect(self, model: nn.Module, tasks: list[Task], step: int, *,
                recorded: Optional[dict[tuple[int, int], dict]] = None, call_environment: bool = True,
                progress: Optional[Progress] = None) -> Experience:
        """``recorded``, ``call_environment``: the step's recorded episodes and whether to call the
        environment (EpisodeRunner.play; only with an episode runner); ``progress``: where the samples
        or episodes done are counted (module docstring)."""
        timings = {"rollout_s": 0.0, "rollout_tokens": 0}
        progress = progress if progress is not None else Progress("rollouts", 0, unit="samples", enabled=False)
        if self.episodes is not None:
            groups = self._episode_groups(model, tasks, step, recorded, call_environment, timings, progress)
            return Experience(trajectories=tuple(t for group in groups for t in group), group_size=self.group_size,
                              timings=timings)
        groups = self._groups(model, tasks, step, purpose=self.purpose, resample_round=0, timings=timings)
        progress.advance(len(tasks) * self.group_size)
        rounds, resampled = 0, 0
        for k in range(1, self.resample_rounds + 1):
            uniform = [p for p, group in enumerate(groups) if np.ptp(_shaped(group)) == 0]
            if not self.any_rank(bool(uniform)):
                break
            progress.extend(len(uniform) * self.group_size)
            fresh = self._groups(model, [tasks[p] for p in uniform], step, purpose=f"{self.purpose}.resample{k}",
                                 resample_round=k, timings=timings)
            progress.advance(len(uniform) * self.group_size)
            for p, group in zip(uniform, fresh):
                groups[p] = group
            rounds, resampled = k, resampled + len(uniform)
        return Experience(trajectories=tuple(t for group in groups for t in group), group_size=self.group_size,
                          resample_rounds=rounds, resampled_groups=resampled, timings=timings)

    def _groups(self, model: nn.Module, tasks: list[Task], step: int, *, purpose: str, resample_round: int,
                timings: dict) -> list[list[Trajectory]]:
        """One group of trajectories per task; adds the sampling time and generated tokens to ``timings``."""
        G = self.group_size
        started = time.perf_counter()
        flat = self.generator.generate_from(model, [t.prompt_ids for t in tasks], [t.index for t in tasks],
                                            self.params, purpose=purpose, step=step, samples=G,
                                            media=[t.media for t in tasks])
        timings["rollout_s"] += time.perf_counter() - started
        timings["rollout_tokens"] += sum(len(sample.tokens) for sample in flat)
        where_round = f", resample round {resample_round}" if resample_round else ""
        groups = []
        for p, task in enumerate(tasks):
            group = []
            for s, sample in enumerate(flat[p * G:(p + 1) * G]):
                where = (f"step {step}, prompt row {task.index}, sample {s}{where_round} "
                         f"(file {task.source.shard}, record {task.source.record})")
                episode = self.environment.reset(task, where=where)
                completion = self.decoder.completion(sample)
                outcome = episode.step(completion)
                if not outcome.done:
                    raise ConfigError(f"group rollouts play single-turn episodes; {type(episode).__name__} "
                                      f"continued after the first turn ({where})",
                                      hint="use a single-turn environment (RewardEnvironment) with GroupRollout")
                group.append(Trajectory(row=task.index * G + s, prompt_ids=task.prompt_ids,
                                        tokens=list(completion.sample.tokens),
                                        logprobs=completion.sample.logprobs[:len(completion.sample.tokens)],
                                        truncated=completion.truncated, reward=outcome.reward,
                                        reward_errors=outcome.reward_errors, routing=completion.sample.routing))
            groups.append(self._shaped_group(group))
        return groups

    def _episode_groups(self, model: nn.Module, tasks: list[Task], step: int, recorded, call_environment: bool,
                        timings: dict, progress: Progress) -> list[list[Trajectory]]:
        G = self.group_size

        def where(task: Task, s: int) -> str:
            return (f"step {step}, prompt row {task.index}, sample {s} "
                    f"(file {task.source.shard}, record {task.source.record})")

        results = self.episodes.play(model, tasks, [t.index for t in tasks], self.params, purpose=self.purpose,
                                     step=step, samples=G, where=where, recorded=recorded,
                                     call_environment=call_environment, timings=timings,
                                     on_ended=progress.advance)
        groups = []
        for p, task in enumerate(tasks):
            group = [Trajectory(row=task.index * G + s, prompt_ids=task.prompt_ids, tokens=e.tokens,
                                logprobs=e.logprobs, truncated=e.truncated, reward=e.reward,
                                reward_errors=e.reward_errors, mask=tuple(e.mask), episode=e)
                     for s, e in enumerate(results[p * G:(p + 1) * G])]
            groups.append(self._shaped_group(group))
        return groups

    def _shaped_group(self, group: list[Trajectory]) -> list[Trajectory]:
        """The group with DAPO's overlong penalty (0 when ``overlong_buffer`` is 0); an episode's
        sampled tokens count against its budget (``max_episode_tokens``)."""
        budget = self.episodes.limits.max_episode_tokens if self.episodes is not None else self.params.max_new_tokens
        penalties = overlong_penalty([t.sampled for t in group], max_new_tokens=budget, buffer=self.overlong_buffer)
        return [replace(t, penalty=penalty) for t, penalty in zip(group, penalties.tolist())]


def rollout_progress(step: int, prompts: int, group_size: int, *, episodes: bool, enabled: bool) -> Progress:
    """The Progress of step ``step``'s rollouts of ``prompts`` prompts (this rank's) on the console:
    ``step 3 rollouts: 96/512 samples, 41.0 s`` (``episodes`` with an environment); ``enabled`` on rank 0."""
    return Progress(f"step {step} rollouts", prompts * group_size, unit="episodes" if episodes else "samples",
                    enabled=enabled, print_fn=get_logger().info)


def _shaped(group: list[Trajectory]) -> np.ndarray:
    return np.array([t.reward for t in group], dtype=np.float64) + np.array([t.penalty for t in group],
                                                                             dtype=np.float64)
