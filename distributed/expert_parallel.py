"""Expert parallelism: a plan's experts split over the mesh's ``ep`` dimension, tokens exchanged by all-to-all.

For every block of a stack whose plan declares ``Experts(path, num_experts)``, the module at ``path``
(its parameters stacked on dim 0, one row per expert) is changed in place:

- each parameter becomes a DTensor on the ``ep`` mesh with placement ``Shard(0)``: ep rank r holds
  the ``num_experts / ep`` contiguous experts ``[r * L, (r + 1) * L)``, ``L = num_experts / ep``. The
  checkpoint (DCP) sees the whole (E, ...) tensor, so a run resumes at another ep degree;
- the module's attribute ``expert_parallel`` (``EXPERT_PARALLEL``) is set to an ``ExpertParallel``:
  the ep group, this rank's place in it and its expert range. The model's own dispatch asks for it
  and, where it is set, hands it the rows it has grouped by expert (``ExpertParallel.exchange``);
  its expert module computes on the local shards (``DTensor.to_local``).

distributed/ names no family and no module: it reads ``Stack.experts`` from the plan only.

The exchange (``ExpertParallel.exchange``) never depends on the ep degree for a token's expert input or
for the order of the combine:

1. The caller's rows are its N * top_k assignments sorted by global expert (stable: ascending
   assignment, i.e. token then slot, within an expert), with the tokens per expert (E,). As each ep
   rank owns contiguous experts, the rows for rank r are one contiguous run.
2. Counts first: one all-to-all of the (ep, L) tokens per expert tells each rank how many rows it
   receives from each source rank for each of its experts; then the rows, one all-to-all with those
   splits. Received rows come by source rank, each source's grouped by expert.
3. They are regrouped by local expert with a stable sort, so inside an expert the order is (source
   rank, the source's assignment order). The ep ranks are consecutive data-parallel ranks, so that is
   the global token order of the ep group's rows.
4. The local experts run on their groups, told the rows each source sent (``(L, ep)`` counts): a
   model that runs each source's block on its own computes exactly what that source computes at
   ep=1 (Qwen3-MoE's loop kernel does). The outputs go back to their sources with the inverse
   permutation and the reverse all-to-all, arriving in exactly the order the caller sent them. The
   caller combines them as it does without expert parallelism (its own fixed slot order).

The all-to-alls are autograd functions whose backward is the reverse exchange, so a local expert's
gradient sums the contributions of every ep rank's tokens; FSDP (distributed/fsdp.py) then reduces it
over the data-parallel ranks outside the ep group and divides by the whole data-parallel size.

Gradient accumulation keeps the sources apart (``SourceSums``). At ep=1 each data-parallel rank adds
its own micro-batches first and FSDP adds the ranks on the last one: (r0m1 + r0m2) + (r1m1 + r1m2).
An expert at ep>1 sees every source's rows in each micro-batch, so adding them as they come would
give (r0m1 + r1m1) + (r0m2 + r1m2): the same sum in another association, other bits. Inside
``distributed.grad.no_sync`` (``accumulating``) the experts' weights enter each source's block through
a tap whose backward keeps that source's gradient apart, summed over the micro-batches in their
order; on the last micro-batch each tap hands its sum on and the sources add there, in ep=1's
association (over two ranks: the same bits, as FSDP's sum of two is the same either way round).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from distributed.model_structure import plan_blocks, submodule

EXPERT_PARALLEL = "expert_parallel"
"""The attribute of a plan's experts module that holds its ``ExpertParallel`` (None or absent: no ep)."""


