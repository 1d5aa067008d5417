"""Two torchrun agents on this machine as two nodes (--nnodes=2, c10d rendezvous on
localhost, one rank each), the mechanism of docs/parallelism.md's Slurm example:

- the ledger equals the single-node 2-rank run's;
- killing one node makes the other node's rank exit within the watchdog timeout, with
  diagnostics (no hang);
- starting both nodes again with --resume continues to the identical ledger;
- a node lost inside a checkpoint save (``crash_checkpoint``) stops the other node's rank
  within the watchdog timeout, publishes nothing, and the resumed run matches too.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests import launch
from tests.e2e_config import e2e_args

pytestmark = pytest.mark.slow

STEPS = 8
WATCHDOG_S = 5
OVERRIDES = [f"runtime.watchdog_timeout_s={WATCHDOG_S}", "checkpoint.interval=2"]


def _node_command(port: int, rdzv_id: str, args: list[str]) -> list[str]:
    return [
        launch.PYTHON, "-m", "torch.distributed.run",
        "--nnodes=2", "--nproc_per_node=1",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv_id}",
        "--max_restarts=0", "--monitor_interval=0.1",
        str(launch.ROOT / "train.py"), *args,
    ]


def _start_nodes(workdir, args: list[str], rdzv_id: str) -> list[subprocess.Popen]:
    port = launch.free_port()
    return [
        subprocess.Popen(_node_command(port, rdzv_id, args), cwd=workdir, env=launch.env(workdir),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for _ in range(2)
    ]


def _lose_node(node: subprocess.Popen) -> None:
    """SIGKILL a node's agent and every process below it (its rank runs in a session of its own)."""
    agent = psutil.Process(node.pid)
    for proc in [*agent.children(recursive=True), agent]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    node.wait(timeout=30)


def _finish(nodes, timeout: float = 600) -> list[tuple[int, str, str]]:
    out = []
    try:
        for node in nodes:
            stdout, stderr = node.communicate(timeout=timeout)
            out.append((node.returncode, stdout, stderr))
    finally:
        for node in nodes:
            if node.poll() is None:
                launch.kill_job(node)
    return out


def _run_dir(workdir, results) -> Path:
    for _, stdout, _ in results:
        for line in stdout.splitlines():
            if line.startswith("run_dir: "):
                return workdir / line.split(": ", 1)[1].strip()
    raise AssertionError(results)


def _checkpoint_saved(run_dir: Path, step: int) -> bool:
    try:
        return any(e["event"] == "checkpoint_saved" and e["step"] >= step for e in launch.events(run_dir))
    except ValueError:  # a line being written
        return False


@pytest.fixture(scope="module")
def expected(e2e_workdir) -> list[dict]:
    """The ledger of the same run on one node (2 ranks), uninterrupted."""
    single = launch.train(e2e_workdir, e2e_args(max_steps=STEPS, name="onenode", overrides=OVERRIDES), nproc=2)
    assert single.returncode == 0, single.stderr
    return launch.ledger(e2e_workdir / single.run_dir)


def test_two_nodes_match_one_node_and_survive_a_lost_node(e2e_workdir, expected):

    results = _finish(_start_nodes(e2e_workdir, e2e_args(max_steps=STEPS, name="twonodes", overrides=OVERRIDES), "twonodes"))
    assert [code for code, _, _ in results] == [0, 0], results
    assert launch.ledger(_run_dir(e2e_workdir, results)) == expected

    # Time to lose a node mid-run: the kill follows the step-4 checkpoint's event within tens of
    # milliseconds, well inside step 5's 0.5 s data wait (the step-6 checkpoint is a second away).
    slow = [*OVERRIDES, "runtime.faults=[slow_data]", "runtime.fault_slow_data_s=0.5"]
    nodes = _start_nodes(e2e_workdir, e2e_args(max_steps=STEPS, name="lostnode", overrides=slow), "lostnode")
    run_dir = None
    try:
        # Only the node that hosts rank 0 prints; find the run dir on disk instead of reading a pipe.
        assert launch.wait_for(lambda: any((e2e_workdir / "runs").glob("lostnode-*")), timeout=300)
        run_dir = next((e2e_workdir / "runs").glob("lostnode-*"))
        # Mid-run, not mid-checkpoint: right after the step-4 checkpoint, while both ranks sleep
        # in step 5's slow data (a step's ledger line is written during the next step, so
        # waiting for ledger lines would lose the node inside the step-4 checkpoint).
        assert launch.wait_for(lambda: _checkpoint_saved(run_dir, 4), timeout=300)
        _lose_node(nodes[1])
        lost_at = time.monotonic()
        nodes[0].wait(timeout=WATCHDOG_S + 60)
        assert time.monotonic() - lost_at < WATCHDOG_S + 60
        assert nodes[0].returncode != 0
    finally:
        for node in nodes:
            if node.poll() is None:
                launch.kill_job(node)
    assert any((run_dir / "diagnostics").iterdir()), "the surviving node wrote no diagnostics"

    run_id = run_dir.name
    resumed = _finish(_start_nodes(e2e_workdir, ["--resume", run_id], "resumed"))
    assert [code for code, _, _ in resumed] == [0, 0], resumed
    assert launch.ledger(run_dir) == expected


def test_a_node_lost_inside_a_checkpoint_save_stops_the_other_and_publishes_nothing(e2e_workdir, expected):
    """Node 1's rank dies inside the step-4 save, after writing its shards (``crash_checkpoint``):
    node 0's rank, paused in the same save, must stop within the watchdog timeout with
    diagnostics; ``LATEST`` stays at step 2; both nodes resumed finish the run to the ledger of
    an uninterrupted single-node run."""
    lost = [*OVERRIDES, "runtime.faults=[crash_checkpoint@4:1]"]
    nodes = _start_nodes(e2e_workdir, e2e_args(max_steps=STEPS, name="lostsave", overrides=lost), "lostsave")
    try:
        nodes[1].wait(timeout=300)
        lost_at = time.monotonic()
        nodes[0].wait(timeout=WATCHDOG_S + 60)
        assert time.monotonic() - lost_at < WATCHDOG_S + 30, "the surviving node outlived the watchdog timeout"
    finally:
        results = _finish(nodes, timeout=30)
    assert all(code != 0 for code, _, _ in results), results
    assert "crash inside the checkpoint save of step 4" in results[1][2]
    run_dir = next((e2e_workdir / "runs").glob("lostsave-*"))
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "LATEST").read_text().strip() == "step_00000002"
    assert not (checkpoints / "step_00000004").exists()
    diagnostics = [p.name for p in (run_dir / "diagnostics").iterdir()]
    assert any(name.startswith("rank0_") for name in diagnostics), diagnostics

    resumed = _finish(_start_nodes(e2e_workdir, ["--resume", run_dir.name, "runtime.faults=[]"], "resumed-save"))
    assert [code for code, _, _ in resumed] == [0, 0], resumed
    assert launch.ledger(run_dir) == expected
