"""``parallel.ddp_embedding_grad=gathered`` (distributed/ddp.py, GatheredEmbeddingGrad).

On 2 spawned gloo ranks, a tied Qwen model under DDP: the gathered lookup rows (and, where
gathering would send more, the dense fallback) give every parameter the gradient of DDP's own
dense reduction, within fp32 rounding, over gradient accumulation; the tied weight's bucket is
reduced first instead of last; a rank that looks up more tokens than its config allows gets a
ConfigError naming the key. Through train.py: SIGKILL (at step 5, and at random moments) +
resume gives the uninterrupted ledger, a step replays, a one-rank resume keeps the batches, and
the losses match the dense run's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import models
from core.config import ModelConfig, ParallelConfig
from core.config import load as load_config
from core.exceptions import ConfigError
from tests import launch
from tests.distributed.dist_harness import run_on_ranks
from tests.e2e_config import E2E_CONFIG, e2e_args

TIED = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=16, tie_embeddings=True)
TOKENS = 8  # per micro-batch; two micro-batches a step


def _ids(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randint(0, TIED.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def _train(ddp, rank: int, gathered) -> list[torch.Tensor]:
    """Three steps of two micro-batches; the gradients of the last step."""
    for step in range(3):
        ddp.zero_grad(set_to_none=True)
        for micro in range(2):
            context = ddp.no_sync() if micro == 0 else contextlib.nullcontext()
            with context:
                ddp(_ids(rank, step, micro)).float().square().mean().backward()
        if gathered is not None:
            gathered.add_to_grad()
    return [p.grad.clone() for p in ddp.module.parameters()]


def _worker() -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.device_mesh import init_device_mesh

    from core.distributed_context import DistributedContext
    from distributed.ddp import apply_ddp, gather_embedding_grad

    result = {}
    parallel = ParallelConfig(device="cpu", backend="gloo", timeout_s=60, ddp_bucket_mb=0.004)
    with DistributedContext.from_env(parallel):
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        group = mesh.get_group()

        def build():
            torch.manual_seed(0)
            return apply_ddp(models.build(TIED), mesh, torch.device("cpu"), parallel)

        def recorded():
            """A DDP model whose hook notes the parameters of bucket 0 every backward."""
            ddp, first_bucket = build(), []

            def record(state, bucket):
                if bucket.index() == 0:
                    first_bucket.append([id(p) for p in bucket.parameters()])
                return allreduce_hook(state, bucket)

            ddp.register_comm_hook(group, record)
            return ddp, first_bucket

        ddp, first_bucket = recorded()
        dense = _train(ddp, rank, None)
        result["dense_weight_in_first_bucket"] = id(ddp.module.embed_tokens.weight) in first_bucket[-1]
        # 2 ranks x 16 tokens x 33 values gathered < 64 x 32 dense; 64 tokens a rank would send more.
        for name, max_tokens in (("gathered", 2 * TOKENS), ("dense_fallback", 4 * 2 * TOKENS)):
            ddp, first_bucket = recorded()
            gathered = gather_embedding_grad(ddp, group, max_tokens=max_tokens)
            grads = _train(ddp, rank, gathered)
            result[name] = {
                "gathers": gathered.gathers,
                "max_diff": max(float((a - b).abs().max()) for a, b in zip(grads, dense)),
                "scale": max(float(b.abs().max()) for b in dense),
                # After DDP rebuilds its buckets by readiness, the tied weight's comes first.
                "weight_in_first_bucket": id(ddp.module.embed_tokens.weight) in first_bucket[-1],
                "tied": ddp.module.lm_head.weight is ddp.module.embed_tokens.weight,
                "state_dict_keys": sorted(ddp.module.state_dict()) == sorted(build().module.state_dict()),
            }
        ddp = build()
        gathered = gather_embedding_grad(ddp, group, max_tokens=TOKENS)  # one micro-batch's worth
        try:
            _train(ddp, rank, gathered)
            result["too_many_tokens"] = ""
        except ConfigError as exc:
            result["too_many_tokens"] = str(exc)
    return result


def test_gathered_rows_give_ddp_gradients_and_reduce_the_tied_bucket_first():
    for result in run_on_ranks(_worker, 2):
        assert result["gathered"]["gathers"] and not result["dense_fallback"]["gathers"]
        for name in ("gathered", "dense_fallback"):
            check = result[name]
            assert check["tied"] and check["state_dict_keys"], (name, check)
            assert check["max_diff"] <= 1e-6 * max(check["scale"], 1.0), (name, check)
            assert check["weight_in_first_bucket"], (name, check)
        assert not result["dense_weight_in_first_bucket"]  # dense: its bucket is the last one ready
        assert "parallel.ddp_embedding_grad" in result["too_many_tokens"]
        assert "16 tokens" in result["too_many_tokens"]


@pytest.mark.parametrize("overrides, fragment", [
    (["model.tie_embeddings=false"], "tied embeddings"),
    (["model.lora.rank=4"], "trained embedding"),
    (["objective.kind=grpo"], "objective.kind=grpo"),
])
def test_gathered_needs_a_trained_tied_embedding_and_a_bounded_objective(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(E2E_CONFIG, ["parallel.ddp_embedding_grad=gathered", *overrides])
    assert info.value.context["key"] == "parallel.ddp_embedding_grad"
    assert fragment in str(info.value)


def test_gathered_has_no_effect_and_no_error_under_other_strategies():
    for strategy in ("none", "fsdp"):
        config = load_config(E2E_CONFIG, ["parallel.ddp_embedding_grad=gathered", f"parallel.strategy={strategy}"])
        assert config.parallel.ddp_embedding_grad == "gathered"


# 2 ranks x 128 tokens x 65 values gathered, under the dense 512 x 64: the gathered path.
GATHERED = ["parallel.strategy=ddp", "parallel.ddp_embedding_grad=gathered", "train.global_batch_size=4",
            "train.micro_batch_size=1", "checkpoint.interval=2"]


@pytest.mark.slow
def test_gathered_run_resumes_replays_and_matches_dense(e2e_workdir):
    reference = launch.train(e2e_workdir, e2e_args(max_steps=6, name="gathered-ref", overrides=GATHERED))
    assert reference.returncode == 0, reference.stderr
    assert "is all-gathered as rows" in reference.stdout + reference.stderr
    reference_dir = e2e_workdir / reference.run_dir if not reference.run_dir.is_absolute() else reference.run_dir
    expected = launch.ledger(reference_dir)
    assert len(expected) == 6 and expected[-1]["loss"] < expected[0]["loss"]

    dense = launch.train(e2e_workdir, e2e_args(max_steps=6, name="gathered-dense",
                                               overrides=[*GATHERED[:1], *GATHERED[2:]]))
    assert dense.returncode == 0, dense.stderr
    dense_dir = e2e_workdir / dense.run_dir if not dense.run_dir.is_absolute() else dense.run_dir
    for a, b in zip(launch.ledger(dense_dir), expected):
        assert a["batch_hash"] == b["batch_hash"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]

    name = "gathered-killed"
    run_dir = launch.stall_kill_and_resume(e2e_workdir, e2e_args(max_steps=6, name=name, overrides=GATHERED), name=name)
    assert launch.ledger(run_dir) == expected
    launch.replay_verifies(e2e_workdir, run_dir, steps=(5,))
    launch.one_rank_resume_keeps_the_batches(e2e_workdir, reference_dir, step=4)
    # And SIGKILL at a random moment (mid-step, mid-gather, mid-checkpoint), then resume.
    name = "gathered-random-kills"
    run_dir = launch.kill_and_resume(e2e_workdir, e2e_args(max_steps=6, name=name, overrides=GATHERED), name=name,
                                     seed=20, kills=1)
    assert launch.ledger(run_dir) == expected
