"""benchmarks/tiny_grpo_seeds.py: what it reads from a GRPO run directory, and its refusals."""

from __future__ import annotations

import json

import pytest

from benchmarks import tiny_grpo_seeds as bench


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_run_directory_gives_its_evaluations_parity_rewards_and_step_time(tmp_path):
    run = tmp_path / "tiny-grpo-bitwise-seed0-20261203-000000-abcdef01"
    run.mkdir()
    _write(run / "ledger.jsonl", [{"step": s, "logprob_parity": p, "reward_mean": r}
                                  for s, p, r in ((1, 0.0, 0.06), (2, 0.0, 0.1), (3, 0.0, 0.12), (4, 0.002, 0.15))])
    _write(run / "events.jsonl", [{"event": "start"},
                                  {"event": "eval", "step": 2, "metrics": {"accuracy": 0.5, "sampled_accuracy": 0.25}},
                                  {"event": "eval", "step": 4, "loss": None}])  # an eval without metrics: skipped
    _write(run / "metrics.jsonl", [{"step": s, "metrics": {"step_time": {"mean": t}}}
                                   for s, t in ((1, 9.0), (2, 5.0), (3, 1.0), (4, 3.0))])
    summary = bench._summary(str(run))
    assert summary["run_id"] == run.name and summary["steps"] == 4
    assert summary["evals"] == [{"step": 2, "accuracy": 0.5, "sampled_accuracy": 0.25}]
    assert summary["logprob_parity_max"] == 0.002
    assert (summary["logprob_parity_zero_lines"], summary["logprob_parity_lines"]) == (3, 4)
    assert summary["reward_mean_first_last"] == [0.06, 0.15]
    assert summary["median_step_s_from_step_3"] == 2.0  # steps 3 and 4 only: step 1 compiles
    assert bench._summary(None) == {}


def test_an_unknown_mode_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(["--out", str(tmp_path / "out.json"), "--work", str(tmp_path / "work"), "--modes", "bitwise,exact"])
    assert stop.value.code == 2 and "unknown ['exact']" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()
