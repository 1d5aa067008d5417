"""``determinism.batch_invariant``: the sampler's log-probs are the trainer's bitwise in a real run.

2 gloo ranks of the e2e GRPO, agent GRPO and PPO configs (tests/methods.py) with the batch-invariant
kernels on: ``logprob_parity`` (max |sampler log-prob - trainer log-prob| over a step's sampled
tokens; PPO's over its first update's, whose old log-probs are then the sampler's) is 0.0 on every
ledger line, where the stock kernels leave about 1e-7 (test_grpo_e2e.py allows 1e-4); a nonzero one
would have stopped the run with exit 5 (test_logprob_parity.py forces one in process). The chain
behind it is tests/models/test_batch_invariance.py's; the key's hashing and checks are
tests/training/test_numerics.py's.
"""

from __future__ import annotations

import pytest

from tests import launch
from tests.methods import AGENT_GRPO, GRPO, PPO

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("method", [GRPO, AGENT_GRPO, PPO], ids=["grpo", "agent-grpo", "ppo"])
def test_logprob_parity_is_zero_on_every_line(e2e_workdir, method):
    args = ["--config", str(method.config_path), f"run.name=parity-{method.name}", "train.max_steps=2",
            "determinism.batch_invariant=true", *method.overrides]
    result = launch.train(e2e_workdir, args, timeout=method.timeout_s)
    assert result.returncode == 0, result.stderr
    run_dir = result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir
    lines = launch.ledger(run_dir)
    assert [line["step"] for line in lines] == [1, 2]
    assert all(line["logprob_parity"] == 0.0 for line in lines), [line["logprob_parity"] for line in lines]


def test_a_parity_difference_on_one_rank_stops_both_before_the_step_is_recorded(e2e_workdir):
    """``runtime.faults=[logprob_drift@2:1]``: rank 1's first compared token of step 2 reaches the check
    one float off. Both ranks stop with exit 5 where the step settles: the ledger ends at step 1,
    LATEST is step 1's checkpoint (step 2's is never written), and each rank's error names step 2,
    the row and token, rank 0's adding that rank 1 found it."""
    args = ["--config", str(GRPO.config_path), "run.name=parity-drift", "train.max_steps=2", "checkpoint.interval=1",
            "determinism.batch_invariant=true", "runtime.faults=[logprob_drift@2:1]", *GRPO.overrides]
    result = launch.train(e2e_workdir, args, timeout=GRPO.timeout_s)
    assert result.exit_code == 5, result.stderr
    run_dir = result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir
    assert [line["step"] for line in launch.ledger(run_dir)] == [1]
    assert (run_dir / "checkpoints" / "LATEST").read_text().strip() == "step_00000001"
    assert not (run_dir / "checkpoints" / "step_00000002").exists()
    output = result.stdout + result.stderr
    assert "determinism violation" in output and "step=2" in output, output[-3000:]
    assert "rank 1 found it" in output, output[-3000:]  # rank 0's error: the difference was rank 1's