@dataclass(frozen=True)
class ExpertParallel:
    """What a block's experts module needs to run under expert parallelism."""

    group: dist.ProcessGroup
    """The ep group: the ranks the experts are split over, in ep-rank order."""
    rank: int
    """This rank's index in the ep group."""
    size: int
    """The ep degree."""
    num_experts: int
    """The block's experts in all (each rank holds ``num_experts / size`` of them)."""
    sums: SourceSums = field(default_factory=lambda: SourceSums())
    """The experts' gradients kept apart by source rank across accumulation micro-batches."""

    @property
    def local_experts(self) -> int:
        """How many experts this rank holds."""
        return self.num_experts // self.size

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first expert (its experts are contiguous)."""
        return self.rank * self.local_experts

    def exchange(self, rows: torch.Tensor, counts: torch.Tensor,
                 run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """rows (M, d) grouped by global expert, ``counts`` (E,) rows each -> the experts' outputs (M, d) in
        the same order; ``run(local_rows, local_counts)`` computes this rank's experts on rows grouped by
        local expert, ``local_counts`` (L, ep) the rows of each local expert from each source rank
        (module docstring)."""
        if counts.numel() != self.num_experts:
            raise ValueError(f"expert parallelism over {self.num_experts} experts got {counts.numel()} counts")
        send_counts = counts.to(torch.int64).view(self.size, self.local_experts)  # (ep, L): by target rank
        recv_counts = torch.empty_like(send_counts)  # (ep, L): by source rank
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        send_splits = send_counts.sum(dim=1).tolist()
        recv_splits = recv_counts.sum(dim=1).tolist()
        received = _AllToAll.apply(rows, recv_splits, send_splits, self.group)  # (R, d) by source, then expert
        local_expert = torch.arange(self.local_experts, device=rows.device).repeat(self.size)
        local_expert = local_expert.repeat_interleave(recv_counts.flatten().to(rows.device))  # (R,)
        order = torch.argsort(local_expert, stable=True)  # by local expert, then (source rank, source's order)
        inverse = torch.argsort(order)
        out = run(received.index_select(0, order), recv_counts.t())  # (R, d) by local expert, then source
        return _AllToAll.apply(out.index_select(0, inverse), send_splits, recv_splits, self.group)


class SourceSums:
    """An experts module's weight gradients per source rank, summed over a step's accumulation
    micro-batches until the last (module docstring)."""

    def __init__(self) -> None:
        self.accumulating = False
        """Set inside ``no_sync``: a micro-batch before the step's last."""
        self.pending: dict[int, list[torch.Tensor]] = {}
        """Source rank -> its summed gradients of the weights, in the order ``per_source`` got them."""

    def active(self) -> bool:
        """Whether this forward's weights must be tapped: an accumulation micro-batch, or the last one
        of a step that had some."""
        return torch.is_grad_enabled() and (self.accumulating or bool(self.pending))

    def per_source(self, weights: tuple[torch.Tensor, ...], sources: int) -> list[tuple[torch.Tensor, ...]]:
        """``weights`` for each source rank's block: the same values, through a tap per source."""
        return [_SourceTap.apply(self, source, self.accumulating, *weights) for source in range(sources)]

    def take(self, source: int, grads: tuple[torch.Tensor | None, ...], keep: bool) -> tuple[torch.Tensor | None, ...]:
        """Add one micro-batch's ``grads`` of a source to its sum; ``keep``: hold it (None goes on),
        else hand the sum on and forget it."""
        held = self.pending.pop(source, None)
        if held is not None:
            grads = tuple(g if h is None else h if g is None else h + g for h, g in zip(held, grads))
        if keep:
            self.pending[source] = list(grads)
            return tuple(None for _ in grads)
        return grads


class _SourceTap(torch.autograd.Function):
    """The identity on a source's view of the experts' weights; its backward goes through ``SourceSums``."""

    @staticmethod
    def forward(ctx, sums: SourceSums, source: int, keep: bool, *weights: torch.Tensor):
        ctx.sums, ctx.source, ctx.keep = sums, source, keep
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, None, *ctx.sums.take(ctx.source, grads, ctx.keep))


@contextlib.contextmanager
def accumulating(model: nn.Module) -> Iterator[None]:
    """Inside: the model's split experts keep their gradients apart by source (an accumulation
    micro-batch, ``distributed.grad.no_sync``)."""
    sums = [getattr(m, EXPERT_PARALLEL).sums for m in expert_modules(model)]
    for s in sums:
        s.accumulating = True
    try:
        yield
    finally:
        for s in sums:
            s.accumulating = False


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Split the experts of every block of the model's plan over ``ep_mesh`` (module docstring); returns the
    experts modules changed, in the plan's order. The model's weights must be equal on every rank."""
    changed = []
    for stack, index, block in plan_blocks(model):
        if stack.experts is None:
            continue
        experts = submodule(block, stack.experts.path)
        if experts is None:  # a dense block of a stack of mixtures
            continue
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.shape[0] != stack.experts.num_experts:
                raise ValueError(f"{stack.path}.{index}.{stack.experts.path}.{name} has {param.shape[0]} rows on dim 0, "
                                 f"but the plan declares {stack.experts.num_experts} experts")
            shard = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        setattr(experts, EXPERT_PARALLEL, ExpertParallel(
            group=ep_mesh.get_group(), rank=ep_mesh.get_local_rank(), size=ep_mesh.size(),
            num_experts=stack.experts.num_experts))
        changed.append(experts)
    return changed


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``apply_expert_parallel`` changed, in module order."""
    return [m for m in model.modules() if isinstance(getattr(m, EXPERT_PARALLEL, None), ExpertParallel)]

