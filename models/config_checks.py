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

from core.config_errors import check_independent, raise_together
from core.exceptions import ConfigError
from core.model_families import model_family

if TYPE_CHECKING:
    from core.config import Config


def validate_model(config: Config) -> None:
    """model.vocab_size, and model.lora and model.quantize_base (docs/models.md, LoRA): every violated
    one (core/config_errors.py)."""
    check_independent(config, (_validate_vocab, _validate_lora))


def _validate_vocab(config: Config) -> None:
    """model.vocab_size on its own (the tokenizer's ids are checked where the tokenizer is loaded)."""
    if config.model.vocab_size <= 0:
        raise ConfigError(f"model.vocab_size must be > 0, got {config.model.vocab_size}", key="model.vocab_size")


def _validate_lora(config: Config) -> None:
    """model.lora and model.quantize_base on their own and against parallel.* (docs/models.md, LoRA).
    A negative rank is reported alone: whether adapters are on decides what else is asked."""
    lora = config.model.lora
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank must be >= 0 (0: off), got {lora.rank}", key="model.lora.rank")
    if lora.rank == 0:
        quantize = config.model.quantize_base
        needs_adapters = {
            "model.lora.init_from": lora.init_from is not None,
            "model.lora.modules_to_save": bool(lora.modules_to_save),
            "model.quantize_base": quantize != "none",
        }
        raise_together([ConfigError(
            f"{key} is set but model.lora.rank is 0 (LoRA off)",
            key="model.lora.rank",
            hint=f"set model.lora.rank > 0 (e.g. 16) to train adapters, or unset {key}",
        ) for key, is_set in needs_adapters.items() if is_set])
        return
    check_independent(config, (_check_adapter_values, _check_dropout_under_batch_invariance, _check_targets,
                               _check_lora_parallel))


def _dropout_in_range(dropout: float) -> bool:
    return 0.0 <= dropout < 1.0


def _check_adapter_values(config: Config) -> None:
    lora, found = config.model.lora, []
    if lora.alpha <= 0:
        found.append(ConfigError(f"model.lora.alpha must be > 0, got {lora.alpha}", key="model.lora.alpha"))
    if not _dropout_in_range(lora.dropout):
        found.append(ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}", key="model.lora.dropout"))
    raise_together(found)


def _check_dropout_under_batch_invariance(config: Config) -> None:
    dropout = config.model.lora.dropout
    if _dropout_in_range(dropout) and dropout > 0.0 and config.determinism.batch_invariant:
        raise ConfigError(
            f"model.lora.dropout={dropout} under determinism.batch_invariant: the trainer's forward drops "
            "adapter inputs the sampler's does not, so their log-probs cannot agree bit for bit",
            key="model.lora.dropout",
            hint="set model.lora.dropout=0.0, or leave determinism.batch_invariant off",
        )


def _check_targets(config: Config) -> None:
    """model.lora.targets: some, each a linear layer of the family's blocks (each wrong one named), none twice."""
    valid, targets = model_family(config.model.arch).lora_targets, config.model.lora.targets
    if not targets:
        raise ConfigError("model.lora.targets is empty", key="model.lora.targets", hint=f"valid: {', '.join(valid)}")
    found = []
    for name in targets:
        if name not in valid:
            near = _nearest(name, list(valid))
            found.append(ConfigError(
                f"model.lora.targets names {name!r}, which is no linear layer of the model's blocks",
                key="model.lora.targets",
                hint=(f"did you mean {near!r}? " if near else "") + f"valid: {', '.join(valid)}",
            ))
    if len(set(targets)) != len(targets):
        found.append(ConfigError(f"model.lora.targets lists a name twice: {list(targets)}", key="model.lora.targets"))
    raise_together(found)


def _check_lora_parallel(config: Config) -> None:
    """Adapters against parallel.*: the layouts and FP8 they do not run under."""
    quantize, p, found = config.model.quantize_base, config.parallel, []
    strategy, float8, tp = p.strategy, p.float8, p.tp  # every read before a find (core/config_errors.py)
    if strategy == "xla_spmd":
        found.append(ConfigError(
            "model.lora is not supported with parallel.strategy=xla_spmd",
            key="parallel.strategy",
            hint="use none, ddp or fsdp for adapter training",
        ))
    if float8 != "none":
        found.append(ConfigError(
            f"model.lora with parallel.float8={float8} is not supported: FP8 would convert the frozen base "
            "and the rank-sized adapter matmuls, a combination that is untested",
            key="parallel.float8",
            hint="set parallel.float8=none for adapter training",
        ))
    if quantize == "nf4" and tp > 1:
        found.append(ConfigError(
            "model.quantize_base=nf4 cannot be tensor-parallel (parallel.tp > 1): NF4 weights are not DTensor-shardable",
            key="model.quantize_base",
            hint="set parallel.tp=1 (FSDP or DDP shard/replicate NF4 bases), or quantize_base=none",
        ))
    raise_together(found)


def _nearest(name: str, options: list[str]) -> str | None:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return match[0] if match else None
