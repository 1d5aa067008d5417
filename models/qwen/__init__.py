"""The Qwen2/Qwen2.5/Qwen3 model family."""

from models.qwen.model import QwenAttention, QwenBlock, QwenForCausalLM, QwenMLP, RMSNorm

__all__ = ["QwenAttention", "QwenBlock", "QwenForCausalLM", "QwenMLP", "RMSNorm"]
