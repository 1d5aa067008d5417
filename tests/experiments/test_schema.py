"""experiments/schema.py and events.py: versioned records and robust JSON-lines I/O."""

import json
import threading

import pytest

from experiments.events import EventLog, iter_jsonl, last_jsonl, read_events
from experiments.schema import EVENT_KINDS, Event, MetricRecord, MetricStats, SchemaError


def test_event_kinds_cover_the_contract():
    assert set(EVENT_KINDS) == {
        "run_started", "resumed", "checkpoint_saved", "checkpoint_corrupt", "stopped", "failed",
        "finished", "watchdog_abort", "nonfinite_skip", "nonfinite_abort", "eval",
    }


def test_event_round_trip_and_line_format():
    event = Event.create("checkpoint_saved", time=12.5, rank=1, step=50, path="checkpoints/step_00000050")
    line = event.to_json()
    raw = json.loads(line)
    assert raw == {
        "event": "checkpoint_saved", "time": 12.5, "rank": 1, "schema_version": 1,
        "step": 50, "path": "checkpoints/step_00000050",
    }
    assert Event.from_dict(raw) == event


@pytest.mark.parametrize(
    "kind, fields, fragment",
    [
        ("exploded", {}, "unknown event kind"),
        ("checkpoint_saved", {"step": 1}, "lacks required field(s) path"),
        ("finished", {"step": 1, "schema_version": 3}, "reserved"),
    ],
)
def test_event_validation(kind, fields, fragment):
    with pytest.raises(SchemaError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        Event.create(kind, time=0.0, rank=0, **fields)


def test_non_finite_values_become_null():
    event = Event.create("nonfinite_skip", time=1.0, rank=0, step=3, loss=float("nan"), norms=[float("inf"), 1.0])
    raw = json.loads(event.to_json())
    assert raw["loss"] is None and raw["norms"] == [None, 1.0]


def test_metric_record_round_trip_and_version_check():
    record = MetricRecord(
        step=10, time=5.0, world_size=2, interval_steps=5,
        metrics={"loss": MetricStats(1.0, 0.5, 1.5, 2.0), "bad": MetricStats(float("nan"), 0, 0, 0)},
        slowest_rank=1, tokens_per_s=100.0, mfu=0.4, eta_s=20.0,
    )
    raw = json.loads(record.to_json())
    assert raw["metrics"]["loss"] == {"mean": 1.0, "min": 0.5, "max": 1.5, "sum": 2.0}
    assert raw["metrics"]["bad"]["mean"] is None
    back = MetricRecord.from_dict(raw)
    assert back.metrics["loss"] == record.metrics["loss"] and back.slowest_rank == 1
    with pytest.raises(SchemaError, match="schema_version 7"):
        MetricRecord.from_dict({**raw, "schema_version": 7})


def test_event_log_appends_from_many_threads_without_torn_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    logs = [EventLog(path, rank=r, clock=lambda: 1.0) for r in range(4)]

    def emit(log):
        for step in range(50):
            log.emit("eval", step=step, loss=0.5, note="x" * 200)

    threads = [threading.Thread(target=emit, args=(log,)) for log in logs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = read_events(path)
    assert len(events) == 200 == len(path.read_text().splitlines())
    assert sorted({e.rank for e in events}) == [0, 1, 2, 3]


def test_readers_survive_a_truncated_last_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    lines = [json.dumps({"step": i, "loss": 1.0 / (i + 1), "pad": "y" * 300}) for i in range(500)]
    path.write_text("\n".join(lines) + '\n{"step": 500, "lo')  # killed mid-write
    assert [r["step"] for r in iter_jsonl(path)] == list(range(500))
    assert last_jsonl(path)["step"] == 499
    assert last_jsonl(path, chunk=64)["step"] == 499  # record longer than the tail chunk
    assert last_jsonl(tmp_path / "missing.jsonl") is None
    (tmp_path / "empty.jsonl").write_text("")
    assert last_jsonl(tmp_path / "empty.jsonl") is None
