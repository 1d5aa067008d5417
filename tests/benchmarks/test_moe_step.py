"""benchmarks/moe_step.py --smoke, in this process: the Qwen3-30B-A3B preset's code path at a tiny
shape on CPU, Lockstep through train.main twice (equal ledgers) and transformers' Qwen3MoeForCausalLM,
into one JSON with both sides' timings, the experts kernels and the active-parameter FLOPs."""

from __future__ import annotations

import json

import pytest

from benchmarks import lockstep_runs, moe_step


@pytest.mark.usefixtures("restore_process_state")
def test_the_smoke_trains_both_sides_and_repeats_bitwise(tmp_path, capfd):
    out = tmp_path / "moe_step.json"
    assert moe_step.main(["--smoke", "--run-root", str(tmp_path / "runs"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    lockstep, repeat, hf = report["lockstep"], report["lockstep_repeat"], report["transformers"]
    assert lockstep["status"] == repeat["status"] == hf["status"] == "ok", (lockstep, repeat, hf)
    assert lockstep["in_process"] and "determinism.mode=bitwise" in lockstep["command"]
    # Both ran the preset's architecture at the smoke's shape, the same parameters on both sides.
    assert hf["hf_class"] == "Qwen3MoeForCausalLM" and hf["hf_params"] == report["shape"]["params_total"]
    assert hf["experts_implementation"] in ("grouped_mm", "batched_mm", "eager")
    assert report["lockstep_experts"]["kernel"] == "loop"  # CPU: no torch._grouped_mm
    # A train.py run of warmup + steps + 1 steps; the ledgers of the two runs are equal, hashes and all.
    steps = moe_step.SMOKE_SETTINGS["warmup"] + moe_step.SMOKE_SETTINGS["steps"] + 1
    assert report["bitwise_repeat"]["equal"] and report["bitwise_repeat"]["lines"] == [steps, steps]
    assert report["bitwise_repeat"]["last_param_hash"][0] is not None
    for part in (lockstep, hf):
        assert part["tokens_per_s"] > 0 and part["step_time_s"] > 0
    # Active parameters: the router and top-2 of 8 experts per layer, not every expert.
    assert report["shape"]["params_active"] < report["shape"]["params_total"]
    assert lockstep["flops_per_token"] == hf["flops_per_token"] == report["shape"]["flops_per_token"]
    printed = capfd.readouterr().out  # capfd: train.main hands faulthandler the real stderr
    assert "| lockstep (bitwise) | ok |" in printed and "equal ledgers" in printed


def test_the_repeat_check_names_the_first_differing_step():
    lines = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    other = [lines[0], {"step": 2, "loss": 1.5000001}]
    check = lockstep_runs.repeat_check({"ledger": lines}, {"ledger": other})
    assert not check["equal"] and check["first_differing_step"] == 2
    assert lockstep_runs.repeat_check({"ledger": lines}, {"ledger": list(lines)})["equal"]
    assert not lockstep_runs.repeat_check({"ledger": lines}, {"ledger": lines[:1]})["equal"]
    assert not lockstep_runs.repeat_check({"ledger": []}, {"ledger": []})["equal"]
