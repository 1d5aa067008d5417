"""Per-step phase timing and a torch.profiler window.

``StepTimer`` splits a step into named phases (``data_wait``, ``forward``, ``backward``,
``optimizer``, ``communication``, ``checkpoint``; others are allowed). Phases may nest;
time is exclusive (a phase opened inside another pauses the outer one). It tells its
listeners (the watchdog, the stall detector) whenever a phase starts, which doubles as
the progress heartbeat.

Timing semantics on CUDA: phases are timed on the host, and kernels run asynchronously, so
a phase's host time is when its work was *issued*. By default ``end_step`` does not wait for
the device: the loop reads the step's loss once, after the backward, so the host runs at most
the optimizer update ahead of the GPU, and the mean of the step times is the device's rate
while each step's own time may be off by that overlap. ``sync_step_end=True`` waits for the
device at every step end and reports the wait as ``device_sync``: each step total is then
exact, at the cost of the GPU idling while the host prepares the next step (on small steps
that is most of the difference between one GPU and several). ``sync_each_phase=True``
synchronizes at every phase boundary for exact phase times (debugging only).

``ProfilerWindow`` records ``runtime.profile_steps`` steps from
``runtime.profile_start_step`` with torch.profiler and writes a chrome trace (open in
https://ui.perfetto.dev or chrome://tracing) per rank into ``trace_dir``.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

import torch

from core.config import RuntimeConfig

PHASES = ("data_wait", "forward", "backward", "optimizer", "communication", "checkpoint")
STEP_START = "step_start"
STEP_END = "step_end"
STEP_RANGE_PREFIX = "lockstep_step#"


class PhaseListener(Protocol):
    """Told whenever a step or phase begins (heartbeats, stall tracking)."""

    def on_phase(self, step: int, phase: str) -> None: ...


class StepTimer:
    """Times the phases of each step; ``end_step()`` returns seconds per phase."""

    def __init__(
        self,
        *,
        device: torch.device | str,
        listeners: Sequence[PhaseListener] = (),
        clock: Callable[[], float] = time.perf_counter,
        sync_each_phase: bool = False,
        sync_step_end: bool = False,
        annotate: bool = True,
    ) -> None:
        self._device = torch.device(device)
        self._listeners = tuple(listeners)
        self._clock = clock
        self._sync_each_phase = sync_each_phase
        self._sync_step_end = sync_step_end or sync_each_phase
        self._annotate = annotate
        self._step: int | None = None
        self._step_start = 0.0
        self._totals: dict[str, float] = {}
        self._stack: list[list] = []  # [name, started_at] of open phases, innermost last
        self._last: tuple[int | None, dict[str, float]] = (None, {})

    @property
    def step(self) -> int | None:
        return self._step

    def start_step(self, step: int) -> None:
        if self._stack:
            raise RuntimeError(f"start_step({step}) inside open phase {self._stack[-1][0]!r}")
        self._step = step
        self._totals = {}
        self._notify(STEP_START)
        self._step_start = self._clock()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (exclusive of phases nested inside it)."""
        if self._step is None:
            raise RuntimeError(f"phase({name!r}) outside a step: call start_step(step) first")
        self._notify(name)
        if self._sync_each_phase:
            self._synchronize()
        now = self._clock()
        if self._stack:
            outer = self._stack[-1]
            self._add(outer[0], now - outer[1])
        entry = [name, now]
        self._stack.append(entry)
        annotation = torch.profiler.record_function(name) if self._annotate else contextlib.nullcontext()
        try:
            with annotation:
                yield
        finally:
            if self._sync_each_phase:
                self._synchronize()
            now = self._clock()
            self._stack.pop()
            self._add(name, now - entry[1])
            if self._stack:
                self._stack[-1][1] = now

    def end_step(self) -> dict[str, float]:
        """Seconds per phase for the step, plus ``device_sync`` (0.0 unless the timer waits for
        the device at step end) and ``other``.

        Every phase in ``PHASES`` is present (0.0 if not entered); ``other`` is step time
        outside any phase. The values add up to the step's wall time, so
        ``sum(times.values())`` is the step time.
        """
        if self._step is None:
            raise RuntimeError("end_step() without start_step()")
        if self._stack:
            raise RuntimeError(f"end_step() inside open phase {self._stack[-1][0]!r}")
        before_sync = self._clock()
        if self._sync_step_end:
            self._synchronize()
        end = self._clock()
        out = {name: 0.0 for name in PHASES}
        out.update(self._totals)
        out["device_sync"] = end - before_sync
        total = end - self._step_start
        out["other"] = max(total - sum(out.values()), 0.0)
        self._notify(STEP_END)
        self._last = (self._step, dict(out))
        self._step = None
        return out

    def summary(self) -> dict:
        """The open step and phases and the last finished step's times (for diagnostics)."""
        now = self._clock()
        last_step, last_times = self._last
        return {
            "step": self._step,
            "open_phases": [name for name, _ in self._stack],
            "seconds_in_step": None if self._step is None else round(now - self._step_start, 3),
            "last_step": last_step,
            "last_step_times": last_times,
        }

    def _add(self, name: str, seconds: float) -> None:
        self._totals[name] = self._totals.get(name, 0.0) + seconds

    def _synchronize(self) -> None:
        # The loop's stream, not the device: a device-wide sync also waited for an async
        # checkpoint's device-to-host copy on its side stream (13 s for Qwen3-1.7B on an H200).
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def _notify(self, phase: str) -> None:
        for listener in self._listeners:
            listener.on_phase(self._step if self._step is not None else -1, phase)


