"""The rollout room (training/rollout/): the generator hands the current weights to its sampler and
keys every sample; the reward environment scores single turns and keeps nothing between episodes;
an experience lays its trajectories out as training rows and its statistics do not depend on how
rows are spread over ranks; group rollouts refuse an episode that does not end at its first turn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import models
from core import seeding
from core.config import load
from core.exceptions import ConfigError
from experiments.console import Progress
from data.batch import IGNORE_INDEX, Batch, DocSpan
from data.chat_template import ChatTemplate
from data.tokenizers import build_tokenizer
from models.generation.prompts import sample_prompts
from models.generation.sampler import Sample, Sampler, SamplingParams
from training.rollout.environment import RewardEnvironment, Task, Transition
from training.rollout.experience import Experience, Trajectory, rollout_fields
from training.rollout.generator import Completion, Decoder, Generator
from training.rollout.group import GroupRollout
from training.rollout.rewards import resolve_reward
from tests import launch

PROMPTS = [[72, 105, 33], [50, 43, 50, 61], [7]]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=5)


@pytest.fixture(scope="module")
def config():
    return load(launch.ROOT / "tests" / "configs" / "e2e.yaml")


def _model(config, seed: int) -> torch.nn.Module:
    return models.build(config.model, generator=seeding.generator(seed, "model_init"))


def _tokens(flat) -> list[list[int]]:
    return [list(sample.tokens) for _, _, sample in flat]


def test_generator_samples_the_weights_it_was_last_handed(config):
    """A float64 generator over a float32 model copies the weights (no shared tensors): after the
    model changes, the next rollout samples the new weights, bitwise as a fresh generator would."""
    model = _model(config, 5)
    generator = Generator(rows=8, max_len=32, seed=3, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        generator.generate(PROMPTS, [0, 1, 2], PARAMS, purpose="t")
    model.train()
    first = generator.generate_from(model, PROMPTS, [0, 1, 2], PARAMS, purpose="t", step=1, samples=2)
    assert model.training  # its mode is restored
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    second = generator.generate_from(model, PROMPTS, [0, 1, 2], PARAMS, purpose="t", step=1, samples=2)
    fresh = Generator(rows=8, max_len=32, seed=3, dtype=torch.float64)
    assert second == fresh.generate_from(model, PROMPTS, [0, 1, 2], PARAMS, purpose="t", step=1, samples=2)
    assert [s.tokens for s in second] != [s.tokens for s in first]


def test_generator_keys_each_sample_as_the_sampler_does(config):
    """``Generator.over`` (the command line's) gives what ``sample_prompts`` gives on a Sampler of the
    same shape: SampleKey(seed, purpose, step, prompt index, sample index), independent of the
    other prompts in the call."""
    model = _model(config, 5).eval()
    generator = Generator.over(model, rows=8, max_len=32, seed=3)
    got = generator.generate(PROMPTS, [4, 9, 2], PARAMS, purpose="generate", step=7, samples=2)
    want = sample_prompts(Sampler(model, max_batch=8, max_len=32), PROMPTS, [4, 9, 2], PARAMS, seed=3,
                          purpose="generate", step=7, samples_per_prompt=2)
    assert got == want
    alone = generator.generate(PROMPTS[1:2], [9], PARAMS, purpose="generate", step=7, samples=2)
    assert _tokens(alone) == _tokens(got)[2:4]


def _task(index: int, answer: str, prompt=(65, 66)) -> Task:
    return Task(index=index, prompt_ids=list(prompt), prompt_text="AB", answer=answer,
                source=DocSpan("s", "part-000.jsonl", index, 0, 4, 0))


def _raising(completion, answer, *, prompt):
    raise KeyError("boom")


def test_reward_environment_scores_one_turn_and_keeps_nothing_between_episodes():
    rewards = [resolve_reward("exact_answer", weight=1.0),
               resolve_reward("format_regex", weight=0.5, pattern=r"\d+")]
    environment = RewardEnvironment(rewards, on_error="error")
    right, wrong = environment.reset(_task(0, "42"), where="a"), environment.reset(_task(1, "7"), where="b")
    assert right.observation == [65, 66]
    done = Sample(tokens=[52, 50], logprobs=[0.0, 0.0], finish_reason="stop")
    assert right.step(Completion(done, "42")) == Transition(reward=1.5, done=True)
    assert wrong.step(Completion(done, "42")) == Transition(reward=0.5, done=True)
    assert right.step(Completion(done, "42")) == Transition(reward=1.5, done=True)  # the same turn, the same answer
    zero = RewardEnvironment([*rewards, resolve_reward(f"{__name__}:_raising", weight=1.0)], on_error="zero")
    assert zero.reset(_task(0, "42"), where="c").step(Completion(done, "42")) == Transition(
        reward=1.5, done=True, reward_errors=1)


def test_experience_lays_out_rows_labels_and_sampler_logprobs():
    """prompt + completion per row, labels on the completion only (none for a truncated one under
    mask_truncated), the sampler's log-probs aligned with the labels, global rows prompt * G + s."""
    trajectories = (
        Trajectory(row=6, prompt_ids=[1, 2], tokens=[3, 4], logprobs=[-0.5, -0.25], truncated=False, reward=1.0),
        Trajectory(row=7, prompt_ids=[1, 2], tokens=[5, 6, 7], logprobs=[-1.0, -2.0, -3.0], truncated=True,
                   reward=0.0, penalty=-0.5),
    )
    experience = Experience(trajectories, group_size=2)
    with pytest.raises(ValueError):
        experience.batch(_prompt_batch(), seq_len=8, pad_id=0, mask_truncated=True)
    assert experience.shaped_rewards().tolist() == [[1.0, -0.5]]
    experience = experience.with_advantages(np.array([[0.75, -0.75]]))
    batch = experience.batch(_prompt_batch(), seq_len=8, pad_id=0, mask_truncated=True)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 0, 0, 0, 0], [1, 2, 5, 6, 7, 0, 0, 0]]
    X = IGNORE_INDEX
    assert batch.labels.tolist() == [[X, 3, 4, X, X, X, X, X], [X] * 8]
    assert batch.extras["old_logps"][1].tolist() == [0.0, -1.0, -2.0, -3.0, 0.0, 0.0, 0.0, 0.0]
    assert batch.extras["advantages"].tolist() == [0.75, -0.75]
    assert batch.sequence_index == [6, 7] and batch.provenance == [_prompt_batch().provenance[0]] * 2
    unmasked = experience.batch(_prompt_batch(), seq_len=8, pad_id=0, mask_truncated=False)
    assert unmasked.labels[1].tolist() == [X, 5, 6, 7, X, X, X, X]
    summary = experience.summary()
    assert [row[0] for row in summary["rows"]] == [6, 7] and summary["rows"][1][5] == -0.5


