"""The Qwen3-MoE row of the model-family registry: ``model.arch: qwen3_moe`` (core/model_families.py).

Qwen3's attention (q/k RMSNorm, grouped-query heads, RoPE) with mixture-of-experts MLPs: each block's
MLP is a router and ``num_experts`` SiLU-gated experts of which every token uses its top ``k``, or a
dense MLP in the layers ``mlp_only_layers`` and ``decoder_sparse_step`` name. Its settings are the
``model.qwen3_moe`` section, hashed only once a key of it is set. Torch-free: the config loader reads
this row and runs ``validate`` before torch is imported; the code it names is imported when a model
is built. training/registry.py registers ``FAMILIES`` after Qwen's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.config_errors import check_independent, raise_together
from core.exceptions import ConfigError
from core.model_families import ModelFamily

if TYPE_CHECKING:
    from core.config import Config

NAME = "qwen3_moe"
"""The model.arch value, and the key of the model.qwen3_moe section."""


@dataclass(frozen=True)
class Qwen3MoeSettings:
    """The ``model.qwen3_moe`` section: the fields of transformers' Qwen3MoeConfig that Qwen3 has not."""

    num_experts: int = 8
    """Experts in each mixture-of-experts block (config.json's num_experts)."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k); at most num_experts."""
    moe_intermediate_size: int = 128
    """Hidden width of one expert's SiLU-gated MLP (model.intermediate_size is the dense layers')."""
    norm_topk_prob: bool = True
    """Renormalize each token's top-k router probabilities to sum to 1 (Qwen3-30B-A3B: true)."""
    decoder_sparse_step: int = 1
    """Layer i is a mixture of experts when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers (0-based) with a dense MLP of model.intermediate_size instead of experts."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing auxiliary loss (0: not added, the load metrics are still recorded)."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert router bias, added only to choose the top-k, moved by this rate times sign(mean load - load) after each optimizer step (0: off, no bias)."""
    routing_replay: bool = False
    """Routing replay (R3): the sampler records each token's top-k experts per sparse layer with its rollouts, the policy's training forward routes those tokens to them (weights from its own router), and the ledger adds model/routing_replay_mismatch, the fraction of replayed tokens whose own top-k differs in some layer."""
    lora_experts: bool = False
    """LoRA on the experts too (model.lora.rank > 0): per-expert low-rank adapters on every sparse layer's stacked gate_proj, up_proj and down_proj, A (E, rank, in) and B (E, out, rank), merged on export (no PEFT form: docs/models.md, Qwen3-MoE)."""


def settings_of(model_config) -> Qwen3MoeSettings:
    """The model.qwen3_moe section of a model config (its defaults where the schema carries none)."""
    return getattr(model_config, NAME, None) or Qwen3MoeSettings()


