"""Defects a probe of the post-training stack found (issue 63, section 4), each reproduced:
the adaptive KL coefficient of PPO, reward models' and critics' weights checked as every
frozen model's, environments that fail outside a step, a replay after a frozen model or an
episode record changed, and a SIGTERM while a frozen model loads."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import models
from core import config as config_lib
from core import seeding
from core.exceptions import ConfigError
from models.hf_weights import WEIGHTS_NAME, save_pretrained
from runtime.signals import StopDuringStartup, StopSignals
from tests import launch, probe_environments
from tests.reward_models import dist
from tests.training.test_agent_episodes import _play, _setup
from training.objectives.critic import build_critic
from training.objectives.frozen import check_finite_weights, source_model
from training.objectives.model_reward import build_model_reward
from training.objectives.ppo_loss import AdaptiveKL
from training.objectives.reward_model_io import SCORE_WEIGHT
from training.rollout.environment import EnvironmentFailure
from training.rollout.episode_store import episodes_path
from training.rollout.episodes import EpisodeLimits
from training.rollout.tool_environment import resolve_environment

PPO_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-ppo.yaml"
AGENT_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-agent-grpo.yaml"

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


# ---------------------------------------------------------------- 2. reward models' and critics' weights


def _classifier(directory: Path, config, *, nan_score: bool = False, truncate: bool = False,
                score: float = 0.25) -> Path:
    """A Hugging Face sequence classifier of the e2e policy's shape with seeded weights (as
    `python -m training export` writes a reward model), its score head NaN or its file cut short."""
    model = models.build(config.model, generator=seeding.generator(5, "reward_init"))
    save_pretrained(model, directory)
    raw = json.loads((directory / "config.json").read_text())
    raw["architectures"] = [raw["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
    raw["num_labels"] = 1
    (directory / "config.json").write_text(json.dumps(raw))
    file = directory / WEIGHTS_NAME
    tensors = load_file(str(file))
    weight = torch.full((1, config.model.hidden_size), score)
    if nan_score:
        weight[0, 3] = math.nan
    tensors[SCORE_WEIGHT] = weight
    save_file(tensors, str(file), metadata={"format": "pt"})
    if truncate:  # the probe: a copy cut short
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return directory


@pytest.fixture(scope="module")
def ppo_config():
    return config_lib.load(str(PPO_CONFIG))


def _critic_config(config, source: Path):
    return config_lib.from_dict({**config_lib.to_dict(config),
                                 "objective": {"kind": "ppo", "ppo": {"critic": str(source)}}})


@pytest.mark.parametrize("damage", ["truncate", "nan_score"])
def test_a_damaged_reward_model_or_critic_is_a_config_error_naming_its_file(tmp_path, ppo_config, damage):
    # The probe: a truncated model.safetensors was exit 1 "SafetensorError" naming no file; a NaN
    # in the score head was exit 7 at the first loss ("inspect the batch").
    source = _classifier(tmp_path / "rm", ppo_config, **{damage: True})
    file = str(source / WEIGHTS_NAME)
    with pytest.raises(ConfigError) as info:
        build_model_reward(ppo_config, str(source), dist=dist(), key="objective.ppo.rewards[1].path")
    assert info.value.exit_code == 2 and info.value.context["file"] == file
    if damage == "nan_score":
        assert info.value.context["key"] == SCORE_WEIGHT and "non-finite" in info.value.message
    with pytest.raises(ConfigError) as info:  # the same file as PPO's critic
        build_critic(_critic_config(ppo_config, source))
    assert info.value.exit_code == 2 and info.value.context["file"] == file


def test_a_sound_reward_model_still_builds(tmp_path, ppo_config):
    source = _classifier(tmp_path / "rm", ppo_config)
    reward = build_model_reward(ppo_config, str(source), dist=dist(), key="objective.ppo.rewards[1].path")
    assert torch.equal(reward.head.weight, torch.full((1, ppo_config.model.hidden_size), 0.25))
    assert torch.equal(build_critic(_critic_config(ppo_config, source)).value_head.weight, reward.head.weight)


def test_a_checkpoints_model_with_a_nan_is_a_config_error_naming_the_checkpoint(tmp_path, ppo_config):
    model = models.build(ppo_config.model, generator=seeding.generator(5, "reward_init"))
    check_finite_weights(model, source="run:rm", path=tmp_path, key="objective.ppo.critic")
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight[0, 0] = math.inf
    with pytest.raises(ConfigError) as info:
        check_finite_weights(model, source="run:rm", path=tmp_path, key="objective.ppo.critic")
    assert info.value.context == {"key": "objective.ppo.critic", "file": str(tmp_path),
                                  "tensor": "layers.1.mlp.down_proj.weight"}


# ---------------------------------------------------------------- 3. environments failing outside a step


def _limits(on_error: str) -> EpisodeLimits:
    return EpisodeLimits("probe", max_turns=2, max_observation_tokens=128, max_episode_tokens=400, timeout_s=5.0,
                         on_error=on_error)


def test_an_environment_whose_constructor_raises_is_a_config_error_naming_its_key():
    # The probe: exit 1 "RuntimeError", naming neither the environment nor its key.
    with pytest.raises(ConfigError) as info:
        resolve_environment("tests.probe_environments:ConstructorRaises", rewards=[], on_reward_error="error",
                            max_calls_per_turn=1, key="objective.grpo.environment.name")
    assert info.value.context["key"] == "objective.grpo.environment.name" and info.value.exit_code == 2
    assert "ConstructorRaises" in str(info.value) and "no connection to the tool server" in str(info.value)


def test_a_reset_that_raises_follows_on_env_error_as_a_step_that_raises():
    # The probe: exit 1 whatever on_env_error said.
    _, _, _, runner, task, _ = _setup("byte", ["a<|im_end|>"], environment=probe_environments.ResetRaises(),
                                      limits=_limits("error"))
    with pytest.raises(EnvironmentFailure) as caught:
        _play(runner, [task])
    assert caught.value.exit_code == 3 and "'probe'" in str(caught.value) and "reset() raised RuntimeError" in str(caught.value)
    assert "step 7, prompt row 3, sample 0, turn 0" in str(caught.value)
    _, _, _, runner, task, _ = _setup("byte", ["a<|im_end|>"], environment=probe_environments.ResetRaises(),
                                      limits=_limits("zero"))
    episodes = _play(runner, [task], samples=2)
    for episode in episodes:  # the first turn is sampled, then the failure ends the episode
        assert episode.reward == 0.0 and episode.env_errors == 1 and len(episode.turns) == 1
        assert episode.turns[0].outcome == "error" and episode.turns[0].sampled and episode.record()["env_errors"] == 1


@pytest.mark.parametrize("on_error", ["error", "zero"])
def test_a_tool_output_past_the_templates_budget_ends_only_its_episode(on_error):
    # The probe: a 16M-character tool output stopped the run with exit 3 naming no environment.
    _, _, _, runner, task, _ = _setup("byte", ["a<|im_end|>", "b<|im_end|>"],
                                      environment=probe_environments.HugeOutput(), limits=_limits(on_error))
    (episode,) = _play(runner, [task])
    assert episode.truncated and episode.env_errors == 0 and episode.reward == 0.5
    assert [t.outcome for t in episode.turns] == ["limit"] and episode.turns[0].observation == ()


def test_a_tool_output_with_a_lone_surrogate_is_an_environment_error():
    _, _, _, runner, task, _ = _setup("byte", ["a<|im_end|>", "b<|im_end|>"],
                                      environment=probe_environments.SurrogateOutput(), limits=_limits("error"))
    with pytest.raises(EnvironmentFailure) as caught:
        _play(runner, [task])
    assert caught.value.exit_code == 3 and "lone surrogate" in str(caught.value) and "'probe'" in str(caught.value)
    assert "step 7, prompt row 3, sample 0, turn 0" in str(caught.value)
    _, _, _, runner, task, _ = _setup("byte", ["a<|im_end|>", "b<|im_end|>"],
                                      environment=probe_environments.SurrogateOutput(), limits=_limits("zero"))
    (episode,) = _play(runner, [task])
    assert episode.reward == 0.0 and episode.env_errors == 1 and [t.outcome for t in episode.turns] == ["error"]


# ---------------------------------------------------------------- 4. a replay after a frozen model or a record changed


def _train(workdir: Path, config: Path, *overrides: str) -> Path:
    result = launch.train(workdir, ["--config", str(config), *overrides], nproc=1)
    assert result.returncode == 0, result.stderr
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


def _replay(workdir: Path, run: Path, step: int) -> launch.Result:
    return launch.train(workdir, ["--replay", run.name, "--step", str(step)], nproc=1)


@pytest.mark.slow
def test_a_replay_after_the_reward_model_changed_names_it_and_both_hashes(e2e_workdir, tmp_path, ppo_config):
    # The probe: a replay of a step before the run's first checkpoint with another reward model file
    # was exit 5 "loss differs".
    source = _classifier(tmp_path / "rm", ppo_config)
    rewards = f"objective.ppo.rewards=[{{name: exact_answer, weight: 1.0}}, {{name: model, path: '{source}', weight: 0.5}}]"
    run = _train(e2e_workdir, PPO_CONFIG, rewards, "run.name=probe-ppo-rm", "train.max_steps=2",
                 "checkpoint.interval=2")
    recorded = json.loads((run / "checkpoints" / "step_00000002" / "objective_state.json").read_text())["frozen"]
    _classifier(tmp_path / "rm", ppo_config, score=0.5)  # the same path, other weights
    result = _replay(e2e_workdir, run, 1)
    assert result.exit_code == 4, result.stderr
    assert "frozen reward model differs" in result.stderr and str(source) in result.stderr
    assert recorded["reward"]["sha256"] in result.stderr  # the recorded hash, and the new one beside it
    assert result.stderr.count("'sha256': ") >= 2


@pytest.mark.slow
def test_a_replay_of_an_edited_episode_record_names_the_file_and_both_hashes(e2e_workdir):
    # The probe: an edited episodes/step_N.json was exit 5 "grad_norm differs" on replay.
    run = _train(e2e_workdir, AGENT_CONFIG, "run.name=probe-agent", "train.max_steps=1")
    replayed = _replay(e2e_workdir, run, 1)
    assert replayed.returncode == 0, replayed.stderr  # the record as written hashes to the ledger's
    path = episodes_path(run, 1)
    payload = json.loads(path.read_text())
    episode = next(r for r in payload["rows"].values() if r["turns"][0]["observation"])
    episode["turns"][0]["observation"][0] += 1
    path.write_text(json.dumps(payload))
    recorded = launch.ledger(run)[0]["episodes_hash"]
    result = _replay(e2e_workdir, run, 1)
    assert result.exit_code == 4, result.stderr
    assert path.name in result.stderr and recorded in result.stderr and "changed after the run wrote it" in result.stderr


# ---------------------------------------------------------------- 5. SIGTERM while a frozen model loads


@contextlib.contextmanager
def _sigterm_inside_torchs_mode_stack_update():
    """SIGTERM at the one point where the probe's 1-in-21 failure happened, every time: torch's
    ``_pop_mode_temporarily`` has popped the device mode and is about to push it back (a frozen
    model is built under ``with torch.device("meta")``, each parameter's init dispatched through
    that mode). A trace hook sends it; the signal handler then runs inside that library frame."""
    push = next(i for i, line in enumerate(Path(torch.overrides.__file__).read_text().splitlines(), 1)
                if line.strip() == "_push_mode(old)")
    sent = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == push and not sent:
            sent.append(frame.f_lineno)
            os.kill(os.getpid(), signal.SIGTERM)
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_name == "_pop_mode_temporarily" and not sent else None

    sys.settrace(calls)
    try:
        yield sent
    finally:
        sys.settrace(None)


def test_a_sigterm_inside_torchs_code_during_a_frozen_build_ends_with_143(ppo_config):
    # The probe: 1 of 21 SIGTERMs during a frozen load ended with exit 1 (torch's mode stack left
    # empty or holding the meta device) instead of 143: the handler raised inside torch's code.
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signals = StopSignals(signals=(signal.SIGTERM,))
        with pytest.raises(StopDuringStartup) as info:
            with signals.at_once(), _sigterm_inside_torchs_mode_stack_update() as sent:
                source_model(ppo_config, "init", key="objective.ppo.reference")  # a frozen reference's build
        assert sent and info.value.exit_code == 143
        assert not torch.overrides._get_current_function_mode_stack()  # torch's state is whole
        assert torch.empty(1).device.type == "cpu"
    finally:
        signal.signal(signal.SIGTERM, previous)
