"""Parameter counts and training FLOPs per token, for MFU, of any model family.

Each family counts its own (``ModelFamily.num_params`` / ``flops_per_token``; Qwen's conventions,
torchtitan's and the one that counts the output head, are described in models/qwen/flops.py).
"""

from __future__ import annotations

from core.config import ModelConfig
from core.model_families import model_family
from core.registration import import_attr


def num_params(config: ModelConfig, *, non_embedding: bool = False) -> int:
    """Parameters of the model (a tied embedding/head counted once); ``non_embedding=True`` leaves
    out the token embedding and the output head."""
    return import_attr(model_family(config.arch).num_params)(config, non_embedding=non_embedding)


def flops_per_token(config: ModelConfig, seq_len: int, *, include_embedding_head: bool) -> int:
    """Training FLOPs (forward + backward) per token at ``seq_len``, as the family counts them."""
    counter = import_attr(model_family(config.arch).flops_per_token)
    return counter(config, seq_len, include_embedding_head=include_embedding_head)
