"""Model definitions and Hugging Face weight I/O, for every registered model family (model.arch:
core/model_families.py; the Qwen2/Qwen3 rows in models/qwen/family.py).

Public API:
    build(config, *, generator=None, device=None) -> the model of config.arch's family
    model_forward(model, batch, *, place=None, head=None, hidden=False, cache=None) -> ModelOutput
    load_pretrained(path, *, base=None, device=None, dtype=torch.float32) -> the model config.json describes
    save_pretrained(model, path, *, state_dict=None, max_shard_bytes=5 GiB) -> None
    model_config_from_hf(path, base=None) -> ModelConfig
    num_params(config, *, non_embedding=False) -> int
    flops_per_token(config, seq_len, *, include_embedding_head) -> int
"""

from __future__ import annotations

import importlib

# Imported when first read (PEP 562), not with the package: the config loader reads the model
# families' rows (models/qwen/family.py) and the model checks (models/config_checks.py) without
# torch, so that `python train.py --nproc N` checks a config before torch is imported.
_EXPORTS = {
    "build": "models.builder",
    "flops_per_token": "models.flops",
    "num_params": "models.flops",
    "model_config_from_hf": "models.hf_config",
    "load_pretrained": "models.hf_weights",
    "save_pretrained": "models.hf_weights",
    "ModelInputs": "models.forward",
    "ModelOutput": "models.forward",
    "model_forward": "models.forward",
    "QwenBlock": "models.qwen.model",
    "QwenForCausalLM": "models.qwen.model",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "ModelInputs",
    "ModelOutput",
    "QwenBlock",
    "QwenForCausalLM",
    "build",
    "flops_per_token",
    "load_pretrained",
    "model_config_from_hf",
    "model_forward",
    "num_params",
    "save_pretrained",
]
