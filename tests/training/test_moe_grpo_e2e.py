"""Qwen3-MoE GRPO through the whole stack (tests/configs/e2e-moe-grpo.yaml: the moe row's model, a
dense layer then 4 experts top-2 with both balancing methods, on the RL prompts with two updates per
rollout batch).

The four guarantees are its row of the guarantee table (tests/methods.py, ``MOE_GRPO``): SIGKILL +
resume (mostly mid-rollout) and replay give the ledger bit for bit, rollouts and the router bias
included; a 2-rank run resumed on 1 rank samples the same rollouts and batch at the first step after
its checkpoint; accumulation keeps the first step's batch and loss. Here, on the row's run: the
ledger's rollout and balancing fields, the bias moved after each of a step's two updates, and the
sampler's log-probs equal to the trainer's (the sampler's copy routes with the policy's bias).
"""

from __future__ import annotations

import pytest

from tests import launch
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
