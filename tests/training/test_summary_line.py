"""The closing summary line and event: skipped bad records are shown, ``stopped`` is not
recorded a second time (the loop records it with its signal)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from core.logging import EventLog
from training import session


def _result(status: str, **extra):
    return SimpleNamespace(status=status, first_step=1, last_step=4, tokens=100, first_loss=2.0, last_loss=1.0,
                           tokens_per_s=10.0, extra=extra)


def _finish(tmp_path, result):
    events = EventLog(tmp_path / "events.jsonl", rank=0)
    run = SimpleNamespace(run_dir=tmp_path, run_id="r")
    session.finish(result, run, events, SimpleNamespace(is_main=True))
    path = tmp_path / "events.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def test_skipped_records_are_in_the_summary_line_and_the_event(tmp_path, capsys):
    recorded = _finish(tmp_path, _result("finished", bad_records_skipped=746))
    assert "746 bad records skipped" in capsys.readouterr().out
    assert recorded[-1]["event"] == "finished" and recorded[-1]["bad_records_skipped"] == 746


def test_a_clean_run_says_nothing_about_skips_and_stopped_is_not_written_again(tmp_path, capsys):
    _finish(tmp_path, _result("finished"))
    assert "skipped" not in capsys.readouterr().out
    stopped_dir = tmp_path / "stopped"
    stopped_dir.mkdir()
    assert _finish(stopped_dir, _result("stopped")) == []
