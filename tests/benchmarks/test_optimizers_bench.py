"""benchmarks/optimizers.py: what each case changes, and the report of a failed case."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import optimizers as bench


def _args(**kw) -> argparse.Namespace:
    return bench.parse_args(["--preset", "tiny", *[f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]])


def test_each_case_changes_only_what_its_optimizer_needs():
    args, preset = _args(lion_lr_scale=0.5), {"lr": 0.004, "weight_decay": 0.1}
    assert bench.case_overrides("adamw", args, preset) == ["train.optimizer=adamw"]
    assert bench.case_overrides("muon", args, preset) == ["train.optimizer=muon"]
    assert bench.case_overrides("lion", args, preset) == ["train.optimizer=lion", "train.lr=0.002", "train.weight_decay=0.2"]
    assert bench.case_overrides("schedule_free_adamw", args, preset)[-1] == "train.schedule=constant"
    assert bench.case_overrides("adamw+fp8-rowwise", args, preset) == [
        "train.optimizer=adamw", "parallel.float8=rowwise", "parallel.precision=bf16"
    ]


def test_fp8_cases_name_their_recipe_and_option():
    args = _args(float8="tensorwise,tensorwise+backward_fast_accum")
    assert args.fp8_cases == ["adamw+fp8-tensorwise", "adamw+fp8-tensorwise+backward_fast_accum"]
    assert bench.case_overrides(args.fp8_cases[1], args, {}) == [
        "train.optimizer=adamw", "parallel.float8=tensorwise", "parallel.precision=bf16",
        "parallel.float8_backward_fast_accum=true",
    ]
    assert bench.case_overrides(bench.fp8_case("tensorwise+backward_fast_accum+head"), args, {})[-2:] == [
        "parallel.float8_backward_fast_accum=true", "parallel.float8_head=true",
    ]
    for bad in ("blockwise", "tensorwise+fast", "tensorwise+head+head"):
        with pytest.raises(SystemExit):
            _args(float8=bad)


def test_one_gpu_trains_without_fsdp_and_keeps_every_step():
    overrides = bench.base_overrides(_args(steps=7, gpus=1), run_root=bench.ROOT / "x")
    assert "parallel.strategy=none" in overrides and "train.max_steps=7" in overrides
    assert "checkpoint.interval=0" in overrides and "metrics.log_interval=1" in overrides
    assert "parallel.strategy=fsdp" in bench.base_overrides(_args(gpus=2), run_root=bench.ROOT / "x")


def test_table_marks_a_failed_case():
    text = bench.table([
        {"case": "muon", "exit_code": 0, "losses": [3.0, 2.0], "final_loss": 2.0, "optimizer_ms": 1.25, "step_ms": 10.0},
        {"case": "lion", "exit_code": 2},
    ])
    assert "| muon | 2.0000 | 1.2 | 10 |" in text and "| lion | failed (exit 2) |" in text
