"""The Qwen3-MoE family's parameter counts and training FLOPs per token (models/flops.py asks them
through the model.arch row), and its block linears' shapes (NF4's layout check).

``num_params`` counts every expert. ``flops_per_token`` counts the *active* weights only, the ones a
token's forward multiplies by: per sparse layer the router (E x hidden) and ``top_k`` experts'
3 x hidden x moe_intermediate, per dense layer its MLP; the conventions are Qwen's
(models/qwen/flops.py): 6 FLOPs per active matmul weight per token plus the attention's
12 * layers * heads * head_dim * seq_len, with or without the output head.
"""

from __future__ import annotations

from core.config import ModelConfig
from models.qwen3_moe.dims import MoeDims, resolve_moe_dims


def num_params(config: ModelConfig, *, non_embedding: bool = False) -> int:
    """Parameters of the model, every expert counted (a tied embedding/head once); ``non_embedding``
    leaves out the token embedding and the output head."""
    dims = resolve_moe_dims(config)
    embedding = dims.vocab_size * dims.hidden_size
    head = 0 if dims.tie_embeddings else embedding
    body = sum(_attention_params(dims) + _mlp_params(dims, sparse) for sparse in dims.sparse) + dims.hidden_size
    return body if non_embedding else body + embedding + head


def flops_per_token(config: ModelConfig, seq_len: int, *, include_embedding_head: bool) -> int:
    """Training FLOPs (forward + backward) per token at ``seq_len``, active weights only (module docstring)."""
    dims = resolve_moe_dims(config)
    attention = 12 * dims.num_layers * dims.num_heads * dims.head_dim * seq_len
    weights = sum(_attention_matmul(dims) + _active_mlp(dims, sparse) for sparse in dims.sparse)
    if include_embedding_head:
        weights += dims.hidden_size * dims.vocab_size
    else:  # torchtitan's convention: non-embedding parameters, norms included
        weights += dims.num_layers * _norm_params(dims) + dims.hidden_size
    return 6 * weights + attention


def block_linears(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """{name inside a block: (rows, columns)} of every nn.Linear's weight (the attention's, and the dense
    MLP's where a layer has one); the stacked experts and the router are no linears."""
    dims = resolve_moe_dims(config)
    shapes = {
        "self_attn.q_proj": (dims.q_width, dims.hidden_size),
        "self_attn.k_proj": (dims.kv_width, dims.hidden_size),
        "self_attn.v_proj": (dims.kv_width, dims.hidden_size),
        "self_attn.o_proj": (dims.hidden_size, dims.q_width),
    }
    if not all(dims.sparse):
        shapes.update({"mlp.gate_proj": (dims.intermediate_size, dims.hidden_size),
                       "mlp.up_proj": (dims.intermediate_size, dims.hidden_size),
                       "mlp.down_proj": (dims.hidden_size, dims.intermediate_size)})
    return shapes


def _attention_matmul(dims: MoeDims) -> int:
    return dims.hidden_size * (dims.q_width + 2 * dims.kv_width) + dims.q_width * dims.hidden_size


def _norm_params(dims: MoeDims) -> int:
    bias = dims.q_width + 2 * dims.kv_width if dims.qkv_bias else 0
    return bias + 2 * dims.head_dim + 2 * dims.hidden_size  # q/k norms, the block's two norms


def _attention_params(dims: MoeDims) -> int:
    return _attention_matmul(dims) + _norm_params(dims)


def _mlp_params(dims: MoeDims, sparse: bool) -> int:
    if not sparse:
        return 3 * dims.hidden_size * dims.intermediate_size
    return dims.num_experts * (dims.hidden_size + 3 * dims.hidden_size * dims.moe_intermediate_size)


def _active_mlp(dims: MoeDims, sparse: bool) -> int:
    if not sparse:
        return 3 * dims.hidden_size * dims.intermediate_size
    return dims.num_experts * dims.hidden_size + dims.top_k * 3 * dims.hidden_size * dims.moe_intermediate_size
