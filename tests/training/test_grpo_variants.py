"""GRPO's variants (training/objectives/grpo_loss.py and training/rollout/advantages.py, driven by
training/objectives/grpo.py):
Dr. GRPO's unscaled advantages, the three loss aggregations (sequence, token, dr_grpo), DAPO's soft
overlong shaping and truncation mask, each against values worked out by hand; then the objective's
rollout batch with stubbed rollouts, and its normalizer taken over the global batch, so that one
micro-batch, one completion per micro-batch and two data-parallel ranks give the same gradient
in every aggregation mode. Last, the seam holds no state: the rollouts' experience travels in the
prepared batch, and the log-prob parity is a maximum the loop reduces."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import models
from core import seeding
from core.config import load
from core.exceptions import ConfigError
from data.batch import IGNORE_INDEX
from data.pipeline.plan import make_plan
from data.pipeline.serial import iterate_serial
from data.tasks import write_task_datasets
from models.generation.sampler import Sample
from training.objectives.base import ObjectiveContext
from training.objectives.grpo import PARITY, GRPOObjective
from training.objectives.grpo_loss import SurrogateSettings, loss_count, per_token_loss, reduce_loss, reduce_metric
from training.rollout.advantages import group_advantages, overlong_penalty
from training.rollout.experience import Experience
from training.determinism import numerics
from training.precision import Precision
from training.step import forward_backward
from tests import launch

EPS = 1e-4
MODES = ("sequence", "token", "dr_grpo")


def settings(**kw) -> SurrogateSettings:
    base = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.0, importance="token", loss_norm="sequence")
    return SurrogateSettings(**{**base, **kw})


# ---------------------------------------------------------------- formulas


def test_advantage_scales_by_hand():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    # Dr. GRPO: reward minus the group mean, not divided (means 0.5, 0.75, 2)
    assert group_advantages(rewards, eps=EPS, std="none").tolist() == [
        [0.5, -0.5, -0.5, 0.5], [2.25, -0.75, -0.75, -0.75], [0.0, 0.0, 0.0, 0.0]]
    # group 0's squared deviations sum to 1: population std sqrt(1/4) = 0.5, unbiased sqrt(1/3)
    population = group_advantages(rewards, eps=EPS, std="population")
    unbiased = group_advantages(rewards, eps=EPS, std="unbiased")
    assert population[0] == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001, -0.5 / 0.5001, 0.5 / 0.5001], abs=1e-12)
    s = math.sqrt(1.0 / 3.0) + EPS
    assert unbiased[0] == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], abs=1e-12)
    # a narrow spread is scaled up by the std but not by none: rewards 0.1 apart
    narrow = np.array([[0.1, 0.0]])
    assert group_advantages(narrow, eps=EPS, std="none")[0] == pytest.approx([0.05, -0.05], abs=1e-15)
    assert group_advantages(narrow, eps=EPS, std="population")[0] == pytest.approx(
        [0.05 / 0.0501, -0.05 / 0.0501], abs=1e-12)
    with pytest.raises(ValueError):
        group_advantages(rewards, eps=EPS, std="mad")


# Three completions of 2, 1 and 4 tokens (T = 4 = max_new_tokens).
PER_TOKEN = [[1.0, 2.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
MASK = [[True, True, False, False], [True, False, False, False], [True, True, True, True]]


def test_loss_aggregations_by_hand():
    per_token, mask = torch.tensor(PER_TOKEN, dtype=torch.float64), torch.tensor(MASK)
    # sequence: the means 1.5, 3 and 1, over 3 completions; token: 10 over 7 tokens;
    # dr_grpo: 10 over 3 completions x 4 slots
    expected = {"sequence": (5.5, 3), "token": (10.0, 7), "dr_grpo": (10.0, 12)}
    for mode, (total, count) in expected.items():
        assert reduce_loss(per_token, mask, mode).item() == total
        assert loss_count(mask, mode, max_new_tokens=4) == count
    # Metrics are means per token (token) or per completion of its token means (sequence, dr_grpo)
    metric = {mode: reduce_metric(per_token, mask, mode, max_new_tokens=4).item()
              / loss_count(mask, mode, max_new_tokens=4) for mode in MODES}
    assert metric["token"] == 10.0 / 7
    assert metric["sequence"] == pytest.approx(5.5 / 3, abs=1e-15)
    assert metric["dr_grpo"] == pytest.approx(5.5 / 3, abs=1e-15)
    # a completion without loss tokens (masked as truncated) counts nowhere
    masked = torch.tensor([MASK[0], [False] * 4, MASK[2]])
    assert [loss_count(masked, mode, max_new_tokens=4) for mode in MODES] == [2, 6, 8]


def test_aggregation_gradients_by_hand():
    """At ratio 1 the surrogate's per-token loss is -A_i, so dL/dlogp_{i,t} = -A_i times the mode's
    weight: 1 / (N |o_i|) (sequence), 1 / sum_i |o_i| (token), 1 / (N max_new_tokens) (dr_grpo)."""
    mask = torch.tensor(MASK)
    advantages = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    lengths, n, tokens, slots = [2, 1, 4], 3, 7, 4
    weights = {"sequence": [1 / (n * k) for k in lengths], "token": [1 / tokens] * n, "dr_grpo": [1 / (n * slots)] * n}
    for mode in MODES:
        logps = torch.full((3, 4), -1.5, dtype=torch.float64, requires_grad=True)
        per_token, _ = per_token_loss(logps, logps.detach(), None, advantages, mask, settings(loss_norm=mode))
        loss = reduce_loss(per_token, mask, mode) / loss_count(mask, mode, max_new_tokens=slots)
        loss.backward()
        expected = [[-a * w if m else 0.0 for m in row] for a, w, row in zip(advantages.tolist(), weights[mode], MASK)]
        assert np.allclose(logps.grad.numpy(), expected, rtol=0, atol=1e-15), mode
        expected_loss = sum(-a * w * k for a, w, k in zip(advantages.tolist(), weights[mode], lengths))
        assert loss.item() == pytest.approx(expected_loss, abs=1e-15), mode


def test_aggregation_gradients_match_finite_differences():
    """Away from ratio 1 and the clip edges (ratios e^-0.05 .. e^0.15, clip [0.8, 1.2]), with the KL term."""
    mask = torch.tensor(MASK)
    old = torch.tensor([[-1.0, -2.0, -1.0, -1.0], [-0.5, -1.0, -1.0, -1.0], [-1.2, -0.7, -2.0, -1.1]],
                       dtype=torch.float64)
    shift = torch.tensor([[0.1, -0.05, 0.0, 0.0], [0.15, 0.0, 0.0, 0.0], [0.05, 0.1, -0.03, 0.02]],
                         dtype=torch.float64)
    ref = old - 0.3
    advantages = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    for mode in MODES:
        for importance in ("token", "sequence"):
            s = settings(loss_norm=mode, importance=importance, kl_coef=0.1)

            def loss(logps):
                per_token, _ = per_token_loss(logps, old, ref, advantages, mask, s)
                return reduce_loss(per_token, mask, mode) / loss_count(mask, mode, max_new_tokens=4)

            logps = (old + shift).clone().requires_grad_(True)
            assert torch.autograd.gradcheck(loss, (logps,), eps=1e-6, atol=1e-9, rtol=0), (mode, importance)


def test_overlong_penalty_by_hand():
    lengths = [0, 10, 12, 13, 14, 15, 16]
    # max_new_tokens 16, buffer 4: 0 up to 12 tokens, then -1/4 per token to -1 at 16
    assert overlong_penalty(lengths, max_new_tokens=16, buffer=4).tolist() == [
        0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(lengths, max_new_tokens=16, buffer=0).tolist() == [0.0] * 7  # off
    assert overlong_penalty([0, 4, 16], max_new_tokens=16, buffer=16).tolist() == [0.0, -0.25, -1.0]


# ---------------------------------------------------------------- the objective

PROMPTS, G, MAX_NEW = 4, 4, 6


@pytest.fixture(scope="module")
def tasks_workdir(tmp_path_factory):
    """A working directory with the RL prompts e2e-grpo.yaml reads (datasets/tasks/rl/train), made
    here in a few hundred records so that a fresh clone needs no `python -m data prepare` first."""
    root = tmp_path_factory.mktemp("grpo-variants")
    write_task_datasets(root / "datasets" / "tasks", seed=0, train_n=256, eval_n=16, shards=16)
    return root


pytestmark = pytest.mark.usefixtures("in_tasks_workdir")


def _config(overrides=()):
    return load(launch.ROOT / "tests" / "configs" / "e2e-grpo.yaml", [
        "objective.grpo.kl_coef=0", "parallel.strategy=none", f"train.global_batch_size={PROMPTS}",
        f"objective.grpo.group_size={G}", f"objective.grpo.max_new_tokens={MAX_NEW}",
        "objective.grpo.rewards=[{name: format_regex, pattern: '.*[a-z].*', weight: 1.0}]", *overrides])


def _objective(config, model):
    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo",
                           all_gather_object=lambda obj: [obj])
    objective = GRPOObjective(config)
    objective.setup(model, ObjectiveContext(config=config, dist=dist, parallel=SimpleNamespace(device=dist.device),
                                            place=lambda t: t))
    return objective


def _stub_rollouts(objective):
    """Every prompt's group: "ab" + EOS (3 tokens, stopped), "abcde" + EOS (6 = max_new_tokens, but
    stopped: not truncated), "ABCDE" (5, ran out of context: truncated), "abcdef" (6, truncated)."""
    tok = objective.tokenizer
    ids = lambda text: [int(t) for t in tok.encode_array(text)]  # noqa: E731
    group = [(ids("ab") + [tok.eos_id], "stop"), (ids("abcde") + [tok.eos_id], "stop"),
             (ids("ABCDE"), "length"), (ids("abcdef"), "length")]
    stubbed = [Sample(tokens=tokens, logprobs=[-2.0 + 0.1 * i for i in range(len(tokens))], finish_reason=reason)
               for tokens, reason in group]
    objective.generator.generate_from = lambda model, prompts, indices, params, *, purpose, step, samples, media=None: [
        sample for _ in prompts for sample in stubbed]
    return [len(tokens) for tokens, _ in group]


def _prepared(overrides=()):
    config = _config(overrides)
    model = models.build(config.model, generator=seeding.generator(5, "model_init")).double()
    objective = _objective(config, model)
    lengths = _stub_rollouts(objective)
    plan = make_plan(config.data, seed=config.train.seed, global_batch_size=PROMPTS, rank=0, world_size=1)
    with torch.no_grad():
        batch = objective.prepare(next(iterate_serial(plan)))
    return config, model, objective, batch, lengths


def test_rollout_batch_shapes_rewards_and_masks_truncated_completions():
    config, _, objective, batch, lengths = _prepared([
        "objective.grpo.overlong_buffer=2", "objective.grpo.mask_truncated=true", "objective.grpo.advantage_std=none"])
    # scores (format_regex): 1, 1, 0, 1; overlong penalties (max 6, buffer 2: from 4 tokens on,
    # -1/2 per token) for lengths 3, 6, 5, 6: 0, -1, -0.5, -1; shaped 1, 0, -0.5, 0, mean 0.125
    assert lengths == [3, 6, 5, 6]
    assert batch.extras["advantages"].tolist() == [0.875, -0.125, -0.625, -0.125] * PROMPTS
    trained = (batch.labels != IGNORE_INDEX).sum(dim=1).tolist()
    assert trained == [3, 6, 0, 0] * PROMPTS  # the truncated completions carry no label
    expected = {"sequence": 2 * PROMPTS, "token": 9 * PROMPTS, "dr_grpo": 2 * PROMPTS * MAX_NEW}
    for mode, count in expected.items():
        objective.g = dataclasses.replace(objective.g, loss_norm=mode)
        assert objective.num_targets(batch) == count
    fields = objective.ledger_fields(batch, {PARITY: 0.0}, 0)
    assert fields["reward_mean"] == 0.75  # the rewards' scores, without the penalty
    assert fields["overlong_penalty_mean"] == -0.625
    assert fields["truncated_masked"] == 0.5
    assert fields["reward_zero_var_groups"] == 0.0
    assert fields["completion_len_mean"] == 5.0


def test_defaults_leave_rollout_batches_and_ledger_as_before():
    _, _, objective, batch, _ = _prepared()
    # population std of the scores 1, 1, 0, 1 (mean 0.75): sqrt(3/16)
    std = math.sqrt(3.0 / 16.0) + EPS
    hand = torch.tensor([0.25 / std, 0.25 / std, -0.75 / std, 0.25 / std] * PROMPTS, dtype=torch.float32)
    assert torch.equal(batch.extras["advantages"], hand)  # float64 advantages, stored as float32
    assert (batch.labels != IGNORE_INDEX).sum(dim=1).tolist() == [3, 6, 5, 6] * PROMPTS
    assert objective.num_targets(batch) == G * PROMPTS  # loss_norm sequence: every completion
    fields = objective.ledger_fields(batch, {PARITY: 0.0}, 0)
    assert "overlong_penalty_mean" not in fields and "truncated_masked" not in fields


def _gradient(objective, model, parts: list[list], global_targets: int) -> tuple[float, torch.Tensor]:
    """The loop's update without the optimizer: each rank's micro-batches through forward_backward
    (dp_size = len(parts)), the ranks' gradients averaged as DDP does; returns loss and flat gradient."""
    config = objective.config
    precision = Precision(numerics(config), device=torch.device("cpu"), wrapper_casts=False)
    total, grads = 0.0, []
    for micro_batches in parts:
        model.zero_grad(set_to_none=True)
        local, _, _ = forward_backward(model, micro_batches, objective=objective, precision=precision,
                                    global_targets=global_targets, dp_size=len(parts), device=torch.device("cpu"),
                                    no_sync=lambda m: contextlib.nullcontext())
        total += float(local)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    return total / global_targets, torch.stack(grads).mean(dim=0)


