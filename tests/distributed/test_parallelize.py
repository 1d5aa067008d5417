"""parallelize under every strategy on 2 real gloo processes vs. one plain process.

All multi-rank runs share one spawn (module fixture) to keep the suite fast; each test then
checks one contract on the collected results. Runs use the real model at toy size (Qwen3;
Qwen2, with q/k/v biases, for one TP run).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import scenarios
from tests.distributed.dist_harness import run_on_ranks

WORLD = 2
RUNS = [
    # name, ParallelConfig overrides, train() kwargs
    ("ddp", dict(strategy="ddp"), {}),
    ("ddp_sgd", dict(strategy="ddp"), {"optimizer": "sgd"}),
    ("fsdp", dict(strategy="fsdp"), {}),
    ("fsdp_sgd", dict(strategy="fsdp", reshard_after_forward=False), {"optimizer": "sgd"}),
    ("hsdp", dict(strategy="fsdp", dp_replicate=2), {}),
    ("fsdp_ac", dict(strategy="fsdp", activation_checkpointing="full"), {}),
    ("fsdp_accum", dict(strategy="fsdp"), {"micro_batches": 2}),
    ("fsdp_units", dict(strategy="fsdp", fsdp_unit_blocks=2, activation_checkpointing="full"), {"micro_batches": 2}),
    ("ddp_accum_ac", dict(strategy="ddp", activation_checkpointing="selective"), {"micro_batches": 2}),
    ("fsdp_bf16", dict(strategy="fsdp", precision="bf16"), {}),
    ("tp", dict(strategy="fsdp", tp=2), {}),
    ("tp_qwen2", dict(strategy="fsdp", tp=2, reshard_after_forward=False), {"arch": "qwen2"}),
    ("tp_ac_bf16", dict(strategy="fsdp", tp=2, activation_checkpointing="full", precision="bf16"), {}),
]
NAMES = [name for name, _, _ in RUNS]
FP32_RUNS = [name for name, over, _ in RUNS if over.get("precision", "fp32") == "fp32"]
BF16_RUNS = [name for name in NAMES if name not in FP32_RUNS]
TOL = dict(rtol=2e-5, atol=2e-6)  # fp32 runs differ only in reduction order


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(scenarios.many, WORLD, RUNS)


@pytest.fixture(scope="module")
def single() -> dict:
    """The same training in one process (strategy none), per (optimizer, model)."""
    keys = {(kw.get("optimizer", "adamw"), kw.get("arch", "qwen3")) for _, _, kw in RUNS}
    return {
        key: scenarios.train(scenarios.cpu_parallel(strategy="none"), optimizer=key[0], arch=key[1])
        for key in keys
    }


def _reference(single: dict, name: str) -> dict:
    kwargs = dict(RUNS[NAMES.index(name)][2])
    return single[(kwargs.get("optimizer", "adamw"), kwargs.get("arch", "qwen3"))]


@pytest.mark.parametrize("name", FP32_RUNS)
def test_loss_and_grad_norm_trajectory_match_single_process(ranks, single, name):
    ref = _reference(single, name)
    for rank in ranks:
        torch.testing.assert_close(rank[name]["losses"], ref["losses"], **TOL)
        torch.testing.assert_close(rank[name]["grad_norms"], ref["grad_norms"], **TOL)
        torch.testing.assert_close(rank[name]["l1_inf_norms"], ref["l1_inf_norms"], **TOL)


def test_clipping_was_active(single):
    # The trajectory comparison checks clipping only if clipping really scaled gradients.
    for ref in single.values():
        assert min(ref["grad_norms"]) > scenarios.MAX_NORM


@pytest.mark.parametrize("name", BF16_RUNS)
def test_bf16_mixed_precision_stays_close_to_fp32(ranks, single, name):
    losses = ranks[0][name]["losses"]
    ref = _reference(single, name)["losses"]
    torch.testing.assert_close(losses, ref, rtol=5e-3, atol=0.0)
    assert losses != ref  # the bf16 compute really happened


@pytest.mark.parametrize("name", NAMES)
def test_every_rank_sees_the_same_grad_norm_and_weights(ranks, name):
    first = ranks[0][name]
    for rank in ranks[1:]:
        assert rank[name]["grad_norms"] == first["grad_norms"]
        assert rank[name]["hash_after"] == first["hash_after"]


@pytest.mark.parametrize("name", NAMES)
def test_param_hash_is_strategy_independent_for_equal_weights(ranks, single, name):
    for rank in ranks:
        assert rank[name]["hash_before"] == _reference(single, name)["hash_before"]


def test_param_hash_tracks_the_weights(ranks, single):
    for ref in single.values():
        assert ref["hash_after"] != ref["hash_before"]
    assert ranks[0]["ddp"]["hash_after"] != ranks[0]["ddp"]["hash_before"]


@pytest.mark.parametrize("name", NAMES)
def test_names_map_back_to_the_plain_model(ranks, single, name):
    arch = dict(RUNS[NAMES.index(name)][2]).get("arch", "qwen3")
    plain_keys = sorted(scenarios.build_model(arch).state_dict())
    for rank in ranks:
        assert rank[name]["names"] == _reference(single, name)["names"]
        assert rank[name]["state_dict_keys"] == plain_keys
        assert rank[name]["tied"]


@pytest.mark.parametrize(
    "name, expected",
    [("ddp", [(0, 2), (1, 2)]), ("fsdp", [(0, 2), (1, 2)]), ("hsdp", [(0, 2), (1, 2)]), ("tp", [(0, 1), (0, 1)])],
)
def test_data_parallel_rank_and_size(ranks, name, expected):
    assert [rank[name]["dp"] for rank in ranks] == expected


@pytest.mark.parametrize("name, units", [("ddp", 0), ("fsdp", scenarios.LAYERS + 1), ("fsdp_units", 2)])
def test_fsdp_units_group_consecutive_blocks(ranks, name, units):
    # fsdp: one unit per block plus the root; fsdp_unit_blocks=2: both blocks in one unit.
    assert [r[name]["fsdp_units"] for r in ranks] == [units] * WORLD
