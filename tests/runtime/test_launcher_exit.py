"""A rank outlives neither a SIGKILLed torchrun nor a killed process group of it.

torchrun starts each rank in a session of its own, so killing the launcher's group does not
reach the ranks; without ``runtime.signals.exit_with_launcher`` they train on, holding the
run dir's lock (and, on a GPU, the device) while the resume is refused.
"""

from __future__ import annotations

import os

import psutil
import pytest

from runtime.signals import exit_with_launcher
from tests import launch
from tests.e2e_config import e2e_args

pytestmark = pytest.mark.slow


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ranks_exit_within_seconds_of_the_launcher_and_the_run_resumes(e2e_workdir):
    job = launch.start(e2e_workdir, e2e_args(max_steps=400, name="orphans"))
    ranks: list[psutil.Process] = []
    try:
        assert launch.wait_for(lambda: list((e2e_workdir / "runs").glob("orphans-*")), timeout=120)
        run_dir = next((e2e_workdir / "runs").glob("orphans-*"))
        assert launch.wait_for(lambda: len(launch.ledger(run_dir)) >= 2, timeout=120), job.stderr.read()
        ranks = psutil.Process(job.pid).children(recursive=True)
        assert len(ranks) == 2
        assert all(os.getsid(r.pid) != os.getsid(job.pid) for r in ranks)  # out of reach of killpg
        launch.kill_job(job)
        gone = launch.wait_for(lambda: not any(_alive(r) for r in ranks), timeout=10)
        assert gone, f"ranks {[r.pid for r in ranks if _alive(r)]} outlived their launcher"
    finally:
        launch.kill_job(job)
        for rank in ranks:
            if _alive(rank):
                rank.kill()
    resumed = launch.train(e2e_workdir, ["--resume", run_dir.name, "train.max_steps=8"])
    assert resumed.returncode == 0, resumed.stderr
    assert "locked" not in resumed.stderr


def test_ranks_killed_while_still_importing_exit_too(e2e_workdir):
    """The launcher SIGKILLed as soon as its ranks run Python, while they are still importing
    torch, and nobody reading their stdout and stderr any more (as when a harness drops the
    killed job's pipes): the watch (a thread) starts before those imports, as train.py's first
    statement, and exits the rank even though its farewell line cannot be written. (Before that, the interpreter's own start, tens of milliseconds, is
    the one window in which a rank cannot yet tell its launcher.)"""
    job = launch.start(e2e_workdir, e2e_args(max_steps=400, name="early-orphans"))
    ranks: list[psutil.Process] = []
    try:
        launcher = psutil.Process(job.pid)
        assert launch.wait_for(lambda: len(launcher.children(recursive=True)) == 2, timeout=60, interval=0.01)
        ranks = launcher.children(recursive=True)
        assert launch.wait_for(lambda: all(r.num_threads() >= 2 for r in ranks), timeout=30, interval=0.01)
        launch.kill_job(job)
        job.stdout.close()  # the ranks' stdout and stderr are pipes nobody reads now: a write fails
        job.stderr.close()
        gone = launch.wait_for(lambda: not any(_alive(r) for r in ranks), timeout=15)
        assert gone, f"ranks {[r.pid for r in ranks if _alive(r)]} outlived their launcher"
        assert not list((e2e_workdir / "runs").glob("early-orphans-*/ledger.jsonl"))  # killed before any step
    finally:
        launch.kill_job(job)
        for rank in ranks:
            if _alive(rank):
                rank.kill()


def test_the_watch_calls_exit_when_the_parent_changes(monkeypatch):
    exits = []
    parents = iter([100, 100, 1])
    monkeypatch.setattr(os, "getppid", lambda: next(parents, 1))
    thread = exit_with_launcher(poll_s=0.01, exit_fn=exits.append, environ={"TORCHELASTIC_RUN_ID": "x", "RANK": "3"})
    thread.join(timeout=5)
    assert exits == [1]
    assert exit_with_launcher(environ={}) is None  # not under torchrun: nothing to watch


def test_the_watch_exits_even_when_stderr_is_a_broken_pipe(monkeypatch):
    class BrokenPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    exits = []
    parents = iter([100, 1])
    monkeypatch.setattr(os, "getppid", lambda: next(parents, 1))
    monkeypatch.setattr("sys.stderr", BrokenPipe())
    thread = exit_with_launcher(poll_s=0.01, exit_fn=exits.append, environ={"TORCHELASTIC_RUN_ID": "x", "RANK": "0"})
    thread.join(timeout=5)
    assert exits == [1]
