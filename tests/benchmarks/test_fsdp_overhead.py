"""benchmarks/fsdp_overhead.py on CPU: the plain model and the one sharded over a one-rank
mesh both train, through the real ``parallelize`` path, and the JSON holds their timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plain_and_one_rank_fsdp_train_and_are_timed(tmp_path):
    out = tmp_path / "fsdp_overhead.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fsdp_overhead.py"), "--shape", "tiny", "--seq", "64",
         "--micro-batch", "2", "--device", "cpu", "--steps", "2", "--warmup", "1",
         "--override", "model.num_layers=2", "--override", "model.hidden_size=64",
         "--override", "model.intermediate_size=128", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert set(record["results"]) == {"none", "fsdp"}
    for name, result in record["results"].items():
        for key in ("step_ms", "forward_ms", "backward_ms", "optimizer_ms", "host_ms"):
            assert result[key] > 0, (name, key, result)
        assert result["tokens_per_s"] == 2 * 64 / (result["step_ms"] / 1e3)
    assert "fsdp - none" in proc.stdout


def test_unknown_variant_is_refused():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fsdp_overhead.py"), "--variants", "none,zero3", "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "zero3" in proc.stderr
