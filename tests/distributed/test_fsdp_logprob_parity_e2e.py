"""FSDP2 with a bf16 policy under ``determinism.batch_invariant``: the sampler's log-probs are the trainer's.

FSDP2's mixed-precision policy casts each wrapped block's floating-point inputs to bf16 as it casts the
parameters. The batch's rotary table (models/qwen/rope.py) crosses every block's boundary; it is an
object that cast does not enter, so its cos/sin stay fp32 in the trainer as in the sampler's bf16 copy
(``Numerics.wrapper_casts``: a bf16 copy, no autocast). 2 gloo ranks, the e2e GRPO config, one step:
``logprob_parity`` 0.0 (a nonzero one stops the run with exit 5: trainer -6.351146, sampler -6.351618 while
the table was a dataclass that the cast rounded).
"""

from __future__ import annotations

import pytest

from tests import launch
from tests.methods import GRPO

pytestmark = pytest.mark.slow


def test_fsdp_bf16_grpo_parity_is_zero(e2e_workdir):
    args = ["--config", str(GRPO.config_path), "run.name=parity-fsdp-bf16", "train.max_steps=1",
            "parallel.strategy=fsdp", "parallel.precision=bf16", "determinism.batch_invariant=true",
            "objective.grpo.inner_updates=1", "objective.grpo.kl_coef=0", "checkpoint.interval=0",
            *GRPO.overrides]
    result = launch.train(e2e_workdir, args, timeout=GRPO.timeout_s)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir
    lines = launch.ledger(run_dir)
    assert [line["step"] for line in lines] == [1]
    assert lines[0]["logprob_parity"] == 0.0
