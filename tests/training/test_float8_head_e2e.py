"""``parallel.float8_head`` end to end on 2 CPU ranks (torch emulates the FP8 matmuls there):
the head really runs in FP8, and the round-1 guarantees hold for it as for every method:
SIGKILL at random moments and resume by run ID give the uninterrupted ledger, a step replays
to a match, and a checkpoint of the 2-rank run resumes on one rank with the same batches."""

from __future__ import annotations

import pytest

from tests import launch
from tests.e2e_config import e2e_args

HEAD = ["parallel.float8_head=true", "parallel.strategy=fsdp", "checkpoint.interval=2"]


def _reference(workdir, name: str, overrides: list[str]):
    result = launch.train(workdir, e2e_args(max_steps=6, name=name, overrides=overrides))
    assert result.returncode == 0, result.stderr
    run_dir = result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir
    return run_dir, launch.ledger(run_dir)


@pytest.mark.slow
def test_float8_head_kill_resume_replay_and_one_rank(e2e_workdir):
    reference_dir, expected = _reference(e2e_workdir, "ref-f8head", HEAD)
    assert len(expected) == 6 and expected[-1]["loss"] < expected[0]["loss"]
    # The key reaches the head: the same batches as the bf16-head run, other losses (FP8 rounding).
    _, plain = _reference(e2e_workdir, "ref-f8head-off", HEAD[1:])
    assert [r["batch_hash"] for r in plain] == [r["batch_hash"] for r in expected]
    assert plain[0]["loss"] != expected[0]["loss"]
    assert expected[-1]["loss"] == pytest.approx(plain[-1]["loss"], rel=0.05)

    name = "killed-f8head"
    run_dir = launch.kill_and_resume(e2e_workdir, e2e_args(max_steps=6, name=name, overrides=HEAD), name=name, seed=20)
    assert launch.ledger(run_dir) == expected
    launch.replay_verifies(e2e_workdir, run_dir, steps=(3, 5))
    launch.one_rank_resume_keeps_the_batches(e2e_workdir, reference_dir, step=4)
