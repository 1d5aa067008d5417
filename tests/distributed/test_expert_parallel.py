"""Expert parallelism (distributed/expert_parallel.py) on 2 gloo ranks, with a tiny Qwen3-MoE.

EP=2 splits each sparse block's 4 experts 2 + 2 over the ranks and exchanges the tokens by all-to-all.
Against EP=1 (the plain model over the whole batch in one process) the loss and every gradient agree
within fp32 tolerance; against FSDP on 2 ranks without the axis they are the same bits (each expert
runs each source rank's rows on their own), also with two micro-batches a rank (each expert keeps its
sources' sums apart until the last); each degree repeats bit for bit. On 4 ranks at EP=2,
where FSDP shards the experts over the 2 ranks outside the ep group, and at TP=2 x EP=2, they agree
within tolerance.
The exchange itself hands each rank's experts their rows grouped by expert, then source rank, then
the source's order, and gives the caller its outputs back in the order it sent them. The experts are
DTensors on the ep mesh, so DCP stores whole (E, ...) tensors: a state written at
EP=2 loads into the plain model, and one written by the plain model loads at EP=2; through train.py, a
2-rank run of configs/tiny-moe.yaml at ``parallel.ep=2`` writes ep=1's ledger line for line (two
micro-batches a rank) and resumes on one rank at ``parallel.ep=1`` with the same batches and losses
within fp32 noise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from core.config import ParallelConfig
from core.config_schema import model_config_class
from core.distributed_context import DistributedContext
from distributed import build_mesh, parallelize
from distributed.expert_parallel import ExpertParallel, apply_expert_parallel, expert_modules
from distributed.grad import no_sync
from models.builder import build
from models.forward import ModelInputs, model_forward
from models.qwen3_moe.family import Qwen3MoeSettings
from tests import launch
from tests.distributed.dist_harness import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
VOCAB, ROWS, SEQ = 64, 4, 12
EXPERT_KEYS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")

pytestmark = pytest.mark.slow


def _config():
    """3 layers (the middle one dense), 4 experts, top-2: each ep rank holds 2 experts of a sparse block."""
    section = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=(1,),
                   norm_topk_prob=True, router_aux_loss_coef=0.0)
    return model_config_class()(arch="qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=40,
                                num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, tie_embeddings=False,
                                max_position_embeddings=64, qwen3_moe=Qwen3MoeSettings(**section))


def _model(seed: int = 0) -> torch.nn.Module:
    return build(_config(), generator=torch.Generator().manual_seed(seed))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(11))
    return tokens[:, :-1], tokens[:, 1:]


def _parallel(**overrides: Any) -> ParallelConfig:
    return dataclasses.replace(ParallelConfig(device="cpu", backend="gloo", strategy="fsdp"), **overrides)


def _loss(model: torch.nn.Module, rows: slice, world: int) -> torch.Tensor:
    """This rank's share of the global mean cross-entropy, times ``world`` (the loop's convention:
    data-parallel wrappers average the gradients)."""
    ids, labels = _batch()
    logits = model_forward(model, ModelInputs(ids[rows])).logits
    return F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten(), reduction="sum") * world / labels.numel()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _reference() -> tuple[float, dict[str, torch.Tensor]]:
    """EP=1 in one process: the whole batch's loss and gradients."""
    model = _model()
    loss = _loss(model, slice(0, ROWS), 1)
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


def _ep_plain(topology) -> tuple[float, dict[str, torch.Tensor]]:
    """EP=2 without FSDP: experts split and exchanged, every other gradient summed over the ranks here."""
    model = _model()
    changed = apply_expert_parallel(model, topology.ep_mesh)
    assert [type(m).__name__ for m in changed] == ["Experts", "Experts"]  # layers 0 and 2; layer 1 is dense
    per_rank = ROWS // 2
    loss = _loss(model, slice(topology.dp_rank * per_rank, (topology.dp_rank + 1) * per_rank), 1)
    loss.backward()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if isinstance(grad, DTensor):  # an expert's: the all-to-all's backward summed every rank's tokens
            grads[name] = grad.full_tensor()
        else:
            grad = grad.clone()
            torch.distributed.all_reduce(grad)
            grads[name] = grad
    return float(total), grads


