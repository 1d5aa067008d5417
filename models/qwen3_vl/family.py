"""The row of ``model.arch: qwen3_vl`` (core/model_families.py) and its ``model.qwen3_vl`` section.

The language model is read from the ``model.*`` keys as for qwen3 (RMSNorm on each head of q and k,
no q/k/v bias, head width model.head_dim); the vision tower, DeepStack, the special token ids and
the interleaved M-RoPE sections from ``model.qwen3_vl``, hashed only once a key of it is set
(core/config_schema.py), so no existing config changes its hash. Torch-free: the config loader
reads this row before torch is imported; the code it names is imported when a model is built.
training/registry.py registers ``FAMILIES`` after the other families' rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from core.config_errors import check_independent, raise_together
from core.exceptions import ConfigError
from core.model_families import ModelFamily
from models.qwen.lora_targets import LORA_TARGETS
from models.qwen_vl.family import (
    TOWER_SIZES,
    TowerTraining,
    check_features_and_tokens,
    check_tower_training,
    positive_int,
    refuse_tensor_parallel,
    tower_errors,
)

if TYPE_CHECKING:
    from core.config import Config

NAME = "qwen3_vl"
"""The model.arch value, and the model.<name> section's key."""
HF_ARCHITECTURE = "Qwen3VLForConditionalGeneration"
"""config.json's ``architectures`` class of a checkpoint of this family."""


@dataclass(frozen=True)
class Qwen3VLSettings:
    """The ``model.qwen3_vl`` section: the vision tower, DeepStack, the special tokens and M-RoPE (defaults: Qwen3-VL's)."""

    depth: int = 27
    """Blocks of the vision tower."""
    hidden_size: int = 1152
    """Width of the vision tower's residual stream."""
    num_heads: int = 16
    """Attention heads of each vision block (head width hidden_size / num_heads, divisible by 4 for the 2-D rotary)."""
    intermediate_size: int = 4304
    """Hidden width of each vision block's GELU (tanh) MLP."""
    in_channels: int = 3
    """Colour channels of a pixel patch."""
    patch_size: int = 16
    """Side of a square patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (a still image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """The mergers join merge x merge neighbouring patches into one language-model token."""
    num_position_embeddings: int = 2304
    """Learned patch positions, a square grid (48 x 48), bilinearly resampled to each image's grid."""
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    """Vision blocks (ascending) whose merged outputs are added to the outputs of language blocks 0, 1, ... at the image tokens."""
    out_hidden_size: Optional[int] = None
    """Width of a merged feature; None means model.hidden_size (which it must equal)."""
    image_token_id: int = 151655
    """The image placeholder token: each is replaced by one merged vision feature."""
    video_token_id: int = 151656
    """The video placeholder token (recorded in exports; videos are not read)."""
    vision_start_token_id: int = 151652
    """The token before an image's placeholders (recorded in exports)."""
    vision_end_token_id: int = 151653
    """The token after an image's placeholders (recorded in exports)."""
    mrope_section: tuple[int, ...] = (24, 20, 20)
    """Rotary frequency pairs of the (temporal, height, width) positions, interleaved (pair i: height if i % 3 == 1 and i < 3 * section[1], width if i % 3 == 2 and i < 3 * section[2], else temporal); they sum to head_dim / 2."""
    tower: TowerTraining = None
    """How the vision tower (its DeepStack mergers too) trains: full (every parameter, beside LoRA's adapters too), frozen (no gradient, no optimizer state, no adapters), lora (adapters on every linear of its blocks; needs model.lora.rank > 0); unset: as the language model (in full, or under model.lora the targets its block linears' names match)."""


def settings_of(model) -> Qwen3VLSettings:
    """The ``model.qwen3_vl`` section of a model config (its defaults where the config has none)."""
    return getattr(model, NAME, None) or Qwen3VLSettings()


def validate(config: Config) -> None:
    """The family's checks of a loaded config, each a ConfigError naming its key: every violated one
    (core/config_errors.py)."""
    if config.model.arch != NAME:
        return
    check_independent(config, (
        lambda view: check_settings(view.model),
        lambda view: check_tower_training(view, settings_of(view.model).tower, f"model.{NAME}.tower"),
        lambda view: refuse_tensor_parallel(view, NAME),
    ))


def text_head_dim(model) -> int:
    """The language model's head width: model.head_dim, else hidden_size // num_heads (ConfigError naming the key)."""
    if model.head_dim is not None:
        return model.head_dim
    if model.num_heads <= 0 or model.hidden_size % model.num_heads:
        raise ConfigError(f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads="
                          f"{model.num_heads}", key="model.head_dim", hint="set model.head_dim explicitly")
    return model.hidden_size // model.num_heads


