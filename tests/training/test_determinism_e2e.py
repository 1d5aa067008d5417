"""Lockstep's central promise, end to end on CPU with 2 ranks (gloo, torchrun):

- the same config twice gives identical ledgers and parameter hashes; so does DDP's reduction
  after the backward (``parallel.ddp_overlap=false``) with collections every 2 steps, and
  settling every step before the next (``runtime.deferred_settle=false``);
- the whole job SIGKILLed at random moments (also mid-checkpoint), then resumed, possibly
  several times, ends with a ledger identical to the uninterrupted run's, line for line;
- 2 ranks -> resume on 1 rank: the same batch_hash sequence, loss within float tolerance;
- accumulation 4x1 vs 1x4: loss within float tolerance;
- replay before and after a resume point matches; a tampered ledger makes replay exit 5;
- a truncated or bit-flipped checkpoint is detected, reported, and the previous one used;
- an incompatible resume exits 4 with the diff;
- FSDP as the Qwen presets run it (gathered parameters kept until the backward, several
  blocks per unit) is identical across SIGKILL and resume too.
"""

from __future__ import annotations

import json
import random
import shutil
import time

import pytest

from tests import launch
from tests.e2e_config import e2e_args

pytestmark = pytest.mark.slow

STEPS = 12


@pytest.fixture(scope="module")
def reference(e2e_workdir):
    """One uninterrupted 2-rank run that the other tests compare against."""
    result = launch.train(e2e_workdir, e2e_args(max_steps=STEPS), nproc=2)
    assert result.returncode == 0, result.stderr
    return result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir


def _run_dir(workdir, result):
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


def test_run_dir_contract(reference):
    for name in ("config.yaml", "meta.json", "ledger.jsonl", "metrics.jsonl", "events.jsonl", "logs/rank0.log", "logs/rank1.log"):
        assert (reference / name).exists(), name
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr", "tokens", "batch_hash", "data_state_hash"):
        assert key in lines[0]
    assert "param_hash" in lines[-1]
    assert lines[-1]["loss"] < lines[0]["loss"]
    meta = json.loads((reference / "meta.json").read_text())
    assert meta["determinism"]["mode"] == "bitwise" and meta["world"]["world_size"] == 2
    kinds = [e["event"] for e in launch.events(reference)]
    assert kinds[0] == "run_started" and "checkpoint_saved" in kinds and kinds[-1] == "finished"


def test_same_config_twice_is_bitwise_identical(e2e_workdir, reference):
    again = launch.train(e2e_workdir, e2e_args(max_steps=STEPS), nproc=2)
    assert again.returncode == 0, again.stderr
    assert launch.ledger(_run_dir(e2e_workdir, again)) == launch.ledger(reference)


def test_reduction_after_backward_and_scheduled_collection_change_nothing(e2e_workdir, reference):
    overrides = ["parallel.ddp_overlap=false", "runtime.gc_interval=2"]
    deferred = launch.train(e2e_workdir, e2e_args(max_steps=STEPS, name="deferred", overrides=overrides), nproc=2)
    assert deferred.returncode == 0, deferred.stderr
    assert launch.ledger(_run_dir(e2e_workdir, deferred)) == launch.ledger(reference)


def test_settling_each_step_before_the_next_changes_nothing(e2e_workdir, reference):
    # By default a step's values are read, and its ledger line and metrics written, during
    # the next step (runtime.deferred_settle); settling every step at once gives the same run.
    overrides = ["runtime.deferred_settle=false"]
    at_once = launch.train(e2e_workdir, e2e_args(max_steps=STEPS, name="at-once", overrides=overrides), nproc=2)
    assert at_once.returncode == 0, at_once.stderr
    run_dir = _run_dir(e2e_workdir, at_once)
    assert launch.ledger(run_dir) == launch.ledger(reference)
    for directory in (run_dir, reference):
        steps = [json.loads(line)["step"] for line in (directory / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, STEPS + 1))


def test_sigkill_at_random_moments_then_resume_is_identical(e2e_workdir, reference):
    rng = random.Random(1234)
    job = launch.start(e2e_workdir, e2e_args(max_steps=STEPS, name="killed"))
    assert launch.wait_for(lambda: list((e2e_workdir / "runs").glob("killed-*")), timeout=120)
    run_dir = next((e2e_workdir / "runs").glob("killed-*"))
    kills = 0
    while kills < 3:
        # Kill the whole job (every rank and the launcher) at a random moment: 1-3 steps after
        # it (re)starts training, then up to about a step later (mid-step or mid-checkpoint).
        # Tied to progress, not to the clock: the 12 steps can take under 2 s on a fast machine.
        target = len(launch.ledger(run_dir)) + rng.randint(1, 3)
        launch.wait_for(lambda: len(launch.ledger(run_dir)) >= target or job.poll() is not None, timeout=120)
        time.sleep(rng.uniform(0.0, 0.2))
        if job.poll() is not None:
            break
        launch.kill_job(job)
        kills += 1
        job = launch.start(e2e_workdir, ["--resume", run_dir.name])
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err
    assert kills >= 1
    assert launch.ledger(run_dir) == launch.ledger(reference)
    assert not (run_dir / ".lock").exists()


def test_resume_on_one_rank_keeps_the_data_stream(e2e_workdir, reference):
    # A copy of the 2-rank reference (checkpoints every 4 steps) cut back to its step-4
    # checkpoint, as if it had died right after it. A fresh run of the same config would be
    # the reference bit for bit (test_same_config_twice_is_bitwise_identical): no need to train it again.
    run_dir = launch.cut_back_copy(reference, 4, "-one-rank")
    resumed = launch.train(e2e_workdir, ["--resume", run_dir.name], nproc=1)
    assert resumed.returncode == 0, resumed.stderr
    ref, got = launch.ledger(reference), launch.ledger(run_dir)
    assert [r["batch_hash"] for r in got] == [r["batch_hash"] for r in ref]
    assert [r["data_state_hash"] for r in got] == [r["data_state_hash"] for r in ref]
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)