def sparse_layers(settings: Qwen3MoeSettings, num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether its MLP is a mixture of experts (transformers' rule, the module docstring)."""
    skipped = set(settings.mlp_only_layers)
    return tuple(i not in skipped and (i + 1) % settings.decoder_sparse_step == 0 for i in range(num_layers))


def validate(config: Config) -> None:
    """The checks of model.qwen3_moe and of the model.* keys this family reads its own way, and that
    parallel.ep splits the experts evenly: every violated one (core/config_errors.py)."""
    check_independent(config, (lambda view: check_model(view.model), check_lora_experts, _check_expert_split))


def _check_expert_split(config: Config) -> None:
    experts, ep = settings_of(config.model).num_experts, config.parallel.ep
    if experts >= 1 and ep > 1 and experts % ep:  # num_experts < 1: check_model names it
        raise ConfigError(
            f"parallel.ep={ep} does not divide model.{NAME}.num_experts={experts}: each expert-parallel rank "
            f"holds the same number of experts", key="parallel.ep",
            hint=f"use a parallel.ep that divides {experts}, or a num_experts that is a multiple of {ep}")


def check_lora_experts(config: Config) -> None:
    """``lora_experts`` needs adapters (model.lora.rank > 0), no adapter dropout and whole experts on each
    rank: every violated one."""
    if settings_of(config.model).lora_experts:
        check_independent(config, (_lora_experts_adapters, _lora_experts_ranks))


_LORA_EXPERTS = f"model.{NAME}.lora_experts"


def _lora_experts_adapters(config: Config) -> None:
    key, lora, found = _LORA_EXPERTS, config.model.lora, []
    if lora.rank <= 0:
        found.append(ConfigError(f"{key} adds adapters to the experts, but model.lora.rank={lora.rank} turns LoRA off",
                                 key=key, hint="set model.lora.rank > 0, or leave lora_experts unset"))
    if lora.dropout:
        found.append(ConfigError(f"{key}: the experts' adapters take no dropout, but model.lora.dropout={lora.dropout}",
                                 key="model.lora.dropout",
                                 hint="set model.lora.dropout to 0 with adapters on the experts"))
    raise_together(found)


def _lora_experts_ranks(config: Config) -> None:
    if config.parallel.ep > 1:
        raise ConfigError(f"{_LORA_EXPERTS}: the experts' adapters are not split over expert-parallel ranks, but "
                          f"parallel.ep={config.parallel.ep}", key="parallel.ep",
                          hint="train adapters on the experts at parallel.ep=1 (FSDP shards them with their blocks)")


def check_model(model) -> None:
    """``validate`` on a model section alone (also asked where a model is built from a config.json):
    every violated constraint."""
    check_independent(model, (_check_experts, _check_layers, _check_balancing, _check_qk_norm))


def _check_experts(model) -> None:
    """The sizes of model.qwen3_moe, and top-k within the experts (once num_experts is valid)."""
    s, where, found = settings_of(model), f"model.{NAME}", []
    for key in ("num_experts", "moe_intermediate_size", "decoder_sparse_step"):
        value = getattr(s, key)
        if value < 1:
            found.append(ConfigError(f"{where}.{key} must be >= 1, got {value}", key=f"{where}.{key}"))
    if s.num_experts >= 1 and not 1 <= s.num_experts_per_tok <= s.num_experts:
        found.append(ConfigError(
            f"{where}.num_experts_per_tok={s.num_experts_per_tok} must be between 1 and "
            f"{where}.num_experts={s.num_experts}: a token cannot be routed to more experts than a block has",
            key=f"{where}.num_experts_per_tok",
            hint=f"lower num_experts_per_tok to at most {s.num_experts}, or raise num_experts"))
    raise_together(found)


def _check_layers(model) -> None:
    """mlp_only_layers within the model's layers, then some layer a mixture of experts (asked only of
    valid mlp_only_layers and decoder_sparse_step: the rule divides by the step)."""
    num_layers, s, where = model.num_layers, settings_of(model), f"model.{NAME}"
    stray = [i for i in s.mlp_only_layers if not 0 <= i < num_layers]
    if stray or len(set(s.mlp_only_layers)) != len(s.mlp_only_layers):
        raise ConfigError(
            f"{where}.mlp_only_layers={list(s.mlp_only_layers)} must name distinct layers in [0, "
            f"model.num_layers={num_layers})", key=f"{where}.mlp_only_layers")
    if s.decoder_sparse_step >= 1 and not any(sparse_layers(s, num_layers)):
        raise ConfigError(
            f"{where}: no layer of model.num_layers={num_layers} is a mixture of experts "
            f"(decoder_sparse_step={s.decoder_sparse_step}, mlp_only_layers={list(s.mlp_only_layers)})",
            key=f"{where}.decoder_sparse_step", hint="use model.arch qwen3 for a dense model")


def _check_balancing(model) -> None:
    s, where, found = settings_of(model), f"model.{NAME}", []
    if not (math.isfinite(s.router_aux_loss_coef) and s.router_aux_loss_coef >= 0):
        found.append(ConfigError(
            f"{where}.router_aux_loss_coef must be a finite number >= 0, got {s.router_aux_loss_coef}",
            key=f"{where}.router_aux_loss_coef"))
    if not (math.isfinite(s.bias_update_rate) and s.bias_update_rate >= 0):
        found.append(ConfigError(f"{where}.bias_update_rate must be a finite number >= 0, got {s.bias_update_rate}",
                                 key=f"{where}.bias_update_rate", hint="0 turns auxiliary-loss-free balancing off"))
    raise_together(found)


def _check_qk_norm(model) -> None:
    if model.qk_norm is False:
        raise ConfigError("Qwen3-MoE's attention always normalizes q and k per head: model.qk_norm=false has no "
                          "Qwen3MoeForCausalLM to compute it", key="model.qk_norm", hint="leave model.qk_norm unset")


_HERE = "models.qwen3_moe"

QWEN3_MOE = ModelFamily(
    name=NAME,
    summary="Qwen3 attention, mixture-of-experts MLPs",
    settings=Qwen3MoeSettings,
    defaults=(("qkv_bias", False), ("qk_norm", True)),
    hf_architectures=("Qwen3MoeForCausalLM",),
    hf_model_type="qwen3_moe",
    build=f"{_HERE}.model:empty_model",
    weights=f"{_HERE}.weights:WEIGHTS",
    config_from_hf=f"{_HERE}.hf_config:config_from_hf",
    config_to_hf=f"{_HERE}.hf_config:config_to_hf",
    parallel_plan=f"{_HERE}.plan:parallel_plan",
    num_params=f"{_HERE}.flops:num_params",
    flops_per_token=f"{_HERE}.flops:flops_per_token",
    block_linears=f"{_HERE}.flops:block_linears",
    generation_copy=f"{_HERE}.generation_copy:generation_copy",
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
    validate=validate,
    hashed_only_when_set=("bias_update_rate", "routing_replay", "lora_experts"),
)

FAMILIES = (QWEN3_MOE,)
"""The rows training/registry.py registers, after Qwen's."""
