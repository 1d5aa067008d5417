"""``parallel.ddp_embedding_grad=gather`` (distributed/embedding_grad.py) on 2 spawned gloo ranks.

The gathered rows must give the gradient DDP's all-reduce gives (the mean of the ranks' local
gradients, to fp32 rounding) for a tied and an untied embedding, with two accumulated
micro-batches; every rank must hold the same bits; and the tied weight's gradient must be
complete in the backward before the lookup's gradient exists (the reason for the option).
``test_a_gathered_embedding_run_resumes_bitwise`` runs it through train.py on 2 ranks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import models
from core.config import ModelConfig, ParallelConfig
from tests import launch
from tests.distributed.dist_harness import run_on_ranks
from tests.e2e_config import e2e_args

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=16)
MICRO = 2  # micro-batches per step


def _ids(rank: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + micro)
    return torch.randint(0, TINY.vocab_size, (2, 12), generator=g)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())


def _model(tied: bool) -> torch.nn.Module:
    return models.build(replace(TINY, tie_embeddings=tied), generator=torch.Generator().manual_seed(3))


def _on_grad(tensor: torch.Tensor, call) -> None:
    tensor.register_hook(lambda grad: call())


def _worker(tied: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from core.distributed_context import DistributedContext
    from distributed.ddp import apply_ddp
    from distributed.embedding_grad import gathered_embedding
    from distributed.grad import no_sync

    torch.manual_seed(0)
    base = ParallelConfig(device="cpu", backend="gloo", timeout_s=60, strategy="ddp")
    with DistributedContext.from_env(base) as ctx:
        rank, world = ctx.rank, ctx.world_size
        want = {}  # the mean over ranks of each rank's local gradient, computed here without DDP
        for r in range(world):
            plain = _model(tied)
            for m in range(MICRO):
                _loss(plain, _ids(r, m)).backward()
            for name, p in plain.named_parameters():
                want[name] = want.get(name, 0) + p.grad / world
        mesh = init_device_mesh("cpu", (world,))
        got = {}
        for mode in ("allreduce", "gather"):
            ddp = apply_ddp(_model(tied), mesh, torch.device("cpu"), replace(base, ddp_embedding_grad=mode))
            gathered = gathered_embedding(ddp)
            order: list[str] = []
            embed = ddp.module.embed_tokens
            embed.weight.register_post_accumulate_grad_hook(lambda p: order.append("weight"))
            embed.register_forward_hook(lambda module, args, out: _on_grad(out, lambda: order.append("lookup")))
            for _step in range(2):  # DDP rebuilds its buckets after the first step
                ddp.zero_grad(set_to_none=True)
                order.clear()
                for m in range(MICRO):
                    with no_sync(ddp) if m < MICRO - 1 else torch.enable_grad():
                        _loss(ddp, _ids(rank, m)).backward()
                    if gathered is not None:
                        gathered.finish(m == MICRO - 1)
            got[mode] = {name: p.grad.clone() for name, p in ddp.module.named_parameters()}
            got[f"{mode}/installed"] = gathered is not None
            got[f"{mode}/order"] = list(order)
        got["want"] = want
        return got


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gathered_rows_give_the_all_reduced_mean_on_every_rank(tied):
    ranks = run_on_ranks(_worker, 2, tied)
    for result in ranks:
        assert not result["allreduce/installed"] and result["gather/installed"]
        for name, want in result["want"].items():
            for mode in ("allreduce", "gather"):
                torch.testing.assert_close(result[mode][name], want, rtol=1e-5, atol=1e-7, msg=f"{mode} {name}")
    for name in ranks[0]["gather"]:
        assert torch.equal(ranks[0]["gather"][name], ranks[1]["gather"][name]), name  # same bits on every rank
    # All-reduced, the weight's gradient is complete only after the lookup's. Gathered, the
    # lookup no longer feeds it: with a tied head it is complete before the lookup's gradient
    # exists (so DDP reduces it beside the backward); untied, only the gather writes it.
    assert ranks[0]["allreduce/order"] == ["lookup", "weight"] * MICRO
    assert ranks[0]["gather/order"] == (["weight", "lookup"] * MICRO if tied else ["lookup"] * MICRO)



@pytest.mark.slow
def test_a_gathered_embedding_run_resumes_and_replays_bitwise(e2e_workdir):
    """Through train.py on two gloo ranks, two micro-batches a step: the gathered run follows
    the all-reduced one to fp32 rounding, and a copy cut back to its step-4 checkpoint resumes
    to the same ledger, bit for bit; a replayed step matches."""
    ddp = ["parallel.strategy=ddp"]
    plain = launch.train(e2e_workdir, e2e_args(max_steps=6, name="embed-allreduce", overrides=ddp))
    gathered = launch.train(e2e_workdir, e2e_args(max_steps=6, name="embed-gather",
                                                  overrides=[*ddp, "parallel.ddp_embedding_grad=gather"]))
    assert plain.returncode == 0 and gathered.returncode == 0, (plain.stderr, gathered.stderr)
    run_dir = e2e_workdir / gathered.run_dir
    expected = launch.ledger(run_dir)
    assert len(expected) == 6
    for a, b in zip(launch.ledger(e2e_workdir / plain.run_dir), expected):
        assert a["batch_hash"] == b["batch_hash"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)

    copy = launch.cut_back_copy(run_dir, 4)
    resumed = launch.train(e2e_workdir, ["--resume", copy.name])
    assert resumed.returncode == 0, resumed.stderr
    assert launch.ledger(copy) == expected
    launch.replay_verifies(e2e_workdir, run_dir, steps=(3,))
