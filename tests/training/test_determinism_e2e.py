"""Lockstep's central promise, end to end on CPU with 2 ranks (gloo, started by tests/ranks.py), beyond the four
guarantees every method keeps (SIGKILL + resume, replay, 2 -> 1 rank resume, accumulation:
tests/training/test_guarantees.py, whose rows ``pretraining`` and ``pretraining-fsdp`` train
this config, the latter with FSDP as the Qwen presets run it):

- the run directory holds what docs/contracts.md promises;
- the same config twice gives identical ledgers and parameter hashes; so does DDP's reduction
  after the backward (``parallel.ddp_overlap=false``) with collections every 2 steps, and
  settling every step before the next (``runtime.deferred_settle=false``);
- a tampered ledger makes replay exit 5;
- a truncated or bit-flipped checkpoint is detected, reported, and the previous one used;
- an incompatible resume exits 4 with the diff;
- evaluation on the held-out source falls.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests import launch
from tests.e2e_config import e2e_args
from tests.methods import PRETRAINING

pytestmark = pytest.mark.slow

STEPS = PRETRAINING.steps


@pytest.fixture
def reference(reference_runs):
    """The guarantee table's uninterrupted 2-rank run of e2e.yaml (12 steps, checkpoints every 4)."""
    return reference_runs.run(PRETRAINING)


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
    again = launch.train(e2e_workdir, e2e_args(max_steps=STEPS, name="again"), nproc=2)
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
