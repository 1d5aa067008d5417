"""How a Qwen model is spread: the module names distributed/ shards, checkpoints and compiles.

distributed/ knows no model family: ``parallelize`` reads ``model.parallel_plan`` (a
``core.model_plan.ModelParallelPlan``) and applies it. A Qwen model has one stack of dense
blocks, ``layers``. Per block, over the tensor-parallel mesh dimension:

- ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``: colwise (output features,
  i.e. whole heads / MLP channels, split across TP ranks; input replicated);
- ``o_proj``, ``down_proj``: rowwise (input features split; outputs summed by one
  all-reduce), so each sub-layer costs one all-reduce forward and one backward;
- ``q_norm``, ``k_norm`` (Qwen3): per-head norms, whose weight gradient distributed/tp.py
  sums over the heads of every rank.

The attention derives its local head counts from the projections' output widths
(models/qwen/model.py, ``_project``), so it runs on ``heads / tp`` heads unchanged.
Embedding, final norm and ``lm_head`` stay replicated under TP and form FSDP's root unit;
each block is one unit of FSDP, activation checkpointing and compile.
"""

from __future__ import annotations

from core.model_plan import ModelParallelPlan, Stack
from models.qwen.dims import QwenDims


def qwen_parallel_plan(dims: QwenDims) -> ModelParallelPlan:
    """The plan of every Qwen2/Qwen3 model of these dimensions (module docstring)."""
    layers = Stack(
        path="layers",
        colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        rowwise=("self_attn.o_proj", "mlp.down_proj"),
        head_projections=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        head_norms=("self_attn.q_norm", "self_attn.k_norm"),
        head_dim=dims.head_dim,
    )
    return ModelParallelPlan(stacks=(layers,), embedding="embed_tokens", output="lm_head", root_modules=("norm",))