def _prompt_batch() -> Batch:
    return Batch.from_rows(4, [np.array([1, 2, 9, 0])], [[DocSpan("s", "f", 3, 0, 4, 0)]], [3], state={})


class _TwoTurnEnvironment:
    """An environment whose episodes want a second turn (a tool's answer to append)."""

    def reset(self, task, *, where):
        return self

    observation = [65]

    def step(self, turn):
        return Transition(reward=0.0, done=False, observation=(10, 11))


def test_group_rollouts_refuse_an_episode_that_continues(config):
    model = _model(config, 5)
    tokenizer = build_tokenizer(config.data.tokenizer)
    rollout = GroupRollout(generator=Generator(rows=2, max_len=32, seed=0), params=PARAMS, purpose="grpo",
                           decoder=Decoder(tokenizer, ChatTemplate.for_tokenizer(config.data.tokenizer, None)),
                           environment=_TwoTurnEnvironment(), group_size=2, overlong_buffer=0, resample_rounds=0,
                           any_rank=lambda flag: flag)
    with pytest.raises(ConfigError) as error:
        rollout.collect(model, [_task(0, "x")], step=1)
    assert "single-turn" in str(error.value) and "prompt row 0, sample 0" in str(error.value)


def test_group_rollouts_count_their_samples_and_resampled_rounds_on_the_progress(config):
    """The samples of each sampler call, once it returns; a re-sampling round adds its groups' samples
    to the total first. The counting changes no sample."""
    model = _model(config, 5)
    tokenizer = build_tokenizer(config.data.tokenizer)

    def rollout():
        return GroupRollout(generator=Generator(rows=4, max_len=32, seed=0), params=PARAMS, purpose="grpo",
                            decoder=Decoder(tokenizer, ChatTemplate.for_tokenizer(config.data.tokenizer, None)),
                            environment=RewardEnvironment([resolve_reward("exact_answer", weight=1.0)], on_error="error"),
                            group_size=2, overlong_buffer=0, resample_rounds=1, any_rank=lambda flag: flag)

    tasks = [_task(0, "never"), _task(1, "never either")]  # every reward 0: both groups are re-sampled
    printed = []
    with _Counted("step 1 rollouts", 4, unit="samples", print_fn=printed.append, tty=False) as progress:
        counted = rollout().collect(model, tasks, step=1, progress=progress)
    assert counted.resampled_groups == 2
    assert progress.calls == [("advance", 4), ("extend", 4), ("advance", 4)]
    assert (progress._done, progress.total) == (8, 8)
    assert rollout().collect(model, tasks, step=1).trajectories == counted.trajectories


class _Counted(Progress):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = []

    def advance(self, items: int = 1) -> None:
        self.calls.append(("advance", items))
        super().advance(items)

    def extend(self, items: int) -> None:
        self.calls.append(("extend", items))
        super().extend(items)


def test_rollout_fields_do_not_depend_on_how_rows_are_spread_over_ranks():
    """Every rank's summary, keyed by global row: one rank, two data-parallel ranks in either order,
    and two tensor-parallel peers holding the same rows give the same fields (counts not doubled)."""
    trajectories = tuple(
        Trajectory(row=r, prompt_ids=[1], tokens=[2 + r] * (1 + r % 3), logprobs=[0.0] * (1 + r % 3),
                   truncated=r == 3, reward=float(r % 2), penalty=-0.25 * (r == 2), reward_errors=int(r == 1))
        for r in range(4))
    whole = Experience(trajectories, group_size=2, resample_rounds=1, resampled_groups=1).summary()
    halves = [Experience(trajectories[:2], group_size=2, resample_rounds=1, resampled_groups=1).summary(),
              Experience(trajectories[2:], group_size=2, resample_rounds=1, resampled_groups=0).summary()]
    flags = dict(group_size=2, shaping=True, masking=True, resampling=True)
    one = rollout_fields([whole], **flags)
    assert rollout_fields(halves, **flags) == rollout_fields(halves[::-1], **flags) == one
    assert rollout_fields([whole, whole], **flags) == one  # tensor-parallel peers
    assert one["reward_mean"] == 0.5 and one["reward_errors"] == 1 and one["truncated_masked"] == 0.25
    assert one["overlong_penalty_mean"] == -0.0625 and (one["resample_rounds"], one["resampled_groups"]) == (1, 1)
    assert one["reward_zero_var_groups"] == 0.0 and one["completion_len_mean"] == 1.75
    assert set(rollout_fields([whole], group_size=2, shaping=False, masking=False, resampling=False)) == {
        "rollout_hash", "reward_mean", "reward_std", "reward_zero_var_groups", "completion_len_mean", "reward_errors"}
