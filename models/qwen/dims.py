"""The resolved shape of a Qwen model: ModelConfig with every family default filled in.

ModelConfig leaves a few fields as ``None`` meaning "the family default" (head_dim, q/k/v
bias, q/k norm: the model.arch row's ``defaults``, models/qwen/family.py). The model, the FLOP counter and the Hugging Face exporter all need the
same concrete answer, so it is computed once here and checked with errors that name the
config key to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ModelConfig
from core.config_errors import raise_together
from core.exceptions import ConfigError
from core.model_families import model_family


@dataclass(frozen=True)
class QwenDims:
    """Concrete sizes and switches of one Qwen2/Qwen3 model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    init_std: float

    @property
    def q_width(self) -> int:
        """Output width of q_proj (all query heads side by side)."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Output width of k_proj and v_proj."""
        return self.num_kv_heads * self.head_dim

    @property
    def kv_groups(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_heads // self.num_kv_heads


def resolve_dims(config: ModelConfig) -> QwenDims:
    """Fill in family defaults and reject shapes the model cannot build (ConfigError; every violation
    at once, ``raise_together``: a relation between two sizes is asked only of valid sizes)."""
    found: list[ConfigError] = []
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        value = getattr(config, key)
        if value <= 0:
            found.append(ConfigError(f"model.{key} must be > 0, got {value}", key=f"model.{key}"))
    heads_valid = config.num_heads > 0 and config.num_kv_heads > 0
    if heads_valid and config.num_heads % config.num_kv_heads:
        found.append(ConfigError(
            f"model.num_heads={config.num_heads} is not divisible by "
            f"model.num_kv_heads={config.num_kv_heads}",
            key="model.num_kv_heads",
        ))
    head_dim = config.head_dim
    if head_dim is None and config.hidden_size > 0 and config.num_heads > 0:
        if config.hidden_size % config.num_heads:
            found.append(ConfigError(
                f"model.hidden_size={config.hidden_size} is not divisible by "
                f"model.num_heads={config.num_heads}",
                key="model.head_dim",
                hint="set model.head_dim explicitly",
            ))
        else:
            head_dim = config.hidden_size // config.num_heads
    # Rotate-half RoPE pairs dimension i with i + head_dim/2, so head_dim must be even.
    if head_dim is not None and (head_dim <= 0 or head_dim % 2):
        found.append(ConfigError(f"model.head_dim must be a positive even number, got {head_dim}", key="model.head_dim"))
    if config.rope_theta <= 0:
        found.append(ConfigError(f"model.rope_theta must be > 0, got {config.rope_theta}", key="model.rope_theta"))
    if config.rms_norm_eps <= 0:
        found.append(ConfigError(f"model.rms_norm_eps must be > 0, got {config.rms_norm_eps}", key="model.rms_norm_eps"))
    if config.init_std <= 0:
        found.append(ConfigError(f"model.init_std must be > 0, got {config.init_std}", key="model.init_std"))
    raise_together(found)
    family = model_family(config.arch)
    return QwenDims(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=head_dim,
        qkv_bias=family.default("qkv_bias") if config.qkv_bias is None else config.qkv_bias,
        qk_norm=family.default("qk_norm") if config.qk_norm is None else config.qk_norm,
        tie_embeddings=config.tie_embeddings,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        init_std=config.init_std,
    )