def _ep_fsdp(dist: DistributedContext, ep: int, *, load: Path | None = None,
             save: Path | None = None, micro_batches: int = 1, tp: int = 1) -> dict[str, Any]:
    """FSDP on 2 ranks at ``ep``: one step's loss and full gradients, over ``micro_batches`` a rank
    (the gradient synchronized on the last, as the training step does); optionally load a state first
    (DCP) or save the model after an SGD update."""
    parallel = _parallel(ep=ep, tp=tp)
    topology = build_mesh(parallel, dist)
    model = parallelize(_model(), parallel, dist, topology)
    if load is not None:
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=str(load))
        set_model_state_dict(model, state)
    per_micro = ROWS // topology.dp_size // micro_batches
    total = torch.zeros(())
    for i in range(micro_batches):
        start = (topology.dp_rank * micro_batches + i) * per_micro
        with contextlib.ExitStack() as sync:
            if i != micro_batches - 1:
                sync.enter_context(no_sync(model))
            loss = _loss(model, slice(start, start + per_micro), topology.dp_size)
            loss.backward()
        total += loss.detach()
    torch.distributed.all_reduce(total)
    out = {"loss": float(total) / torch.distributed.get_world_size(),  # tp ranks repeat their dp rank's loss
           "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
           "experts": [isinstance(m, FSDPModule) for m in expert_modules(model)]}
    out["weights"] = {n: _full(p.detach()) for n, p in model.named_parameters()}
    if save is not None:
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(0.5 * param.grad)
        dcp.save(get_model_state_dict(model), checkpoint_id=str(save))
        out["saved"] = {n: _full(p.detach()) for n, p in model.named_parameters()}
    return out


EXCHANGE_COUNTS = ((2, 0, 3, 1), (1, 2, 0, 2))
"""Rows per expert (4 experts, 2 a rank) that ranks 0 and 1 send: expert 1 gets none from rank 0."""


