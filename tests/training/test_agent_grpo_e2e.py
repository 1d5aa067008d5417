"""Agent GRPO end to end on 2 CPU ranks (tests/configs/e2e-agent-grpo.yaml: episodes of up to
three turns with tests/agent_environment.py). The four guarantees are the ``agent-grpo`` row of
tests/training/test_guarantees.py: SIGKILL mid-episode then resume gives the uninterrupted ledger,
``episodes_hash`` included; replay; 2 -> 1 ranks; accumulation. Here, what is particular to
episodes:

- every step's ledger line has the episode fields, and the step's episode record in the run dir
  (``episodes/step_<N>.json``) hashes to the line's ``episodes_hash``;
- a replay verifies a step without calling the environment (it fails if called);
- a replay of a step whose episode record is gone is refused (exit 4), never run with the tools;
- the step lines show the ledger's tool calls and malformed calls, and ``python -m experiments runs
  episodes`` prints a step's episodes as text.
"""

from __future__ import annotations

import re
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


def test_the_step_lines_show_tool_calls_and_runs_episodes_prints_a_step(reference, reference_runs):
    lines = {line["step"]: line for line in launch.ledger(reference)}
    shown = {int(m[1]): (float(m[2]), float(m[3])) for m in re.finditer(
        r"^step (\d+)/\d+ \|.* \| tool calls ([\d.]+) \| malformed calls ([\d.]+) \|",
        reference_runs.result(AGENT_GRPO).stdout, re.M)}
    assert shown == {step: (line["tool_calls"], line["malformed_calls"]) for step, line in lines.items()}

    def episodes(step: int) -> launch.Result:
        return launch.run_module(launch.ROOT, ["experiments", "runs", "episodes", reference.name, "--step", str(step),
                                               "--root", str(reference.parent)], timeout=120)

    printed = episodes(2)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith(f"run {reference.name} step 2: ")
    assert printed.stdout.count("\nepisode row ") == printed.stdout.count(", sample 0 |") * 4  # group_size 4
    counts = [tuple(map(int, m)) for m in re.findall(r"\| (\d+) tool calls?, (\d+) malformed", printed.stdout)]
    assert [sum(c) for c in zip(*counts)] == [lines[2]["tool_calls"], lines[2]["malformed_calls"]]
    assert "    observation (" in printed.stdout
    missing = episodes(99)
    assert missing.returncode == 2 and "step 99 of run" in missing.stderr and "step_00000099.json" in missing.stderr


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
