"""Defects a probe of the post-training stack found (issue 63, section 4), each reproduced:
the adaptive KL coefficient of PPO, reward models' and critics' weights checked as every
frozen model's, environments that fail outside a step, a replay after a frozen model or an
episode record changed, and a SIGTERM while a frozen model loads."""

from __future__ import annotations

import math
import sys

import pytest

from core import config as config_lib
from core.exceptions import ConfigError
from training.objectives.ppo_loss import AdaptiveKL

PROMPTS = {"sources": [{"path": "datasets/tasks/rl/train", "record": "prompt"}], "num_streams": 4}


def _ppo_config(ppo: dict, *, batch: int = 4):
    config = config_lib.from_dict({"objective": {"kind": "ppo", "ppo": ppo}, "data": PROMPTS,
                                   "train": {"global_batch_size": batch, "micro_batch_size": 2}})
    config_lib.validate(config)
    return config


# ---------------------------------------------------------------- 1. the adaptive KL coefficient


def test_the_adaptive_kl_coefficient_moves_by_the_clipped_error_on_hand_computed_values():
    kl = AdaptiveKL(coef=0.1, target=1.0, horizon=8)
    kl.update(0.0, samples=8)  # error -1 clipped to -0.2: 0.1 * (1 - 0.2 * 8 / 8)
    assert kl.coef == pytest.approx(0.08, abs=1e-15)
    kl.update(5.0, samples=8)  # error 4 clipped to 0.2: 0.08 * 1.2
    assert kl.coef == pytest.approx(0.096, abs=1e-15)
    kl.update(1.1, samples=4)  # error 0.1: 0.096 * (1 + 0.1 * 4 / 8)
    assert kl.coef == pytest.approx(0.1008, abs=1e-15)
    kl.update(1.0, samples=8)  # on target: unchanged
    assert kl.coef == pytest.approx(0.1008, abs=1e-15)
    kl.update(math.nan, samples=8)  # a skipped step's KL does not move it
    assert kl.coef == pytest.approx(0.1008, abs=1e-15)


def test_the_adaptive_kl_coefficient_never_leaves_the_positive_floats():
    low, high = AdaptiveKL(coef=0.1, target=1.0, horizon=8), AdaptiveKL(coef=0.1, target=1.0, horizon=8)
    for _ in range(5000):  # 0.8 ** 5000 and 1.2 ** 5000 leave the floats
        low.update(0.0, samples=8)
        high.update(10.0, samples=8)
    assert low.coef == sys.float_info.min and high.coef == sys.float_info.max


def test_a_kl_horizon_below_a_steps_completions_is_a_config_error():
    # The probe: kl_horizon 1 against 8 completions a step took the coefficient 0.1 -> -0.06 ->
    # 0.036 -> -0.0216, and the KL term then rewarded drifting from the reference.
    _ppo_config({"kl_target": 0.5, "kl_horizon": 8, "group_size": 2})  # 4 x 2 completions: the least allowed
    for horizon in (1, 7):
        with pytest.raises(ConfigError) as info:
            _ppo_config({"kl_target": 0.5, "kl_horizon": horizon, "group_size": 2})
        assert info.value.context["key"] == "objective.ppo.kl_horizon"
        assert info.value.exit_code == 2 and "8 completions" in str(info.value)
    _ppo_config({"kl_target": 0.0, "kl_horizon": 1, "group_size": 2})  # a fixed kl_coef: the horizon is unused
    with pytest.raises(ConfigError) as info:  # the controller itself refuses such a step
        AdaptiveKL(coef=0.1, target=1.0, horizon=1).update(0.0, samples=8)
    assert info.value.context["key"] == "objective.ppo.kl_horizon"
