"""The Qwen family's parameter counts and training FLOPs per token, for MFU (models/flops.py asks them
through the model.arch row), and its block linears' shapes (NF4's layout check, models/nf4.py).

Both FLOP conventions count a training step as 6 FLOPs per matmul weight per token
(2 forward, 4 backward) plus the attention score/value matmuls, 12 * layers * heads *
head_dim * seq_len per token, without discounting causal masking and without counting
activation-checkpointing recomputation. They differ in which weights they count:

- ``include_embedding_head=False`` -- torchtitan's formula,
  6 * non-embedding parameters + 12 * L * H * D * T, where "non-embedding" excludes the
  token embedding and the output head (and counts norm weights and biases, which are
  negligible). For tied-embedding models this equals torchtitan's number exactly;
  torchtitan subtracts only ``nn.Embedding`` modules, so for an *untied* model it also
  counts lm_head and reports our ``include_embedding_head=True`` value up to norms/biases.
- ``include_embedding_head=True`` -- every matmul weight, including the output head
  (lm_head, hidden x vocab, a real matmul whether or not it is tied); norms and biases are
  not matmuls and are left out. The embedding lookup is a gather, not a matmul, and is
  counted by neither.

The second is the better measure of hardware use for small models with large
vocabularies (Qwen's 151,936 tokens make lm_head a quarter of a 0.5B model's compute);
the first is comparable with published torchtitan MFU numbers.
"""

from __future__ import annotations

from core.config import ModelConfig
from models.qwen.dims import QwenDims, resolve_dims


def num_params(config: ModelConfig, *, non_embedding: bool = False) -> int:
    """Parameters of the model (a tied embedding/head counted once).

    ``non_embedding=True`` leaves out the token embedding and the output head.
    """
    dims = resolve_dims(config)
    embedding = dims.vocab_size * dims.hidden_size
    head = 0 if dims.tie_embeddings else embedding
    body = dims.num_layers * _layer_params(dims) + dims.hidden_size  # + final norm
    return body if non_embedding else body + embedding + head


def flops_per_token(config: ModelConfig, seq_len: int, *, include_embedding_head: bool) -> int:
    """Training FLOPs (forward + backward) per token at ``seq_len``; see the module docstring."""
    dims = resolve_dims(config)
    attention = 12 * dims.num_layers * dims.num_heads * dims.head_dim * seq_len
    if include_embedding_head:
        weights = dims.num_layers * _layer_matmul_weights(dims) + dims.hidden_size * dims.vocab_size
    else:
        weights = num_params(config, non_embedding=True)
    return 6 * weights + attention


def block_linears(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """{name inside a block: (rows, columns)} of every linear's weight."""
    dims = resolve_dims(config)
    return {
        "self_attn.q_proj": (dims.q_width, dims.hidden_size),
        "self_attn.k_proj": (dims.kv_width, dims.hidden_size),
        "self_attn.v_proj": (dims.kv_width, dims.hidden_size),
        "self_attn.o_proj": (dims.hidden_size, dims.q_width),
        "mlp.gate_proj": (dims.intermediate_size, dims.hidden_size),
        "mlp.up_proj": (dims.intermediate_size, dims.hidden_size),
        "mlp.down_proj": (dims.hidden_size, dims.intermediate_size),
    }


def _layer_matmul_weights(dims: QwenDims) -> int:
    attention = dims.hidden_size * (dims.q_width + 2 * dims.kv_width) + dims.q_width * dims.hidden_size
    mlp = 3 * dims.hidden_size * dims.intermediate_size
    return attention + mlp


def _layer_params(dims: QwenDims) -> int:
    bias = dims.q_width + 2 * dims.kv_width if dims.qkv_bias else 0
    qk_norm = 2 * dims.head_dim if dims.qk_norm else 0
    norms = 2 * dims.hidden_size
    return _layer_matmul_weights(dims) + bias + qk_norm + norms
