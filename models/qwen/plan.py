"""How a Qwen model is spread: the module names distributed/ shards, checkpoints and compiles.

distributed/ knows no model family: ``parallelize`` reads ``model.parallel_plan`` (a
``ModelParallelPlan``) and applies it. Per block, over the tensor-parallel mesh dimension:

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

from dataclasses import dataclass

from models.qwen.dims import QwenDims


@dataclass(frozen=True)
class ModelParallelPlan:
    """A model's structure as parallelism sees it: attribute paths, relative to what holds them."""

    blocks: str
    """The root's attribute holding the transformer blocks (an nn.ModuleList)."""
    colwise: tuple[str, ...]
    """Per block: the linears split on their output features under tensor parallelism."""
    rowwise: tuple[str, ...]
    """Per block: the linears split on their input features (outputs all-reduced)."""
    head_projections: tuple[str, ...]
    """The colwise linears whose output features are whole attention heads of ``head_dim``."""
    head_norms: tuple[str, ...]
    """Per block: norms applied per attention head (absent modules are skipped)."""
    head_dim: int
    """Width of one attention head: tensor parallelism splits whole heads."""
    embedding: str
    """The root's token embedding."""
    output: str
    """The root's output projection (tied to the embedding or not); never converted to FP8."""


def qwen_parallel_plan(dims: QwenDims) -> ModelParallelPlan:
    """The plan of every Qwen2/Qwen3 model of these dimensions (module docstring)."""
    return ModelParallelPlan(
        blocks="layers",
        colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        rowwise=("self_attn.o_proj", "mlp.down_proj"),
        head_projections=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        head_norms=("self_attn.q_norm", "self_attn.k_norm"),
        head_dim=dims.head_dim,
        embedding="embed_tokens",
        output="lm_head",
    )
