"""``bad_records_skipped`` (the run's ``finished`` event) counts each bad record once over the
ranks: one JSONL file is one unit, so every stream of both ranks reads it, epoch after epoch, and
skips the same records; the count is the distinct records the returned batches skipped, united
over ranks (training/loop.py), not a sum of the ranks' counts."""

from __future__ import annotations

import json

import pytest

from tests import launch
from tests.e2e_config import e2e_args
from tests.guarantees import run_dir

pytestmark = pytest.mark.slow

BAD = (3, 11, 20)


def test_a_bad_record_read_by_both_ranks_counts_once(tmp_path):
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for i in range(30):  # about 900 tokens: each stream reads the file more than once in 12 steps
            f.write('{"text": "unterminated\n' if i in BAD else json.dumps({"text": f"x = {i} * {i}\n"}) + "\n")
    result = launch.train(tmp_path, e2e_args(max_steps=12, name="bad-records", overrides=[
        f"data.sources=[{{path: '{data}', name: bad, record: text}}]", "data.on_bad_record=skip",
        "checkpoint.interval=0"]), nproc=2)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in (run_dir(tmp_path, result) / "events.jsonl").read_text().splitlines()]
    finished = [e for e in events if e["event"] == "finished"]
    assert finished and finished[-1]["bad_records_skipped"] == len(BAD), finished
