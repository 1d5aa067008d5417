"""The Qwen2/Qwen2.5/Qwen3 model family."""

from __future__ import annotations

import importlib

__all__ = ["QwenAttention", "QwenBlock", "QwenForCausalLM", "QwenMLP", "RMSNorm"]


def __getattr__(name: str):
    """The model classes, imported when first read: the family's rows (family.py) are read by the
    config loader without torch (models/__init__.py)."""
    if name not in __all__:
        raise AttributeError(f"module 'models.qwen' has no attribute {name!r}")
    value = getattr(importlib.import_module("models.qwen.model"), name)
    globals()[name] = value
    return value
