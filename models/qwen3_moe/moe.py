"""A Qwen3-MoE block's mixture of experts: the router, deterministic dispatch and combine, the experts.

Router: logits ``x @ gate.weight.T`` in the compute dtype, softmax over the experts in fp32, each
token's ``top_k`` experts by a stable descending sort (equal probabilities: the lower expert index
first), their probabilities renormalized to sum to 1 where ``norm_topk_prob``, then cast to the
logits' dtype (transformers' Qwen3MoeTopKRouter). No token is dropped: every expert takes every token
routed to it.

Dispatch and combine use no atomics and no accumulation into duplicate indices, so a forward and its
backward give the same bits on every run:

- Token t's slot s is assignment ``a = t * top_k + s``. The assignments are sorted by expert with a
  stable sort, so within an expert they stay in ascending ``a`` (token, then slot) order; each
  expert's group is a contiguous run of that order, its size read from the sorted experts with
  ``searchsorted`` (no histogram).
- The experts' inputs are the tokens repeated ``top_k`` times (an ``expand``, whose backward is a
  sum over the slots) and permuted into that order (``index_select`` with a permutation: each
  gradient row receives exactly one row).
- The experts run on their contiguous groups: ``torch._grouped_mm`` over the group offsets where the
  GPU supports it (CUDA, compute capability 9.0 or newer, bf16, widths aligned to 16 bytes), else a
  loop over the experts. The last offset is the number of rows, so no output row is left
  uninitialised.
- The outputs are permuted back to assignment order (the inverse permutation), scaled by their
  routing weights and summed over each token's ``top_k`` slots in slot order.

Under ``Numerics.batch_invariant`` (``batch_invariant.active()``) the router's softmax, the weights'
renormalization and the combine over the slots are models/batch_invariant.py's fixed-order sums, and
the experts always run as the loop of ``F.linear``s (the batch-invariant ``linear``, never the grouped
matmul): a token's routing and output depend on its own hidden state only, so the sampler's cached
forward and the trainer's choose the same experts (tests/models/test_batch_invariance.py).

Routing replay (``model.qwen3_moe.routing_replay``): a router handed the experts a sampler chose for
its tokens (``replay``, -1 where a token has none recorded) routes those tokens to them instead of its
own top-k; their weights are still its own probabilities at those experts, renormalized where
``norm_topk_prob``, so the router keeps its gradient. ``Routing.mismatched`` marks the recorded tokens
whose own top-k (as a set) differs from the recorded one.

``load_balance`` is transformers' ``load_balancing_loss_func`` over the sparse layers, formed by the
training step over the global batch's tokens per expert (docs/models.md, "Qwen3-MoE").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models import batch_invariant
from models.forward import INPUT_TOKEN, PooledProductLoss
from models.qwen3_moe import expert_lora
from models.qwen3_moe.dims import MoeDims

ExpertKernel = Literal["auto", "loop", "grouped"]
"""How the experts' matmuls run: auto (grouped where supported, else loop), or either one forced."""


@dataclass(frozen=True)
class Routing:
    """One block's routing of its N tokens."""

    probs: torch.Tensor
    """(N, E) fp32 softmax over the experts (the auxiliary loss's router probabilities)."""
    weights: torch.Tensor
    """(N, top_k) each chosen expert's weight, in the router logits' dtype."""
    experts: torch.Tensor
    """(N, top_k) int64 the chosen experts, most probable first (a replayed token's: in the recorded order)."""
    mismatched: torch.Tensor | None = None
    """(N,) bool, under replay: the recorded tokens whose own top-k set differs from the recorded one."""


@dataclass(frozen=True)
class MoeOutput:
    """What a block's mixture of experts gives for its (B, T) tokens."""

    hidden: torch.Tensor
    """(B, T, d) its output."""
    prob_sum: torch.Tensor
    """(E,) fp32 router probabilities summed over the tokens."""
    counts: torch.Tensor
    """(E,) int64 tokens per expert."""
    experts: torch.Tensor
    """(B, T, top_k) int64 each token's experts (what a sampler records for replay)."""
    mismatched: torch.Tensor | None
    """(B, T) bool under replay (``Routing.mismatched``), else None."""


@dataclass(frozen=True)
class Dispatch:
    """Where each of the N * top_k assignments goes: grouped by expert, in a fixed order."""

    order: torch.Tensor
    """(N * top_k,) int64: the assignments sorted by expert (stable: ascending assignment within an expert)."""
    inverse: torch.Tensor
    """(N * top_k,) int64: the inverse permutation of ``order``."""
    counts: torch.Tensor
    """(E,) int64: assignments per expert (tokens per expert), in expert order."""


