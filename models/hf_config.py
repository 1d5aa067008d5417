"""Translation between a Hugging Face ``config.json`` and our ModelConfig, for every model family.

config.json's ``architectures`` (or, without it, its ``model_type``) picks the registered family
that claims it (core/model_families.py); the family reads the rest (``ModelFamily.config_from_hf``,
Qwen's: models/qwen/hf_config.py) through ``FieldReader``, and writes an export's config.json
(``ModelFamily.config_to_hf``). Only what the family's Hugging Face classes can express is
accepted: anything else is a ConfigError that names the file and the field, because loading it
anyway would give a model that silently computes something else.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from core.config import ModelConfig
from core.config_schema import model_config_class
from core.json_files import read_json_object
from core.exceptions import ConfigError
from core.model_families import ModelFamily, hf_family, model_families, model_family
from core.registration import import_attr


def __getattr__(name: str) -> Any:
    """``CLASSIFIER_ARCHITECTURES``: {class name: model.arch} of every registered family's sequence
    classifiers (a reward model's export: the trunk loads as the causal LM's), read when asked."""
    if name == "CLASSIFIER_ARCHITECTURES":
        return {a: f.name for f in model_families() for a in f.hf_classifier_architectures}
    raise AttributeError(f"module 'models.hf_config' has no attribute {name!r}")


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
    return read_json_object(file, ConfigError)


def model_config_from_hf(path: str | Path, base: ModelConfig | None = None) -> ModelConfig:
    """A ModelConfig whose shape comes from ``path``'s config.json.

    Shape fields (arch, sizes, heads, head_dim, RoPE theta, norm eps, tying, bias, qk-norm,
    max positions) are taken from config.json; fields that are not part of the checkpoint
    (attention kernel, sdpa_backends, init_std, init_from) are kept from ``base``.
    """
    file = config_path(path)
    reader = FieldReader(read_hf_config(file), file)
    family = _read_family(reader)
    return import_attr(family.config_from_hf)(reader, family, base or ModelConfig())


def hf_config_dict(config: ModelConfig, dims: Any, dtype_name: str) -> dict[str, Any]:
    """The config.json that transformers loads as the class of ``config``'s family that computes
    the same function (``ModelFamily.config_to_hf``)."""
    return import_attr(model_family(config.arch).config_to_hf)(config, dims, dtype_name)


# --------------------------------------------------------------------------- reading


class FieldReader:
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


def _read_family(reader: FieldReader) -> ModelFamily:
    architectures = reader.get("architectures")
    if architectures is not None:
        if not isinstance(architectures, list) or len(architectures) != 1:
            raise reader.error("architectures", f"architectures must list one class, got {architectures!r}")
        family = hf_family(architectures[0], None)
        if family is None:
            known = [a for f in model_families() for a in (*f.hf_architectures, *f.hf_classifier_architectures)]
            raise reader.error(
                "architectures",
                f"unsupported architecture {architectures[0]!r}",
                hint=f"supported: {', '.join(known)}",
            )
        return family
    model_type = reader.get("model_type")
    family = hf_family(None, model_type)
    if family is None:
        raise reader.error(
            "model_type",
            f"unsupported or missing model_type {model_type!r} (and no architectures field)",
            hint=f"supported: {', '.join(f.hf_model_type for f in model_families() if f.hf_model_type)}",
        )
    return family


def read_rope_theta(reader: FieldReader, default: float) -> float:
    """RoPE's base from ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x), else ``default``;
    RoPE scaling is refused."""
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
    return reader.number("rope_theta", default)


def with_section(base: ModelConfig, name: str) -> ModelConfig:
    """``base`` as the registered model schema, which carries the ``model.<name>`` section a family's
    ``config_from_hf`` fills (a plain ``ModelConfig`` has none)."""
    if hasattr(base, name):
        return base
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return model_config_class()(**values)


def _positive_number(reader: FieldReader, key: str, value: Any) -> float:
    """A finite number > 0; JSON's NaN and Infinity (which Python's json accepts) are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise reader.error(key, f"{key} must be a finite positive number, got {value!r}",
                           hint=f"fix {key} in config.json (NaN and Infinity are not valid values)")
    return float(value)
