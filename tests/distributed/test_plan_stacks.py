"""A model of two stacks, declared by its own plan (core/model_plan.py): parallelize walks every stack.

The model is defined here, outside any model family: a stack at a dotted path (``vision.blocks``)
and one at the root (``text``), one of them with experts. On 2 gloo ranks each stack's blocks are
FSDP units, activation-checkpointed (selective: every other block of each stack) and compiled when
asked, and FSDP over the plan's stacks trains like one process; with ``parallel.ep=2`` the mesh's
expert axis splits the data-parallel ranks, and a plan without experts is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.config import ParallelConfig
from core.distributed_context import DistributedContext
from core.exceptions import ConfigError
from core.model_plan import Experts, ModelParallelPlan, Stack
from distributed import build_mesh, clip_grad_norm_, parallelize
from distributed.fsdp import fsdp_units
from distributed.model_structure import check_expert_parallel, plan_blocks
from distributed.topology import MeshShape, Topology
from tests.distributed.dist_harness import run_on_ranks

VOCAB, HIDDEN, EXPERTS = 32, 16, 2
VISION_BLOCKS, TEXT_BLOCKS = 3, 2
ROWS, SEQ = 4, 8


class Block(nn.Module):
    """x + down(gelu(up(x))), plus a mixture of stacked experts where asked."""

    def __init__(self, experts: int = 0) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        self.experts = ExpertWeights(experts) if experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(F.gelu(self.up(x)))
        if self.experts is not None:
            x = x + self.experts(x)
        return x


class ExpertWeights(nn.Module):
    """Every expert's weight stacked on dim 0; the mean of their outputs (no router: every token goes to
    every expert). Under expert parallelism (``expert_parallel`` set, distributed/expert_parallel.py) the
    rows go to the ranks holding their experts and back."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(count, HIDDEN, HIDDEN) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = self.weight.shape[0]
        expert_parallel = getattr(self, "expert_parallel", None)
        if expert_parallel is None:
            return torch.einsum("bth,ehk->btk", x, self.weight) / count
        rows = x.reshape(-1, HIDDEN)

        def run(local_rows: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
            weight = self.weight.to_local()
            parts = local_rows.split(local_counts.sum(dim=1).tolist())  # (experts, sources) -> per expert
            return torch.cat([part @ weight[e] for e, part in enumerate(parts)])

        counts = torch.full((count,), rows.shape[0], dtype=torch.int64)
        out = expert_parallel.exchange(rows.repeat(count, 1), counts, run)  # expert e's rows: block e
        return out.view(count, *x.shape).sum(dim=0) / count


class Vision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(VISION_BLOCKS))


class TwoStacks(nn.Module):
    """(B, T) ids -> (B, T, VOCAB) logits through the vision stack, then the text stack."""

    def __init__(self, *, experts: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.vision = Vision()
        self.text = nn.ModuleList(Block(EXPERTS if experts else 0) for _ in range(TEXT_BLOCKS))
        self.final = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.experts = experts

    @property
    def parallel_plan(self) -> ModelParallelPlan:
        dense = dict(colwise=("up",), rowwise=("down",))
        text = Stack("text", **dense, experts=Experts("experts", EXPERTS) if self.experts else None)
        return ModelParallelPlan(stacks=(Stack("vision.blocks", **dense), text), embedding="embed", output="head",
                                 root_modules=("final",))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in (*self.vision.blocks, *self.text):
            x = block(x)
        return self.head(self.final(x))


def _model(experts: bool = False) -> TwoStacks:
    torch.manual_seed(0)
    return TwoStacks(experts=experts)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _parallel(**overrides: Any) -> ParallelConfig:
    return dataclasses.replace(ParallelConfig(device="cpu", backend="gloo"), **overrides)


def _step(model: nn.Module, rows: slice, dp_size: int) -> tuple[float, float]:
    """One forward/backward over this rank's rows; the global mean loss and the gradient norm."""
    ids, labels = _batch()
    logits = model(ids[rows])
    loss = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten())
    loss.backward()  # FSDP averages the gradients over the data-parallel ranks
    norm = float(clip_grad_norm_(model, 1e9))
    total = loss.detach().clone()
    if dp_size > 1:
        torch.distributed.all_reduce(total)
    return float(total) / dp_size, norm


