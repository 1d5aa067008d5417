"""A frozen model's outputs do not depend on the number of ranks (training/objectives/frozen.py).

A reference's log-probs are batch contents: a 2-rank run resumed on one rank must compute the
same ones. Under ``parallel.strategy=fsdp`` with bf16, two ranks shard the model and one rank
does not (no process group, nothing to shard), so the frozen model computes one way on any
number of ranks: fp32 parameters (FSDP gathers them with no mixed-precision cast) under the
precision's autocast, which ``FrozenModel.context()`` enters. FSDP2's bf16 policy instead
computes with bf16 parameters and activations, which gives other log-probs: the last test shows
the difference is real on this machine, so the equality is not an accident of the arithmetic.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from core import config as config_lib
from tests import launch
from tests.distributed.dist_harness import run_on_ranks

CONFIG = launch.ROOT / "tests" / "configs" / "e2e-grpo.yaml"
OVERRIDES = ["parallel.device=cpu", "parallel.precision=bf16", "parallel.strategy=fsdp"]
ROWS, KEY = 4, "objective.grpo.reference"


def _rows(config) -> SimpleNamespace:
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, config.model.vocab_size, (ROWS, config.data.seq_len), generator=generator)
    positions = torch.arange(config.data.seq_len).expand(ROWS, -1)
    return SimpleNamespace(input_ids=ids, labels=ids.roll(-1, dims=1), position_ids=positions, document_ids=None)


def _reference_logps(frozen, config) -> torch.Tensor:
    from training.objectives.token_logps import autocast_dtype, label_logps

    placed = _rows(config)
    with torch.no_grad(), frozen.context():
        return label_logps(frozen.module, placed, fused=True, chunk_tokens=config.train.loss_chunk_tokens,
                           compute_dtype=autocast_dtype(placed.input_ids.device)).float()


def _on_this_process() -> torch.Tensor:
    from core.distributed_context import DistributedContext
    from training.objectives.frozen import build_frozen

    config = config_lib.load(str(CONFIG), OVERRIDES)
    with DistributedContext.from_env(config.parallel) as dist:
        frozen = build_frozen(config, "init", role="reference", dist=dist, key=KEY)
        return _reference_logps(frozen, config)


@pytest.mark.slow  # two spawned ranks
def test_a_frozen_reference_gives_the_same_log_probs_on_two_ranks_and_on_one():
    torch.set_num_threads(1)
    one = _on_this_process()  # world size 1: a plain model, nothing sharded
    two = run_on_ranks(_on_this_process, 2)  # FSDP over 2 gloo ranks, each computing the same rows
    assert one.abs().sum() > 0
    for rank, logps in enumerate(two):
        assert torch.equal(logps, one), f"rank {rank}: max diff {(logps - one).abs().max().item():.3e}"


def test_bf16_parameters_would_give_other_log_probs():
    """What FSDP2's bf16 policy computes (bf16 parameters, no fp32 master in the forward) differs
    from fp32 parameters under autocast: the arithmetic the frozen model avoids."""
    import models
    from core import seeding
    from training.objectives.frozen import FrozenModel, compute_autocast

    torch.set_num_threads(1)
    config = config_lib.load(str(CONFIG), OVERRIDES)
    built = models.build(config.model, generator=seeding.generator(config.train.seed, "model_init")).eval()
    cpu = torch.device("cpu")
    as_frozen = FrozenModel("reference", built, {}, config.model.vocab_size,
                            context=lambda: compute_autocast("bf16", cpu))
    fp32_params = _reference_logps(as_frozen, config)
    assert torch.equal(fp32_params, _on_this_process())  # the same seeded weights build_frozen starts from
    as_frozen.module = built.to(torch.bfloat16)
    assert not torch.equal(_reference_logps(as_frozen, config), fp32_params)
