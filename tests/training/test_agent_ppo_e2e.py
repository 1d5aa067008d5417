"""Agent PPO end to end on 2 CPU ranks (tests/configs/e2e-agent-ppo.yaml: PPO's critic and KL on
episodes of up to three turns with tests/agent_environment.py). The four guarantees are the
``agent-ppo`` row of tests/training/test_guarantees.py: SIGKILL mid-episode then resume gives the
uninterrupted ledger, ``episodes_hash`` included; replay; 2 -> 1 ranks; accumulation. Here, what
is particular to episodes under PPO:

- every step's ledger line has the episode fields and PPO's, its length statistics count sampled
  tokens only, and the step's episode record in the run dir hashes to the line's ``episodes_hash``;
- a replay verifies a step without calling the environment (it fails if called).
"""

from __future__ import annotations

import pytest

from tests import launch
from tests.agent_environment import FORBID, recorded_hash
from tests.methods import AGENT_PPO

pytestmark = pytest.mark.slow


@pytest.fixture
def reference(reference_runs):
    return reference_runs.run(AGENT_PPO)


def test_every_step_records_its_episodes_and_their_hash(reference):
    lines = launch.ledger(reference)
    group = 2  # e2e-ppo.yaml's group_size
    for line in lines:
        assert recorded_hash(reference, line["step"], group) == line["episodes_hash"], line["step"]
        assert line["turns_mean"] > 1.0 and line["tool_calls"] > 0 and line["env_errors"] == 0
        assert line["completion_len_mean"] <= 8 * 3  # sampled tokens only: max_new_tokens x max_turns
        assert len(line["inner_losses"]) == 2  # 1 epoch x 2 minibatches
    assert len({line["episodes_hash"] for line in lines}) == len(lines)
    # the critic trains (step 1's first minibatch holds only episodes scored 0: no value gradient yet)
    assert all(line["grad_norm_critic"] > 0 for line in lines[1:])


def test_replay_uses_the_recorded_observations_without_calling_the_environment(reference, reference_runs,
                                                                                monkeypatch):
    monkeypatch.setenv(FORBID, "1")
    result = launch.train(reference_runs.workdir, ["--replay", reference.name, "--step", "2"], nproc=2,
                          timeout=AGENT_PPO.timeout_s)
    assert result.returncode == 0, result.stderr
    assert "match" in result.stdout