@pytest.mark.parametrize("mode", MODES)
def test_normalizer_is_global_across_micro_batches_and_ranks(mode):
    """1 x 16 == 16 x 1 == 2 ranks x 2 micro-batches of 4, with truncated completions masked; and
    the masked completions change nothing: the same gradient as the batch without them."""
    _, model, objective, batch, _ = _prepared([f"objective.grpo.loss_norm={mode}", "objective.grpo.mask_truncated=true",
                                               "objective.grpo.advantage_std=none", "objective.grpo.overlong_buffer=2"])
    rows = batch.micro_batches(1)
    count = sum(objective.num_targets(row) for row in rows)
    assert count == objective.num_targets(batch)
    whole = _gradient(objective, model, [[batch]], count)
    layouts = {"16 x 1": [rows], "2 ranks x 2 x 4": [batch.micro_batches(4)[:2], batch.micro_batches(4)[2:]]}
    # The loop sums loss values in float32 (one rounding of a sum apart: 2^-23 relative); the
    # gradients are float64 here and agree to 1e-18.
    fp32 = 2.0 ** -23
    for name, parts in layouts.items():
        loss, grad = _gradient(objective, model, parts, count)
        assert loss == pytest.approx(whole[0], rel=fp32, abs=0), (mode, name)
        assert torch.allclose(grad, whole[1], rtol=0, atol=1e-16), (mode, name)
    kept = [row for row in rows if objective.num_targets(row) > 0]
    assert len(kept) == 2 * PROMPTS
    loss, grad = _gradient(objective, model, [kept], sum(objective.num_targets(row) for row in kept))
    assert loss == pytest.approx(whole[0], rel=fp32, abs=0) and torch.allclose(grad, whole[1], rtol=0, atol=1e-16)
    assert whole[1].abs().max() > 1e-3


