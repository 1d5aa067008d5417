"""Stop requests from signals, agreed across ranks at step boundaries.

SIGTERM (preemption, torchrun teardown), SIGINT (Ctrl-C) and SIGUSR1 (e.g. SLURM's
warning before the time limit) only set a flag; the training loop asks
``should_stop(dist)`` once per step boundary, every rank gets the same answer (one small
all-reduce), and the run checkpoints and exits 0. A SIGINT that arrives while a stop is
already pending means "now": the process exits at once with code 130, without cleanup.

Python runs signal handlers in the main thread between bytecodes, so a rank blocked in a
long C call (a collective, a kernel) sees its flag only when that call returns; that is
fine for step-boundary semantics, and a rank that never returns is the watchdog's case.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator, Protocol, Sequence

from core.exceptions import LockstepError
from runtime.own_code_raise import raise_in_own_code

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
INTERRUPT_EXIT_CODE = 130


class AgreesOnFlags(Protocol):
    """The part of DistributedContext used here."""

    def any_true(self, flag: bool) -> bool: ...


class StopSignals:
    """Installs stop handlers on construction; ``restore()`` (or ``with``) removes them."""

    def __init__(
        self,
        *,
        signals: Sequence[signal.Signals] = STOP_SIGNALS,
        exit_fn: Callable[[int], Any] = os._exit,
    ) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise LockstepError(
                "StopSignals must be created in the main thread",
                hint="create it in train.py / the trainer before the step loop",
            )
        self._exit = exit_fn
        self._received: list[str] = []
        self._at_once = False  # inside at_once(): a stop signal raises instead of waiting for a step boundary
        self._agreed = False
        self._previous: dict[signal.Signals, Any] = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
            owner = getattr(self._previous[sig], "__self__", None)
            if isinstance(owner, StartupSignals):
                owner.disarm()  # the step loop's stop handling takes over from start-up's

    # ------------------------------------------------------------------ queries

    @property
    def requested(self) -> bool:
        """Whether this process received a stop signal."""
        return bool(self._received)

    @property
    def signal_name(self) -> str | None:
        """The first stop signal received (e.g. "SIGTERM"), or None."""
        return self._received[0] if self._received else None

    @property
    def received(self) -> tuple[str, ...]:
        return tuple(self._received)

    def should_stop(self, dist: AgreesOnFlags) -> bool:
        """True on every rank if any rank received a stop signal (a collective: every rank
        must call it at the same step boundary). Once True it stays True."""
        if not self._agreed:
            self._agreed = dist.any_true(self.requested)
        return self._agreed

    # ------------------------------------------------------------------ lifecycle

    def restore(self) -> None:
        """Put back the handlers that were installed before (idempotent)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @contextlib.contextmanager
    def at_once(self) -> Iterator[None]:
        """Start-up work after the handlers are installed and before the first step (building a
        frozen teacher or reference can take minutes): inside, a stop signal, or one received
        before, raises ``StopDuringStartup`` (exit 128 + signal) at once instead of waiting for a
        step boundary that is still far off. Nothing has been trained: there is nothing to save."""
        if self._received:
            raise StopDuringStartup(signal.Signals[self._received[0]])
        self._at_once = True
        try:
            yield
        finally:
            self._at_once = False

    def __enter__(self) -> "StopSignals":
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    # ------------------------------------------------------------------ handler

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self._received:
            if _prints_notices():
                os.write(2, f"stop: second interrupt ({name}); exiting now without cleanup\n".encode())
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError, RuntimeError):
                    pass
            self._exit(INTERRUPT_EXIT_CODE)
            return
        self._received.append(name)
        if self._at_once:
            self._at_once = False
            # at the next line of our own code: raised inside torch's or safetensors' code, it could
            # leave their state half-updated and end the run with their error (runtime/own_code_raise.py)
            raise_in_own_code(frame, StopDuringStartup(signum))
            return
        if len(self._received) == 1 and _prints_notices():
            os.write(2, f"stop: {name} received; stopping at the next step boundary "
                        "(Ctrl-C again to exit now)\n".encode())


def _prints_notices() -> bool:
    """Under ``python train.py --nproc N`` every rank gets the signal: rank 0 alone says so."""
    from runtime.launcher import under_launcher

    return not under_launcher() or os.environ.get("RANK", "0") == "0"


class StopDuringStartup(LockstepError):
    """A stop signal before the step loop could take it: nothing to checkpoint yet, so the
    run records a failure with exit code 128 + signal (143 for SIGTERM) and ends cleanly
    (event written, lock released) instead of dying silently with its lock held."""

    kind = "stopped during start-up"

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(
            f"{name} received before the first step; nothing was trained or checkpointed",
            signal=name,
            hint="run or resume it again",
        )
        self.exit_code = 128 + signum


class StartupSignals:
    """From process start until ``StopSignals`` takes over: the first stop signal raises
    ``StopDuringStartup`` in the main thread. Once disarmed (by ``StopSignals``), a signal
    that reaches it again (after the loop's handlers are restored, during teardown) gets
    the default action, as if no handler had been installed."""

    def __init__(self, *, signals: Sequence[signal.Signals] = STOP_SIGNALS) -> None:
        self._armed = True
        for sig in signals:
            signal.signal(sig, self._handle)

    def disarm(self) -> None:
        self._armed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._armed:
            self._armed = False
            raise_in_own_code(frame, StopDuringStartup(signum))  # as StopSignals.at_once does
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


