"""The row of ``model.arch: qwen2_5_vl`` (core/model_families.py) and its ``model.qwen2_5_vl`` section.

The language model is read from the ``model.*`` keys as for qwen2 (q/k/v bias, no q/k norm, head
width hidden_size / num_heads); the vision tower, the special token ids and the M-RoPE sections
from ``model.qwen2_5_vl``, hashed only once a key of it is set (core/config_schema.py), so no
existing config changes its hash. Torch-free: the config loader reads this row before torch is
imported; the code it names is imported when a model is built. training/registry.py registers
``FAMILIES`` after Qwen's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional

from core.config_errors import check_independent, raise_together
from core.exceptions import ConfigError
from core.model_families import ModelFamily
from models.qwen.lora_targets import LORA_TARGETS

if TYPE_CHECKING:
    from core.config import Config

TowerTraining = Optional[Literal["full", "frozen", "lora"]]
"""A vision section's ``tower`` key: how its vision tower trains (None: as the language model)."""

NAME = "qwen2_5_vl"
"""The model.arch value, and the model.<name> section's key."""
HF_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
"""config.json's ``architectures`` class of a checkpoint of this family."""


@dataclass(frozen=True)
class QwenVLSettings:
    """The ``model.qwen2_5_vl`` section: the vision tower, the special tokens and M-RoPE (defaults: Qwen2.5-VL's)."""

    depth: int = 32
    """Blocks of the vision tower."""
    hidden_size: int = 1280
    """Width of the vision tower's residual stream."""
    num_heads: int = 16
    """Attention heads of each vision block (head width hidden_size / num_heads, divisible by 4 for the 2-D rotary)."""
    intermediate_size: int = 3420
    """Hidden width of each vision block's SiLU-gated MLP."""
    in_channels: int = 3
    """Colour channels of a pixel patch."""
    patch_size: int = 14
    """Side of a square patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (a still image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """The merger joins merge x merge neighbouring patches into one language-model token."""
    window_size: int = 112
    """Side of an attention window, in pixels (a multiple of patch_size * spatial_merge_size)."""
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    """Vision blocks that attend over their whole image; the others attend within windows."""
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
    mrope_section: tuple[int, ...] = (16, 24, 24)
    """Rotary frequency pairs given to the (temporal, height, width) positions; they sum to head_dim / 2."""
    tower: TowerTraining = None
    """How the vision tower trains: full (every parameter, beside LoRA's adapters too), frozen (no gradient, no optimizer state, no adapters), lora (adapters on every linear of its blocks; needs model.lora.rank > 0); unset: as the language model (in full, or under model.lora the targets its block linears' names match)."""


def settings_of(model) -> QwenVLSettings:
    """The ``model.qwen2_5_vl`` section of a model config (its defaults where the config has none)."""
    return getattr(model, NAME, None) or QwenVLSettings()


def validate(config: Config) -> None:
    """The family's checks of a loaded config, each a ConfigError naming its key: every violated one
    (core/config_errors.py)."""
    if config.model.arch != NAME:
        return
    check_independent(config, (lambda view: check_settings(view.model), _check_tower_training, _check_image_patches,
                               lambda view: refuse_tensor_parallel(view, NAME)))


def _check_tower_training(config: Config) -> None:
    check_tower_training(config, settings_of(config.model).tower, f"model.{NAME}.tower")


def _check_image_patches(config: Config) -> None:
    """data.images cuts the tower's patches (each size asked once check_tower holds it valid)."""
    tower, images = settings_of(config.model), config.data.images
    pairs = [(key, getattr(images, key), name, getattr(tower, name)) for key, name in (
        ("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
        ("merge_size", "spatial_merge_size"))]
    raise_together([ConfigError(f"data.images.{key}={value} is not the vision tower's model.{NAME}.{name}={size}: "
                                "images are cut into its patches",
                                key=f"data.images.{key}", hint=f"set data.images.{key}={size}")
                    for key, value, name, size in pairs if positive_int(size) and value != size])


def check_tower_training(config: Config, tower: TowerTraining, key: str) -> None:
    """A vision section's ``tower`` (under ``key``) against ``model.lora`` and ``model.quantize_base``
    (one value of ``tower``: at most one of them fails)."""
    if tower == "lora" and config.model.lora.rank <= 0:
        raise ConfigError(f"{key}=lora puts adapters on the vision tower, but model.lora.rank is "
                          f"{config.model.lora.rank} (no adapters)", key=key,
                          hint="set model.lora.rank > 0, or the tower to full or frozen")
    if tower == "full" and config.model.quantize_base != "none":
        raise ConfigError(f"{key}=full trains the vision tower's linears, which model.quantize_base="
                          f"{config.model.quantize_base} stores quantized and frozen", key=key,
                          hint="set the tower to lora or frozen, or model.quantize_base=none")


def refuse_tensor_parallel(config: Config, name: str) -> None:
    """A vision family's refusal of parallel.tp > 1 (model.arch ``name``): its tower has no such layout."""
    if config.parallel.tp > 1:
        raise ConfigError(f"model.arch {name} declares no tensor-parallel layout for its vision tower "
                          f"(parallel.tp={config.parallel.tp})", key="parallel.tp",
                          hint="set parallel.tp=1 (FSDP and DDP shard or replicate both stacks)")


TOWER_SIZES = ("depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size",
               "temporal_patch_size", "spatial_merge_size")
"""The vision section's sizes every Qwen VL tower has, each a positive integer."""


def positive_int(value) -> bool:
    """Whether a size of a vision section is valid: an integer (not a bool) > 0."""
    return not isinstance(value, bool) and isinstance(value, int) and value > 0


def tower_errors(s, key: str, sizes: tuple[str, ...]) -> list[ConfigError]:
    """A vision section ``s`` (under ``key``): ``sizes`` positive integers, and a head width divisible
    by 4 (asked once hidden_size and num_heads are valid): every violated one."""
    found = [ConfigError(f"{key}.{name} must be a positive integer, got {getattr(s, name)!r}", key=f"{key}.{name}")
             for name in sizes if not positive_int(getattr(s, name))]
    if (positive_int(s.hidden_size) and positive_int(s.num_heads)
            and (s.hidden_size % s.num_heads or (s.hidden_size // s.num_heads) % 4)):
        found.append(ConfigError(f"{key}.hidden_size={s.hidden_size} / num_heads={s.num_heads} must be a head width "
                                 "divisible by 4 (the 2-D rotary gives a quarter to each of height and width, twice)",
                                 key=f"{key}.num_heads"))
    return found


def check_features_and_tokens(model, s, key: str) -> None:
    """A vision section ``s`` (under ``key``) against ``model.*``: the merged feature's width and the special
    token ids within the vocabulary, every violated one."""
    hidden_size, vocab_size, found = model.hidden_size, model.vocab_size, []
    if s.out_hidden_size is not None and s.out_hidden_size != hidden_size:
        found.append(ConfigError(f"{key}.out_hidden_size={s.out_hidden_size} must equal model.hidden_size="
                                 f"{hidden_size}: merged features replace token embeddings",
                                 key=f"{key}.out_hidden_size", hint="leave it unset"))
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        value = getattr(s, name)
        if not 0 <= value < vocab_size:
            found.append(ConfigError(f"{key}.{name}={value} is no token id of model.vocab_size={vocab_size}",
                                     key=f"{key}.{name}", hint="set the tokenizer's id of that special token"))
    raise_together(found)


def check_settings(model) -> None:
    """``model.*`` and ``model.qwen2_5_vl.*`` of a model config against each other (ConfigError naming the
    key): every violated constraint."""
    key = f"model.{NAME}"
    check_independent(model, (
        _check_tower,
        lambda view: check_features_and_tokens(view, settings_of(view), key),
        _check_language_model,
        _check_head_dim,
        _check_heads_and_mrope,
    ))


def _check_tower(model) -> None:
    """The vision section on its own: sizes, window, full-attention blocks (each asked once the sizes it
    reads are valid)."""
    s, key = settings_of(model), f"model.{NAME}"
    found = tower_errors(s, key, (*TOWER_SIZES, "window_size"))
    if (all(positive_int(v) for v in (s.window_size, s.patch_size, s.spatial_merge_size))
            and s.window_size % (s.patch_size * s.spatial_merge_size)):
        found.append(ConfigError(f"{key}.window_size={s.window_size} must be a multiple of patch_size * "
                                 f"spatial_merge_size={s.patch_size * s.spatial_merge_size}", key=f"{key}.window_size"))
    bad = [i for i in s.fullatt_block_indexes if not 0 <= i < s.depth]
    if positive_int(s.depth) and (bad or len(set(s.fullatt_block_indexes)) != len(s.fullatt_block_indexes)):
        found.append(ConfigError(f"{key}.fullatt_block_indexes {list(s.fullatt_block_indexes)} must name distinct "
                                 f"vision blocks in [0, depth={s.depth})", key=f"{key}.fullatt_block_indexes"))
    raise_together(found)


def _check_language_model(model) -> None:
    if model.qkv_bias is False or model.qk_norm is True:
        which = "model.qkv_bias" if model.qkv_bias is False else "model.qk_norm"
        raise ConfigError(f"{NAME}'s language model has q/k/v bias and no q/k norm; {which} says otherwise",
                          key=which, hint=f"leave {which} unset")


def _check_head_dim(model) -> None:
    if model.head_dim is not None and model.head_dim * model.num_heads != model.hidden_size:
        raise ConfigError(f"{NAME}'s head width is hidden_size // num_heads, got model.head_dim={model.head_dim}",
                          key="model.head_dim", hint="leave model.head_dim unset")


def _check_heads_and_mrope(model) -> None:
    """The language model's head width, then the M-RoPE sections that split it."""
    hidden_size, num_heads = model.hidden_size, model.num_heads
    if num_heads <= 0 or hidden_size % num_heads:
        raise ConfigError(f"model.hidden_size={hidden_size} is not divisible by model.num_heads="
                          f"{num_heads}", key="model.num_heads")
    s, key = settings_of(model), f"model.{NAME}"
    half = hidden_size // num_heads // 2
    if len(s.mrope_section) != 3 or any(p < 0 for p in s.mrope_section) or sum(s.mrope_section) != half:
        raise ConfigError(f"{key}.mrope_section {list(s.mrope_section)} must be three counts summing to head_dim / 2 "
                          f"= {half}", key=f"{key}.mrope_section")


_CODE = "models.qwen_vl"

QWEN2_5_VL = ModelFamily(
    name=NAME,
    summary="Qwen2.5-VL: vision tower, merged patches in place of image tokens, 3-D M-RoPE",
    settings=QwenVLSettings,
    defaults=(("qkv_bias", True), ("qk_norm", False)),
    hf_architectures=(HF_ARCHITECTURE,),
    hf_model_type=NAME,
    build=f"{_CODE}.model:empty_model",
    weights=f"{_CODE}.weights:QWEN_VL_WEIGHTS",
    config_from_hf=f"{_CODE}.hf_config:config_from_hf",
    config_to_hf=f"{_CODE}.hf_config:config_to_hf",
    parallel_plan=f"{_CODE}.plan:qwen_vl_parallel_plan",
    num_params=f"{_CODE}.flops:num_params",
    flops_per_token=f"{_CODE}.flops:flops_per_token",
    block_linears=f"{_CODE}.flops:block_linears",
    generation_copy=f"{_CODE}.generation_copy:generation_copy",
    lora_targets=(*LORA_TARGETS, "qkv", "proj"),
    validate=validate,
    hashed_only_when_set=("tower",),
)

FAMILIES = (QWEN2_5_VL,)
"""Registered by training/registry.py after Qwen's rows."""
