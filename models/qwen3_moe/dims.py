"""The resolved shape of a Qwen3-MoE model: Qwen's (attention, norms, RoPE) plus its experts.

``MoeDims`` extends ``QwenDims`` (models/qwen/dims.py), so Qwen's attention and dense MLP build from
it unchanged; the model, the FLOP counter, the plan and the exporter read the same concrete answer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from core.config import ModelConfig
from models.qwen.dims import QwenDims, resolve_dims
from models.qwen3_moe.family import check_model, settings_of, sparse_layers


@dataclass(frozen=True)
class MoeDims(QwenDims):
    """Concrete sizes of one Qwen3-MoE model."""

    num_experts: int
    """Experts per mixture-of-experts block."""
    top_k: int
    """Experts each token is routed to."""
    moe_intermediate_size: int
    """Hidden width of one expert."""
    norm_topk_prob: bool
    """Each token's top-k probabilities are renormalized to sum to 1."""
    sparse: tuple[bool, ...]
    """Per layer: a mixture of experts (True) or a dense MLP of intermediate_size (False)."""
    router_aux_loss_coef: float
    """Weight of the load-balancing auxiliary loss."""
    bias_update_rate: float = 0.0
    """Step of the auxiliary-loss-free balancing bias (0: the routers have no bias)."""
    lora_experts: bool = False
    """The experts take LoRA adapters when the model's adapters are applied (models/lora.py)."""

    @property
    def num_sparse_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return sum(self.sparse)


def resolve_moe_dims(config: ModelConfig) -> MoeDims:
    """Qwen's checks and defaults (``resolve_dims``), then the model.qwen3_moe section's (ConfigError naming the key)."""
    check_model(config)
    base = resolve_dims(config)
    s = settings_of(config)
    return MoeDims(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(QwenDims)},
        num_experts=s.num_experts,
        top_k=s.num_experts_per_tok,
        moe_intermediate_size=s.moe_intermediate_size,
        norm_topk_prob=s.norm_topk_prob,
        sparse=sparse_layers(s, config.num_layers),
        router_aux_loss_coef=s.router_aux_loss_coef,
        bias_update_rate=s.bias_update_rate,
        lora_experts=s.lora_experts,
    )