def _structure(model: nn.Module) -> dict[str, Any]:
    """Per block of each stack: (path, index, checkpointed, compiled) and (path, index, an FSDP unit)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    return {
        "blocks": [(stack.path, index, isinstance(block, CheckpointWrapper),
                    getattr(block, "_compiled_call_impl", None) is not None)
                   for stack, index, block in plan_blocks(model)],
        "sharded": [(stack.path, index, isinstance(block, FSDPModule)) for stack, index, block in plan_blocks(model)],
        "root_sharded": isinstance(model, FSDPModule),
    }


def _on_ranks() -> dict[str, Any]:
    """On every rank: the FSDP + selective AC + compile structure, an FSDP (+ AC) step, an ep=2 step."""
    with DistributedContext.from_env(_parallel(strategy="ddp")) as dist:
        out = {}
        parallel = _parallel(strategy="fsdp", activation_checkpointing="selective", compile=True)
        out["compiled"] = _structure(parallelize(_model(), parallel, dist, build_mesh(parallel, dist)))

        for name, ep, experts in (("fsdp", 1, False), ("ep", 2, True)):
            parallel = _parallel(ep=ep, strategy="fsdp", activation_checkpointing="selective")
            topology = build_mesh(parallel, dist)
            model = parallelize(_model(experts), parallel, dist, topology)
            per_rank = ROWS // topology.dp_size
            rows = slice(topology.dp_rank * per_rank, (topology.dp_rank + 1) * per_rank)
            out[name] = {"step": _step(model, rows, topology.dp_size), "structure": _structure(model),
                         "shape": topology.shape, "dp": (topology.dp_rank, topology.dp_size),
                         "shard_ranks": topology.dp_mesh.size(), "ep_ranks": topology.ep_mesh.size()}
        return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_on_ranks, 2)


def test_each_stacks_blocks_are_fsdp_units_checkpointed_and_compiled(ranks):
    for result in ranks:
        structure = result["compiled"]
        assert [(path, index) for path, index, _, _ in structure["blocks"]] == [
            *(("vision.blocks", i) for i in range(VISION_BLOCKS)), *(("text", i) for i in range(TEXT_BLOCKS))]
        # Selective: every other block of each stack (vision 0 and 2, text 0).
        assert [checkpointed for _, _, checkpointed, _ in structure["blocks"]] == [True, False, True, True, False]
        assert all(compiled for _, _, _, compiled in structure["blocks"])
        assert all(sharded for _, _, sharded in structure["sharded"]) and structure["root_sharded"]


def test_fsdp_over_two_stacks_trains_like_one_process(ranks):
    model = _model()
    reference = _step(model, slice(0, ROWS), 1)
    for result in ranks:
        torch.testing.assert_close(result["fsdp"]["step"], reference, rtol=2e-5, atol=2e-6)
        assert all(sharded for _, _, sharded in result["fsdp"]["structure"]["sharded"])
    assert [r["fsdp"]["dp"] for r in ranks] == [(0, 2), (1, 2)]


def test_the_ep_axis_takes_its_ranks_from_data_parallel(ranks):
    reference = _step(_model(experts=True), slice(0, ROWS), 1)
    for result in ranks:
        ep = result["ep"]
        assert ep["shape"] == MeshShape(dp_replicate=1, dp_shard=1, tp=1, ep=2)
        assert (ep["shard_ranks"], ep["ep_ranks"]) == (2, 2)  # FSDP shards over dp_shard x ep
        torch.testing.assert_close(ep["step"], reference, rtol=2e-5, atol=2e-6)
    assert [r["ep"]["dp"] for r in ranks] == [(0, 2), (1, 2)]  # ep ranks read their own rows


def test_fsdp_units_never_span_two_stacks():
    model = _model()
    units = fsdp_units(model, 2)
    assert [len(unit) for unit in units] == [2, 1, 2]
    assert units[1][0] is model.vision.blocks[2] and units[2][0] is model.text[0]


def test_ep_without_experts_is_refused_naming_the_key_and_the_model():
    dist = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo",
                              timeout_s=5)
    topology = Topology(shape=MeshShape(1, 1, 1, ep=2), dp_rank=0, tp_rank=0, mesh=None)
    with pytest.raises(ConfigError) as info:
        parallelize(_model(), _parallel(ep=2, strategy="fsdp"), dist, topology)
    assert info.value.context["key"] == "parallel.ep"
    assert "parallel.ep=2" in info.value.message and "TwoStacks" in info.value.message
    check_expert_parallel(_model(experts=True), 2)  # declared experts: accepted
    with pytest.raises(ConfigError, match="does not divide the 2 experts"):
        check_expert_parallel(_model(experts=True), 4)
    check_expert_parallel(_model(), 1)  # ep=1 asks nothing of the plan


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: ModelParallelPlan(stacks=(), embedding="e", output="o"), "at least one stack"),
        (lambda: ModelParallelPlan(stacks=(Stack("a"), Stack("a")), embedding="e", output="o"), "none repeated"),
        (lambda: ModelParallelPlan(stacks=(Stack("a"), Stack("a.b")), embedding="e", output="o"), "inside another"),
        (lambda: Stack("a", head_projections=("q",)), "not colwise"),
        (lambda: Stack("a", colwise=("q",), head_projections=("q",)), "head_dim >= 1"),
        (lambda: Stack("a..b"), "attribute path"),
        (lambda: Stack("a", experts=Experts("e", 0)), "num_experts"),
    ],
)
def test_a_malformed_plan_is_refused(build, words):
    with pytest.raises(ConfigError, match=words):
        build()
