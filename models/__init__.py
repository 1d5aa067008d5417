"""Model definitions (Qwen2/Qwen3 family) and Hugging Face weight I/O.

Public API:
    build(config, *, generator=None, device=None) -> QwenForCausalLM
    model_forward(model, batch, *, place=None, head=None, hidden=False, cache=None) -> ModelOutput
    load_pretrained(path, *, base=None, device=None, dtype=torch.float32) -> QwenForCausalLM
    save_pretrained(model, path, *, state_dict=None, max_shard_bytes=5 GiB) -> None
    model_config_from_hf(path, base=None) -> ModelConfig
    num_params(config, *, non_embedding=False) -> int
    flops_per_token(config, seq_len, *, include_embedding_head) -> int
"""

from models.build import build
from models.qwen import lora_targets as _lora_targets  # noqa: F401  (registers the family's LoRA names)
from models.flops import flops_per_token, num_params
from models.hf_config import model_config_from_hf
from models.hf_weights import load_pretrained, save_pretrained
from models.qwen.forward import ModelInputs, ModelOutput, model_forward
from models.qwen.model import QwenBlock, QwenForCausalLM

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
