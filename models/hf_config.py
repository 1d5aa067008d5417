"""Translation between a Hugging Face ``config.json`` and our ModelConfig.

Only what the Qwen2ForCausalLM / Qwen3ForCausalLM classes of transformers can express is
accepted; anything else (another architecture, RoPE scaling, sliding-window attention, a
non-SiLU activation) is a ConfigError that names the file and the field, because loading it
anyway would give a model that silently computes something else.

Family mapping: Qwen2 always has q/k/v bias and no q/k norm. Qwen3 always has q/k norm, and
its ``attention_bias`` switches a bias on q, k, v *and* o; our model has no o_proj bias, so
a Qwen3 export with q/k/v bias writes an all-zero o_proj bias (models/hf_weights.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from core.config import ModelConfig
from core.exceptions import ConfigError
from models.qwen.dims import QwenDims

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# A reward model's export (training/objectives/reward_model_io.py): the same trunk, with a score
# head (score.weight) instead of the output head; the trunk loads as the causal LM's.
CLASSIFIER_ARCHITECTURES = {"Qwen2ForSequenceClassification": "qwen2", "Qwen3ForSequenceClassification": "qwen3"}
_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# transformers' class defaults for keys a config.json may omit.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_EPS = 1e-6
_DEFAULT_MAX_POSITIONS = 32768
_QWEN3_DEFAULT_HEAD_DIM = 128


def config_path(path: str | Path) -> Path:
    """The config.json of a model directory (or the file itself)."""
    path = Path(path)
    return path if path.name == "config.json" else path / "config.json"


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Parse config.json; a missing or malformed file is a ConfigError naming it."""
    file = config_path(path)
    if not file.is_file():
        raise ConfigError(
            f"{file.parent} has no config.json",
            file=str(file),
            hint="point at a Hugging Face model directory (config.json plus model.safetensors)",
        )
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file} is not readable JSON: {exc}", file=str(file)) from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{file} must hold a JSON object", file=str(file))
    return raw


