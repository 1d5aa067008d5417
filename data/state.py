"""The data position: small, explicit, JSON-serializable per-stream state.

A stream's state after a sequence is everything needed to continue it exactly:

- ``docs``: documents fully packed so far; also the counter that fixes the next document's
  source (mixture) and augmentation;
- ``skip``: tokens of that next document already packed (a document split across
  sequences): the packing carry-over, kept by reference — resume re-reads the one document
  from its unit and drops ``skip`` tokens — so the state stays small however long documents are;
- ``sequences``: sequences emitted (global batch ``k`` ends with ``k * G/S`` of them);
- ``sources``: per source, the position of its next unread record: ``epoch``, ``cursor``
  (index into this stream's units for that epoch), ``record`` (records consumed within the
  unit) and ``seek`` (its byte offset, for formats that can seek).

Each stream also carries ``compat``, the settings its position is only valid under, so a
state merged from any number of ranks can still be checked stream by stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from core.exceptions import DataError

STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Position:
    """Where a stream's reading of one source continues."""

    epoch: int = 0
    cursor: int = 0
    record: int = 0
    seek: Optional[int] = None

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "record": self.record, "seek": self.seek}

    @classmethod
    def from_json(cls, raw: dict) -> "Position":
        return cls(int(raw["epoch"]), int(raw["cursor"]), int(raw["record"]),
                   None if raw["seek"] is None else int(raw["seek"]))


@dataclass(frozen=True, slots=True)
class StreamState:
    """One stream's position after its last emitted sequence."""

    positions: tuple[Position, ...]
    docs: int = 0
    skip: int = 0
    sequences: int = 0

    @classmethod
    def start(cls, num_sources: int) -> "StreamState":
        return cls(positions=tuple(Position() for _ in range(num_sources)))

    def to_json(self, compat: dict) -> dict:
        return {
            "compat": compat,
            "docs": self.docs,
            "skip": self.skip,
            "sequences": self.sequences,
            "sources": [p.to_json() for p in self.positions],
        }

    @classmethod
    def from_json(cls, raw: dict) -> "StreamState":
        return cls(
            positions=tuple(Position.from_json(p) for p in raw["sources"]),
            docs=int(raw["docs"]), skip=int(raw["skip"]), sequences=int(raw["sequences"]),
        )


def state_dict(streams: dict[int, StreamState], compat: dict) -> dict:
    """The JSON form: {"version": 1, "streams": {"<id>": {...}}}."""
    return {
        "version": STATE_VERSION,
        "streams": {str(s): streams[s].to_json(compat) for s in sorted(streams)},
    }


def merge_states(states: list[dict]) -> dict:
    """One state holding the streams of several ranks' state dicts."""
    merged: dict = {"version": STATE_VERSION, "streams": {}}
    for state in states:
        _check_version(state)
        merged["streams"].update(state["streams"])
    merged["streams"] = dict(sorted(merged["streams"].items(), key=lambda kv: int(kv[0])))
    return merged


def select_streams(state: dict, owned: list[int], compat: dict) -> dict[int, StreamState]:
    """This rank's streams from a (merged) state; refuses a state saved under other settings."""
    _check_version(state)
    streams = state.get("streams")
    if not isinstance(streams, dict):
        raise DataError("data state has no 'streams' mapping", hint="pass the state from a Lockstep checkpoint")
    missing = [s for s in owned if str(s) not in streams]
    if missing:
        raise DataError(
            f"data state lacks streams {missing} (it holds {sorted(int(s) for s in streams)})",
            hint="merge the data states of all ranks (data.state.merge_states) before loading",
        )
    selected = {}
    for s in owned:
        raw = streams[str(s)]
        _check_compat(raw.get("compat", {}), compat, s)
        try:
            selected[s] = StreamState.from_json(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"data state of stream {s} is malformed: {exc!r}",
                            hint="the checkpoint's data state is damaged; use an earlier checkpoint") from exc
    return selected


def _check_version(state: dict) -> None:
    version = state.get("version") if isinstance(state, dict) else None
    if version != STATE_VERSION:
        raise DataError(
            f"data state version {version!r} is not {STATE_VERSION}",
            hint="this checkpoint was written by an incompatible version of the data pipeline",
        )


def _check_compat(saved: dict, current: dict, stream: int) -> None:
    differences = [
        f"{key}: {saved.get(key)!r} in the state, {current.get(key)!r} now"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    if differences:
        raise DataError(
            f"data state of stream {stream} was saved under different settings: " + "; ".join(differences),
            hint="resume with the data settings (sources, seq_len, num_streams, tokenizer, seed) of the run",
        )
