"""A launcher restart continues the same run (runtime/relaunch.py): torchrun
--max_restarts=1 after crash@S:R resumes the same run ID and dir from its newest intact
checkpoint, the fault does not fire again, and the ledger equals an uninterrupted run's."""

from __future__ import annotations

import subprocess

import pytest

from runtime import relaunch
from tests import launch
from tests.e2e_config import e2e_args

STEPS = 6


def test_launch_key_and_restart_detection():
    assert relaunch.launch_key({"SLURM_JOB_ID": "123", "TORCHELASTIC_RUN_ID": "abc"}) == "slurm-123"
    assert relaunch.launch_key({"TORCHELASTIC_RUN_ID": "a/b"}) == "torchelastic-a_b"
    assert relaunch.launch_key({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert relaunch.launch_key({}) is None
    assert relaunch.is_restart({"TORCHELASTIC_RESTART_COUNT": "1"})
    assert relaunch.is_restart({"SLURM_RESTART_COUNT": "2"})
    assert not relaunch.is_restart({"TORCHELASTIC_RESTART_COUNT": "0"})


def test_only_a_restart_of_the_same_job_finds_its_run(tmp_path):
    first = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}
    relaunch.record_launch(tmp_path, "r-1", first)
    assert relaunch.launched_run(tmp_path, first) is None  # the first attempt starts a run
    assert relaunch.launched_run(tmp_path, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}) == "r-1"
    assert relaunch.launched_run(tmp_path, {"SLURM_JOB_ID": "8", "SLURM_RESTART_COUNT": "1"}) is None


def test_faults_fire_once_per_run():
    faults = ["crash@4:1", "nan@9", "slow_data", "sigterm@step=2,rank=0"]
    assert relaunch.faults_not_yet_reached(faults, last_recorded_step=3) == ["nan@9", "slow_data"]
    assert relaunch.faults_not_yet_reached(faults, last_recorded_step=0) == faults


@pytest.mark.slow
def test_torchrun_restart_after_a_rank_crash_continues_the_same_run(e2e_workdir):
    # The same checkpoint cadence as the restarted run: checkpoint steps carry param_hash.
    reference = launch.train(e2e_workdir, e2e_args(max_steps=STEPS, name="restartref",
                                                   overrides=["checkpoint.interval=2"]), nproc=2)
    assert reference.returncode == 0, reference.stderr
    command = launch.command(2, e2e_args(
        max_steps=STEPS, name="restarted", overrides=["runtime.faults=[crash@4:1]", "checkpoint.interval=2"]),
        rendezvous="c10d")
    command[command.index("--max_restarts=0")] = "--max_restarts=1"
    command.insert(command.index("--max_restarts=1"), f"--rdzv_id=restart-{launch.free_port()}")  # the job's ID
    proc = subprocess.run(command, cwd=e2e_workdir, env=launch.env(e2e_workdir), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = {line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("run_id: ")}
    assert len(ids) == 1, ids  # both attempts worked on one run
    run_dir = e2e_workdir / next(l for l in proc.stdout.splitlines() if l.startswith("run_dir: ")).split(": ", 1)[1]
    assert proc.stderr.count("fault injection: rank 1: crash at step 4") == 1
    kinds = [e["event"] for e in launch.events(run_dir)]
    assert "resume_started" in kinds and kinds[-1] == "finished", kinds
    assert launch.ledger(run_dir) == launch.ledger(e2e_workdir / reference.run_dir)
