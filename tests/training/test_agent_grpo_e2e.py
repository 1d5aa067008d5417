"""Agent GRPO end to end on 2 CPU ranks (tests/configs/e2e-agent-grpo.yaml: episodes of up to
three turns with tests/agent_environment.py). The four guarantees are the ``agent-grpo`` row of
tests/training/test_guarantees.py: SIGKILL mid-episode then resume gives the uninterrupted ledger,
``episodes_hash`` included; replay; 2 -> 1 ranks; accumulation. Here, what is particular to
episodes:

- every step's ledger line has the episode fields, and the step's episode record in the run dir
  (``episodes/step_<N>.json``) hashes to the line's ``episodes_hash``;
- a replay verifies a step without calling the environment (it fails if called);
- a replay of a step whose episode record is gone is refused (exit 4), never run with the tools.
"""

from __future__ import annotations

import shutil

import pytest

from tests import launch
from tests.agent_runs import checked_episode_lines, replay_verifies_without_the_environment
from tests.methods import AGENT_GRPO
from training.rollout.episode_store import episodes_path

pytestmark = pytest.mark.slow


@pytest.fixture
def reference(reference_runs):
    return reference_runs.run(AGENT_GRPO)


def test_every_step_records_its_episodes_and_their_hash(reference):
    checked_episode_lines(reference, group_size=4)  # e2e-grpo.yaml's group_size


def test_replay_uses_the_recorded_observations_without_calling_the_environment(reference, reference_runs,
                                                                                monkeypatch):
    replay_verifies_without_the_environment(reference_runs, reference, AGENT_GRPO.timeout_s, monkeypatch)


def test_a_replay_without_the_step_record_is_refused(reference, reference_runs, tmp_path):
    copy = launch.cut_back_copy(reference, 4, "-no-episodes")
    episodes_path(copy, 3).unlink()
    result = launch.train(reference_runs.workdir, ["--replay", copy.name, "--step", "3"], nproc=1,
                          timeout=AGENT_GRPO.timeout_s)
    assert result.returncode == 4, result.stderr
    assert "has no episode record" in result.stderr
    shutil.rmtree(copy)
