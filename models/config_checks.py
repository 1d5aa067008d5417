"""The checks of model.* on a loaded config that need no model code: its vocabulary, LoRA
(model.lora.*) and NF4 (model.quantize_base), on their own and against parallel.*; registered with
core.config's loader (core/config_checks.py, training/registry.py). The shape rules live with each
family (models.qwen.dims, asked where the model is built, and by the loader last of all:
core.config_checks.check_model_shape). Torch-free: the launcher checks a config before torch is
imported.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from core.config_errors import check_each
from core.exceptions import ConfigError
from core.model_families import model_family

if TYPE_CHECKING:
    from core.config import Config


def validate_model(config: Config) -> None:
    """model.vocab_size, then model.lora and model.quantize_base (docs/models.md, LoRA): each
    violated one (core/config_errors.py)."""
    check_each(config, (_validate_vocab, _validate_lora))


def _validate_vocab(config: Config) -> None:
    """model.vocab_size on its own (the tokenizer's ids are checked where the tokenizer is loaded)."""
    if config.model.vocab_size <= 0:
        raise ConfigError(f"model.vocab_size must be > 0, got {config.model.vocab_size}", key="model.vocab_size")


def _validate_lora(config: Config) -> None:
    """model.lora and model.quantize_base on their own and against parallel.* (docs/models.md, LoRA)."""
    lora = config.model.lora
    if lora.rank < 0:  # before model.* is read: reported beside a wrong model.vocab_size
        raise ConfigError(f"model.lora.rank must be >= 0 (0: off), got {lora.rank}", key="model.lora.rank")
    quantize = config.model.quantize_base
    if lora.rank == 0:
        needs_adapters = {
            "model.lora.init_from": lora.init_from is not None,
            "model.lora.modules_to_save": bool(lora.modules_to_save),
            "model.quantize_base": quantize != "none",
        }
        for key, is_set in needs_adapters.items():
            if is_set:
                raise ConfigError(
                    f"{key} is set but model.lora.rank is 0 (LoRA off)",
                    key="model.lora.rank",
                    hint=f"set model.lora.rank > 0 (e.g. 16) to train adapters, or unset {key}",
                )
        return
    if lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha must be > 0, got {lora.alpha}", key="model.lora.alpha")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}", key="model.lora.dropout")
    if lora.dropout > 0.0 and config.determinism.batch_invariant:
        raise ConfigError(
            f"model.lora.dropout={lora.dropout} under determinism.batch_invariant: the trainer's forward drops "
            "adapter inputs the sampler's does not, so their log-probs cannot agree bit for bit",
            key="model.lora.dropout",
            hint="set model.lora.dropout=0.0, or leave determinism.batch_invariant off",
        )
    valid = model_family(config.model.arch).lora_targets
    if not lora.targets:
        raise ConfigError("model.lora.targets is empty", key="model.lora.targets", hint=f"valid: {', '.join(valid)}")
    for name in lora.targets:
        if name not in valid:
            near = _nearest(name, list(valid))
            raise ConfigError(
                f"model.lora.targets names {name!r}, which is no linear layer of the model's blocks",
                key="model.lora.targets",
                hint=(f"did you mean {near!r}? " if near else "") + f"valid: {', '.join(valid)}",
            )
    if len(set(lora.targets)) != len(lora.targets):
        raise ConfigError(f"model.lora.targets lists a name twice: {list(lora.targets)}", key="model.lora.targets")
    p = config.parallel
    if p.strategy == "xla_spmd":
        raise ConfigError(
            "model.lora is not supported with parallel.strategy=xla_spmd",
            key="parallel.strategy",
            hint="use none, ddp or fsdp for adapter training",
        )
    if p.float8 != "none":
        raise ConfigError(
            f"model.lora with parallel.float8={p.float8} is not supported: FP8 would convert the frozen base "
            "and the rank-sized adapter matmuls, a combination that is untested",
            key="parallel.float8",
            hint="set parallel.float8=none for adapter training",
        )
    if quantize == "nf4" and p.tp > 1:
        raise ConfigError(
            "model.quantize_base=nf4 cannot be tensor-parallel (parallel.tp > 1): NF4 weights are not DTensor-shardable",
            key="model.quantize_base",
            hint="set parallel.tp=1 (FSDP or DDP shard/replicate NF4 bases), or quantize_base=none",
        )


def _nearest(name: str, options: list[str]) -> str | None:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return match[0] if match else None