def test_accumulation_does_not_change_the_loss(e2e_workdir):
    four_by_one = launch.train(e2e_workdir, e2e_args(max_steps=3, overrides=["train.micro_batch_size=1"]), nproc=1)
    one_by_four = launch.train(e2e_workdir, e2e_args(max_steps=3, overrides=["train.micro_batch_size=4"]), nproc=1)
    assert four_by_one.returncode == 0 and one_by_four.returncode == 0, four_by_one.stderr + one_by_four.stderr
    a = launch.ledger(_run_dir(e2e_workdir, four_by_one))
    b = launch.ledger(_run_dir(e2e_workdir, one_by_four))
    assert [r["batch_hash"] for r in a] == [r["batch_hash"] for r in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)


def test_replay_matches_before_and_after_a_resume_point(e2e_workdir, reference, tmp_path):
    for step in (3, 6):  # checkpoint every 4 steps: 3 replays from scratch, 6 from step 4
        dump = tmp_path / f"dump{step}"
        result = launch.train(e2e_workdir, ["--replay", reference.name, "--step", str(step), "--dump", str(dump)], nproc=2)
        assert result.returncode == 0, result.stderr
        assert "match" in result.stdout
        summary = json.loads((dump / "rank0_step.json").read_text())
        assert summary["provenance"] and summary["activations"] and summary["param_grads"]
        assert (dump / "rank1_batch.pt").exists()


def test_tampered_ledger_makes_replay_exit_5(e2e_workdir, reference, tmp_path):
    copy = reference.parent / (reference.name + "-tampered")
    shutil.copytree(reference, copy)
    lines = launch.ledger(copy)
    lines[5]["loss"] += 1e-6
    (copy / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = launch.train(e2e_workdir, ["--replay", copy.name, "--step", "6"], nproc=2)
    assert result.exit_code == 5, result.stderr
    assert "loss" in result.stderr and "step=6" in result.stderr
    assert launch.ledger(copy) == lines  # replay never rewrites the ledger


def test_damaged_checkpoint_falls_back_to_the_previous_one(e2e_workdir, reference):
    copy = reference.parent / (reference.name + "-damaged")
    shutil.copytree(reference, copy)
    steps = sorted((copy / "checkpoints").glob("step_*"))
    assert len(steps) >= 3, steps
    newest, middle, oldest = steps[-1], steps[-2], steps[-3]
    flipped = _largest_file(newest)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    flipped.write_bytes(bytes(data))
    truncated = _largest_file(middle)
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])

    result = launch.train(e2e_workdir, ["--resume", copy.name], nproc=2)
    assert result.returncode == 0, result.stderr
    corrupt = {e["path"].rstrip("/").rsplit("/", 1)[-1] for e in launch.events(copy) if e["event"] == "checkpoint_corrupt"}
    assert {newest.name, middle.name} <= corrupt
    resumed = [e for e in launch.events(copy) if e["event"] == "resumed"]
    assert resumed[-1]["step"] == int(oldest.name.split("_")[1])
    assert launch.ledger(copy) == launch.ledger(reference)


def _largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size)


def test_incompatible_resume_exits_4_with_diff(e2e_workdir, reference):
    result = launch.train(e2e_workdir, ["--resume", reference.name, "model.hidden_size=96"], nproc=1)
    assert result.exit_code == 4, result.stderr
    assert "model.hidden_size" in result.stdout + result.stderr
    assert "- model.hidden_size: 64" in result.stdout and "+ model.hidden_size: 96" in result.stdout


def test_evaluation_on_the_held_out_source(e2e_workdir):
    result = launch.train(e2e_workdir, e2e_args(max_steps=4, name="eval", overrides=["train.eval_interval=2", "train.eval_batches=2"]), nproc=2)
    assert result.returncode == 0, result.stderr
    evals = [e for e in launch.events(_run_dir(e2e_workdir, result)) if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4]
    assert all(0 < e["loss"] < 10 and e["tokens"] > 0 for e in evals)
    assert evals[1]["loss"] < evals[0]["loss"]


def test_fsdp_as_the_qwen_presets_run_it_resumes_and_replays_identically(e2e_workdir):
    """FSDP keeping gathered parameters until the backward, several blocks per unit (the
    Qwen presets' settings): SIGKILLed at random moments and resumed, it ends with the
    uninterrupted run's ledger, a replayed step matches, and its step-4 checkpoint resumed
    on one rank keeps the batches."""
    overrides = ["parallel.strategy=fsdp", "parallel.reshard_after_forward=false", "parallel.fsdp_unit_blocks=2",
                 "model.num_layers=4"]
    reference = launch.train(e2e_workdir, e2e_args(max_steps=8, name="fsdp-z2", overrides=overrides), nproc=2)
    assert reference.returncode == 0, reference.stderr
    expected = launch.ledger(_run_dir(e2e_workdir, reference))
    assert len(expected) == 8
    run_dir = launch.kill_and_resume(e2e_workdir, e2e_args(max_steps=8, name="fsdp-z2-killed", overrides=overrides),
                                     name="fsdp-z2-killed", seed=5)
    assert launch.ledger(run_dir) == expected
    launch.replay_verifies(e2e_workdir, run_dir, steps=(5,))
    launch.one_rank_resume_keeps_the_batches(e2e_workdir, _run_dir(e2e_workdir, reference), step=4)