def check_settings(model) -> None:
    """``model.*`` and ``model.qwen3_vl.*`` of a model config against each other (ConfigError naming the key):
    every violated constraint."""
    key = f"model.{NAME}"
    check_independent(model, (
        _check_tower,
        _check_deepstack_layers,
        lambda view: check_features_and_tokens(view, settings_of(view), key),
        _check_language_model,
        _check_mrope,
    ))


def _check_tower(model) -> None:
    """The vision section on its own: sizes, learned positions, DeepStack blocks (each asked once the
    sizes it reads are valid)."""
    s, key = settings_of(model), f"model.{NAME}"
    found = tower_errors(s, key, (*TOWER_SIZES, "num_position_embeddings"))
    positions = s.num_position_embeddings
    if positive_int(positions) and math.isqrt(positions) ** 2 != positions:
        found.append(ConfigError(f"{key}.num_position_embeddings={s.num_position_embeddings} must be a square (the "
                                 "learned positions are a square grid)", key=f"{key}.num_position_embeddings"))
    indexes = list(s.deepstack_visual_indexes)
    if positive_int(s.depth) and (
            any(isinstance(i, bool) or not isinstance(i, int) for i in indexes)
            or not all(0 <= i < s.depth for i in indexes) or indexes != sorted(set(indexes))):
        found.append(ConfigError(f"{key}.deepstack_visual_indexes {indexes} must name distinct vision blocks in [0, "
                                 f"depth={s.depth}), ascending", key=f"{key}.deepstack_visual_indexes"))
    raise_together(found)


def _check_deepstack_layers(model) -> None:
    num_layers, s, key = model.num_layers, settings_of(model), f"model.{NAME}"
    if len(s.deepstack_visual_indexes) > num_layers:
        raise ConfigError(f"{key}.deepstack_visual_indexes gives {len(s.deepstack_visual_indexes)} DeepStack features "
                          f"for model.num_layers={num_layers} language blocks (one block each)",
                          key=f"{key}.deepstack_visual_indexes")


def _check_language_model(model) -> None:
    if model.qkv_bias is True or model.qk_norm is False:
        which = "model.qkv_bias" if model.qkv_bias is True else "model.qk_norm"
        raise ConfigError(f"{NAME}'s language model has q/k RMSNorm and no q/k/v bias; {which} says otherwise",
                          key=which, hint=f"leave {which} unset")


def _check_mrope(model) -> None:
    """The language model's head width, then the three M-RoPE sections that split it, then their
    interleaving (each asked once the one before holds)."""
    half = text_head_dim(model) // 2
    s, key = settings_of(model), f"model.{NAME}"
    section = list(s.mrope_section)
    if (len(section) != 3 or any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in section)
            or sum(section) != half):
        raise ConfigError(f"{key}.mrope_section {section} must be three counts summing to head_dim / 2 = {half}",
                          key=f"{key}.mrope_section")
    if 3 * section[1] - 2 >= half or 3 * section[2] - 1 >= half:
        raise ConfigError(f"{key}.mrope_section {section}: interleaved, height takes pairs 1, 4, ... and width 2, 5, "
                          f"...; {section[1]} and {section[2]} of them do not fit in head_dim / 2 = {half} pairs",
                          key=f"{key}.mrope_section")


_CODE = "models.qwen3_vl"

QWEN3_VL = ModelFamily(
    name=NAME,
    summary="Qwen3-VL: vision tower with learned positions, DeepStack, interleaved 3-D M-RoPE over Qwen3",
    settings=Qwen3VLSettings,
    defaults=(("qkv_bias", False), ("qk_norm", True)),
    hf_architectures=(HF_ARCHITECTURE,),
    hf_model_type=NAME,
    build=f"{_CODE}.model:empty_model",
    weights=f"{_CODE}.weights:QWEN3_VL_WEIGHTS",
    config_from_hf=f"{_CODE}.hf_config:config_from_hf",
    config_to_hf=f"{_CODE}.hf_config:config_to_hf",
    parallel_plan=f"{_CODE}.plan:qwen3_vl_parallel_plan",
    num_params=f"{_CODE}.flops:num_params",
    flops_per_token=f"{_CODE}.flops:flops_per_token",
    block_linears=f"{_CODE}.flops:block_linears",
    generation_copy=f"{_CODE}.generation_copy:generation_copy",
    lora_targets=(*LORA_TARGETS, "qkv", "proj", "linear_fc1", "linear_fc2"),
    validate=validate,
    hashed_only_when_set=("tower",),
)

FAMILIES = (QWEN3_VL,)
"""Registered by training/registry.py after the other families' rows."""
