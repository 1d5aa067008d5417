"""Read run directories: state, progress, summary and config diff (curves: plots.py).

A run's state comes from its lock and its events (all ranks write to one events.jsonl):

- ``running``: ``.lock`` names a live process on this host (or any process on another
  host, which cannot be checked from here; ``detail`` says so);
- otherwise the last terminal event after the last ``run_started``/``resumed`` decides:
  ``finished``, ``stopped`` (clean stop after a signal), ``failed`` (``failed``,
  ``watchdog_abort``, ``nonfinite_abort``);
- ``crashed``: the run started and no terminal event followed (killed, node lost);
- ``unknown``: no events at all.
"""

from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from core.config import config_hash, from_dict
from core.processes import pid_alive
from core.exceptions import ConfigError, UsageError
from core import layout
from experiments.events import last_jsonl, read_events
from experiments.schema import START_EVENTS, TERMINAL_EVENTS, Event


@dataclass(frozen=True)
class RunSummary:
    """One line of ``runs list``."""

    run_id: str
    path: str
    state: str
    step: int | None
    loss: float | None
    tokens_per_s: float | None
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------- finding runs


def find_runs(root: Path) -> list[Path]:
    """Run directories directly under ``root``, by name."""
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.iterdir() if p.is_dir() and any((p / m).exists() for m in layout.RUN_MARKERS)
    )


_RUN_ID_TIME = re.compile(r"-(\d{8}-\d{6})-[0-9a-f]{8}$")


def started_at(run_dir: Path) -> str:
    """When the run started, as ``YYYYMMDD-HHMMSS`` (from its ID; its config's mtime for a
    directory named otherwise), so that run dirs sort by time whatever their names."""
    match = _RUN_ID_TIME.search(run_dir.name)
    if match:
        return match.group(1)
    try:
        return time.strftime("%Y%m%d-%H%M%S", time.gmtime((run_dir / layout.CONFIG_FILE).stat().st_mtime))
    except OSError:
        return ""


def newest_first(root: Path) -> list[Path]:
    """``find_runs``, the most recently started first."""
    return sorted(find_runs(root), key=lambda p: (started_at(p), p.name), reverse=True)


def recent_runs(root: Path, count: int = 5) -> list[str]:
    """The IDs of the ``count`` newest runs under ``root``, newest first."""
    return [p.name for p in newest_first(root)[:count]]


