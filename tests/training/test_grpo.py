"""GRPO's formulas against values worked out by hand (training/objectives/grpo_loss.py,
training/rollout/advantages.py), and the reward set's typed errors (training/rollout/rewards.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from core import config as config_lib
from core.exceptions import ConfigError
from training.objectives.grpo_loss import SurrogateSettings, loss_count, per_token_loss, reduce_loss
from training.rollout.advantages import group_advantages
from training.rollout.rewards import RewardError, resolve_reward, score

EPS = 1e-4


def settings(**kw) -> SurrogateSettings:
    base = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.0, importance="token", loss_norm="sequence")
    return SurrogateSettings(**{**base, **kw})


def test_group_advantages_use_the_population_std_plus_eps():
    adv = group_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 0.0, 0.0, 0.0]]), eps=EPS)
    # group 0: mean 0.5, population std 0.5 (Bessel's would be 0.577)
    assert adv[0] == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001, -0.5 / 0.5001, 0.5 / 0.5001], abs=1e-12)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # no variance: nothing to learn
    # group 2: mean 0.75, std sqrt((2.25^2 + 3 * 0.75^2) / 4) = sqrt(1.6875)
    std = math.sqrt(1.6875)
    assert adv[2] == pytest.approx([2.25 / (std + EPS)] + [-0.75 / (std + EPS)] * 3, abs=1e-12)


def test_token_ratio_clipped_surrogate_by_hand():
    logps = torch.tensor([[-1.0, -2.0], [-0.7, -2.0]], dtype=torch.float64)
    old = torch.tensor([[-1.1, -2.0], [-1.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([2.0, 1.0], dtype=torch.float64)
    loss, terms = per_token_loss(logps, old, None, adv, mask, settings())
    # row 0: ratios e^0.1 = 1.10517 (inside [0.8, 1.2]) and 1 -> -ratio * A
    # row 1: ratio e^0.3 = 1.34986 > 1.2 with A > 0: the clipped branch, -1.2 * 1
    expected = [[-math.exp(0.1) * 2.0, -2.0], [-1.2, 0.0]]
    assert np.allclose(loss.numpy(), expected, rtol=0, atol=1e-12)
    assert terms["clipped"].tolist() == [[0.0, 0.0], [1.0, 0.0]]
    # a negative advantage with the same ratio takes the unclipped (more pessimistic) branch
    loss_neg, terms_neg = per_token_loss(logps, old, None, -adv, mask, settings())
    assert loss_neg[1, 0].item() == pytest.approx(math.exp(0.3), abs=1e-12)
    assert terms_neg["clipped"][1, 0].item() == 0.0


def test_clip_higher_widens_only_the_upper_bound():
    logps = torch.tensor([[-0.7]], dtype=torch.float64)
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    mask = torch.tensor([[True]])
    loss, _ = per_token_loss(logps, old, None, torch.tensor([1.0], dtype=torch.float64), mask,
                             settings(clip_high=0.28))
    assert loss.item() == pytest.approx(-1.28, abs=1e-12)


def test_k3_kl_penalty_by_hand():
    logps = torch.tensor([[-1.0, -3.0]], dtype=torch.float64)
    old = logps.clone()
    ref = torch.tensor([[-1.5, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True]])
    loss, terms = per_token_loss(logps, old, ref, torch.tensor([0.0], dtype=torch.float64), mask,
                                 settings(kl_coef=0.1))
    k3 = math.exp(-0.5) + 0.5 - 1.0  # exp(ref - logp) - (ref - logp) - 1 = 0.106531
    assert np.allclose(terms["kl"].numpy(), [[k3, 0.0]], rtol=0, atol=1e-12)
    assert np.allclose(loss.numpy(), [[0.1 * k3, 0.0]], rtol=0, atol=1e-12)


def test_sequence_importance_is_one_length_normalized_ratio_per_completion():
    logps = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.2, -2.0, -5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    loss, _ = per_token_loss(logps, old, None, torch.tensor([1.0], dtype=torch.float64), mask,
                             settings(importance="sequence"))
    s = math.exp(0.1)  # exp(mean(0.2, 0.0)) over the two completion tokens; the masked one does not count
    assert np.allclose(loss.detach().numpy(), [[-s, -s, 0.0]], rtol=0, atol=1e-12)
    total = reduce_loss(loss, mask, "sequence")
    total.backward()
    # d/dlogp_t of -s = -s * (1/|o|) for each completion token: the gradient is shared
    assert np.allclose(logps.grad.numpy(), [[-s / 2, -s / 2, 0.0]], rtol=0, atol=1e-12)
    token_loss, _ = per_token_loss(logps.detach(), old, None, torch.tensor([1.0], dtype=torch.float64), mask,
                                   settings(importance="token"))
    assert not np.allclose(token_loss.numpy(), loss.detach().numpy())


def test_loss_norm_sequence_vs_token():
    per_token = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    total, count = reduce_loss(per_token, mask, "sequence"), loss_count(mask, "sequence", max_new_tokens=3)
    assert (total.item(), count) == (pytest.approx(1.5 + 3.0), 2)  # mean per completion, then summed
    total, count = reduce_loss(per_token, mask, "token"), loss_count(mask, "token", max_new_tokens=3)
    assert (total.item(), count) == (pytest.approx(6.0), 3)  # every token weighs the same


def _sample_reward(completion, answer, *, prompt):
    return float(completion.strip() == answer)


def _raising_reward(completion, answer, *, prompt):
    raise KeyError("boom")


def _nan_reward(completion, answer, *, prompt):
    return float("nan")


def test_rewards_builtin_and_user_functions_are_weighted():
    rewards = [resolve_reward("exact_answer", weight=1.0),
               resolve_reward("numeric_tolerance", weight=0.5, tol=0.5),
               resolve_reward("format_regex", weight=0.25, pattern=r"\d+"),
               resolve_reward(f"{__name__}:_sample_reward", weight=2.0)]
    assert score(rewards, " 82 ", "82", "What is 40 + 42?", where="s", on_error="error") == (3.75, 0)
    assert score(rewards, "8.4", "8", "q", where="s", on_error="error") == (0.5, 0)


def test_unknown_reward_function_path_is_a_config_error():
    for name in ("no_such_reward", "tests.training.no_such_module:f", f"{__name__}:no_such_function"):
        with pytest.raises(ConfigError) as info:
            resolve_reward(name, weight=1.0, key="objective.grpo.rewards[0]")
        assert info.value.context["key"] == "objective.grpo.rewards[0].name"
    with pytest.raises(ConfigError):
        resolve_reward("format_regex", weight=1.0, pattern="(")


def test_reward_exceptions_name_the_function_and_sample_or_count_as_zero():
    for fn in ("_raising_reward", "_nan_reward"):
        rewards = [resolve_reward("exact_answer", weight=1.0), resolve_reward(f"{__name__}:{fn}", weight=1.0)]
        with pytest.raises(RewardError) as info:
            score(rewards, "82", "82", "q", where="step 3, prompt row 5, sample 1", on_error="error")
        assert fn in str(info.value) and "prompt row 5, sample 1" in str(info.value)
        assert info.value.exit_code == 3
        assert score(rewards, "82", "82", "q", where="x", on_error="zero") == (1.0, 1)


def test_grpo_config_is_validated():
    base = {"objective": {"kind": "grpo"},
            "data": {"sources": [{"path": "datasets/tasks/rl/train", "record": "prompt"}]}}
    config_lib.validate(config_lib.from_dict(base))
    bad = [({"group_size": 1}, "group_size"), ({"temperature": 0.0}, "temperature"),
           ({"inner_updates": 0}, "inner_updates"), ({"rewards": []}, "rewards")]
    config_lib.validate(config_lib.from_dict({**base, "objective": {"kind": "grpo", "grpo": {"inner_updates": 4}}}))
    for grpo, key in bad:
        raw = {**base, "objective": {"kind": "grpo", "grpo": grpo}}
        with pytest.raises(ConfigError) as info:
            config_lib.validate(config_lib.from_dict(raw))
        assert info.value.context["key"] == f"objective.grpo.{key}"
    with pytest.raises(ConfigError):  # GRPO trains on prompt records only
        config_lib.validate(config_lib.from_dict({"objective": {"kind": "grpo"},
                                                  "data": {"sources": [{"path": "x.jsonl", "record": "chat"}]}}))


def test_group_advantages_with_the_unbiased_std_as_trl():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards, eps=EPS, std="unbiased")
    # group 0: mean 0.5, squared deviations sum to 1, unbiased std sqrt(1 / 3)
    s0 = math.sqrt(1.0 / 3.0)
    assert adv[0] == pytest.approx([0.5 / (s0 + EPS), -0.5 / (s0 + EPS), -0.5 / (s0 + EPS), 0.5 / (s0 + EPS)], abs=1e-12)
    # group 1: mean 0.75, squared deviations 2.25^2 + 3 * 0.75^2 = 6.75, unbiased std sqrt(6.75 / 3) = 1.5
    assert adv[1] == pytest.approx([2.25 / (1.5 + EPS)] + [-0.75 / (1.5 + EPS)] * 3, abs=1e-12)
    assert adv[2].tolist() == [0.0, 0.0, 0.0, 0.0]
    # the two choices differ by sqrt(G / (G - 1)) in the std (1.069 at G = 8), eps aside
    group = np.array([[1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]])
    ratio = group_advantages(group, eps=0.0)[0, 0] / group_advantages(group, eps=0.0, std="unbiased")[0, 0]
    assert ratio == pytest.approx(math.sqrt(8 / 7), abs=1e-12) and round(ratio, 3) == 1.069


def test_advantage_std_is_a_key_hashed_only_when_set():
    path = Path(__file__).resolve().parents[2] / "configs" / "tiny-grpo.yaml"
    default = config_lib.load(path)
    assert default.objective.grpo.advantage_std == "population"
    assert config_lib.load(path, ["objective.grpo.advantage_std=population"]).hash == default.hash
    unbiased = config_lib.load(path, ["objective.grpo.advantage_std=unbiased"])
    assert unbiased.objective.grpo.advantage_std == "unbiased" and unbiased.hash != default.hash
    with pytest.raises(ConfigError) as error:
        config_lib.load(path, ["objective.grpo.advantage_std=bessel"])
    assert "objective.grpo.advantage_std" in str(error.value)
    with pytest.raises(ValueError):
        group_advantages(np.array([[1.0]]), eps=EPS, std="unbiased")  # one completion has no unbiased std
