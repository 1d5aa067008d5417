"""benchmarks/float8_scales.py on 2 CPU ranks (torchrun, gloo, torchao's FP8 emulation): the
precomputed FP8 all-gather scales and batched casts train bitwise like torchao's per-weight
path, and the script says so in its table and JSON, with the host time of both casts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launch

ROOT = Path(__file__).resolve().parents[2]


def test_two_cpu_ranks_agree_bitwise(tmp_path):
    pytest.importorskip("torchao.float8")
    out = tmp_path / "float8_scales.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1", "--rdzv_backend=c10d",
         f"--rdzv_endpoint=127.0.0.1:{launch.free_port()}", "--max_restarts=0",
         str(ROOT / "benchmarks" / "float8_scales.py"), "--no-compile", "--out", str(out)],
        cwd=ROOT, env=launch.env(tmp_path), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["ok"] and record["ranks"] == 2 and record["device"] == "cpu (FP8 emulated)"
    assert [case["reshard_after_forward"] for case in record["cases"]] == [True, False]
    for case in record["cases"]:
        assert case["losses_hook"] == case["losses_per_weight"] and case["scales_mismatched"] == 0
        assert len(case["losses_hook"]) == 4 and case["losses_hook"][-1] < case["losses_hook"][0]
    host = record["gather_inputs_host"]  # both casts timed, over Qwen3-1.7B's count of FP8 weights
    assert host["weights"] == 196 and host["torchao_us_per_weight"] > 0 and host["batched_us_per_weight"] > 0
    assert "host time of the all-gathers' FP8 inputs, 196 weights" in proc.stdout
    assert "| True | False |" in proc.stdout
