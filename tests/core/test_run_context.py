"""core/run_context.py: run ID, layout, meta.json, and the lock on a live run dir."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess

import pytest
import torch

from core import config as config_lib
from core.distributed_context import DistributedContext
from core.exceptions import RunDirLockedError
from core.run_context import RunContext, git_info


def _single(tmp_path):
    config = config_lib.load(None, [f"run.root={tmp_path / 'runs'}", "run.name=ctx"])
    dist = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", timeout_s=5)
    return config, dist


def test_create_writes_layout_and_meta(tmp_path):
    config, dist = _single(tmp_path)
    run = RunContext.create(config, dist)
    assert re.fullmatch(r"ctx-\d{8}-\d{6}-" + config.hash[:8], run.run_id)
    for sub in ("logs", "checkpoints", "diagnostics", "artifacts"):
        assert (run.run_dir / sub).is_dir()
    assert config_lib.load(run.paths.config) == config
    meta = json.loads(run.paths.meta.read_text())
    assert meta["config_hash"] == config.hash
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["world"]["world_size"] == 1 and meta["determinism"]["mode"] == "bitwise"
    run.release()
    assert not run.paths.lock.exists()


def test_a_second_live_writer_is_refused_and_a_stale_lock_is_taken(tmp_path):
    config, dist = _single(tmp_path)
    run = RunContext.create(config, dist)  # holds the lock (this live process)
    with pytest.raises(RunDirLockedError) as info:
        RunContext.open_existing(config.run.root, run.run_id, dist, lock=True)
    assert str(os.getpid()) in str(info.value)
    run.release()
    # A lock left by a killed process (pid no longer alive) does not block a resume.
    dead = subprocess.Popen(["true"])
    dead.wait()
    run.paths.lock.write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    again = RunContext.open_existing(config.run.root, run.run_id, dist, lock=True)
    assert json.loads(again.paths.lock.read_text())["pid"] == os.getpid()
    again.release()


def test_git_info_outside_a_checkout(tmp_path):
    info = git_info(tmp_path)
    assert info["is_repo"] is False and "not a git checkout" in info["reason"]


def test_a_lock_held_by_a_zombie_is_stale(tmp_path):
    """A killed writer nobody reaped (containers without an init) still has a pid."""
    config, dist = _single(tmp_path)
    run = RunContext.create(config, dist)
    run.release()
    zombie = subprocess.Popen(["true"])
    try:
        import psutil

        assert _wait_for_zombie(zombie.pid)
        run.paths.lock.write_text(json.dumps({"pid": zombie.pid, "host": socket.gethostname()}))
        again = RunContext.open_existing(config.run.root, run.run_id, dist, lock=True)
        assert json.loads(again.paths.lock.read_text())["pid"] == os.getpid()
        assert psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE  # not reaped by the check
        again.release()
    finally:
        zombie.wait()


def _wait_for_zombie(pid: int, timeout: float = 10.0) -> bool:
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.01)
    return False