def top_k_experts(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` largest probabilities of each row and their experts; ties go to the lower index."""
    values, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[..., :top_k], experts[..., :top_k]


def plan_dispatch(experts: torch.Tensor, num_experts: int) -> Dispatch:
    """The grouping of ``experts`` (N, top_k) by expert (module docstring)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.argsort(order)
    bounds = torch.searchsorted(flat[order], torch.arange(num_experts + 1, device=flat.device))
    return Dispatch(order=order, inverse=inverse, counts=bounds.diff())


def grouped_mm_supported(x: torch.Tensor, widths: Sequence[int]) -> bool:
    """Whether ``torch._grouped_mm`` runs the experts here: CUDA with compute capability 9.0 or newer,
    bf16 activations and every matrix width a multiple of 8 (16-byte aligned rows)."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")) or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    return dtype == torch.bfloat16 and all(w % 8 == 0 for w in widths)


BIAS = "e_score_correction_bias"
"""The router's balancing bias buffer (DeepSeek-V3's name), present only under model.qwen3_moe.bias_update_rate > 0."""


def bias_step(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """Auxiliary-loss-free balancing's update of ``bias`` (E,) fp32 from the step's global tokens per
    expert ``counts`` (E,) int: ``bias + rate * sign(mean load - load)``, the sign taken exactly in
    integers (``sum(counts) - E * count``), so an expert at the mean load keeps its bias."""
    counts = counts.to(torch.int64)
    direction = torch.sign(counts.sum() - counts.numel() * counts).to(torch.float32)  # (E,)
    return bias + rate * direction


class Router(nn.Module):
    """Token -> its top-k experts and their weights (module docstring); ``weight`` is (E, hidden).

    With auxiliary-loss-free balancing (``dims.bias_update_rate > 0``) a per-expert fp32 buffer
    ``e_score_correction_bias`` (E,) is added to the probabilities for choosing the top-k only; the
    weights are the chosen experts' unbiased probabilities. The model moves it after each optimizer
    step (``bias_step``); it is in the state dict, so checkpoints carry it."""

    def __init__(self, dims: MoeDims) -> None:
        super().__init__()
        self.top_k = dims.top_k
        self.norm_topk_prob = dims.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(dims.num_experts, dims.hidden_size))
        if dims.bias_update_rate > 0:
            self.register_buffer(BIAS, torch.zeros(dims.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> Routing:
        """x (N, hidden) -> its routing; ``replay`` (N, top_k) int64: recorded experts to use instead of the
        router's own choice, a row of -1 where a token has none (module docstring)."""
        logits = F.linear(x, self.weight)  # (N, E) in the compute dtype
        invariant = batch_invariant.active()
        if invariant:  # Numerics.batch_invariant: the normalizer by a fixed tree
            probs = batch_invariant.softmax(logits).to(torch.float32)  # (N, E)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
        bias = getattr(self, BIAS, None)
        if bias is None:
            weights, experts = top_k_experts(probs, self.top_k)  # (N, k)
        else:  # the bias chooses, the unbiased probabilities weigh
            _, experts = top_k_experts(probs + bias.to(torch.float32), self.top_k)  # (N, k)
            weights = probs.gather(-1, experts)
        mismatched = None
        if replay is not None:  # the recorded experts choose, the router's own probabilities weigh
            recorded = replay[:, 0] >= 0  # (N,)
            own = experts
            experts = torch.where(recorded.unsqueeze(-1), replay, own)  # (N, k)
            weights = probs.gather(-1, experts)
            mismatched = recorded & (own.sort(dim=-1).values != experts.sort(dim=-1).values).any(dim=-1)
        if self.norm_topk_prob:
            total = batch_invariant.pairwise_sum(weights) if invariant else weights.sum(dim=-1)
            weights = weights / total.unsqueeze(-1)
        return Routing(probs=probs, weights=weights.to(logits.dtype), experts=experts, mismatched=mismatched)

    def extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


class Experts(nn.Module):
    """``num_experts`` SiLU-gated MLPs, their weights stacked on dim 0 (the plan's ``Experts``):
    ``gate_proj`` and ``up_proj`` (E, moe_intermediate, hidden), ``down_proj`` (E, hidden, moe_intermediate).

    Under ``model.qwen3_moe.lora_experts`` models/lora.py's ``apply_lora`` adds per-expert adapters to
    the three (models/qwen3_moe/expert_lora.py), which both kernels add to the base projections."""

    adapter_key = expert_lora.KEY
    """The config key that puts adapters here (models/lora.py names it in its refusals)."""

    def __init__(self, dims: MoeDims, *, kernel: ExpertKernel = "auto") -> None:
        super().__init__()
        experts, width, inner = dims.num_experts, dims.hidden_size, dims.moe_intermediate_size
        self.kernel = kernel
        self.gate_proj = nn.Parameter(torch.empty(experts, inner, width))
        self.up_proj = nn.Parameter(torch.empty(experts, inner, width))
        self.down_proj = nn.Parameter(torch.empty(experts, width, inner))
        self.wants_adapters = dims.lora_experts
        """Whether ``apply_lora`` adds adapters here (model.qwen3_moe.lora_experts)."""
        self.adapter_disabled = False
        """True inside ``models.lora.adapters_disabled``: the base experts alone."""
        self.scaling = 0.0
        """alpha / rank of the adapters, once added."""

    def add_adapters(self, *, rank: int, alpha: float, dropout: float, seed: int, name: str) -> None:
        """Per-expert adapters on gate, up and down (``expert_lora.add``); ``name``: this module's canonical name."""
        expert_lora.add(self, rank=rank, alpha=alpha, dropout=dropout, seed=seed, name=name)

    def merge_adapters(self) -> None:
        """Fold the adapters into the stacked weights and drop them (``expert_lora.merge``)."""
        expert_lora.merge(self)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, hidden): rows grouped by expert, ``counts`` (E,) rows each -> (M, hidden) in the same order.

        Under expert parallelism the experts are this rank's and ``counts`` is (L, S): each local expert's
        rows in S blocks, one per source rank. The loop runs each block on its own, so an expert's
        matmuls have the shapes they have at ep=1 on the source rank (the same bits), and its weight
        gradient adds the blocks' partial sums as FSDP adds the ranks' at ep=1 (over two ranks and one
        micro-batch: the same bits)."""
        kernel = "loop" if batch_invariant.active() else self.kernel  # the loop's linears are batch-invariant
        weights = self._local_weights()
        adapters = expert_lora.active(self)
        if kernel == "auto":
            widths = (*weights[2].shape[1:], *(() if adapters is None else (self.rank,)))
            kernel = "grouped" if grouped_mm_supported(x, widths) else "loop"
        if kernel == "grouped":
            return self._grouped(x, counts.reshape(counts.shape[0], -1).sum(dim=1), weights, adapters)
        return self._loop(x, counts, weights, adapters)

    def _local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate, up, down: the stacked weights, or this rank's experts of them where expert parallelism
        made them DTensors sharded on dim 0 (distributed/expert_parallel.py)."""
        from torch.distributed.tensor import DTensor

        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.gate_proj, self.up_proj, self.down_proj))

    def _loop(self, x: torch.Tensor, counts: torch.Tensor, weights: tuple[torch.Tensor, ...],
              adapters: tuple[expert_lora.Adapter, ...] | None = None) -> torch.Tensor:
        # unbind: one backward node that stacks the experts' gradients. Every block runs, an empty one
        # too: its (0, d) output adds no row and its weight gradient is exactly zero (not none, also
        # where this rank's experts got no rows under expert parallelism), and no Python branch reads a
        # block's size, so torch.compile traces the loop whole (the sizes stay symbolic).
        blocks = counts.reshape(counts.shape[0], -1)  # (experts, blocks of each)
        sources = blocks.shape[1]
        expert_parallel = getattr(self, "expert_parallel", None)  # set by distributed/expert_parallel.py
        if adapters is None and expert_parallel is not None and sources > 1 and expert_parallel.sums.active():
            # accumulating: each source's block reads the weights through its own tap, whose gradient
            # is summed apart over the micro-batches (distributed/expert_parallel.py, SourceSums)
            per_source = [tuple(w.unbind(0) for w in ws) for ws in expert_parallel.sums.per_source(weights, sources)]
        else:
            per_source = [tuple(w.unbind(0) for w in weights)] * sources
        outputs = []
        if adapters is None:
            for block, rows in enumerate(x.split(blocks.flatten().tolist())):
                expert, source = divmod(block, sources)
                gate, up, down = per_source[source]
                outputs.append(F.linear(F.silu(F.linear(rows, gate[expert])) * F.linear(rows, up[expert]), down[expert]))
            return torch.cat(outputs)
        gate, up, down = per_source[0]
        lora = [tuple(zip(a.unbind(0), b.unbind(0))) for a, b in adapters]  # per projection, per expert (A_e, B_e)
        for block, rows in enumerate(x.split(blocks.flatten().tolist())):
            e = block // blocks.shape[1]
            hidden = (F.silu(expert_lora.project(rows, gate[e], lora[0][e], self.scaling))
                      * expert_lora.project(rows, up[e], lora[1][e], self.scaling))
            outputs.append(expert_lora.project(hidden, down[e], lora[2][e], self.scaling))
        return torch.cat(outputs)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor, weights: tuple[torch.Tensor, ...],
                 adapters: tuple[expert_lora.Adapter, ...] | None = None) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        offsets = counts.cumsum(0).to(torch.int32)  # the last is x's row count: every output row is written
        x = x.to(dtype)
        gate_proj, up_proj, down_proj = (w.to(dtype).transpose(-2, -1) for w in weights)
        if adapters is None:
            gate = torch._grouped_mm(x, gate_proj, offs=offsets)  # (M, inner)
            up = torch._grouped_mm(x, up_proj, offs=offsets)  # (M, inner)
            return torch._grouped_mm(F.silu(gate) * up, down_proj, offs=offsets)
        gate = expert_lora.project_grouped(x, gate_proj, adapters[0], self.scaling, offsets)  # (M, inner)
        up = expert_lora.project_grouped(x, up_proj, adapters[1], self.scaling, offsets)  # (M, inner)
        return expert_lora.project_grouped(F.silu(gate) * up, down_proj, adapters[2], self.scaling, offsets)


class SparseMoe(nn.Module):
    """A block's mixture of experts: ``gate`` (the router) and ``experts``; names as in the checkpoints."""

    def __init__(self, dims: MoeDims) -> None:
        super().__init__()
        self.num_experts = dims.num_experts
        self.gate = Router(dims)
        self.experts = Experts(dims)

    def forward(self, hidden: torch.Tensor, replay: torch.Tensor | None = None, *,
                routed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | MoeOutput:
        """hidden (B, T, d) -> (its output (B, T, d), router probabilities summed over the tokens (E,) fp32,
        tokens per expert (E,) int64), or with ``routed`` the whole ``MoeOutput`` (the choices too);
        ``replay`` (B, T, top_k) int64: recorded experts (-1: none recorded) the tokens are routed to
        instead of the router's top-k."""
        batch, seq_len, width = hidden.shape
        x = hidden.reshape(-1, width)  # (N, d)
        routing = self.gate(x, None if replay is None else replay.reshape(batch * seq_len, -1))
        top_k = routing.experts.shape[1]
        dispatch = plan_dispatch(routing.experts, self.num_experts)
        repeated = x.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, width)  # (N * k, d): row a is token a // k
        grouped = repeated.index_select(0, dispatch.order)  # (N * k, d) by expert
        expert_parallel = getattr(self.experts, "expert_parallel", None)  # set by distributed/expert_parallel.py
        if expert_parallel is None:
            grouped = self.experts(grouped, dispatch.counts)
        else:  # to the ranks holding the experts and back, in the same order
            grouped = expert_parallel.exchange(grouped, dispatch.counts, self.experts)
        out = grouped.index_select(0, dispatch.inverse).view(-1, top_k, width)  # (N, k, d) by token and slot
        weighted = out * routing.weights.unsqueeze(-1)
        if batch_invariant.active():  # Numerics.batch_invariant: the slots by a fixed tree
            out = batch_invariant.pairwise_sum(weighted, dim=1)  # (N, d)
        else:
            out = weighted.sum(dim=1)  # (N, d): the slots added in slot order
        if not routed:
            return out.view(batch, seq_len, width), routing.probs.sum(dim=0), dispatch.counts
        mismatched = None if routing.mismatched is None else routing.mismatched.view(batch, seq_len)
        return MoeOutput(hidden=out.view(batch, seq_len, width), prob_sum=routing.probs.sum(dim=0),
                         counts=dispatch.counts, experts=routing.experts.view(batch, seq_len, top_k),
                         mismatched=mismatched)


def load_balance(prob_sums: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], tokens: int, *,
                 weight: float = 1.0) -> PooledProductLoss:
    """transformers' ``load_balancing_loss_func`` over L sparse layers, from each layer's router
    probabilities summed over the ``tokens`` tokens (E,) and its tokens per expert (E,):

        E * sum_e f_e * P_e,  f_e = sum_l count_le / (L * tokens),  P_e = sum_l prob_le / (L * tokens).

    ``f`` sums to ``top_k`` (each token counts once per chosen expert), so a perfectly even router gives
    ``top_k``. Only ``P`` carries a gradient. As a ``PooledProductLoss`` (models/forward.py) the
    training step forms it over the global batch: f from the counts of every micro-batch and rank."""
    return PooledProductLoss(counts=torch.stack(list(counts)).detach(), sums=torch.stack(list(prob_sums)),
                             units=tokens, per=INPUT_TOKEN, scale=float(len(counts[0])), weight=weight)


def load_balancing_loss(prob_sums: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], tokens: int) -> torch.Tensor:
    """``load_balance``'s value over these ``tokens`` alone (one forward taken as the whole batch)."""
    loss = load_balance(prob_sums, counts, tokens)
    return loss.value(loss.counts, loss.sums, tokens)