def _exchange(topology) -> dict[str, Any]:
    """Each sent row is (its rank, its index there); what the local experts see, and what comes back."""
    mesh = topology.ep_mesh
    exchange = ExpertParallel(group=mesh.get_group(), rank=mesh.get_local_rank(), size=mesh.size(),
                              num_experts=4).exchange
    counts = torch.tensor(EXCHANGE_COUNTS[topology.dp_rank])
    sent = torch.stack([torch.full((int(counts.sum()),), float(topology.dp_rank)),
                        torch.arange(int(counts.sum()), dtype=torch.float32)], dim=1)  # (M, 2)
    seen = {}

    def run(local_rows: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        seen.update(received=local_rows.clone(), counts=local_counts.clone())
        return local_rows * 10

    return {"sent": sent, "back": exchange(sent, counts, run), **seen}


def _on_ranks(directory: str) -> dict[str, Any]:
    with DistributedContext.from_env(_parallel(strategy="ddp")) as dist:
        topology = build_mesh(_parallel(ep=2), dist)
        out = {"exchange": _exchange(topology), "plain": [_ep_plain(topology) for _ in range(2)]}
        out["fsdp_ep1"] = [_ep_fsdp(dist, 1) for _ in range(2)]
        out["fsdp_ep2"] = [_ep_fsdp(dist, 2, save=Path(directory) / "ep2")]
        out["fsdp_ep2"].append(_ep_fsdp(dist, 2))
        out["loaded_ep2"] = _ep_fsdp(dist, 2, load=Path(directory) / "ep1")
        out["accumulated"] = {ep: [_ep_fsdp(dist, ep, micro_batches=2) for _ in range(2)] for ep in (1, 2)}
        return out


def _on_four_ranks() -> dict[str, Any]:
    """ep=2 with dp_shard=2: the experts' FSDP units shard over 2 ranks and sum their gradients; and
    tp=2 x ep=2 (TP, then EP, then FSDP, in parallelize's order): each tp rank runs its ep group's exchange."""
    with DistributedContext.from_env(_parallel(strategy="ddp")) as dist:
        topology = build_mesh(_parallel(ep=2), dist)
        out = {"shape": topology.shape, "expert_ranks": topology.expert_dp_mesh.size(), **_ep_fsdp(dist, 2)}
        out["tp_ep"] = {"shape": build_mesh(_parallel(ep=2, tp=2), dist).shape, **_ep_fsdp(dist, 2, tp=2)}
        return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """A directory holding ``ep1``: the plain model (seed 5) written by DCP from one process."""
    directory = tmp_path_factory.mktemp("ep")
    dcp.save(get_model_state_dict(_model(seed=5)), checkpoint_id=str(directory / "ep1"), no_dist=True)
    return directory


@pytest.fixture(scope="module")
def ranks(checkpoints) -> list[dict[str, Any]]:
    return run_on_ranks(_on_ranks, 2, str(checkpoints))


def _assert_close(got: tuple[float, dict], want: tuple[float, dict]) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert sorted(got[1]) == sorted(want[1])
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_exchange_groups_by_expert_then_source_and_returns_the_callers_order(ranks):
    def sent(rank: int, expert: int) -> list[list[float]]:  # rank's rows for expert: after its earlier experts' rows
        start = sum(EXCHANGE_COUNTS[rank][:expert])
        return [[float(rank), float(i)] for i in range(start, start + EXCHANGE_COUNTS[rank][expert])]

    for rank, result in enumerate(ranks):
        exchange, experts = result["exchange"], (2 * rank, 2 * rank + 1)  # rank 0: experts 0, 1; rank 1: 2, 3
        assert exchange["received"].tolist() == [row for e in experts for source in (0, 1) for row in sent(source, e)]
        assert exchange["counts"].tolist() == [[EXCHANGE_COUNTS[source][e] for source in (0, 1)] for e in experts]
        assert torch.equal(exchange["back"], exchange["sent"] * 10)


def test_ep2_equals_ep1_without_fsdp_and_repeats_bitwise(ranks):
    reference = _reference()
    for result in ranks:
        first, second = result["plain"]
        _assert_close(first, reference)
        assert first[0] == second[0] and all(torch.equal(first[1][n], second[1][n]) for n in first[1])
    # every rank ends with the same full gradients
    assert all(torch.equal(ranks[0]["plain"][0][1][n], ranks[1]["plain"][0][1][n]) for n in reference[1])


def test_ep2_under_fsdp_equals_ep1_bitwise_and_repeats(ranks):
    reference = _reference()
    for result in ranks:
        ep1, ep2 = result["fsdp_ep1"][0], result["fsdp_ep2"][0]
        assert ep1["experts"] == [] and ep2["experts"] == [True, True]  # the split experts are FSDP units
        _assert_close((ep1["loss"], ep1["grads"]), reference)
        _assert_close((ep2["loss"], ep2["grads"]), reference)
        # each expert runs each source rank's rows on their own, as that rank does at ep=1: the same bits
        assert ep1["loss"] == ep2["loss"]
        assert all(torch.equal(ep1["grads"][n], ep2["grads"][n]) for n in reference[1])
        for runs in (result["fsdp_ep1"], result["fsdp_ep2"]):
            assert runs[0]["loss"] == runs[1]["loss"]
            assert all(torch.equal(runs[0]["grads"][n], runs[1]["grads"][n]) for n in reference[1])


def test_ep2_equals_ep1_bitwise_with_accumulation(ranks):
    # Two micro-batches a rank: at ep=1 each rank adds its own micro-batches, then FSDP adds the ranks,
    # (r0m1 + r0m2) + (r1m1 + r1m2); an expert at ep=2 keeps each source rank's partial sum across the
    # micro-batches and adds the sources on the last, in that association: the same bits.
    reference = _reference()
    for result in ranks:
        ep1, ep2 = result["accumulated"][1], result["accumulated"][2]
        _assert_close((ep2[0]["loss"], ep2[0]["grads"]), reference)
        assert ep1[0]["loss"] == ep2[0]["loss"]
        unequal = [n for n in reference[1] if not torch.equal(ep1[0]["grads"][n], ep2[0]["grads"][n])]
        assert unequal == []
        for runs in (ep1, ep2):
            assert all(torch.equal(runs[0]["grads"][n], runs[1]["grads"][n]) for n in reference[1])
    # the micro-batches change the association of the dense parameters' sums, not what they add up to
    for name in reference[1]:
        torch.testing.assert_close(ranks[0]["accumulated"][2][0]["grads"][name], ranks[0]["fsdp_ep2"][0]["grads"][name],
                                   rtol=1e-5, atol=1e-7, msg=name)


def test_ep2_over_two_shards_and_under_tp_equals_ep1():
    reference = _reference()
    for result in run_on_ranks(_on_four_ranks, 4):
        assert (result["shape"].dp_shard, result["shape"].ep, result["expert_ranks"]) == (2, 2, 2)
        _assert_close((result["loss"], result["grads"]), reference)
        tp_ep = result["tp_ep"]
        assert (tp_ep["shape"].dp_shard, tp_ep["shape"].ep, tp_ep["shape"].tp) == (1, 2, 2)
        assert tp_ep["experts"] == [True, True]
        _assert_close((tp_ep["loss"], tp_ep["grads"]), reference)


def test_a_state_saved_at_ep2_loads_into_the_plain_model(ranks, checkpoints):
    model = _model(seed=9)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=str(checkpoints / "ep2"), no_dist=True)
    set_model_state_dict(model, state)
    saved = ranks[0]["fsdp_ep2"][0]["saved"]
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), saved[name]), name
    assert any(key in name for name in saved for key in EXPERT_KEYS)