class LauncherWatch(threading.Thread):
    """The daemon thread of ``exit_with_launcher``: ends the rank when its parent changes."""

    def __init__(self, launcher: int, rank: str, *, poll_s: float, exit_fn: Callable[[int], Any]) -> None:
        super().__init__(name="lockstep-launcher-watch", daemon=True)
        self.launcher = launcher
        self._rank = rank
        self._poll_s = poll_s
        self._exit_fn = exit_fn
        self._events: Path | None = None
        self._ending = threading.Lock()  # the watch and the main thread may both see the loss: one event
        self._recorded = False

    def record_to(self, events: Path | None) -> None:
        """Once the run dir exists: where the launcher's death is recorded (the run's events.jsonl).
        The event's modules are imported here, by the main thread, not at this module's import
        (train.py's first statement, ahead of everything slow) nor in a dying rank."""
        import experiments.events  # noqa: F401
        import experiments.schema  # noqa: F401

        self._events = events

    @property
    def lost(self) -> bool:
        """Whether the launcher died: the kernel re-parents its children as it exits, so this is
        True before any peer rank can have ended because of that death."""
        return os.getppid() != self.launcher

    def run(self) -> None:
        while True:
            time.sleep(self._poll_s)
            if self.lost:
                self.end()
                return

    def end(self) -> None:
        """Record the launcher's death and say so on stderr (once per process, whichever thread comes
        first), then exit with code 1, without cleanup."""
        with self._ending:
            if not self._recorded:
                self._recorded = True
                try:
                    self._record_loss()
                except Exception:  # noqa: BLE001 - nothing may keep the rank from exiting
                    pass
                try:
                    sys.stderr.write(f"[rank {self._rank}] launcher (pid {self.launcher}) is gone; "
                                     "exiting without cleanup\n")
                    sys.stderr.flush()
                except (OSError, ValueError):  # stderr a pipe whose reader went with the launcher
                    pass
        self._exit_fn(1)

    def _record_loss(self) -> None:
        """A ``failed`` event naming the launcher, so ``runs list`` shows a failed run, not a crashed one.

        One ``O_APPEND`` write (experiments/events.py), so a line the main thread writes at the same
        moment stays whole; not through the logger, whose lock the main thread may hold."""
        if self._events is None or not self._events.parent.is_dir():
            return
        from experiments.events import append_line  # loaded by record_to
        from experiments.schema import Event
        rank = int(self._rank) if self._rank.isdigit() else 0
        event = Event.create("failed", time=time.time(), rank=rank, exit_code=1, type="LauncherLost",
                             error=f"the launcher (pid {self.launcher}) died; the rank exited without cleanup",
                             hint="resume the run (--resume RUN_ID) from its last checkpoint")
        append_line(self._events, event.to_json())  # a full disk: the run reads as crashed, as before


def record_launcher_loss(events: Path | None) -> None:
    """Tell this rank's launcher watch (if any) where to record the launcher's death: the run's
    events.jsonl, once the run dir exists (None: nowhere, e.g. a replay)."""
    if _launcher_watch is not None:
        _launcher_watch.record_to(events)


def exit_if_launcher_lost() -> None:
    """A failing rank calls this before it records its own failure: if its launcher is gone, the
    failure follows from that death (a peer the watch ended broke its collective), so the rank
    records ``LauncherLost`` and exits as its watch would, instead of recording an error that,
    written after the peers' ``LauncherLost``, would read as the run's cause. Returns (does
    nothing) when there is no watch or the launcher lives."""
    if _launcher_watch is not None and _launcher_watch.lost:
        _launcher_watch.end()


def exit_with_launcher(
    *, poll_s: float = 1.0, exit_fn: Callable[[int], Any] = os._exit, environ: dict[str, str] | None = None
) -> LauncherWatch | None:
    """Under torchrun, end this rank within ``poll_s`` of its launcher's death.

    torchrun starts every rank in a session of its own, so SIGKILL of torchrun (or of its
    process group: an OOM killer's pick, ``timeout -s KILL``, a harness's ``killpg``) leaves the
    ranks running: holding the GPU, the run dir's lock and their checkpoint writes, with no
    one to collect their exit. A daemon thread watches the parent pid and exits the process
    (code 1, no cleanup, as a kill would) once it changes; the resume then finds what a kill
    leaves: a stale lock and no half-written checkpoint published. Where the run dir exists
    (``record_launcher_loss``), it first appends a ``failed`` event naming the launcher to the
    run's events.jsonl (``type: LauncherLost``), so the run reads as failed, with its cause,
    rather than crashed.

    The launcher is the parent at the first call, so the first call must come before anything
    slow: ``train.py`` makes it its first statement, ahead of the imports (seconds of torch),
    and a launcher killed during them is still noticed. Later calls return the same thread.

    Returns the thread, or None when the process was not started by torchrun.
    """
    global _launcher_watch
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    if _launcher_watch is not None and environ is None:
        return _launcher_watch
    thread = LauncherWatch(os.getppid(), env.get("RANK", "?"), poll_s=poll_s, exit_fn=exit_fn)
    thread.start()
    if environ is None:
        _launcher_watch = thread
    return thread


_launcher_watch: LauncherWatch | None = None  # this process's watch, once started
