"""benchmarks/fsdp_overhead.py on CPU: the plain model and the one sharded over a one-rank
mesh both train, through the real ``parallelize`` path, and the JSON holds their timings."""

from __future__ import annotations

import json

from tests import launch

ROOT = launch.ROOT


def _bench(args: list[str], timeout: float) -> launch.Result:
    """``python benchmarks/fsdp_overhead.py ARGS`` from the repository root, with the suite's
    environment, a fork of the zygote's import (tests/launch.py)."""
    job = launch.popen([launch.PYTHON, str(ROOT / "benchmarks" / "fsdp_overhead.py"), *args], ROOT, launch.env(ROOT))
    out, err = launch.finish(job, timeout)
    return launch.Result(job.returncode, out, err)


def test_plain_and_one_rank_fsdp_train_and_are_timed(tmp_path):
    out = tmp_path / "fsdp_overhead.json"
    proc = _bench(["--shape", "tiny", "--seq", "64", "--micro-batch", "2", "--device", "cpu", "--steps", "2",
                   "--warmup", "1", "--override", "model.num_layers=2", "--override", "model.hidden_size=64",
                   "--override", "model.intermediate_size=128", "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert set(record["results"]) == {"none", "fsdp"}
    for name, result in record["results"].items():
        for key in ("step_ms", "forward_ms", "backward_ms", "optimizer_ms", "host_ms"):
            assert result[key] > 0, (name, key, result)
        assert result["tokens_per_s"] == 2 * 64 / (result["step_ms"] / 1e3)
    assert "fsdp - none" in proc.stdout


def test_unknown_variant_is_refused():
    proc = _bench(["--variants", "none,zero3", "--device", "cpu"], timeout=120)
    assert proc.returncode == 2
    assert "zero3" in proc.stderr