def test_variant_keys_are_validated_and_hashed_only_when_set():
    path = launch.ROOT / "configs" / "tiny-grpo.yaml"
    default = load(path)
    g = default.objective.grpo
    assert (g.overlong_buffer, g.mask_truncated, g.dynamic_sampling_rounds) == (0, False, 0)
    for key, value in (("overlong_buffer", 0), ("mask_truncated", "false"), ("advantage_std", "population"),
                       ("dynamic_sampling_rounds", 0)):
        assert load(path, [f"objective.grpo.{key}={value}"]).hash == default.hash
    for key, value in (("overlong_buffer", 4), ("mask_truncated", "true"), ("advantage_std", "none"),
                       ("loss_norm", "dr_grpo"), ("dynamic_sampling_rounds", 2)):
        assert load(path, [f"objective.grpo.{key}={value}"]).hash != default.hash
    for override, key in (("objective.grpo.overlong_buffer=17", "overlong_buffer"),
                          ("objective.grpo.overlong_buffer=-1", "overlong_buffer"),
                          ("objective.grpo.dynamic_sampling_rounds=17", "dynamic_sampling_rounds"),
                          ("objective.grpo.loss_norm=seq_mean", "loss_norm")):
        with pytest.raises(ConfigError) as error:
            load(path, [override])
        assert f"objective.grpo.{key}" in str(error.value) and error.value.exit_code == 2


