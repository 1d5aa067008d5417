"""Launchers and their ranks.

A rank outlives neither a SIGKILLed torchrun nor a killed process group of it: torchrun
starts each rank in a session of its own, so killing the launcher's group does not reach the
ranks; without ``runtime.signals.exit_with_launcher`` they train on, holding the run dir's
lock (and, on a GPU, the device) while the resume is refused.

``python train.py --nproc N`` (runtime/launcher.py) keeps train.py's exit codes and prints
one line per failure: what a user sees on the terminal is asserted line by line.
"""

from __future__ import annotations

import os
import signal
import subprocess
from types import SimpleNamespace

import psutil
import pytest

from core.exceptions import UsageError
from runtime import launcher
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
    job = launch.start(e2e_workdir, e2e_args(max_steps=400, name="orphans"), rendezvous="static")
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
    job = launch.start(e2e_workdir, e2e_args(max_steps=400, name="early-orphans"), rendezvous="static")
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


# --------------------------------------------------------------------------- python train.py --nproc N


def _nproc_command(args: list[str], nproc: int = 2) -> list[str]:
    return [launch.PYTHON, str(launch.ROOT / "train.py"), "--nproc", str(nproc), *args]


def _run_nproc(cwd, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(_nproc_command(args), cwd=cwd, env=launch.env(cwd), capture_output=True, text=True,
                          timeout=180)


def _no_launcher_noise(text: str) -> None:
    for noise in ("Traceback", "ChildFailedError", "SignalException", "torch.distributed.elastic"):
        assert noise not in text, text


def test_nproc_config_error_prints_one_line_and_exits_2(tmp_path):
    result = _run_nproc(tmp_path, e2e_args(max_steps=2, overrides=["train.max_step=3"]))
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()  # both ranks fail; the terminal shows one of them, once
    assert len(lines) == 1 and "train.max_step" in lines[0] and "did you mean train.max_steps" in lines[0], lines
    assert not (tmp_path / "runs").exists()


def test_nproc_data_error_prints_one_line_and_exits_3(e2e_workdir):
    args = e2e_args(max_steps=2, name="nproc-data", overrides=["data.sources=[{path: nowhere/*.jsonl}]"])
    result = _run_nproc(e2e_workdir, args)
    assert result.returncode == 3, result.stdout + result.stderr
    _no_launcher_noise(result.stdout + result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[rank ") and "data error" in lines[0] and "nowhere" in lines[0]
    stdout = result.stdout.splitlines()
    assert stdout[0].startswith("run_id: nproc-data-") and stdout[1].startswith("run_dir: "), stdout
    assert "error" not in "\n".join(stdout).lower(), stdout


def test_nproc_sigint_checkpoints_and_exits_0(e2e_workdir):
    job = subprocess.Popen(_nproc_command(e2e_args(max_steps=400, name="nproc-stop")), cwd=e2e_workdir,
                           env=launch.env(e2e_workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        runs = e2e_workdir / "runs"
        assert launch.wait_for(lambda: list(runs.glob("nproc-stop-*/ledger.jsonl")), timeout=120)
        run_dir = next(runs.glob("nproc-stop-*"))
        assert launch.wait_for(lambda: len(launch.ledger(run_dir)) >= 2, timeout=120)
        job.send_signal(signal.SIGINT)  # Ctrl-C reaches the launcher; the ranks have sessions of their own
        out, err = job.communicate(timeout=120)
    finally:
        launch.kill_job(job)
    assert job.returncode == 0, err
    _no_launcher_noise(out + err)
    assert err.splitlines() == ["stop: SIGINT received; stopping at the next step boundary (Ctrl-C again to exit now)"]
    stdout = out.splitlines()
    assert stdout[:2] == [f"run_id: {run_dir.name}", f"run_dir: runs/{run_dir.name}"], stdout
    last = launch.ledger(run_dir)[-1]["step"]
    assert stdout[-1].startswith(f"stopped: steps 1..{last}, "), stdout
    assert (run_dir / "checkpoints" / "LATEST").read_text().strip().endswith(f"{last:08d}")
    assert sum(line.startswith("stopped:") for line in stdout) == 1


def _failure(exitcode: int, message, time_ns: int | None = None, timestamp: int = 100):
    data = {"message": message if time_ns is None else {"message": message, "extraInfo": {"time_ns": time_ns}}}
    signal_name = signal.Signals(-exitcode).name if exitcode < 0 else "<N/A>"
    return SimpleNamespace(exitcode=exitcode, error_file_data=data, timestamp=timestamp,
                           signal_name=lambda: signal_name)


def test_the_first_failure_is_the_earliest_by_the_ranks_own_clock():
    failures = {
        0: _failure(1, "[rank 0] error: RuntimeError: Connection closed by peer", time_ns=2_000_000_123),
        1: _failure(3, "[rank 1] data error: bad record", time_ns=2_000_000_001),  # same second, earlier
    }
    assert launcher.first_failure(failures) == (1, 3, "[rank 1] data error: bad record")
    # A peer the agent killed after that failure has no message, and a time in whole seconds
    # that truncates to before it: the explained failure is still the root cause.
    failures[2] = _failure(-15, "<NONE>", timestamp=1)
    assert launcher.first_failure(failures)[:2] == (1, 3)
    killed = launcher.first_failure({2: _failure(-9, "<NONE>")})
    assert killed[:2] == (2, 137) and "SIGKILL" in killed[2] and "logs/rank2.log" in killed[2]


def test_nproc_is_taken_out_of_the_arguments(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launcher.split_nproc(["--config", "x.yaml", "--nproc", "4", "a=1"]) == (4, ["--config", "x.yaml", "a=1"])
    assert launcher.split_nproc(["--nproc=2", "--resume", "r"]) == (2, ["--resume", "r"])
    assert launcher.split_nproc(["--config", "x.yaml"]) == (None, ["--config", "x.yaml"])
    for bad in (["--nproc"], ["--nproc", "0"], ["--nproc", "two"]):
        with pytest.raises(UsageError, match="--nproc"):
            launcher.split_nproc(bad)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(UsageError, match="torchrun"):
        launcher.split_nproc(["--nproc", "2"])
