"""benchmarks/sampling_rule.py on the CPU: every path it times draws the torch reference's tokens."""

from __future__ import annotations

import json

from benchmarks import sampling_rule


def test_the_cpu_smoke_run_times_every_rule_and_checks_its_tokens(tmp_path):
    out = tmp_path / "rule.json"
    assert sampling_rule.main(["--rows", "3", "--vocab", "500", "--calls", "2", "--device", "cpu",
                               "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["path"] for r in results] == ["greedy", "no filter, torch", "top-p 0.95, torch"]
    assert all(r["equal"] and r["ms"] > 0 for r in results)