def test_rollout_slots_is_validated_and_hashed_only_when_set():
    path = launch.ROOT / "configs" / "tiny-grpo.yaml"
    default = load(path)
    assert default.objective.grpo.rollout_slots == 0
    assert load(path, ["objective.grpo.rollout_slots=0"]).hash == default.hash
    assert load(path, ["objective.grpo.rollout_slots=3"]).hash != default.hash
    with pytest.raises(ConfigError) as error:
        load(path, ["objective.grpo.rollout_slots=-1"])
    assert "objective.grpo.rollout_slots" in str(error.value) and error.value.exit_code == 2


def test_rollout_slots_refill_fewer_sampler_rows_and_a_prompt_keeps_its_group(request):
    """3 sampler rows for PROMPTS x G completions: finished rows take pending ones, and a prompt's group
    is the same whichever prompts share its call and in which order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads on a busy machine wait on each other
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    config = _config(["objective.grpo.rollout_slots=3"])
    model = models.build(config.model, generator=seeding.generator(5, "model_init"))
    objective = _objective(config, model)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]][:PROMPTS]
    indices = list(range(10, 10 + len(prompts)))

    def rollouts(prompts, indices):  # prompt-major: G completions of each prompt
        flat = objective.generator.generate_from(model, prompts, indices, objective.params, purpose="grpo", step=1,
                                                 samples=G)
        return [flat[p * G:(p + 1) * G] for p in range(len(prompts))]

    with torch.no_grad():
        groups = rollouts(prompts, indices)
        assert objective.generator._sampler.max_batch == 3 < PROMPTS * G
        assert rollouts(prompts, indices) == groups
        alone = rollouts(prompts[-1:], indices[-1:])
        backwards = rollouts(prompts[::-1], indices[::-1])
    assert alone[0] == groups[-1] and backwards[::-1] == groups
    assert len({len(sample.tokens) for group in groups for sample in group}) > 1  # mixed lengths


def _stub_resampling(objective, calls: list, uniform_rows: dict | None = None):
    """Groups by (purpose, prompt row): mixed ("ab" and "AB": format scores 1 and 0) or uniform.
    By default round 0: rows 0 and 2 uniform; round 1: row 0 mixed, row 2 uniform; round 2: row 2
    uniform again; round 3: row 2 mixed. Every call is recorded as (purpose, rows)."""
    tok = objective.tokenizer
    sample = lambda text: Sample(tokens=[int(t) for t in tok.encode_array(text)] + [tok.eos_id],  # noqa: E731
                                 logprobs=[-1.0] * (len(text) + 1), finish_reason="stop")
    mixed, uniform = [sample("ab"), sample("AB"), sample("ab"), sample("AB")], [sample("xy")] * G
    if uniform_rows is None:
        uniform_rows = {"grpo": {0, 2}, "grpo.resample1": {2}, "grpo.resample2": {2}}

    def generate_from(model, prompts, indices, params, *, purpose, step, samples, media=None):
        calls.append((purpose, list(indices)))
        return [sample for index in indices for sample in (uniform if index in uniform_rows.get(purpose, ()) else mixed)]

    objective.generator.generate_from = generate_from


@pytest.mark.parametrize("rounds, expected_calls, replaced, zero_var", [
    (1, [("grpo", [0, 1, 2, 3]), ("grpo.resample1", [0, 2])], 2, 0.25),
    (2, [("grpo", [0, 1, 2, 3]), ("grpo.resample1", [0, 2]), ("grpo.resample2", [2])], 3, 0.25),
    (5, [("grpo", [0, 1, 2, 3]), ("grpo.resample1", [0, 2]), ("grpo.resample2", [2]), ("grpo.resample3", [2])],
     4, 0.0),  # stops once no group is uniform
])
def test_dynamic_sampling_resamples_uniform_groups_with_fresh_keys(rounds, expected_calls, replaced, zero_var):
    config = _config([f"objective.grpo.dynamic_sampling_rounds={rounds}", "objective.grpo.advantage_std=none"])
    model = models.build(config.model, generator=seeding.generator(5, "model_init"))
    objective, calls = _objective(config, model), []
    _stub_resampling(objective, calls)
    plan = make_plan(config.data, seed=config.train.seed, global_batch_size=PROMPTS, rank=0, world_size=1)
    with torch.no_grad():
        batch = objective.prepare(next(iterate_serial(plan)))
    assert calls == expected_calls
    mixed = [0.5, -0.5, 0.5, -0.5]  # scores 1, 0, 1, 0 minus their mean
    adv = batch.extras["advantages"].tolist()
    assert adv == mixed + mixed + ([0.0] * G if zero_var else mixed) + mixed
    assert batch.input_ids.shape[0] == PROMPTS * G  # the batch stays full: groups are replaced in place
    fields = objective.ledger_fields(batch, {PARITY: 0.0}, 0)
    assert (fields["resample_rounds"], fields["resampled_groups"]) == (len(expected_calls) - 1, replaced)
    assert fields["reward_zero_var_groups"] == zero_var


def test_dynamic_sampling_rounds_follow_every_rank():
    """A rank without uniform groups still runs the rounds another rank needs (generation may be a
    collective), on no prompts, and its own groups stay as they were."""
    config = _config(["objective.grpo.dynamic_sampling_rounds=2", "objective.grpo.advantage_std=none"])
    model = models.build(config.model, generator=seeding.generator(5, "model_init"))
    objective, calls = _objective(config, model), []
    objective._context.dist.all_gather_object = lambda obj: [obj, True]  # the other rank has a uniform group
    _stub_resampling(objective, calls, uniform_rows={})
    plan = make_plan(config.data, seed=config.train.seed, global_batch_size=PROMPTS, rank=0, world_size=1)
    with torch.no_grad():
        batch = objective.prepare(next(iterate_serial(plan)))
    assert calls == [("grpo", [0, 1, 2, 3]), ("grpo.resample1", []), ("grpo.resample2", [])]
    assert batch.extras["advantages"].tolist() == [0.5, -0.5, 0.5, -0.5] * PROMPTS


def test_prepare_parks_nothing_on_the_objective_and_ledger_fields_read_their_batch():
    """rollout -> advantages -> loss with no state between the seam calls: a step's ledger fields
    come from the experience its prepared batch carries, also once the next batch is prepared."""
    config = _config()
    model = models.build(config.model, generator=seeding.generator(5, "model_init"))
    objective = _objective(config, model)
    data = iterate_serial(make_plan(config.data, seed=config.train.seed, global_batch_size=PROMPTS, rank=0,
                                    world_size=1))
    before = dict(vars(objective))
    with torch.no_grad():
        first = objective.prepare(next(data))
        fields = objective.ledger_fields(first, {PARITY: 0.0}, 0)
        second = objective.prepare(next(data))
    assert vars(objective) == before
    experience = first.prepared
    assert isinstance(experience, Experience) and len(experience.trajectories) == PROMPTS * G
    assert torch.equal(first.extras["advantages"], torch.tensor(experience.advantages, dtype=torch.float32))
    assert experience.timings["rollout_s"] > 0 and experience.timings["rollout_tokens"] > 0
    assert objective.ledger_fields(first, {PARITY: 0.0}, 0) == fields
    assert objective.ledger_fields(second, {PARITY: 0.0}, 0)["rollout_hash"] != fields["rollout_hash"]


def test_logprob_parity_is_a_maximum_over_micro_batches():
    """The loss reports max |sampler log-prob - trainer log-prob| as a maximum (LossOutput.maxima),
    which forward_backward reduces by max: any split into micro-batches gives the same value."""
    _, model, objective, batch, _ = _prepared()
    whole = objective.loss(model, batch).maxima[PARITY]
    precision = Precision(numerics(objective.config), device=torch.device("cpu"), wrapper_casts=False)
    for size in (1, 3):
        model.zero_grad(set_to_none=True)
        _, _, maxima = forward_backward(model, batch.micro_batches(size), objective=objective, precision=precision,
                                        global_targets=objective.num_targets(batch), dp_size=1,
                                        device=torch.device("cpu"), no_sync=lambda m: contextlib.nullcontext())
        assert torch.equal(maxima[PARITY], whole.float()), size
    assert whole > 0  # the stubbed log-probs are not the model's
