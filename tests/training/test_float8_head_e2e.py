"""``parallel.float8_head`` end to end on 2 CPU ranks (torch emulates the FP8 matmuls there).
The four guarantees (SIGKILL + resume, replay, 2 -> 1 rank resume, accumulation) are the
``float8-head`` row of tests/training/test_guarantees.py; here, that the head really runs in FP8."""

from __future__ import annotations

import pytest

from tests import launch
from tests.e2e_config import e2e_args
from tests.guarantees import run_dir
from tests.methods import FLOAT8_HEAD, HEAD_IN_FLOAT8

pytestmark = pytest.mark.slow


def test_the_key_reaches_the_head(e2e_workdir, reference_runs):
    expected = launch.ledger(reference_runs.run(FLOAT8_HEAD))
    assert len(expected) == FLOAT8_HEAD.steps and expected[-1]["loss"] < expected[0]["loss"]
    # The same batches as the bf16-head run, other losses (FP8 rounding).
    result = launch.train(e2e_workdir, e2e_args(max_steps=FLOAT8_HEAD.steps, name="ref-f8head-off",
                                                overrides=HEAD_IN_FLOAT8[1:]))
    assert result.returncode == 0, result.stderr
    plain = launch.ledger(run_dir(e2e_workdir, result))
    assert [r["batch_hash"] for r in plain] == [r["batch_hash"] for r in expected]
    assert plain[0]["loss"] != expected[0]["loss"]
    assert expected[-1]["loss"] == pytest.approx(plain[-1]["loss"], rel=0.05)
