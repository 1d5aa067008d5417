"""The model families the config loader reads ``model.arch`` with, registered from above.

Core knows no model. Each family declares itself as a ``ModelFamily`` row, one per ``model.arch``
value (models/qwen/family.py declares qwen2 and qwen3), and training/registry.py hands the rows to
``register_family`` before any config is read. A row carries what the generic model code
(models/builder.py, hf_config.py, hf_weights.py, flops.py, lora.py, nf4.py) asks of a family as
import paths, ``module:attr``, which core only carries (it imports nothing above itself); a row is
asked what it declares, never compared by name outside its own family's modules.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from core.exceptions import ConfigError
from core.registration import ensure_registered


@dataclass(frozen=True)
class ModelFamily:
    """One ``model.arch`` value: its Hugging Face names, its defaults, its settings and where its
    code lives. Registered from above (training/registry.py) with ``register_family``."""

    name: str
    """The model.arch value, and the key of its settings section (model.<name>)."""
    summary: str
    """What sets it apart, in a few words, for model.arch's doc."""
    settings: Optional[type] = None
    """A frozen dataclass with a docstring under each field: the model.<name> section, hashed only once a key of it is set (None: no section)."""
    defaults: tuple[tuple[str, Any], ...] = ()
    """(key, value): what a model.* key left at None means for this family (qwen2: qkv_bias true, qk_norm false)."""
    hf_architectures: tuple[str, ...] = ()
    """Hugging Face causal-LM class names (config.json's ``architectures``) read as this family."""
    hf_classifier_architectures: tuple[str, ...] = ()
    """Hugging Face sequence-classifier class names whose trunk loads as this family (a reward model's export)."""
    hf_model_type: str = ""
    """config.json's ``model_type`` of this family, read where ``architectures`` is absent."""
    build: str = ""
    """``module:function``: ``(ModelConfig, *, device=None, dtype=torch.float32) -> model``, the model with
    uninitialized weights; the model's ``init_weights(generator)`` draws them (models.build calls both)."""
    weights: str = ""
    """``module:attr``: the family's weight adapter (models/weight_adapter.py): Hugging Face keys <-> ours."""
    config_from_hf: str = ""
    """``module:function``: ``(reader, family, base) -> ModelConfig`` from a config.json (models/hf_config.py's reader)."""
    config_to_hf: str = ""
    """``module:function``: ``(ModelConfig, dims, dtype_name) -> dict``, the config.json an export writes."""
    parallel_plan: str = ""
    """``module:function``: ``(dims) -> ModelParallelPlan``, the module names distributed/ shards and wraps."""
    num_params: str = ""
    """``module:function``: ``(ModelConfig, *, non_embedding=False) -> int`` (models/flops.py)."""
    flops_per_token: str = ""
    """``module:function``: ``(ModelConfig, seq_len, *, include_embedding_head) -> int`` (models/flops.py)."""
    block_linears: str = ""
    """``module:function``: ``(ModelConfig) -> {name in a block: (rows, columns)}``, the block linears' weight shapes (NF4's layout check)."""
    generation_copy: str = ""
    """``module:function``: a plain local copy of a trained model's full weights for the sampler."""
    lora_targets: tuple[str, ...] = ()
    """The linear layers of a block that model.lora.targets may name, in their order."""
    validate: Optional[Callable[[Any], None]] = None
    """Its checks of a loaded config (its section, model.* against it), torch-free; raises ConfigError."""
    hashed_only_when_set: tuple[str, ...] = ()
    """Keys of its section left out of the config hash at their default (keys added after configs set the section)."""

    def default(self, key: str) -> Any:
        """What model.<key> left at None means for this family (KeyError: the family declares none)."""
        return dict(self.defaults)[key]


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> None:
    """Add a model family. Registering the same row again does nothing; another row under a
    registered name is refused. The order of registration is model.arch's listing order."""
    known = _FAMILIES.get(family.name)
    if known is not None and known != family:
        raise ConfigError(f"model.arch {family.name!r} is registered twice, by two different families",
                          key="model.arch", hint="give the new model family a name of its own")
    if family.settings is not None and not dataclasses.is_dataclass(family.settings):
        raise ConfigError(f"model.arch {family.name!r}: its settings must be a dataclass, got {family.settings!r}",
                          key=f"model.{family.name}")
    if known is None:
        _FAMILIES[family.name] = family


def unregister_family(name: str) -> None:
    """Remove a registered family (a test's own family, once the test is done)."""
    _FAMILIES.pop(name, None)


def model_families() -> tuple[ModelFamily, ...]:
    """The registered families, in the order of registration."""
    if not _FAMILIES:
        ensure_registered()
    if not _FAMILIES:
        raise ConfigError("no model families are registered, so no config can be read",
                          hint="register one with core.model_families.register_family (training/registry.py does)")
    return tuple(_FAMILIES.values())


def model_family(name: str) -> ModelFamily:
    """The registered family ``name``; ConfigError listing the registered names and the nearest one."""
    families = {f.name: f for f in model_families()}
    if name in families:
        return families[name]
    listed = " | ".join(repr(n) for n in families)
    near = difflib.get_close_matches(str(name), list(families), n=1, cutoff=0.5)
    raise ConfigError(f"model.arch must be one of {listed}, got {name!r}", key="model.arch",
                      hint=f"did you mean {near[0]!r}?" if near else "pick one of the registered model families")


def hf_family(architecture: str | None, model_type: str | None) -> ModelFamily | None:
    """The family of a config.json's ``architectures`` class (causal LM or classifier), else of its
    ``model_type``; None when no registered family claims either."""
    for family in model_families():
        if architecture is not None and architecture in (*family.hf_architectures, *family.hf_classifier_architectures):
            return family
    if architecture is None:
        for family in model_families():
            if model_type and model_type == family.hf_model_type:
                return family
    return None


def default_lora_targets() -> tuple[str, ...]:
    """model.lora.targets' default: the first registered family's LoRA targets (a family with other
    names lists its own targets in its configs)."""
    return model_families()[0].lora_targets
