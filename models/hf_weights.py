"""Hugging Face safetensors checkpoints <-> our models, for every model family.

A checkpoint directory holds config.json plus either ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``. config.json picks the family (models/hf_config.py),
whose weight adapter (``ModelFamily.weights``, models/weight_adapter.py) maps each Hugging Face
key to ours, one-to-one or into a slot of a stacked tensor; I/O is that mapping plus checks:
every parameter (every slot) must be found exactly once with the shape config.json implies,
and a tensor we have no place for is an error rather than silently dropped (a tensor the
adapter declares as zero padding is accepted only if all zeros).

A directory is data from elsewhere (``model.init_from``, a reference, a teacher, generate's
``--from``), so the loader also refuses, as a ConfigError naming file and tensor: an index entry
naming a file outside the directory, a file safetensors cannot read, and a NaN/Inf weight.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from core.config import ModelConfig
from core.exceptions import ConfigError
from core.model_families import model_family
from core.registration import import_attr
from models.hf_config import config_path, hf_config_dict, model_config_from_hf
from models.weight_adapter import WeightAdapter

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def weight_adapter(config: ModelConfig) -> WeightAdapter:
    """The weight adapter of ``config``'s model family."""
    return import_attr(model_family(config.arch).weights)


def empty_model(config: ModelConfig, *, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``config``'s family's model with uninitialized weights (``ModelFamily.build``)."""
    return import_attr(model_family(config.arch).build)(config, device=device, dtype=dtype)


# --------------------------------------------------------------------------- load


def load_pretrained(
    path: str | Path,
    *,
    base: ModelConfig | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """Our model with the weights of a local HF directory, on ``device`` in ``dtype``.

    The shape comes from config.json; non-shape fields from ``base`` (see
    ``model_config_from_hf``). Any disagreement is a ConfigError naming file and field.
    """
    config = model_config_from_hf(path, base)
    model = empty_model(config, device=device, dtype=dtype)
    load_hf_weights(model, path)
    return model


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Fill every parameter of ``model`` (every slot of a stacked one) from the safetensors files under ``path``."""
    directory = config_path(path).parent
    adapter = weight_adapter(model.config)
    params = dict(model.named_parameters())  # tied: the embedding only
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(params)
    expected = {}
    for name, param in params.items():
        slots = param.shape[0] if adapter.stacked(name) else None
        hf_keys = adapter.to_hf(name, slots)
        indices = range(slots) if slots is not None else (None,)
        expected.update({hf_key: (name, index) for hf_key, index in zip(hf_keys, indices)})
    filled: set[str] = set()
    saved = model.state_dict().keys()  # persistent buffers (a router's balancing bias): filled where present
    fillable = {**{name: b for name, b in model.named_buffers() if name in saved}, **params}
    for file in _weight_files(directory):
        try:
            _fill_from_file(model, adapter, file, fillable, aliases, filled)
        except (SafetensorError, OSError) as exc:
            raise ConfigError(
                f"{file.name} is not a readable safetensors file: {exc}",
                file=str(file),
                hint="the file is damaged or truncated; copy or export the model directory again",
            ) from None
    missing = sorted(set(expected) - filled)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(
            f"{directory} lacks tensor {missing[0]!r}{more} that config.json requires",
            file=str(directory / (INDEX_NAME if (directory / INDEX_NAME).is_file() else WEIGHTS_NAME)),
            key=missing[0],
            hint="config.json and the weights disagree (num_hidden_layers, tie_word_embeddings, architecture?)",
        )


def _fill_from_file(model: torch.nn.Module, adapter: WeightAdapter, file: Path, params: dict[str, torch.Tensor],
                    aliases: set[str], filled: set[str]) -> None:
    with safe_open(str(file), framework="pt", device="cpu") as reader:
        for hf_key in reader.keys():
            slot = adapter.from_hf(hf_key)
            if slot is not None and slot.key in params:
                param = params[slot.key]
                target = param if slot.index is None else param[slot.index]
                tensor = reader.get_tensor(hf_key)
                _check_shape(hf_key, tensor, target, file, model.config)
                _check_finite(hf_key, tensor, file)
                target.copy_(tensor)
                filled.add(hf_key)
            elif slot is not None and slot.key in aliases:
                continue  # tied: the output head is the embedding, as in transformers
            elif adapter.ignored(hf_key):
                continue
            elif adapter.zero_padding(hf_key):
                _check_zero_padding(hf_key, reader.get_tensor(hf_key), file)
            else:
                raise ConfigError(
                    f"{file.name} holds tensor {hf_key!r}, which this model has no place for",
                    file=str(file),
                    key=hf_key,
                    hint="check config.json's architecture and flags (tie_word_embeddings, attention_bias)",
                )


def check_weight_files(path: str | Path) -> None:
    """Refuse a model directory whose safetensors files are missing or listed outside it, without
    reading a tensor: a run checks its Hugging Face sources so before it creates its run dir."""
    _weight_files(config_path(path).parent)


def _weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{index} is not a valid safetensors index: {exc}", file=str(index), key="weight_map"
            ) from exc
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise ConfigError(f"{index} is not a valid safetensors index: weight_map must map tensor names to "
                              "file names", file=str(index), key="weight_map")
        names = list(dict.fromkeys(weight_map.values()))  # ordered, unique
        for name in names:
            _check_inside(name, directory, index)
        files = [directory / name for name in names]
        for file in files:
            if not file.is_file():
                raise ConfigError(
                    f"{index.name} lists {file.name}, which does not exist", file=str(file), key="weight_map"
                )
        return files
    single = directory / WEIGHTS_NAME
    if not single.is_file():
        raise ConfigError(
            f"{directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}",
            file=str(single),
            hint="only safetensors checkpoints are supported (convert .bin files with transformers first)",
        )
    return [single]


