"""Versioned records written to ``events.jsonl`` and ``metrics.jsonl``.

Both files hold one JSON object per line. Every record carries ``schema_version`` so
readers can refuse (or adapt to) a format they do not know. Non-finite floats are written
as ``null``: strict JSON has no NaN, and a NaN loss is already recorded exactly in the
ledger.

Event line: ``{"event": kind, "time": unix seconds, "rank": r, "schema_version": 1, ...}``
with the kind's required fields (``EVENT_FIELDS``) plus any others.

Metric line: ``{"schema_version": 1, "step": s, "time": t, "world_size": W,
"interval_steps": n, "metrics": {name: {"mean", "min", "max", "sum"}}, "slowest_rank": r,
"tokens_per_s": x, "mfu": y, "eta_s": z}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from core.exceptions import LockstepError

EVENT_SCHEMA_VERSION = 1
METRICS_SCHEMA_VERSION = 1

# Required fields per event kind; any other fields may be added freely.
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "run_started": ("run_id",),
    "resumed": ("run_id", "step"),
    "checkpoint_saved": ("step", "path"),
    "checkpoint_corrupt": ("path",),
    "stopped": ("step",),
    "failed": ("exit_code",),
    "finished": ("step",),
    "watchdog_abort": ("step",),
    "nonfinite_skip": ("step",),
    "nonfinite_abort": ("step",),
    "eval": ("step",),
}
EVENT_KINDS: tuple[str, ...] = tuple(EVENT_FIELDS)

# Event kinds that end a process's part of a run, and the run state each one means.
TERMINAL_EVENTS: dict[str, str] = {
    "finished": "finished",
    "stopped": "stopped",
    "failed": "failed",
    "watchdog_abort": "failed",
    "nonfinite_abort": "failed",
}
START_EVENTS = ("run_started", "resume_started", "resumed")


class SchemaError(LockstepError):
    """A record that does not follow the event or metric schema."""

    kind = "schema error"


def json_safe(value: Any) -> Any:
    """Replace non-finite floats by None (recursively) so the output is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dumps_line(record: Mapping[str, Any]) -> str:
    """One strict-JSON line (no trailing newline); unknown objects are written as repr."""
    return json.dumps(json_safe(record), allow_nan=False, default=repr, separators=(",", ":"))


@dataclass(frozen=True)
class Event:
    """One structured event of a run."""

    event: str
    time: float
    rank: int
    fields: Mapping[str, Any] = field(default_factory=dict)
    schema_version: int = EVENT_SCHEMA_VERSION

    @classmethod
    def create(cls, kind: str, *, time: float, rank: int, **fields: Any) -> "Event":
        """A new event, checked against ``EVENT_FIELDS``."""
        if kind not in EVENT_FIELDS:
            raise SchemaError(
                f"unknown event kind {kind!r}",
                hint=f"use one of {', '.join(EVENT_KINDS)}",
            )
        missing = [name for name in EVENT_FIELDS[kind] if name not in fields]
        if missing:
            raise SchemaError(
                f"event {kind!r} lacks required field(s) {', '.join(missing)}",
                hint=f"pass {', '.join(f'{m}=...' for m in missing)}",
            )
        reserved = {"event", "time", "rank", "schema_version"} & set(fields)
        if reserved:
            raise SchemaError(f"event field name(s) {sorted(reserved)} are reserved")
        return cls(event=kind, time=float(time), rank=int(rank), fields=dict(fields))

    def to_dict(self) -> dict[str, Any]:
        return {
            "event": self.event,
            "time": self.time,
            "rank": self.rank,
            "schema_version": self.schema_version,
            **self.fields,
        }

    def to_json(self) -> str:
        return dumps_line(self.to_dict())

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Event":
        """Parse a stored event; unknown kinds are kept (a newer writer may add kinds)."""
        try:
            rest = {k: v for k, v in raw.items() if k not in ("event", "time", "rank", "schema_version")}
            return cls(
                event=str(raw["event"]),
                time=float(raw["time"]),
                rank=int(raw.get("rank", 0)),
                fields=rest,
                schema_version=int(raw.get("schema_version", EVENT_SCHEMA_VERSION)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(f"malformed event record {dict(raw)!r}: {exc}") from exc


@dataclass(frozen=True)
class MetricStats:
    """One metric reduced across ranks."""

    mean: float
    min: float
    max: float
    sum: float

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "min": self.min, "max": self.max, "sum": self.sum}


@dataclass(frozen=True)
class MetricRecord:
    """One log interval of aggregated metrics (a line of metrics.jsonl)."""

    step: int
    time: float
    world_size: int
    interval_steps: int
    metrics: Mapping[str, MetricStats]
    slowest_rank: int | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    eta_s: float | None = None
    schema_version: int = METRICS_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "step": self.step,
            "time": self.time,
            "world_size": self.world_size,
            "interval_steps": self.interval_steps,
            "metrics": {name: stats.to_dict() for name, stats in self.metrics.items()},
            "slowest_rank": self.slowest_rank,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "eta_s": self.eta_s,
        }

    def to_json(self) -> str:
        return dumps_line(self.to_dict())

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "MetricRecord":
        version = int(raw.get("schema_version", 0))
        if version != METRICS_SCHEMA_VERSION:
            raise SchemaError(
                f"metrics record has schema_version {version}, this reader knows "
                f"{METRICS_SCHEMA_VERSION}",
                hint="read it with the Lockstep version that wrote it",
            )
        try:
            metrics = {
                name: MetricStats(**{k: _float_or_nan(v) for k, v in stats.items()})
                for name, stats in raw["metrics"].items()
            }
            return cls(
                step=int(raw["step"]),
                time=float(raw["time"]),
                world_size=int(raw["world_size"]),
                interval_steps=int(raw["interval_steps"]),
                metrics=metrics,
                slowest_rank=raw.get("slowest_rank"),
                tokens_per_s=raw.get("tokens_per_s"),
                mfu=raw.get("mfu"),
                eta_s=raw.get("eta_s"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(f"malformed metrics record: {exc}") from exc


def _float_or_nan(value: Any) -> float:
    return float("nan") if value is None else float(value)
