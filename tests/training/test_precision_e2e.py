"""bf16 autocast and fp16 with a gradient scaler train through train.py and stay close to fp32;
an fp16 run resumes bitwise (the scaler's state is in the checkpoint)."""

from __future__ import annotations

import shutil

import pytest

from tests import launch
from tests.e2e_config import e2e_args

pytestmark = pytest.mark.slow


def _ledger(workdir, precision, name, steps=4):
    result = launch.train(
        workdir,
        e2e_args(max_steps=steps, name=name, overrides=["parallel.strategy=none", f"parallel.precision={precision}"]),
        nproc=1,
    )
    assert result.returncode == 0, result.stderr
    run_dir = result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir
    return run_dir, launch.ledger(run_dir)


def test_mixed_precision_tracks_fp32(e2e_workdir):
    _, fp32 = _ledger(e2e_workdir, "fp32", "p32")
    for precision in ("bf16", "fp16"):
        _, got = _ledger(e2e_workdir, precision, f"p{precision}")
        assert [r["batch_hash"] for r in got] == [r["batch_hash"] for r in fp32]
        for a, b in zip(fp32, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=2e-2), precision
            assert b["loss"] != a["loss"] or precision == "fp32"  # really ran in low precision


def test_fp16_resume_is_bitwise(e2e_workdir):
    run_dir, full = _ledger(e2e_workdir, "fp16", "p16full", steps=8)
    for path in (run_dir / "checkpoints").glob("step_*"):
        if path.name != "step_00000004":
            shutil.rmtree(path)
    (run_dir / "checkpoints" / "LATEST").write_text("step_00000004")
    result = launch.train(e2e_workdir, ["--resume", run_dir.name], nproc=1)
    assert result.returncode == 0, result.stderr
    assert launch.ledger(run_dir) == full