def test_a_plain_models_state_loads_at_ep2(ranks):
    source = dict(_model(seed=5).named_parameters())
    for result in ranks:
        loaded = result["loaded_ep2"]
        for name, param in source.items():
            assert torch.equal(loaded["weights"][name], param.detach()), name



def test_a_run_at_ep2_matches_ep1_and_resumes_on_one_rank_at_ep1(e2e_workdir):
    runs = []
    for ep in (2, 1):
        args = ["--config", str(ROOT / "configs" / "tiny-moe.yaml"), f"run.name=ep{ep}", "parallel.device=cpu",
                "parallel.strategy=fsdp", f"parallel.ep={ep}", "train.max_steps=4", "train.eval_interval=0",
                "train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=128", "checkpoint.interval=2"]
        result = launch.train(e2e_workdir, args, nproc=2)
        assert result.returncode == 0, result.stderr
        runs.append(result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir)
    reference = runs[0]
    at_ep2 = launch.ledger(reference)
    assert len(at_ep2) == 4 and at_ep2 == launch.ledger(runs[1])  # two micro-batches a rank: the same bits
    copy = launch.cut_back_copy(reference, 2, "-one-rank")
    resumed = launch.train(e2e_workdir, ["--resume", copy.name, "parallel.ep=1"], nproc=1)
    assert resumed.returncode == 0, resumed.stderr
    ref, got = launch.ledger(reference), launch.ledger(copy)
    assert [r["step"] for r in got] == [1, 2, 3, 4] and got[:2] == ref[:2]
    for key in ("batch_hash", "data_state_hash"):
        assert [r[key] for r in got] == [r[key] for r in ref], key
    for a, b in zip(ref[2:], got[2:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]
    # And back, 1 -> 2: the ep=1 run's step-2 checkpoint (experts whole, their AdamW state too) resumed
    # at ep=2 on its 2 ranks splits them and writes the uninterrupted ledger bit for bit (ep=2
    # computes ep=1's bits, above).
    split = launch.cut_back_copy(runs[1], 2, "-at-ep2")
    resumed = launch.train(e2e_workdir, ["--resume", split.name, "parallel.ep=2"], nproc=2)
    assert resumed.returncode == 0, resumed.stderr
    assert launch.ledger(split) == launch.ledger(runs[1])
