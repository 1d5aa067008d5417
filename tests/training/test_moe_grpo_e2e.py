"""Qwen3-MoE GRPO through the whole stack (tests/configs/e2e-moe-grpo.yaml: the moe row's model, a
dense layer then 4 experts top-2 with both balancing methods, on the RL prompts with two updates per
rollout batch).

The four guarantees are its row of the guarantee table (tests/methods.py, ``MOE_GRPO``): SIGKILL +
resume (mostly mid-rollout) and replay give the ledger bit for bit, rollouts and the router bias
included; a 2-rank run resumed on 1 rank samples the same rollouts and batch at the first step after
its checkpoint; accumulation keeps the first step's batch and loss. Here, on the row's run: the
ledger's rollout and balancing fields, the bias moved after each of a step's two updates, and the
sampler's log-probs equal to the trainer's (the sampler's copy routes with the policy's bias). The
row runs with routing replay on (``model.qwen3_moe.routing_replay``): each update routes its tokens to
the experts the sampler recorded. The same run without it: the first update, on the weights that
sampled, has the row's loss bits (no token routed otherwise), the second another loss (the row's
record held after the weights moved), and a resume from its step-2 checkpoint writes its ledger
bit for bit.
"""

from __future__ import annotations

import pytest

from tests import launch
from tests.guarantees import run_dir
from tests.methods import MOE_BIAS_FIELDS, MOE_FIELDS, MOE_GRPO

pytestmark = pytest.mark.slow

RATE = 0.001  # e2e-moe.yaml's model.qwen3_moe.bias_update_rate
UPDATES = 2  # e2e-moe-grpo.yaml's objective.grpo.inner_updates


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_runs.run(MOE_GRPO)


def test_the_ledger_reports_rollouts_and_the_balancing_fields(reference):
    lines = launch.ledger(reference)
    assert len({line["rollout_hash"] for line in lines}) == MOE_GRPO.steps
    for line in lines:
        assert set(MOE_FIELDS) <= set(line) and line["reward_errors"] == 0
        assert len(line["inner_losses"]) == UPDATES and line["inner_losses"][0] == line["loss"]
        assert line["logprob_parity"] < 1e-4  # the sampler's copy routes as the trained model does
        low, high = (line[key] for key in MOE_BIAS_FIELDS)
        moved = RATE * UPDATES * (line["step"] - 1)  # moved after each update before this step
        assert -moved - 1e-9 <= low <= high <= moved + 1e-9, line["step"]
    assert [lines[0][key] for key in MOE_BIAS_FIELDS] == [0.0, 0.0]
    assert lines[1][MOE_BIAS_FIELDS[1]] > RATE  # two updates of step 1 moved an expert twice


def test_routing_replay_follows_the_record_and_a_run_without_it_resumes_bitwise(reference_runs, reference):
    workdir = reference_runs.workdir
    lines = launch.ledger(reference)
    for line in lines:  # the first update's recorded tokens: every one routed as the sampler chose
        assert line["model/routing_replay_mismatch"] == 0.0, line["step"]
    result = launch.train(workdir, reference_runs.args(
        MOE_GRPO, name="moe-grpo-no-replay", overrides=("model.qwen3_moe.routing_replay=false",)), nproc=2,
        timeout=MOE_GRPO.timeout_s)
    assert result.returncode == 0, result.stderr
    run = run_dir(workdir, result)
    plain = launch.ledger(run)
    assert [line["step"] for line in plain] == [line["step"] for line in lines]
    assert all("model/routing_replay_mismatch" not in line for line in plain)
    # step 1 samples the same rollouts; the record is in the row's batch hash; the first update (the
    # weights that sampled, no token routed otherwise) has the same loss bits, the second follows the
    # record where the moved router would have chosen otherwise
    first, row = plain[0], lines[0]
    assert first["rollout_hash"] == row["rollout_hash"] and first["batch_hash"] != row["batch_hash"]
    assert first["inner_losses"][0] == row["inner_losses"][0]
    assert first["inner_losses"][1] != row["inner_losses"][1]
    copy = launch.cut_back_copy(run, 2, "-resumed")
    resumed = launch.train(workdir, ["--resume", copy.name], nproc=2, timeout=MOE_GRPO.timeout_s)
    assert resumed.returncode == 0, resumed.stderr
    assert launch.ledger(copy) == plain
