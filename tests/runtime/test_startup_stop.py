"""A stop signal before the step loop is recorded (exit 128+signal, a ``failed`` event,
lock released) instead of killing the process silently with its lock held; once the loop's
handlers took over and were restored, the signal gets its default action again. A resume
killed during start-up shows as crashed, not as the earlier stop; ``stopped`` is one event."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from experiments.events import read_events
from experiments.runs import run_state
from runtime.signals import StartupSignals, StopDuringStartup
from tests import launch
from tests.e2e_config import e2e_args


def test_startup_signal_raises_once_with_the_signal_exit_code():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        StartupSignals(signals=(signal.SIGTERM,))
        with pytest.raises(StopDuringStartup) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert info.value.exit_code == 143 and "SIGTERM" in str(info.value)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_after_the_loop_took_over_a_late_signal_gets_the_default_action():
    code = (
        "import os, signal, time\n"
        "from runtime.signals import StartupSignals, StopSignals\n"
        "StartupSignals(signals=(signal.SIGTERM,))\n"
        "StopSignals(signals=(signal.SIGTERM,)).restore()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(5)\n"
        "raise SystemExit(0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=launch.ROOT, env=launch.env(launch.ROOT), timeout=60)
    assert proc.returncode == -signal.SIGTERM


def test_a_resume_killed_during_start_up_is_not_shown_as_the_earlier_stop(tmp_path):
    events = [
        {"event": "run_started", "rank": 0, "time": 1, "run_id": "r"},
        {"event": "stopped", "rank": 0, "time": 2, "step": 4},
        {"event": "resume_started", "rank": 0, "time": 3},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    state, _ = run_state(tmp_path, events=read_events(tmp_path / "events.jsonl"))
    assert state == "crashed"


@pytest.mark.slow
def test_sigterm_during_start_up_ends_the_run_cleanly(e2e_workdir):
    proc = launch.start(e2e_workdir, e2e_args(max_steps=50, name="earlyterm"), nproc=1)
    try:
        first = proc.stdout.readline()
        second = proc.stdout.readline()  # run_dir: the run dir and its lock exist now
        assert first.startswith("run_id: ") and second.startswith("run_dir: "), first + second
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            launch.kill_job(proc)
    run_dir = e2e_workdir / second.split(": ", 1)[1].strip()
    kinds = [e["event"] for e in launch.events(run_dir)]
    # Start-up (exit 143, failed) or, if the loop's handlers were already in place, a
    # clean stop with a checkpoint (exit 0, stopped): either way recorded, and no lock left.
    assert proc.returncode in (143, 0), (proc.returncode, err)
    assert kinds[-1] == ("failed" if proc.returncode == 143 else "stopped"), kinds
    assert kinds.count("stopped") <= 1, kinds
    assert not (run_dir / ".lock").exists()
    assert len(err.strip().splitlines()) <= 2, err  # the stop line (and its notice), no traceback
    assert "Traceback" not in out + err


@pytest.mark.slow
def test_ctrl_c_while_torch_loads_ends_with_one_line_and_writes_nothing(tmp_path):
    # The child takes SIGINT's default whatever this process inherited: a suite started as a shell's
    # background job ignores SIGINT (bash does so for asynchronous commands), an ignored SIGINT is
    # inherited across exec, and Python then installs no KeyboardInterrupt handler, so the Ctrl-C was
    # lost and the run went on to its data error (exit 3).
    proc = subprocess.Popen([sys.executable, str(launch.ROOT / "train.py"), *e2e_args(max_steps=2, name="ctrlc")],
                            cwd=tmp_path, env=launch.env(launch.ROOT), stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    maps = f"/proc/{proc.pid}/maps"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # torch's libraries are being mapped: the imports in train.py's try
        with open(maps) as f:
            if "libtorch" in f.read():
                break
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "train.py: interrupted while starting (Ctrl-C); nothing was written"
    assert not list(tmp_path.rglob("ledger.jsonl")) and not list(tmp_path.rglob("events.jsonl"))
