"""The Qwen rows of the model-family registry: ``model.arch`` qwen2 and qwen3 (core/model_families.py).

Both are one model (models/qwen/model.py) with two defaults apart: Qwen2 (and Qwen2.5) has a bias on
q, k and v; Qwen3 has an RMSNorm on each head of q and k. ``model.qkv_bias`` and ``model.qk_norm``
override either. training/registry.py registers ``FAMILIES``. Torch-free: the config loader reads
these rows before torch is imported; the code they name is imported when a model is built.
"""

from __future__ import annotations

from core.model_families import ModelFamily
from models.qwen.lora_targets import LORA_TARGETS

_CODE = dict(
    build="models.qwen.model:empty_model",
    weights="models.qwen.weights:QWEN_WEIGHTS",
    config_from_hf="models.qwen.hf_config:config_from_hf",
    config_to_hf="models.qwen.hf_config:config_to_hf",
    parallel_plan="models.qwen.plan:qwen_parallel_plan",
    num_params="models.qwen.flops:num_params",
    flops_per_token="models.qwen.flops:flops_per_token",
    block_linears="models.qwen.flops:block_linears",
    generation_copy="models.qwen.generation_copy:generation_copy",
    lora_targets=LORA_TARGETS,
)

QWEN2 = ModelFamily(
    name="qwen2",
    summary="q/k/v bias",
    defaults=(("qkv_bias", True), ("qk_norm", False)),
    hf_architectures=("Qwen2ForCausalLM",),
    hf_classifier_architectures=("Qwen2ForSequenceClassification",),
    hf_model_type="qwen2",
    **_CODE,
)
QWEN3 = ModelFamily(
    name="qwen3",
    summary="RMSNorm on q and k",
    defaults=(("qkv_bias", False), ("qk_norm", True)),
    hf_architectures=("Qwen3ForCausalLM",),
    hf_classifier_architectures=("Qwen3ForSequenceClassification",),
    hf_model_type="qwen3",
    **_CODE,
)

FAMILIES = (QWEN2, QWEN3)
"""The order is model.arch's listing: qwen2, then qwen3 (the default of ModelConfig.arch)."""
