"""``parallel.fsdp_cast_parameters: false``: a trained model computes one way on any number of ranks.

Under ``strategy: fsdp`` with bf16, two ranks shard the policy and one rank does not (no process
group). FSDP2's bf16 policy computes with bf16 parameters and no autocast; one process computes with
its fp32 parameters under bf16 autocast, so the log-probs of one set of weights differ, and so do the
batches that come from them (PPO's old log-probs and values, the sampler's copy under
``determinism.batch_invariant``) after a 2 -> 1 rank resume. With the key off, FSDP gathers the fp32
parameters and the loop autocasts (training/builders.py, training/precision.py): two ranks give one
rank's bits. The control: bf16 parameters without autocast (what the default computes on several
ranks) give other bits, so the equality is not an accident of the arithmetic (shown in process).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from core import config as config_lib
from tests import launch
from tests.distributed.dist_harness import run_on_ranks

CONFIG = launch.ROOT / "tests" / "configs" / "e2e-ppo.yaml"
OVERRIDES = ["parallel.device=cpu", "parallel.precision=bf16", "parallel.strategy=fsdp"]
ROWS = 4


def _rows(config) -> SimpleNamespace:
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, config.model.vocab_size, (ROWS, config.data.seq_len), generator=generator)
    positions = torch.arange(config.data.seq_len).expand(ROWS, -1)
    return SimpleNamespace(input_ids=ids, labels=ids.roll(-1, dims=1), position_ids=positions, document_ids=None)


def _policy_logps(cast: bool) -> dict:
    """The policy's label log-probs of fixed rows as the loop's training forward computes them with
    ``parallel.fsdp_cast_parameters=cast``, whether the loop autocasts and whether FSDP sharded the
    policy, on this process's world size."""
    from core.distributed_context import DistributedContext
    from distributed.params import unwrap
    from training.builders import build_model
    from training.objectives.token_logps import label_logps
    from training.precision import Precision

    torch.set_num_threads(1)
    config = config_lib.load(str(CONFIG), [*OVERRIDES, f"parallel.fsdp_cast_parameters={str(cast).lower()}"])
    with DistributedContext.from_env(config.parallel) as dist:
        model, plan = build_model(config, dist)
        numerics = unwrap(model).numerics
        precision = Precision(numerics, device=dist.device, wrapper_casts=numerics.wrapper_casts)
        with torch.no_grad(), precision.autocast():
            logps = label_logps(model, _rows(config), fused=True, chunk_tokens=config.train.loss_chunk_tokens).float()
        return {"logps": logps, "autocast": precision.use_autocast, "sharded": plan.fsdp_applied}


@pytest.mark.slow  # two spawned ranks
def test_fp32_gathers_under_autocast_give_one_rank_s_log_probs_on_two():
    one = _policy_logps(cast=False)  # world size 1: a plain model under autocast, nothing sharded
    assert one["autocast"] and not one["sharded"] and one["logps"].abs().sum() > 0
    for rank, gathered in enumerate(run_on_ranks(_policy_logps, 2, False)):
        assert gathered["sharded"] and gathered["autocast"], rank
        assert torch.equal(gathered["logps"], one["logps"]), \
            f"rank {rank}: max diff {(gathered['logps'] - one['logps']).abs().max().item():.3e}"


def test_bf16_parameters_without_autocast_would_give_other_log_probs():
    """The control, in process: what FSDP2's bf16 policy computes (the default on several ranks: bf16
    parameters, no autocast) is not what fp32 parameters under autocast compute, so the equality above
    is not an accident of the arithmetic."""
    from distributed.params import unwrap
    from training.builders import build_model
    from training.objectives.token_logps import label_logps
    from core.distributed_context import DistributedContext

    torch.set_num_threads(1)
    config = config_lib.load(str(CONFIG), OVERRIDES)
    with DistributedContext.from_env(config.parallel) as dist:
        model = unwrap(build_model(config, dist)[0])
        rows = _rows(config)
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = label_logps(model, rows, fused=True, chunk_tokens=config.train.loss_chunk_tokens).float()
            model.to(torch.bfloat16)
            cast = label_logps(model, rows, fused=True, chunk_tokens=config.train.loss_chunk_tokens).float()
    assert autocast.abs().sum() > 0 and not torch.equal(cast, autocast)
