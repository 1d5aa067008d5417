"""Qwen3-MoE pretraining through the whole stack (tests/configs/e2e-moe.yaml: a dense layer, then a
router over 4 experts, top-2, with the load-balancing loss and auxiliary-loss-free balancing).

The four guarantees are its row of the guarantee table (tests/methods.py, ``MOE``): SIGKILL + resume
gives the uninterrupted ledger bit for bit (the ``model/*`` fields and so the router bias included),
replay before and after a checkpoint verifies, the 2-rank checkpoint resumed on 1 rank and micro-
batches 1 x 4 against 4 x 1 keep the batches, the loss and the fields the row's note names. Here, on
the row's run: the balancing fields in the ledger, in the metric records (TensorBoard's) and on runs
plot's expert-load panels, the bias a checkpoint holds being the one the next step chose with; bad
expert settings refused by train.py's launcher (exit 2) before any rank starts: a
``parallel.ep`` that does not divide the experts, a top-k above them; and a resume at another expert
count refused (exit 4), naming both counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launch
from tests.guarantees import CONFIGS
from tests.methods import MOE, MOE_BIAS_FIELDS, MOE_FIELDS, MOE_SPARSE_LAYER

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RATE = 0.001  # e2e-moe.yaml's model.qwen3_moe.bias_update_rate


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_runs.run(MOE)


def test_the_ledger_reports_the_load_the_balancing_loss_and_the_bias(reference):
    lines = launch.ledger(reference)
    assert all(set(MOE_FIELDS) <= set(line) for line in lines)
    first = lines[0]
    assert [first[key] for key in MOE_BIAS_FIELDS] == [0.0, 0.0]  # the bias starts at 0
    for line in lines:
        low, high = (line[key] for key in MOE_BIAS_FIELDS)
        steps_taken = line["step"] - 1  # moved once after each update before this step's forwards
        assert -RATE * steps_taken - 1e-9 <= low <= high <= RATE * steps_taken + 1e-9, line["step"]
        assert line[f"model/layer{MOE_SPARSE_LAYER}_load_min"] <= 1.0 <= line[f"model/layer{MOE_SPARSE_LAYER}_load_max"]
        assert line["model/aux/load_balance"] > 0
    assert any(line[MOE_BIAS_FIELDS[1]] > 0 for line in lines[1:])  # it moved


def test_the_metric_records_and_runs_plot_get_the_balancing_fields(reference):
    """metrics.jsonl's records are what the TensorBoard sink writes (``<name>/mean|min|max``, the
    row's config turns TensorBoard off; tests/experiments/test_tracking.py checks the sink)."""
    from experiments.plots import panels, run_series

    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert records and all(set(MOE_FIELDS) <= set(record["metrics"]) for record in records)
    laid = {name: (group, set(lines)) for group, name, lines in panels(run_series(reference))}
    assert laid["model/load_max"] == laid["model/bias_min"] == ("expert load", {f"layer{MOE_SPARSE_LAYER}"})


def test_the_checkpoint_holds_the_bias_the_next_step_chose_with(reference):
    from core import config as config_lib
    from core.layout import RunPaths
    from models.qwen3_moe.moe import BIAS
    from training.checkpoint.load import checkpoint_dir, load_checkpoint_model

    paths = RunPaths(reference)
    model = load_checkpoint_model(config_lib.load(paths.config), checkpoint_dir(paths, 3))
    (layer, router), = model.routers_with_bias()
    bias = getattr(router, BIAS)
    after = launch.ledger(reference)[3]  # step 4: its forwards chose with the bias step 3 left
    assert layer == MOE_SPARSE_LAYER and after["step"] == 4
    assert (float(bias.min()), float(bias.max())) == (pytest.approx(after[MOE_BIAS_FIELDS[0]], rel=1e-6),
                                                      pytest.approx(after[MOE_BIAS_FIELDS[1]], rel=1e-6))
    assert bias.dtype.is_floating_point and bool((bias.abs() <= 3 * RATE + 1e-9).all())


@pytest.mark.parametrize("overrides, message", [
    (("parallel.ep=2", "model.qwen3_moe.num_experts=3"), "parallel.ep=2 does not divide model.qwen3_moe.num_experts=3"),
    (("model.qwen3_moe.num_experts_per_tok=5",),
     "model.qwen3_moe.num_experts_per_tok=5 must be between 1 and model.qwen3_moe.num_experts=4"),
], ids=["ep-not-dividing-the-experts", "top-k-above-the-experts"])
def test_a_bad_expert_setting_exits_2_naming_both_numbers(tmp_path, overrides, message):
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--nproc", "2", "--config",
                             str(CONFIGS / "e2e-moe.yaml"), *overrides],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "runs").exists()  # refused before any run dir


def test_resuming_with_another_expert_count_exits_4_naming_both(reference, reference_runs):
    # the checkpoint's experts are (4, ...) tensors: a run of 8 experts cannot continue from them
    result = launch.train(reference_runs.workdir, ["--resume", reference.name, "model.qwen3_moe.num_experts=8"],
                          nproc=1)
    assert result.returncode == 4, result.stderr
    assert "model.qwen3_moe.num_experts: 4 -> 8" in result.stderr
    assert [line["step"] for line in launch.ledger(reference)] == list(range(1, MOE.steps + 1))  # untouched
