"""The runtime guards a trainer runs under, gathered behind one small interface.

The watchdog (hang -> diagnostics bundle -> abort), stop signals (SIGTERM/SIGINT/SIGUSR1 ->
checkpoint at the next step boundary), fault injection, the non-finite guard, the step
timer, the profiler window and memory readings. The trainer talks to this object only; a
replay or a benchmark can pass a quieter one.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

from core.config import Config
from core.distributed_context import DistributedContext
from runtime.faults import FaultInjector, parse_faults
from runtime.health import NonFiniteGuard, StallDetector, dump_provenance
from runtime.memory import memory_snapshot
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
    ) -> None:
        self.dist = dist
        self.diagnostics_dir = diagnostics_dir
        self.timer = StepTimer(device=dist.device)
        self.stall = StallDetector()
        self.faults = FaultInjector(parse_faults(config.runtime.faults), rank=dist.rank)
        self.nonfinite = NonFiniteGuard(config.runtime.on_nonfinite, dist=dist)
        self.profiler = ProfilerWindow(config.runtime, trace_dir=trace_dir)
        self.signals = StopSignals() if install_signals else None
        self.watchdog = Watchdog(
            config.runtime,
            rank=dist.rank,
            diagnostics_dir=diagnostics_dir,
            providers={**providers, "stall": self.stall.summary, "step_times": self.timer.summary},
            on_abort=on_abort,
        )

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
        return self.signals.received if self.signals is not None else None

    def profiler_step(self) -> None:
        self.profiler.step()

    def dump_provenance(self, step: int, batch) -> Path:
        path = self.diagnostics_dir / f"nonfinite_step{step:08d}_rank{self.dist.rank}.json"
        dump_provenance(path, step=step, rank=self.dist.rank, provenance=batch.provenance)
        return path

    def memory(self) -> dict[str, float]:
        return {k: float(v) for k, v in memory_snapshot(self.dist.device).items() if isinstance(v, (int, float))}