def _check_inside(name: str, directory: Path, index: Path) -> None:
    """An index entry must name a file inside the model directory (symlinks resolved): an entry
    such as ``../other/model.safetensors`` or an absolute path would read weights from elsewhere."""
    if (directory / name).resolve().is_relative_to(directory.resolve()):
        return
    raise ConfigError(
        f"{index.name} lists {name!r}, which is outside the model directory {directory}",
        file=str(index),
        key="weight_map",
        hint="weight files must lie in the model directory itself; fix the index or copy the shards there",
    )


def _check_finite(hf_key: str, tensor: torch.Tensor, file: Path) -> None:
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    raise ConfigError(
        f"tensor {hf_key!r} in {file.name} holds {bad} non-finite value(s) (NaN or Inf)",
        file=str(file),
        key=hf_key,
        hint="the weights are damaged or came from a diverged run; use another checkpoint",
    )


def _check_shape(hf_key: str, tensor: torch.Tensor, param: torch.Tensor, file: Path, config: ModelConfig) -> None:
    if tuple(tensor.shape) == tuple(param.shape):
        return
    raise ConfigError(
        f"tensor {hf_key!r} in {file.name} has shape {list(tensor.shape)} but config.json implies "
        f"{list(param.shape)} (hidden_size={config.hidden_size}, intermediate_size={config.intermediate_size}, "
        f"num_attention_heads={config.num_heads}, num_key_value_heads={config.num_kv_heads}, "
        f"head_dim={config.head_dim}, vocab_size={config.vocab_size})",
        file=str(file),
        key=hf_key,
        hint="config.json does not describe these weights; fix its sizes or use the matching config",
    )


def _check_zero_padding(hf_key: str, tensor: torch.Tensor, file: Path) -> None:
    if not torch.count_nonzero(tensor):
        return
    raise ConfigError(
        f"{file.name} holds a non-zero {hf_key!r}, a bias this model does not implement",
        file=str(file),
        key=hf_key,
        hint="only checkpoints without o_proj bias (Qwen3 attention_bias=false) are supported",
    )


# --------------------------------------------------------------------------- save


def save_pretrained(
    model: torch.nn.Module,
    path: str | Path,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> None:
    """Write config.json and safetensors weights that transformers loads as the model family's class.

    ``state_dict`` overrides the model's own (pass a gathered full state dict for an
    FSDP-sharded model, and call on one rank). Weights keep their dtype. Tied checkpoints
    omit the tied copy (lm_head.weight), as transformers does. Above ``max_shard_bytes`` the
    weights are split into shards with an index. Earlier weight files in ``path`` are replaced.
    """
    adapter = weight_adapter(model.config)
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(dict(model.named_parameters()))
    source = model.state_dict() if state_dict is None else state_dict
    tensors: dict[str, torch.Tensor] = {}
    for key, value in source.items():
        if key in aliases:
            continue
        if hasattr(value, "full_tensor"):
            raise ValueError(f"{key} is a sharded DTensor; pass a gathered full state_dict to save_pretrained")
        value = value.detach().to("cpu").contiguous()
        if adapter.stacked(key):
            tensors.update(zip(adapter.to_hf(key, value.shape[0]), (part.contiguous() for part in value.unbind(0))))
        else:
            (hf_key,) = adapter.to_hf(key)
            tensors[hf_key] = value
    dtype = next(iter(tensors.values())).dtype
    tensors.update(adapter.export_padding(model, dtype))

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in [directory / WEIGHTS_NAME, directory / INDEX_NAME, *directory.glob("model-*-of-*.safetensors")]:
        if stale.is_file() and (stale.name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_PATTERN.fullmatch(stale.name)):
            stale.unlink()
    _write_shards(tensors, directory, max_shard_bytes)
    hf_config = hf_config_dict(model.config, model.dims, str(dtype).removeprefix("torch."))
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def _write_shards(tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][key] = tensor
        shard_bytes += size
    metadata = {"format": "pt"}  # transformers checks this tag before trusting the file
    if len(shards) == 1:
        save_file(shards[0], str(directory / WEIGHTS_NAME), metadata=metadata)
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        name = _SHARD_NAME.format(index=index, count=len(shards))
        save_file(shard, str(directory / name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index_doc, indent=2, sort_keys=True) + "\n")
