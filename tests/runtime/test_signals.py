"""runtime/signals.py: stop flags from real signals, immediate exit on a second Ctrl-C."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from core.exceptions import LockstepError
from runtime.signals import INTERRUPT_EXIT_CODE, StopSignals

ROOT = Path(__file__).resolve().parents[2]


class FakeDist:
    """Records the flag it was asked to agree on; pretends another rank said ``other``."""

    def __init__(self, other: bool = False):
        self.other = other
        self.calls = []

    def any_true(self, flag: bool) -> bool:
        self.calls.append(flag)
        return flag or self.other


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_sets_flag_and_names_it(sig):
    with StopSignals() as stop:
        assert not stop.requested and stop.signal_name is None
        os.kill(os.getpid(), sig)
        assert stop.requested
        assert stop.signal_name == sig.name


def test_should_stop_asks_the_ranks_and_latches():
    with StopSignals() as stop:
        dist = FakeDist()
        assert stop.should_stop(dist) is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.should_stop(dist) is True
        assert stop.should_stop(dist) is True
        assert dist.calls == [False, True]  # latched: no third collective
    with StopSignals() as stop:
        assert stop.should_stop(FakeDist(other=True)) is True  # another rank got the signal


def test_restore_puts_previous_handlers_back():
    def mine(signum, frame):
        pass

    old = signal.signal(signal.SIGUSR1, mine)
    try:
        stop = StopSignals()
        assert signal.getsignal(signal.SIGUSR1) != mine
        stop.restore()
        assert signal.getsignal(signal.SIGUSR1) is mine
        stop.restore()  # idempotent
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_second_sigint_exits_at_once_with_130():
    codes = []
    with StopSignals(exit_fn=codes.append) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert codes == []
        os.kill(os.getpid(), signal.SIGINT)
        assert codes == [INTERRUPT_EXIT_CODE]
        assert stop.received == ("SIGINT",)


def test_sigint_after_sigterm_also_means_now():
    codes = []
    with StopSignals(exit_fn=codes.append):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert codes == []
        os.kill(os.getpid(), signal.SIGINT)
        assert codes == [INTERRUPT_EXIT_CODE]


def test_refuses_to_install_outside_main_thread():
    errors = []

    def target():
        try:
            StopSignals()
        except LockstepError as exc:
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


_CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from runtime.signals import StopSignals

    class One:
        def any_true(self, flag):
            return flag

    stop = StopSignals()
    print("ready", flush=True)
    for step in range(2000):
        time.sleep(0.01)
        if stop.should_stop(One()):
            print("clean stop at", step, stop.signal_name, flush=True)
            sys.exit(0)
    sys.exit(3)
    """
)


def _start_child():
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(root=str(ROOT))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_real_process_stops_cleanly_on_sigterm():
    proc = _start_child()
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "clean stop at" in out and "SIGTERM" in out


def test_real_process_exits_130_on_double_ctrl_c():
    # A slow loop body so the second SIGINT lands before the step boundary is reached.
    child = _CHILD.replace("time.sleep(0.01)", "time.sleep(5)").format(root=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == INTERRUPT_EXIT_CODE, (out, err)
    assert "clean stop" not in out
    assert "second interrupt" in err
