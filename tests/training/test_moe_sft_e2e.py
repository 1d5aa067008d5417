"""Qwen3-MoE SFT through the whole stack, its experts split over 2 ranks (tests/configs/e2e-moe-sft.yaml:
the moe row's model, a dense layer then 4 experts top-2 with both balancing methods, on the chat tasks
under FSDP at ``parallel.ep=2``).

The four guarantees are its row of the guarantee table (tests/methods.py, ``MOE_SFT``): SIGKILL +
resume and replay give the ledger bit for bit at ep=2, the 2-rank checkpoint resumed on 1 rank at
``parallel.ep=1`` (an expert-parallel 2 -> 1 resume) keeps the batches, the trained tokens and the
loss and balancing fields within fp32 noise, and micro-batches 1 x 4 against 4 x 1 (one rank, ep=1)
keep the batches and the loss. Here, on the row's run: the ledger's SFT and balancing fields, and
that a checkpoint written at ep=2 holds every expert whole, each trained.
"""

from __future__ import annotations

import pytest

from tests import launch
from tests.methods import MOE_BIAS_FIELDS, MOE_FIELDS, MOE_SFT, MOE_SPARSE_LAYER

pytestmark = pytest.mark.slow

EXPERTS = 4  # e2e-moe.yaml's model.qwen3_moe.num_experts
RATE = 0.001  # and its bias_update_rate


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_runs.run(MOE_SFT)


def test_the_ledger_reports_trained_tokens_and_the_balancing_fields(reference):
    lines = launch.ledger(reference)
    assert all({"trained_tokens", *MOE_FIELDS} <= set(line) for line in lines)
    assert all(0 < line["trained_tokens"] < line["tokens"] for line in lines)  # assistant turns only
    for line in lines:
        low, high = (line[key] for key in MOE_BIAS_FIELDS)
        assert -RATE * (line["step"] - 1) - 1e-9 <= low <= high <= RATE * (line["step"] - 1) + 1e-9, line["step"]
        assert line["model/aux/load_balance"] > 0
    assert any(line[MOE_BIAS_FIELDS[1]] > 0 for line in lines[1:])  # the bias moved
    assert lines[-1]["loss"] < lines[0]["loss"]


def test_a_checkpoint_written_at_ep2_holds_every_expert_whole_and_trained(reference):
    from core import config as config_lib
    from core.layout import RunPaths
    from training.checkpoint.load import checkpoint_dir, load_checkpoint_model

    paths = RunPaths(reference)
    config = config_lib.load(paths.config)
    assert config.parallel.ep == 2
    experts = [load_checkpoint_model(config, checkpoint_dir(paths, step)).layers[MOE_SPARSE_LAYER].mlp.experts
               for step in (3, 6)]
    for name in ("gate_proj", "up_proj", "down_proj"):
        early, late = (getattr(module, name).detach() for module in experts)
        assert early.shape[0] == EXPERTS, name
        # each expert moved between the checkpoints, those held by rank 0 (0, 1) and by rank 1 (2, 3)
        assert all(not early[e].equal(late[e]) for e in range(EXPERTS)), name