class ProfilerWindow:
    """torch.profiler over steps [profile_start_step, profile_start_step + profile_steps).

    Either call ``before_step(step)`` before and ``after_step(step)`` after every optimizer
    step, or ``begin()`` once before the first step and ``step()`` after every step (steps
    are then counted from ``first_step``, the first step this process runs). ``close()`` at the end writes a partial window if the run stopped
    inside it. A resumed run that starts after the window records nothing. Traces are named
    ``rank<R>_steps<A>-<B>.json`` (``pid<PID>_...`` without a rank), so ranks sharing a
    trace_dir never overwrite each other.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        *,
        trace_dir: Path,
        rank: int | None = None,
        device: torch.device | str = "cpu",
        first_step: int = 1,
    ) -> None:
        self._start = config.profile_start_step
        self._end = config.profile_start_step + max(config.profile_steps, 1) - 1
        self._trace_dir = Path(trace_dir)
        self._rank = rank
        self._device = torch.device(device)
        self._profiler: torch.profiler.profile | None = None
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._traces: list[Path] = []
        self._step_range: torch.profiler.record_function | None = None
        self._next_step = first_step

    @property
    def enabled(self) -> bool:
        return self._start > 0

    @property
    def active(self) -> bool:
        return self._profiler is not None

    @property
    def traces(self) -> list[Path]:
        return list(self._traces)

    def begin(self) -> None:
        """With ``step()``: call once right before the first step (``first_step``)."""
        self.before_step(self._next_step)

    def step(self) -> None:
        """Call after every optimizer step (alternative to before_step/after_step)."""
        self.after_step(self._next_step)
        self._next_step += 1
        self.before_step(self._next_step)

    def before_step(self, step: int) -> None:
        if self.enabled and self._profiler is None and not self._traces and self._start <= step <= self._end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self._device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
            self._first_step = step
        if self._profiler is not None:
            # A per-step range in the trace, named like the ledger's step.
            self._step_range = torch.profiler.record_function(f"{STEP_RANGE_PREFIX}{step}")
            self._step_range.__enter__()

    def after_step(self, step: int) -> None:
        if self._profiler is None:
            return
        self._close_step_range()
        self._last_step = step
        if step >= self._end:
            self._finish()

    def close(self) -> None:
        if self._profiler is not None:
            self._finish()

    def _close_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _finish(self) -> None:
        assert self._profiler is not None
        self._close_step_range()
        self._profiler.stop()
        self._trace_dir.mkdir(parents=True, exist_ok=True)
        last = self._last_step if self._last_step is not None else self._first_step
        who = f"rank{self._rank}" if self._rank is not None else f"pid{os.getpid()}"
        path = self._trace_dir / f"{who}_steps{self._first_step}-{last}.json"
        self._profiler.export_chrome_trace(str(path))
        self._traces.append(path)
        self._profiler = None
