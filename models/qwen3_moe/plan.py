"""How a Qwen3-MoE model is spread: one stack of blocks, ``layers``, with their experts.

Tensor parallelism splits the attention as Qwen's plan does (q, k, v colwise in whole heads, o
rowwise, per-head norms); the MLPs (routers, experts, the dense MLPs of ``mlp_only_layers``) stay
replicated under it. Each sparse block's experts are ``Experts("mlp.experts", num_experts)``: the
module whose ``gate_proj``, ``up_proj`` and ``down_proj`` are stacked on dim 0, which expert
parallelism (the mesh's ``ep`` axis) splits; a dense block has no ``mlp.experts``. Embedding, final
norm and ``lm_head`` form FSDP's root unit; each block is one unit of FSDP, activation
checkpointing and compile.
"""

from __future__ import annotations

from core.model_plan import Experts, ModelParallelPlan, Stack
from models.qwen3_moe.dims import MoeDims


def parallel_plan(dims: MoeDims) -> ModelParallelPlan:
    """The plan of every Qwen3-MoE model of these dimensions (module docstring)."""
    layers = Stack(
        path="layers",
        colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        rowwise=("self_attn.o_proj",),
        head_projections=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        head_norms=("self_attn.q_norm", "self_attn.k_norm"),
        head_dim=dims.head_dim,
        experts=Experts("mlp.experts", dims.num_experts),
    )
    return ModelParallelPlan(stacks=(layers,), embedding="embed_tokens", output="lm_head", root_modules=("norm",))
