"""benchmarks/train_throughput.py's steady-state summary of a run with a torch.profiler window in it:
the window's steps are left out and the rate comes from the other steps' own times, since the
trace is written inside the wall time between their records (a 0.093 s step read as 0.148 s)."""

from __future__ import annotations

import json

import yaml

from core.config import load, to_dict
from tests.benchmarks.test_harness import ROOT, _module


def _run_dir(tmp_path, overrides, seconds, slow_wall):
    """A finished run's config.yaml and metrics.jsonl: step s took ``seconds[s]`` by its own timer, and
    its record came ``slow_wall`` seconds late where the step is a key of it (the profiler's export)."""
    tmp_path.mkdir(parents=True)
    config = load(ROOT / "configs" / "tiny.yaml", ["train.max_steps=8", *overrides])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(config)))
    now, lines = 1000.0, []
    for step in range(1, 9):
        now += seconds + slow_wall.get(step, 0.0)
        lines.append({"step": step, "time": now, "metrics": {"tokens": {"sum": 4096.0},
                                                             "time_step": {"max": seconds, "mean": seconds}}})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return tmp_path


def test_a_profiled_step_is_left_out_and_the_rate_comes_from_the_step_times(tmp_path):
    tt = _module("train_throughput")
    profiled = _run_dir(tmp_path / "a", ["runtime.profile_start_step=6", "runtime.profile_steps=1"], 0.1, {6: 5.0})
    out = tt.summarize_run(profiled, warmup=3, gpus=1, peak=None, started_at=990.0)
    assert out["profiled_steps_left_out"] == [6]
    assert out["steady_steps"] == 3  # steps 4, 5 and 7 (8, the last, hashes the parameters)
    assert abs(out["tokens_per_s"] - 40960.0) < 1e-6  # 4096 tokens in 0.1 s each, not the 5 s export


def test_without_a_profiler_window_the_rate_is_the_wall_times(tmp_path):
    tt = _module("train_throughput")
    plain = _run_dir(tmp_path / "b", [], 0.1, {6: 0.2})  # a slow step counts: nothing was profiled
    out = tt.summarize_run(plain, warmup=3, gpus=1, peak=None, started_at=990.0)
    assert "profiled_steps_left_out" not in out and out["steady_steps"] == 4
    assert abs(out["tokens_per_s"] - 4 * 4096 / (4 * 0.1 + 0.2)) < 1e-6