def resolve_run(root: Path, run_id: str) -> Path:
    """The run dir named ``run_id``, or the only one whose name starts with it."""
    runs = find_runs(root)
    exact = [p for p in runs if p.name == run_id]
    if exact:
        return exact[0]
    matches = [p for p in runs if p.name.startswith(run_id)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        recent = recent_runs(root, 3)
        raise UsageError(
            f"no run {run_id!r} under {str(root)!r}",
            hint=(f"recent runs, newest first: {', '.join(recent)}; " if recent else "")
            + "list the runs with: python -m experiments runs list --root DIR",
        )
    raise UsageError(
        f"run id prefix {run_id!r} matches {len(matches)} runs",
        hint="use more of the id: " + ", ".join(p.name for p in matches[:5]),
    )


# ---------------------------------------------------------------------------- state


def read_lock(run_dir: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads((run_dir / layout.LOCK_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def run_state(
    run_dir: Path,
    *,
    events: list[Event] | None = None,
    host: str | None = None,
    is_alive: Callable[[int], bool] = pid_alive,
) -> tuple[str, str | None]:
    """(state, detail) of a run dir; see the module docstring."""
    lock = read_lock(run_dir)
    if lock is not None and "pid" in lock:
        lock_host = str(lock.get("host", ""))
        here = host if host is not None else socket.gethostname()
        if lock_host and lock_host != here:
            return "running", f"locked by pid {lock['pid']} on {lock_host} (not checkable here)"
        if is_alive(int(lock["pid"])):
            return "running", f"pid {lock['pid']}"
    events = read_events(run_dir / layout.EVENTS_FILE) if events is None else events
    if not events:
        return "unknown", "no events"
    last_start = max((i for i, e in enumerate(events) if e.event in START_EVENTS), default=-1)
    terminal = [e for e in events[last_start + 1 :] if e.event in TERMINAL_EVENTS]
    if terminal:
        last = terminal[-1]
        return TERMINAL_EVENTS[last.event], _event_detail(last)
    if last_start < 0:
        return "unknown", "no run_started event"
    stale = " (stale lock)" if lock is not None else ""
    return "crashed", f"no terminal event after {events[last_start].event}{stale}"


def _event_detail(event: Event) -> str:
    keys = ("step", "signal", "exit_code", "error", "phase")
    parts = [f"{k}={event.fields[k]}" for k in keys if k in event.fields]
    return f"{event.event} on rank {event.rank}" + (f" ({', '.join(parts)})" if parts else "")


def summarize(run_dir: Path) -> RunSummary:
    state, detail = run_state(run_dir)
    ledger = last_jsonl(run_dir / layout.LEDGER_FILE) or {}
    metrics = last_jsonl(run_dir / layout.METRICS_FILE) or {}
    step = ledger.get("step", metrics.get("step"))
    loss = ledger.get("loss")
    if loss is None:
        loss = ((metrics.get("metrics") or {}).get("loss") or {}).get("mean")
    return RunSummary(
        run_id=run_dir.name,
        path=str(run_dir),
        state=state,
        step=step,
        loss=loss,
        tokens_per_s=metrics.get("tokens_per_s"),
        detail=detail,
    )


# ---------------------------------------------------------------------------- show / diff


def describe_run(run_dir: Path, *, max_events: int = 50) -> dict[str, Any]:
    """Everything ``runs show`` prints: identity, meta, progress, checkpoints, events."""
    meta = _read_json(run_dir / layout.META_FILE)
    events = read_events(run_dir / layout.EVENTS_FILE)
    state, detail = run_state(run_dir, events=events)
    return {
        "run_id": run_dir.name,
        "path": str(run_dir),
        "state": state,
        "state_detail": detail,
        "config_hash": _config_hash(run_dir, meta),
        "meta": meta,
        "last_ledger": last_jsonl(run_dir / layout.LEDGER_FILE),
        "last_metrics": last_jsonl(run_dir / layout.METRICS_FILE),
        "checkpoints": list_checkpoints(run_dir),
        "events": [e.to_dict() for e in events[-max_events:]],
        "events_total": len(events),
        "diagnostics": sorted(p.name for p in (run_dir / layout.DIAGNOSTICS_DIR).glob("*")),
    }


def list_checkpoints(run_dir: Path) -> dict[str, Any]:
    ckpt_dir = run_dir / layout.CHECKPOINTS_DIR
    latest_file = ckpt_dir / layout.LATEST_FILE
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    entries = [
        {"name": p.name, "has_manifest": (p / "manifest.json").is_file()}
        for p in sorted(ckpt_dir.glob(f"{layout.STEP_DIR_PREFIX}*"))
        if p.is_dir() and layout.parse_step_dir_name(p.name) is not None
    ]
    return {"latest": latest, "checkpoints": entries}


def _config_hash(run_dir: Path, meta: dict[str, Any] | None) -> str | None:
    if meta and meta.get("config_hash"):
        return str(meta["config_hash"])
    raw = _read_yaml(run_dir / layout.CONFIG_FILE)
    if raw is None:
        return None
    try:
        return config_hash(from_dict(raw))
    except ConfigError:
        return None  # written by a version with other keys; meta.json is the record then


def config_diff(a_dir: Path, b_dir: Path) -> list[tuple[str, Any, Any]]:
    """Every leaf key whose value differs between two runs' config.yaml files."""
    a = _read_yaml(a_dir / layout.CONFIG_FILE)
    b = _read_yaml(b_dir / layout.CONFIG_FILE)
    for raw, path in ((a, a_dir), (b, b_dir)):
        if raw is None:
            raise UsageError(f"{path / layout.CONFIG_FILE} is missing or unreadable")
    flat_a, flat_b = _flatten(a), _flatten(b)
    return [
        (key, flat_a.get(key, "<absent>"), flat_b.get(key, "<absent>"))
        for key in sorted(set(flat_a) | set(flat_b))
        if flat_a.get(key, "<absent>") != flat_b.get(key, "<absent>")
    ]


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def _read_yaml(path: Path) -> dict[str, Any] | None:
    try:
        raw = yaml.safe_load(path.read_text())
    except (FileNotFoundError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return raw if isinstance(raw, dict) else None