def model_config_from_hf(path: str | Path, base: ModelConfig | None = None) -> ModelConfig:
    """A ModelConfig whose shape comes from ``path``'s config.json.

    Shape fields (arch, sizes, heads, head_dim, RoPE theta, norm eps, tying, bias, qk-norm,
    max positions) are taken from config.json; fields that are not part of the checkpoint
    (attention kernel, sdpa_backends, init_std, init_from) are kept from ``base``.
    """
    file = config_path(path)
    raw = read_hf_config(file)
    reader = _FieldReader(raw, file)
    arch = _read_arch(reader)
    num_heads = reader.integer("num_attention_heads")
    hidden_size = reader.integer("hidden_size")
    if arch == "qwen3":
        head_dim = reader.integer("head_dim", default=_QWEN3_DEFAULT_HEAD_DIM)
        qkv_bias = reader.flag("attention_bias", default=False)
    else:
        # Qwen2's modeling code uses config.head_dim when present, else hidden / heads.
        if "head_dim" not in raw and hidden_size % num_heads:
            raise reader.error(
                "num_attention_heads", f"hidden_size={hidden_size} is not divisible by {num_heads} heads"
            )
        head_dim = reader.integer("head_dim", default=hidden_size // num_heads)
        qkv_bias = True
    num_kv_heads = reader.integer("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        raise reader.error(
            "num_key_value_heads",
            f"num_attention_heads={num_heads} is not divisible by num_key_value_heads={num_kv_heads}",
        )
    if head_dim % 2:
        raise reader.error("head_dim", f"head_dim must be even for rotary embeddings, got {head_dim}")
    _reject_unsupported(reader)
    base = base or ModelConfig()
    return dataclasses.replace(
        base,
        arch=arch,
        vocab_size=reader.integer("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=reader.integer("intermediate_size"),
        num_layers=reader.integer("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=_read_rope_theta(reader),
        rms_norm_eps=reader.number("rms_norm_eps", default=_DEFAULT_RMS_EPS),
        tie_embeddings=reader.flag("tie_word_embeddings", default=False),
        qkv_bias=qkv_bias,
        qk_norm=arch == "qwen3",
        max_position_embeddings=reader.integer("max_position_embeddings", default=_DEFAULT_MAX_POSITIONS),
    )


def hf_config_dict(config: ModelConfig, dims: QwenDims, dtype_name: str) -> dict[str, Any]:
    """The config.json that transformers loads as Qwen2ForCausalLM or Qwen3ForCausalLM.

    The HF class is chosen by qk_norm (only Qwen3 has it), not by ``config.arch``, so every
    combination of our switches is exported to a class that computes the same function.
    """
    architecture = "Qwen3ForCausalLM" if dims.qk_norm else "Qwen2ForCausalLM"
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": ARCHITECTURES[architecture],
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": dims.rms_norm_eps,
        # rope_theta for transformers 4.x readers, rope_parameters for 5.x.
        "rope_theta": dims.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": dims.rope_theta},
        "tie_word_embeddings": dims.tie_embeddings,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": dims.init_std,
        "use_cache": True,
        "dtype": dtype_name,
    }
    if architecture == "Qwen3ForCausalLM":
        out["attention_bias"] = dims.qkv_bias
    return out


# --------------------------------------------------------------------------- reading


class _FieldReader:
    """Typed access to config.json fields; every failure names the file and the field."""

    def __init__(self, raw: dict[str, Any], file: Path) -> None:
        self.raw = raw
        self.file = file

    def error(self, key: str, message: str, hint: str | None = None) -> ConfigError:
        return ConfigError(f"{self.file}: {message}", file=str(self.file), key=key, hint=hint)

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise self.error(key, f"required field {key!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(key, f"{key} must be a positive integer, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        return _positive_number(self, key, self.get(key, default))

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"{key} must be true or false, got {value!r}")
        return value


def _read_arch(reader: _FieldReader) -> str:
    architectures = reader.get("architectures")
    if architectures is not None:
        if not isinstance(architectures, list) or len(architectures) != 1:
            raise reader.error("architectures", f"architectures must list one class, got {architectures!r}")
        name = architectures[0]
        known = {**ARCHITECTURES, **CLASSIFIER_ARCHITECTURES}
        if name not in known:
            raise reader.error(
                "architectures",
                f"unsupported architecture {name!r}",
                hint=f"supported: {', '.join(known)}",
            )
        return known[name]
    model_type = reader.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise reader.error(
            "model_type",
            f"unsupported or missing model_type {model_type!r} (and no architectures field)",
            hint=f"supported: {', '.join(_MODEL_TYPES)}",
        )
    return model_type


def _read_rope_theta(reader: _FieldReader) -> float:
    params = reader.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise reader.error("rope_parameters", f"rope_parameters must be an object, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise reader.error(
                "rope_parameters.rope_type",
                f"RoPE scaling {rope_type!r} is not supported",
                hint="only plain RoPE (rope_type default) is implemented",
            )
        if params.get("rope_theta") is not None:
            return _positive_number(reader, "rope_parameters.rope_theta", params["rope_theta"])
    return reader.number("rope_theta", _DEFAULT_ROPE_THETA)


def _positive_number(reader: _FieldReader, key: str, value: Any) -> float:
    """A finite number > 0; JSON's NaN and Infinity (which Python's json accepts) are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise reader.error(key, f"{key} must be a finite positive number, got {value!r}",
                           hint=f"fix {key} in config.json (NaN and Infinity are not valid values)")
    return float(value)


def _reject_unsupported(reader: _FieldReader) -> None:
    scaling = reader.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind != "default":
            raise reader.error(
                "rope_scaling",
                f"RoPE scaling {kind!r} is not supported",
                hint="only plain RoPE is implemented; remove rope_scaling or use another checkpoint",
            )
    act = reader.get("hidden_act", "silu")
    if act != "silu":
        raise reader.error("hidden_act", f"activation {act!r} is not supported", hint="only silu is implemented")
    if reader.get("use_sliding_window", False):
        raise reader.error(
            "use_sliding_window",
            "sliding-window attention is not supported",
            hint="set use_sliding_window to false if the checkpoint was trained with full attention",
        )
