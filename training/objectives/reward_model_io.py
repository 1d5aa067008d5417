"""A reward model as a Hugging Face sequence-classification directory, both ways.

Export (``python -m training export`` of a run whose checkpoint holds a ``score`` part): the
causal-LM directory training/cli/export.py writes, turned into ``Qwen2ForSequenceClassification`` /
``Qwen3ForSequenceClassification``: config.json names that class, ``num_labels: 1`` and the
tokenizer's ``pad_token_id``, and the weights gain ``score.weight`` (1, hidden_size). transformers
reads such a model's score at the last token that is not ``pad_token_id``; Lockstep reads it at the
last token of the sequence (reward_model.py), which is the same token as long as no sequence ends
in the pad token: the pad token is the tokenizer config's ``pad_token``, else ``<|pad|>``, else
``<|endoftext|>``, and one that is also the end-of-text token the chat template closes with is
refused.

Import (``model.init_from`` of a reward-model run, or a model reward's ``path``): the trunk loads
as any Hugging Face directory (models/hf_weights.py skips ``score.weight``), and
``read_score_weight`` gives the head's weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from core.exceptions import CheckpointError, ConfigError
from models.hf_config import CLASSIFIER_ARCHITECTURES, config_path
from models.hf_weights import INDEX_NAME, WEIGHTS_NAME

SCORE_WEIGHT = "score.weight"
SCORE_PART = "score"
SCORE_FILE = "score.safetensors"
"""Where a sharded export keeps the score head (a single-file export holds it in model.safetensors)."""
PAD_CANDIDATES = ("<|pad|>", "<|endoftext|>")


def read_checkpoint_score(checkpoint: Path) -> torch.Tensor | None:
    """The ``score`` part's weight (1, hidden_size) from a checkpoint, or None where it has none."""
    import torch.distributed.checkpoint as dcp

    from distributed.safe_dcp import SafeFileSystemReader
    from training.checkpoint.manifest import DCP_DIR
    from training.checkpoint.manager import part_keys, saved_part_names

    reader = SafeFileSystemReader(str(checkpoint / DCP_DIR))
    metadata = reader.read_metadata()
    if SCORE_PART not in saved_part_names(metadata.state_dict_metadata):
        return None
    model_key, _ = part_keys(SCORE_PART)
    key = f"{model_key}.weight"
    shape = metadata.state_dict_metadata[key].size
    state = {key: torch.empty(tuple(shape), dtype=torch.float32)}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint / DCP_DIR)), no_dist=True)
    check_finite_weight(state[key], name=key, file=checkpoint / DCP_DIR)
    return state[key]


def check_finite_weight(weight: torch.Tensor, *, name: str, file: Path) -> None:
    """Refuse a reward model's or critic's weight that holds NaN or Inf, as every frozen model's
    weights are refused (models/hf_weights.py): its scores would be NaN, and the run would stop at
    the first loss with nothing naming the file."""
    if not weight.is_floating_point() or bool(torch.isfinite(weight).all()):
        return
    bad = int((~torch.isfinite(weight)).sum())
    raise ConfigError(f"tensor {name!r} in {file} holds {bad} non-finite value(s) (NaN or Inf)", file=str(file),
                      key=name, hint="the weights are damaged or came from a diverged run; use another checkpoint")


def write_classifier(directory: Path, weight: torch.Tensor) -> None:
    """Turn the causal-LM export in ``directory`` (config.json, weights, tokenizer files) into a
    sequence classifier with the score head ``weight`` (1, hidden_size)."""
    config_file = directory / "config.json"
    raw = json.loads(config_file.read_text())
    dtype = _weights_dtype(directory)
    single = directory / WEIGHTS_NAME
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as reader:
            tensors = {key: reader.get_tensor(key) for key in reader.keys()}
        tensors[SCORE_WEIGHT] = weight.detach().to(dtype).contiguous()
        save_file(tensors, str(single), metadata={"format": "pt"})
    else:
        index_file = directory / INDEX_NAME
        index = json.loads(index_file.read_text())
        save_file({SCORE_WEIGHT: weight.detach().to(dtype).contiguous()}, str(directory / SCORE_FILE),
                  metadata={"format": "pt"})
        index["weight_map"][SCORE_WEIGHT] = SCORE_FILE
        index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    causal = raw["architectures"][0]
    raw["architectures"] = [causal.replace("ForCausalLM", "ForSequenceClassification")]
    raw["num_labels"] = 1
    raw["id2label"], raw["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    raw["pad_token_id"] = pad_token_id(directory)
    config_file.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def pad_token_id(directory: Path) -> int:
    """The id transformers stops at when it looks for a sequence's last token (module docstring)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    settings_file = directory / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    named = settings.get("pad_token")
    named = named.get("content") if isinstance(named, dict) else named
    eos = settings.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    for name in ([named] if isinstance(named, str) else []) + list(PAD_CANDIDATES):
        token = tokenizer.token_to_id(name)
        if token is not None and name != eos:
            return token
    raise CheckpointError(f"the tokenizer in {directory} has no pad token other than its end of text {eos!r}",
                          path=str(directory), hint="set pad_token in the tokenizer directory's tokenizer_config.json "
                          "to a special token no sequence ends with")


def is_classifier(path: str | Path) -> bool:
    """Whether the Hugging Face directory ``path`` holds a sequence classifier (its config.json says so)."""
    raw = json.loads(config_path(path).read_text())
    return any(name in CLASSIFIER_ARCHITECTURES for name in raw.get("architectures") or ())


def read_score_weight(path: str | Path, hidden_size: int) -> torch.Tensor:
    """``score.weight`` (1, hidden_size) fp32 of the sequence-classification directory ``path``."""
    directory = config_path(path).parent
    index = directory / INDEX_NAME
    name = json.loads(index.read_text())["weight_map"].get(SCORE_WEIGHT) if index.is_file() else WEIGHTS_NAME
    file = directory / name if name else None
    if file is not None and file.is_file():
        weight = _read_tensor(file, SCORE_WEIGHT)
        if weight is not None:
            weight = weight.float()
            if tuple(weight.shape) != (1, hidden_size):
                raise ConfigError(f"{file.name}'s {SCORE_WEIGHT} has shape {tuple(weight.shape)}, a reward "
                                  f"model's score head is (1, {hidden_size})", file=str(file), key=SCORE_WEIGHT,
                                  hint="export a reward model with num_labels 1")
            check_finite_weight(weight, name=SCORE_WEIGHT, file=file)
            return weight
    raise ConfigError(f"{directory} is a sequence classifier without {SCORE_WEIGHT}", file=str(directory),
                      key=SCORE_WEIGHT, hint="export the reward model again")


def _read_tensor(file: Path, name: str) -> torch.Tensor | None:
    """Tensor ``name`` of the safetensors ``file`` as stored, or None where the file has no such tensor;
    a file safetensors cannot read (truncated, damaged) is a ConfigError naming it, as a frozen
    model's weight file is (models/hf_weights.py)."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            return reader.get_tensor(name) if name in reader.keys() else None
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{file.name} is not a readable safetensors file: {exc}", file=str(file),
                          hint="the file is damaged or truncated; copy or export the model directory again") from None


def _weights_dtype(directory: Path) -> torch.dtype:
    single = directory / WEIGHTS_NAME
    file = single if single.is_file() else directory / next(iter(json.loads(
        (directory / INDEX_NAME).read_text())["weight_map"].values()))
    with safe_open(str(file), framework="pt", device="cpu") as reader:
        return reader.get_tensor(next(iter(reader.keys()))).dtype
