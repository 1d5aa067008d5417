"""Training health: stalls (data or compute?) and non-finite losses/gradients.

``StallDetector`` listens to the step timer's phases. It knows which phase the rank is in
right now and for how long (the answer to "what stalled" when the watchdog fires) and,
over a window of recent steps, how the step time splits between waiting for data and
everything else (the answer to "is this run data-bound").

``NonFiniteGuard`` checks loss and gradient norm once per step with one collective, so
every rank takes the same decision: apply the update, skip it (``skip``), or abort
(``abort``: the caller dumps the batch provenance with ``dump_provenance`` and raises
``guard.error(step)``, a NonFiniteError with exit code 7).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch

from core.exceptions import CheckpointError, ConfigError, NonFiniteError

POLICIES = ("abort", "skip")
DATA_PHASES = frozenset({"data_wait"})
IDLE_PHASES = frozenset({"step_start", "step_end"})
CHECKPOINT_PHASES = frozenset({"checkpoint"})
GUARD_STATE_VERSION = 1
PROVENANCE_SCHEMA_VERSION = 1


def phase_kind(phase: str) -> str:
    """``data`` for waiting on the pipeline, ``checkpoint``, ``between_phases``, else ``compute``."""
    if phase in DATA_PHASES:
        return "data"
    if phase in CHECKPOINT_PHASES:
        return "checkpoint"
    if phase in IDLE_PHASES:
        return "between_phases"
    return "compute"


class StallDetector:
    """Tracks the current phase and the recent data-wait/compute split."""

    def __init__(
        self,
        *,
        window: int = 50,
        data_bound_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._data_bound_fraction = data_bound_fraction
        self._recent: deque[tuple[int, float, float]] = deque(maxlen=window)
        self._current: tuple[int, str, float] | None = None

    def on_phase(self, step: int, phase: str) -> None:
        self._current = (step, phase, self._clock())

    def observe(self, step: int, phases: Mapping[str, float]) -> None:
        """Record one finished step's phase seconds (``StepTimer.end_step()``'s dict)."""
        data = sum(v for k, v in phases.items() if k in DATA_PHASES)
        total = sum(phases.values())
        self._recent.append((step, data, max(total - data, 0.0)))

    def stalled_on(self) -> str | None:
        """What the rank is busy with right now: data, compute, checkpoint, between_phases."""
        return phase_kind(self._current[1]) if self._current else None

    def bottleneck(self) -> str | None:
        """``data`` if recent steps spent at least ``data_bound_fraction`` waiting for data."""
        if not self._recent:
            return None
        data = sum(d for _, d, _ in self._recent)
        compute = sum(c for _, _, c in self._recent)
        if data + compute <= 0:
            return None
        return "data" if data / (data + compute) >= self._data_bound_fraction else "compute"

    def summary(self) -> dict[str, Any]:
        """JSON-ready state for the watchdog bundle and logs."""
        current = None
        if self._current is not None:
            step, phase, since = self._current
            current = {
                "step": step,
                "phase": phase,
                "kind": phase_kind(phase),
                "seconds_in_phase": round(self._clock() - since, 3),
            }
        n = len(self._recent)
        data = sum(d for _, d, _ in self._recent)
        compute = sum(c for _, _, c in self._recent)
        return {
            "current": current,
            "stalled_on": self.stalled_on(),
            "verdict": self._verdict(current),
            "recent_steps": n,
            "data_wait_s_mean": data / n if n else None,
            "compute_s_mean": compute / n if n else None,
            "data_fraction": data / (data + compute) if data + compute > 0 else None,
            "bottleneck": self.bottleneck(),
        }

    @staticmethod
    def _verdict(current: dict[str, Any] | None) -> str:
        if current is None:
            return "no step started yet"
        kind, where = current["kind"], f"step {current['step']} phase {current['phase']}"
        secs = current["seconds_in_phase"]
        if kind == "data":
            return f"data starvation: waiting {secs}s for a batch ({where}); check the pipeline queues"
        if kind == "checkpoint":
            return f"stuck in checkpoint I/O for {secs}s ({where})"
        if kind == "between_phases":
            return f"{secs}s outside any timed phase ({where}): logging, metrics or an untimed collective"
        return f"compute/communication stall for {secs}s ({where}); a collective may wait on another rank"


class Collective(Protocol):
    """The part of DistributedContext the guard uses."""

    rank: int
    world_size: int
    device: torch.device

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...


class NonFiniteGuard:
    """Agrees across ranks whether a step's loss and gradient norm are finite."""

    def __init__(self, policy: str, *, dist: Collective) -> None:
        if policy not in POLICIES:
            raise ConfigError(
                f"runtime.on_nonfinite must be one of {POLICIES}, got {policy!r}",
                key="runtime.on_nonfinite",
            )
        self._policy = policy
        self._dist = dist
        self._skipped = 0
        self._last_bad_ranks: tuple[int, ...] = ()

    @property
    def policy(self) -> str:
        return self._policy

    @property
    def skipped(self) -> int:
        """Steps skipped so far (kept across resume through state_dict)."""
        return self._skipped

    @property
    def last_bad_ranks(self) -> tuple[int, ...]:
        """Ranks whose values were non-finite in the last failed check."""
        return self._last_bad_ranks

    def check(self, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None) -> bool:
        """True if every rank's loss and grad norm are finite (apply the update).

        One all-reduce of a ``[world_size]`` flag vector, so every rank returns the same
        value and learns which ranks were bad. On False under ``skip`` the skip is counted;
        under ``abort`` the caller dumps provenance and raises ``self.error(step)``.
        """
        return self.resolve(self.flags(loss, grad_norm).tolist())

    def flags(self, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None) -> torch.Tensor:
        """The all-reduced ``[world_size]`` vector (1.0 where a rank saw a non-finite value),
        left where the collective ran: reading it is the caller's (see ``resolve``)."""
        device = self._dist.device
        flags = torch.zeros(self._dist.world_size, dtype=torch.float32, device=device)
        bad = ~torch.isfinite(torch.as_tensor(loss, dtype=torch.float32, device=device).detach())
        if grad_norm is not None:
            gn = torch.as_tensor(grad_norm, dtype=torch.float32, device=device).detach()
            bad = bad | ~torch.isfinite(gn)
        flags[self._dist.rank] = bad.any().to(torch.float32)
        self._dist.all_reduce(flags, "sum")  # in place
        return flags

    def resolve(self, flags: list[float]) -> bool:
        """``check``'s answer from the flag values read back on the host."""
        bad_ranks = tuple(i for i, v in enumerate(flags) if v > 0)
        if not bad_ranks:
            return True
        self._last_bad_ranks = bad_ranks
        if self._policy == "skip":
            self._skipped += 1
        return False

    def error(self, step: int, *, provenance_path: Path | None = None) -> NonFiniteError:
        """The error to raise under ``abort`` (exit 7), naming the step and bad ranks."""
        return NonFiniteError(
            f"non-finite loss or gradient norm at step {step} on rank(s) "
            f"{', '.join(map(str, self._last_bad_ranks))}",
            step=step,
            rank=self._dist.rank,
            file=None if provenance_path is None else str(provenance_path),
            hint=(
                "inspect the batch provenance, replay the step with --replay RUN --step "
                f"{step} --dump DIR, lower the learning rate, or set runtime.on_nonfinite=skip"
            ),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"version": GUARD_STATE_VERSION, "skipped": self._skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        version = state.get("version")
        if version != GUARD_STATE_VERSION:
            raise CheckpointError(
                f"non-finite guard state has version {version!r}, expected {GUARD_STATE_VERSION}",
                hint="resume with the Lockstep version that wrote the checkpoint",
            )
        self._skipped = int(state["skipped"])


def provenance_path(diagnostics_dir: Path, step: int, rank: int) -> Path:
    """Where a non-finite step's provenance goes: ``nonfinite_step<SSSSSSSS>_rank<R>.json``."""
    return Path(diagnostics_dir) / f"nonfinite_step{step:08d}_rank{rank}.json"


def dump_provenance(path: Path, step: int, rank: int, provenance: Any) -> Path:
    """Write a step's batch provenance (any JSON-able structure, dataclasses included)
    to ``path`` atomically; non-finite floats become null, unknown objects their repr."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "schema_version": PROVENANCE_SCHEMA_VERSION,
        "step": step,
        "rank": rank,
        "time": time.time(),
        "provenance": _jsonable(provenance),
    }
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1, allow_nan=False, default=repr) + "\n")
    os.replace(tmp, path)
    return path


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, torch.Tensor):
        return _jsonable(value.detach().cpu().tolist())
    return value
