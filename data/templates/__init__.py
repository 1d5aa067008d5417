"""Chat templates of model families, stored as their ``tokenizer_config.json`` ship them.

A run names one with ``data.chat_template`` (a preset name instead of a file path); the ``qwen``
tokenizer renders with ``qwen2.5``. README.md here says which model each file is the template
of, and its sha256.
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent

PRESETS = {"qwen2.5": "qwen2.5-instruct.jinja", "qwen3": "qwen3.jinja"}
"""Preset name -> template file in this directory."""


def preset_path(name: str) -> Path:
    """The template file of preset ``name`` (a KeyError for a name that is not one)."""
    return DIRECTORY / PRESETS[name]
