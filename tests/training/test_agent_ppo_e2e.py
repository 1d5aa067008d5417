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

from tests.agent_runs import checked_episode_lines, replay_verifies_without_the_environment
from tests.methods import AGENT_PPO

pytestmark = pytest.mark.slow


@pytest.fixture
def reference(reference_runs):
    return reference_runs.run(AGENT_PPO)


def test_every_step_records_its_episodes_and_their_hash(reference):
    lines = checked_episode_lines(reference, group_size=2)  # e2e-ppo.yaml's group_size
    assert all(len(line["inner_losses"]) == 2 for line in lines)  # 1 epoch x 2 minibatches
    # the critic trains (step 1's first minibatch holds only episodes scored 0: no value gradient yet)
    assert all(line["grad_norm_critic"] > 0 for line in lines[1:])


def test_replay_uses_the_recorded_observations_without_calling_the_environment(reference, reference_runs,
                                                                                monkeypatch):
    replay_verifies_without_the_environment(reference_runs, reference, AGENT_PPO.timeout_s, monkeypatch)
