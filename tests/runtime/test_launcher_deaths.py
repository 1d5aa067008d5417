"""What ``python train.py --nproc 2`` reports when a process of the job is killed from outside
(runtime/launcher.py, runtime/signals.py).

- A rank SIGKILLed (as by the OOM killer): its peer's collective fails on the closed connection
  ("Connection reset by peer") and writes its line first; the launcher still names the killed
  rank and the signal, and exits 128 + 9.
- The launcher SIGKILLed: its ranks exit within seconds (runtime.signals.exit_with_launcher) and
  record a ``failed`` event naming it, so ``runs list`` shows the run failed, not crashed. A rank
  whose collective fails because a peer already left that way records the same event, never its
  own error, whichever it notices first.
"""

from __future__ import annotations

import os
import signal
import subprocess
from types import SimpleNamespace

import psutil
import pytest

from experiments.runs import run_state
from runtime import launcher, signals
from runtime.signals import LauncherWatch, exit_if_launcher_lost, exit_with_launcher
from tests import launch
from tests.e2e_config import e2e_args
from training import session


def _start_nproc(cwd, name: str) -> subprocess.Popen:
    command = [launch.PYTHON, str(launch.ROOT / "train.py"), "--nproc", "2", *e2e_args(max_steps=400, name=name)]
    return subprocess.Popen(command, cwd=cwd, env=launch.env(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _training(cwd, job: subprocess.Popen, name: str):
    """(run dir, {rank: process}) once the job has written two ledger lines."""
    runs = cwd / "runs"
    assert launch.wait_for(lambda: [d for d in launch.run_dirs_named(runs, name) if (d / "ledger.jsonl").is_file()],
                           timeout=180), job.stderr.read()
    (run_dir,) = launch.run_dirs_named(runs, name)
    assert launch.wait_for(lambda: len(launch.ledger(run_dir)) >= 2, timeout=120)
    ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(job.pid).children()}
    assert sorted(ranks) == [0, 1]
    return run_dir, ranks


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_a_rank_killed_by_sigkill_is_named_with_its_signal(e2e_workdir):
    job = _start_nproc(e2e_workdir, "oom-kill")
    try:
        _, ranks = _training(e2e_workdir, job, "oom-kill")
        ranks[1].send_signal(signal.SIGKILL)  # what the OOM killer does
        out, err = job.communicate(timeout=120)
    finally:
        launch.kill_job(job)
    assert job.returncode == 128 + signal.SIGKILL, err
    assert err.splitlines() == ["[rank 1] was killed by SIGKILL (the OOM killer, or a kill -9?); 1 other rank ended "
                                "after it -> its log is logs/rank1.log in the run dir"], err


@pytest.mark.slow
def test_a_killed_launchers_run_reads_as_failed_naming_the_launcher(e2e_workdir):
    job = _start_nproc(e2e_workdir, "launcher-kill")
    ranks: dict = {}
    try:
        run_dir, ranks = _training(e2e_workdir, job, "launcher-kill")
        os.kill(job.pid, signal.SIGKILL)  # the launcher alone: its ranks have sessions of their own
        job.wait(timeout=30)
        assert launch.wait_for(lambda: not any(_alive(r) for r in ranks.values()), timeout=15)
    finally:
        launch.kill_job(job)
        for rank in ranks.values():
            if _alive(rank):
                rank.kill()
    state, detail = run_state(run_dir)
    assert state == "failed", detail
    assert f"the launcher (pid {job.pid}) died" in detail, detail
    lost = [e for e in launch.events(run_dir) if e.get("type") == "LauncherLost"]
    assert sorted(e["rank"] for e in lost) == [0, 1] and all(e["event"] == "failed" for e in lost)
    resumed = launch.train(e2e_workdir, ["--resume", run_dir.name, "train.max_steps=6"])
    assert resumed.returncode == 0, resumed.stderr  # what a kill leaves: a stale lock, no half checkpoint
    assert run_state(run_dir)[0] == "finished"


# --------------------------------------------------------------------------- in-process


def _failure(pid: int, exitcode: int, message="<NONE>", time_ns: int | None = None):
    data = {"message": message if time_ns is None else {"message": message, "extraInfo": {"time_ns": time_ns}}}
    name = signal.Signals(-exitcode).name if exitcode < 0 else "<N/A>"
    return SimpleNamespace(pid=pid, exitcode=exitcode, error_file_data=data, timestamp=100, signal_name=lambda: name)


def test_the_rank_that_ended_first_without_a_line_is_the_root_cause():
    reset = "[rank 0] error: RuntimeError: Connection reset by peer"
    failures = {0: _failure(10, 1, reset, time_ns=5), 1: _failure(11, -9)}
    assert launcher.first_failure(failures)[0] == 0  # without the order of ends: the explained failure
    rank, code, line = launcher.first_failure(failures, ended={11: 1_000, 10: 2_000})
    assert (rank, code) == (1, 137) and line.startswith("[rank 1] was killed by SIGKILL (the OOM killer")
    # a peer the agent stopped with SIGTERM after a real failure is never the root cause
    failures = {0: _failure(10, 3, "[rank 0] data error: bad record", time_ns=5), 1: _failure(11, -15)}
    assert launcher.first_failure(failures, ended={11: 1_000, 10: 900})[:2] == (0, 3)
    assert launcher.first_failure(failures, ended={11: 800, 10: 900})[:2] == (0, 3)
    # an explained rank that ended first keeps its line
    failures = {0: _failure(10, 3, "[rank 0] data error", time_ns=5), 1: _failure(11, -9)}
    assert launcher.first_failure(failures, ended={10: 1_000, 11: 2_000})[:2] == (0, 3)
    # a native crash, ended first, without a line
    failures = {0: _failure(10, 1, reset, time_ns=5), 1: _failure(11, -int(signal.SIGSEGV))}
    line = launcher.first_failure(failures, ended={11: 1, 10: 2})[2]
    assert "killed by SIGSEGV (a crash in native code" in line


@pytest.mark.slow
def test_rank_deaths_notes_when_each_child_ended():
    others = len(psutil.Process().children())  # e.g. the suite's zygote: a launcher has only its ranks
    deaths = launcher.RankDeaths(others + 2, find_every_s=0.01).start()
    try:
        short = subprocess.Popen(["sleep", "0.2"])
        longer = subprocess.Popen(["sleep", "0.6"])
        short.wait(), longer.wait()
        assert launch.wait_for(lambda: {short.pid, longer.pid} <= set(deaths.ended), timeout=5)
    finally:
        deaths.stop()
    assert deaths.ended[short.pid] < deaths.ended[longer.pid]


def test_the_watch_records_a_failed_event_before_it_exits(tmp_path, monkeypatch):
    parent = [100]
    monkeypatch.setattr(os, "getppid", lambda: parent[0])
    exits = []
    watch = exit_with_launcher(poll_s=0.01, exit_fn=exits.append, environ={"TORCHELASTIC_RUN_ID": "x", "RANK": "1"})
    events = tmp_path / "events.jsonl"
    watch.record_to(events)
    parent[0] = 1  # the launcher died: the rank was re-parented
    watch.join(timeout=5)
    assert exits == [1]
    [event] = launch.events(tmp_path)
    assert (event["event"], event["rank"], event["exit_code"], event["type"]) == ("failed", 1, 1, "LauncherLost")
    state, detail = run_state(tmp_path)
    assert state == "failed" and "the launcher (pid 100) died" in detail, detail


class _Exited(Exception):
    """What the fake exit raises, so the caller stops where the rank's process would."""


def _exit(code: int) -> None:
    raise _Exited(code)


def test_a_failure_after_the_launchers_death_is_recorded_as_that_death(tmp_path, monkeypatch):
    parent = [100]
    monkeypatch.setattr(os, "getppid", lambda: parent[0])
    watch = LauncherWatch(100, "1", poll_s=60, exit_fn=_exit)  # not started: its poll is the test's call
    watch.record_to(tmp_path / "events.jsonl")
    monkeypatch.setattr(signals, "_launcher_watch", watch)
    exit_if_launcher_lost()  # the launcher lives: the rank's own failure is the cause
    assert launch.events(tmp_path) == []
    parent[0] = 1  # the launcher died; a peer's exit then broke this rank's collective
    with pytest.raises(_Exited):
        session.fail(RuntimeError("Connection reset by peer"), None, None, None)
    with pytest.raises(_Exited):
        watch.end()  # the watch's own poll, a moment later: the loss is recorded once
    [event] = launch.events(tmp_path)
    assert (event["event"], event["rank"], event["type"]) == ("failed", 1, "LauncherLost")
