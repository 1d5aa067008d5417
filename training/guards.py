"""The runtime guards a trainer runs under, gathered behind one small interface.

The watchdog (hang -> diagnostics bundle -> abort), stop signals (SIGTERM/SIGINT/SIGUSR1 ->
checkpoint at the next step boundary), fault injection, the non-finite guard, the step
timer, the profiler window and memory readings. The trainer talks to this object only; a
replay or a benchmark can pass a quieter one.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

from core.config import Config
from core.distributed_context import DistributedContext
from runtime.faults import STEP_START_KINDS, FaultInjector, for_replay, parse_faults
from runtime.health import NonFiniteGuard, StallDetector, dump_provenance
from runtime.memory import memory_metrics
from runtime.profiler import ProfilerWindow, StepTimer
from runtime.signals import StopSignals
from runtime.watchdog import Watchdog


class Guards:
    def __init__(
        self,
        config: Config,
        *,
        dist: DistributedContext,
        diagnostics_dir: Path,
        trace_dir: Path,
        providers: dict[str, Callable[[], Any]],
        on_abort: Callable[[dict], None] | None,
        install_signals: bool = True,
        replaying: bool = False,
    ) -> None:
        self.dist = dist
        self.diagnostics_dir = diagnostics_dir
        self.stall = StallDetector()
        self.watchdog = Watchdog(
            config.runtime,
            rank=dist.rank,
            diagnostics_dir=diagnostics_dir,
            providers={**providers, "stall": self.stall.summary, "step_times": lambda: self.timer.summary()},
            on_abort=on_abort,
            device=dist.device,
        )
        # Every phase start is a heartbeat, so the watchdog knows the phase a rank hangs in.
        self.timer = StepTimer(device=dist.device, listeners=[self.watchdog, self.stall],
                               sync_step_end=config.runtime.sync_step_end)
        faults = parse_faults(config.runtime.faults)
        if replaying:
            faults = for_replay(faults)  # a replay fires only what the step computes (runtime/faults.py)
        # Steps where some rank's injected fault ends or stops the run at the step's start,
        # the same on every rank (the loop settles the step before on all of them first).
        self.fault_steps = frozenset(f.step for f in faults if f.kind in STEP_START_KINDS)
        self.faults = FaultInjector(
            faults,
            rank=dist.rank,
            slow_data_s=config.runtime.fault_slow_data_s,
            flush=_flush_logs,
        )
        self.nonfinite = NonFiniteGuard(config.runtime.on_nonfinite, dist=dist)
        self.profiler = ProfilerWindow(config.runtime, trace_dir=trace_dir, rank=dist.rank, device=dist.device)
        self.signals = StopSignals() if install_signals else None

    def start(self) -> None:
        self.watchdog.start()

    def close(self) -> None:
        self.watchdog.stop()
        self.profiler.close()
        if self.signals is not None:
            self.signals.restore()

    def heartbeat(self, step: int, phase: str) -> None:
        self.watchdog.heartbeat(step, phase)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self.watchdog.paused():
            yield

    def should_stop(self, dist: DistributedContext) -> bool:
        return self.signals is not None and self.signals.should_stop(dist)

    def stop_reason(self) -> str | None:
        return self.signals.signal_name if self.signals is not None else None

    def begin_step(self, step: int) -> None:
        self.profiler.before_step(step)
        self.timer.start_step(step)

    def end_step(self, step: int) -> dict[str, float]:
        """Seconds per phase of the step that just ended (they add up to the step time)."""
        times = self.timer.end_step()
        self.stall.observe(step, times)
        self.profiler.after_step(step)
        return times

    def dump_provenance(self, step: int, batch) -> Path:
        path = self.diagnostics_dir / f"nonfinite_step{step:08d}_rank{self.dist.rank}.json"
        dump_provenance(path, step=step, rank=self.dist.rank, provenance=batch.provenance)
        return path

    def memory(self) -> dict[str, float]:
        return memory_metrics(self.dist.device)

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "nonfinite": self.nonfinite.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.nonfinite.load_state_dict(state["nonfinite"])


def _flush_logs() -> None:
    """Flush every log handler before an injected hard crash, so the logs show it."""
    for handler in logging.getLogger("lockstep").handlers:
        handler.flush()
