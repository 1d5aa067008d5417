"""Per-rank watchdog: no progress within the timeout -> diagnostics bundle, exit 6.

Progress is a ``heartbeat(step, phase)`` (the step timer sends one whenever a phase
starts). A daemon thread checks the age of the last heartbeat; after
``runtime.watchdog_timeout_s`` it writes into ``diagnostics_dir``:

- ``rank<R>_stacks.txt``: every thread's Python stack (``faulthandler``, written from the
  watchdog thread, so it works while the main thread is blocked in C code such as a
  collective or a CUDA synchronize);
- ``rank<R>_watchdog.json``: reason, last step and phase, seconds since the heartbeat,
  thread names and stacks, process/device memory, and the output of every provider
  (pipeline queue depths, stall summary, last ledger line, recent events...);
- ``rank<R>_flight_recorder.pkl`` / ``rank<R>_flight_recorder_nccl.pkl``: torch.distributed's
  collective flight recorders (gloo / NCCL), if a process group exists and they hold
  entries (``configure_nccl_diagnostics`` turns them on).

Then it calls ``on_abort(summary)`` (the trainer records a ``watchdog_abort`` event),
prints one line to stderr, waits ``runtime.watchdog_exit_grace_s`` and ends the process
with ``os._exit(6)``, so torchrun tears the job down. A rank blocked in a collective
because another rank hangs stops heartbeating too, so it also times out and writes its
own part; the grace period keeps the hung rank's connections open meanwhile (with gloo, a
peer's exit fails the blocked collective at once, before its watchdog could dump).

Every part of the bundle after the stacks (providers, memory, callbacks, flushing) runs
in a helper thread with a time limit: a provider that blocks on a lock the hung main
thread holds cannot keep the process alive.

Known-good long phases (checkpoint writes, compilation) go inside ``with
watchdog.pause():``; a pause longer than ``runtime.watchdog_pause_limit_s`` aborts too.

GIL backstop: if the main thread hangs in C code that holds the GIL, no Python thread
runs, this one included. While alive, the watchdog re-arms
``faulthandler.dump_traceback_later`` (a C thread that needs no GIL); if the watchdog
stops running for ``timeout + backstop margin``, that C thread dumps all stacks to stderr
and exits with code 1. ``faulthandler``'s timer is process-wide: nothing else in the
process may use ``dump_traceback_later`` while the backstop is on.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from core.config import RuntimeConfig
from core.exceptions import ExitCode, WatchdogAbort
from experiments.schema import json_safe
from runtime.memory import memory_snapshot

BUNDLE_SCHEMA_VERSION = 1
FLIGHT_RECORDER_PREFIX = "nccl_flight_recorder_rank"
FR_RENAME_VERSION = (2, 9)  # first torch that reads TORCH_FR_BUFFER_SIZE / TORCH_FR_DUMP_TEMP_FILE


class Watchdog:
    """Aborts this rank with diagnostics when heartbeats stop."""

    def __init__(
        self,
        config: RuntimeConfig,
        *,
        rank: int,
        diagnostics_dir: Path,
        providers: Mapping[str, Callable[[], Any]],
        on_abort: Callable[[dict], None] | None,
        device: torch.device | str = "cpu",
        clock: Callable[[], float] = time.monotonic,
        exit_fn: Callable[[int], Any] = os._exit,
        poll_interval_s: float | None = None,
        section_timeout_s: float = 5.0,
        gil_backstop: bool = True,
        backstop_margin_s: float = 60.0,
    ) -> None:
        self._timeout = config.watchdog_timeout_s
        self._pause_limit = config.watchdog_pause_limit_s
        self._exit_grace = config.watchdog_exit_grace_s
        self._rank = rank
        self._dir = Path(diagnostics_dir)
        self._providers = dict(providers)
        self._on_abort = on_abort
        self._device = torch.device(device)
        self._clock = clock
        self._exit = exit_fn
        self._poll = poll_interval_s or min(1.0, max(self._timeout / 10, 0.02))
        self._section_timeout = section_timeout_s
        self._backstop = gil_backstop
        self._backstop_margin = backstop_margin_s
        self._beat: tuple[float, int | None, str] = (clock(), None, "not_started")
        self._lock = threading.Lock()
        self._pauses = 0
        self._pause_started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fired = False
        self._dumped = threading.Event()

    # ------------------------------------------------------------------ public API

    @property
    def enabled(self) -> bool:
        return self._timeout > 0

    @property
    def fired(self) -> bool:
        return self._fired

    def wait_for_dump(self, timeout: float) -> bool:
        """After ``fired``: block until the diagnostics bundle is written (True) or timeout."""
        return self._dumped.wait(timeout)

    def start(self) -> None:
        """Start watching; the timeout counts from now. No-op when the timeout is 0."""
        if not self.enabled or self._thread is not None:
            return
        self._beat = (self._clock(), self._beat[1], self._beat[2])
        self._arm_backstop()  # armed here too: the main thread may grab the GIL at once
        self._thread = threading.Thread(target=self._run, name=f"lockstep-watchdog-rank{self._rank}", daemon=True)
        self._thread.start()

    def heartbeat(self, step: int, phase: str) -> None:
        """Progress: ``step`` entered ``phase``. Cheap (one tuple assignment)."""
        self._beat = (self._clock(), step, phase)

    def on_phase(self, step: int, phase: str) -> None:
        """``PhaseListener`` hook for ``StepTimer``: every phase start is a heartbeat."""
        self.heartbeat(step, phase)

    def pause(self) -> "_Pause":
        """Suspend the timeout (nestable); ``resume()`` or leaving the ``with`` block ends it."""
        with self._lock:
            if self._pauses == 0:
                self._pause_started = self._clock()
            self._pauses += 1
        return _Pause(self)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """``with watchdog.paused():`` the same as ``with watchdog.pause():``."""
        with self.pause():
            yield

    def resume(self) -> None:
        with self._lock:
            if self._pauses == 0:
                return
            self._pauses -= 1
            if self._pauses == 0:
                _, step, phase = self._beat
                self._beat = (self._clock(), step, phase)

    def stop(self) -> None:
        """Stop watching (idempotent); call in the trainer's ``finally``."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._poll * 4 + 1.0)
        if self._backstop:
            faulthandler.cancel_dump_traceback_later()

    def dump(self, reason: str) -> dict[str, Any]:
        """Write the diagnostics bundle now (without exiting); returns its summary."""
        self._dir.mkdir(parents=True, exist_ok=True)
        now = self._clock()
        beat_time, step, phase = self._beat
        stacks = self._write_stacks(reason)
        bundle: dict[str, Any] = {
            "schema_version": BUNDLE_SCHEMA_VERSION,
            "rank": self._rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "reason": reason,
            "last_step": step,
            "last_phase": phase,
            "seconds_since_heartbeat": round(now - beat_time, 3),
            "timeout_s": self._timeout,
            "paused": self._pauses > 0,
            "threads": _thread_stacks(),
            "memory": self._bounded(lambda: memory_snapshot(self._device)),
            "flight_recorder": self._bounded(self._dump_flight_recorder),
            "providers": {name: self._bounded(fn) for name, fn in self._providers.items()},
        }
        json_path = self._dir / f"rank{self._rank}_watchdog.json"
        json_path.write_text(json.dumps(json_safe(bundle), indent=2, default=repr) + "\n")
        files = [str(stacks), str(json_path), *(bundle["flight_recorder"].get("value") or [])]
        # No "rank"/"time"/"event" keys: callers pass this straight into an event record.
        return {
            "step": step,
            "phase": phase,
            "seconds_since_heartbeat": bundle["seconds_since_heartbeat"],
            "timeout_s": self._timeout,
            "reason": reason,
            "files": files,
        }

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._poll):
                self._arm_backstop()
                reason = self._overdue()
                if reason is not None:
                    self._fire(reason)
                    return
        finally:
            if self._backstop:
                faulthandler.cancel_dump_traceback_later()

    def _overdue(self) -> str | None:
        now = self._clock()
        beat_time, _, phase = self._beat
        with self._lock:
            paused, pause_started = self._pauses > 0, self._pause_started
        if paused:
            if self._pause_limit > 0 and now - pause_started > self._pause_limit:
                return (
                    f"paused in phase {phase} for {now - pause_started:.1f}s, longer than "
                    f"runtime.watchdog_pause_limit_s={self._pause_limit:g}"
                )
            return None
        if now - beat_time > self._timeout:
            return f"no progress for {now - beat_time:.1f}s (runtime.watchdog_timeout_s={self._timeout:g})"
        return None

    def _fire(self, reason: str) -> None:
        self._fired = True
        summary = self.dump(reason)
        error = WatchdogAbort(
            f"rank {self._rank} {reason}; last step {summary['step']}, phase {summary['phase']}",
            rank=self._rank,
            step=summary["step"],
            file=summary["files"][0],
            hint=f"read the stacks and rank{self._rank}_watchdog.json in {self._dir}",
        )
        summary["error"] = error.to_record()
        os.write(2, (str(error) + "\n").encode())  # no Python-level lock: the main thread may hold one
        if self._on_abort is not None:
            self._bounded(lambda: self._on_abort(summary))
        self._bounded(_flush_everything, timeout_s=min(self._section_timeout, 2.0))
        self._dumped.set()
        # Exiting tears down this rank's connections, which makes a peer blocked on it fail
        # its collective at once (gloo) instead of timing out and dumping its own stacks.
        time.sleep(self._exit_grace)
        self._exit(ExitCode.WATCHDOG)

    # ------------------------------------------------------------------ helpers

    def _write_stacks(self, reason: str) -> Path:
        path = self._dir / f"rank{self._rank}_stacks.txt"
        with open(path, "w") as handle:
            handle.write(f"# rank {self._rank} pid {os.getpid()}: {reason}\n")
            handle.write(f"# threads: {', '.join(f'{t.ident}={t.name}' for t in threading.enumerate())}\n")
            handle.flush()
            faulthandler.dump_traceback(file=handle, all_threads=True)
        return path

    def _dump_flight_recorder(self) -> list[str]:
        """The collective flight recorders with entries: the generic one (gloo) and, on
        CUDA builds, NCCL's (a separate recorder, ``_dump_nccl_trace``)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return []
        c10d = torch._C._distributed_c10d
        written = []
        for dumper, suffix in (("_dump_fr_trace", ""), ("_dump_nccl_trace", "_nccl")):
            dump = getattr(c10d, dumper, None)
            if dump is None:
                continue
            data = dump()
            if not pickle.loads(data).get("entries"):
                continue
            path = self._dir / f"rank{self._rank}_flight_recorder{suffix}.pkl"
            path.write_bytes(data)
            written.append(str(path))
        return written

    def _bounded(self, fn: Callable[[], Any], timeout_s: float | None = None) -> dict[str, Any]:
        """``{"value": ...}`` or ``{"error": ...}``; never blocks longer than the limit."""
        limit = self._section_timeout if timeout_s is None else timeout_s
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # a diagnostics section must never stop the abort
                box["error"] = f"{type(exc).__name__}: {exc}"

        helper = threading.Thread(target=target, name="lockstep-watchdog-probe", daemon=True)
        helper.start()
        helper.join(limit)
        if helper.is_alive():
            return {"error": f"did not return within {limit:g}s"}
        return box

    def _arm_backstop(self) -> None:
        if self._backstop:
            deadline = self._timeout + self._backstop_margin
            faulthandler.dump_traceback_later(deadline, repeat=False, file=2, exit=True)


class _Pause:
    """Returned by ``Watchdog.pause()``; leaving its ``with`` block resumes."""

    def __init__(self, watchdog: Watchdog) -> None:
        self._watchdog = watchdog

    def __enter__(self) -> "_Pause":
        return self

    def __exit__(self, *exc: object) -> None:
        self._watchdog.resume()


def _thread_stacks() -> dict[str, list[str]]:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        frames = traceback.extract_stack(frame)
        out[f"{names.get(ident, 'unknown')} ({ident})"] = [
            f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-25:]
        ]
    return out


def _flush_everything() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def configure_nccl_diagnostics(
    diagnostics_dir: Path,
    timeout_s: float,
    *,
    environ: dict[str, str] | None = None,
    trace_entries: int = 2000,
) -> dict[str, str]:
    """Turn on torch.distributed's collective diagnostics; returns the effective settings.

    Must run BEFORE the process group is created (ProcessGroupNCCL reads these variables
    at construction). Variables already set in the environment are left alone, so an
    operator's choice wins. ``timeout_s`` (pass ``runtime.watchdog_timeout_s``, at least
    60 s is used) bounds how long NCCL's own watchdog thread may be stuck before its
    heartbeat monitor ends the process.

    - flight recorder: the last ``trace_entries`` collectives per process group, also for
      gloo (``TORCH_FR_BUFFER_SIZE``; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` before torch 2.9);
    - on a collective timeout NCCL dumps it to ``<diagnostics>/nccl_flight_recorder_rank<R>``
      (``TORCH_NCCL_DUMP_ON_TIMEOUT``, ``TORCH_FR_DUMP_TEMP_FILE``, before torch 2.9
      ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``); the Lockstep watchdog also dumps it on a hang;
    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: a failed or timed-out collective tears the
      process down (without a communicator abort that could hang), so torchrun ends the job.
    """
    env = os.environ if environ is None else environ
    diagnostics_dir = Path(diagnostics_dir)
    diagnostics_dir.mkdir(parents=True, exist_ok=True)
    prefix = str(diagnostics_dir.resolve() / FLIGHT_RECORDER_PREFIX)
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(max(timeout_s, 60))),
    }
    # torch renamed the flight recorder variables (TORCH_NCCL_* -> TORCH_FR_*) and warns
    # about the old names; set the names this torch reads.
    if _torch_version() >= FR_RENAME_VERSION:
        wanted.update(TORCH_FR_BUFFER_SIZE=str(trace_entries), TORCH_FR_DUMP_TEMP_FILE=prefix)
    else:
        wanted.update(TORCH_NCCL_TRACE_BUFFER_SIZE=str(trace_entries), TORCH_NCCL_DEBUG_INFO_TEMP_FILE=prefix)
    for key, value in wanted.items():
        env.setdefault(key, value)
    return {key: env[key] for key in wanted}


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)
