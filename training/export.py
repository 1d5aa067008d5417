"""Export a checkpoint as a Hugging Face model directory.

``python -m training export --run RUN_ID [--step S] --to DIR`` writes ``config.json``,
``model.safetensors`` (sharded above 5 GB) and the tokenizer files with the chat template,
which ``transformers`` loads as ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` with the same
logits as Lockstep's model from that checkpoint.

Any checkpoint loads here, whatever strategy or world size saved it: the model's tensors are
stored under canonical parameter names by torch.distributed.checkpoint, which reassembles
full tensors on load (one process, no process group). The checkpoint is verified against its
manifest first, and its metadata is read with the restricted unpickler (distributed/safe_dcp.py).

Architecture fields: a run that started ``model.init_from`` a Hugging Face directory exports
that directory's own ``config.json`` (copied into the run dir when the run started,
``artifacts/init_from/``), with only ``torch_dtype`` set to the exported weights' dtype, so
fields Lockstep does not model (token ids, sliding-window settings, ...) survive. Tokenizer:
the tokenizer directory's files (``tokenizer.json``, ``tokenizer_config.json``, ...) are copied;
the built-in byte tokenizer is written as an equivalent byte-level ``tokenizer.json``. The
chat template the run trained with goes into ``tokenizer_config.json``.

LoRA runs (``model.lora.rank > 0``): the checkpoint holds only the adapters, so the base is
rebuilt as the run built it and verified against the identity the checkpoint recorded (exit 4
when it differs). ``--merge`` (the default for such a run) writes the adapters merged into a
full directory as above; ``--adapter`` writes the PEFT adapter directory for the run's
``model.init_from`` base (docs/models.md, "LoRA and QLoRA").
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import models
from core import config as config_lib
from core import seeding
from core.config import Config
from core.exceptions import CheckpointError, UsageError
from core.layout import CHECKPOINTS_DIR, RunPaths, list_steps, step_dir_name
from data.chat_template import ChatTemplate
from data.tokenizers import ByteTokenizer, build_tokenizer, tokenizer_directory
from models.hf_config import config_path, model_config_from_hf
from models.hf_weights import save_pretrained
from models.lora import add_adapters, merge_lora, save_peft_adapter
from training.checkpoint_manifest import DCP_DIR, state_file_name, verify_checkpoint
from training.objectives.base import check_frozen
from distributed.safe_dcp import SafeFileSystemReader

MODEL_KEY = "model"
OBJECTIVE_PART = "objective"
"""The checkpoint part whose ``frozen`` entry holds a LoRA run's base identity (training/loop.py)."""
INIT_SOURCE_DIR = "init_from"
"""Under the run's artifacts/: the init_from directory's config.json and tokenizer files."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json", "chat_template.jinja")


def record_init_source(config: Config, paths: RunPaths) -> None:
    """Keep the init_from directory's config.json and tokenizer files with the run (rank 0)."""
    source = config.model.init_from
    if source is None:
        return
    target = paths.artifacts / INIT_SOURCE_DIR
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        path = Path(source) / name
        if path.is_file() and not (target / name).exists():
            shutil.copyfile(path, target / name)


def checkpoint_dir(paths: RunPaths, step: int | None) -> Path:
    """The checkpoint of ``step`` (default: the newest), verified against its manifest."""
    steps = list_steps(paths.checkpoints)
    if not steps:
        raise UsageError(f"run {paths.root.name} has no checkpoint under {CHECKPOINTS_DIR}/",
                         hint="export needs a checkpoint; train with checkpoint.interval > 0 or checkpoint.at_end")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise UsageError(f"run {paths.root.name} has no checkpoint at step {step} (it has {steps})",
                         hint="pick one of the listed steps")
    path = paths.checkpoints / step_dir_name(step)
    reason = verify_checkpoint(path)
    if reason is not None:
        raise CheckpointError(f"checkpoint is damaged: {reason}", path=str(path),
                              hint="export an older step with --step")
    return path


def load_checkpoint_model(config: Config, path: Path) -> torch.nn.Module:
    """Lockstep's model (fp32, CPU) with the weights of checkpoint ``path``.

    A LoRA run's checkpoint holds only the trained tensors (adapters, modules_to_save): the
    base is rebuilt as the run built it (``model.init_from``, else the seeded init), checked
    against the identity the checkpoint recorded, and the adapters are applied before the
    checkpoint's tensors are loaded into them."""
    if config.model.lora.rank > 0:
        model = _lora_base(config, path)
    else:
        model_config = config.model
        if model_config.init_from is not None:
            model_config = model_config_from_hf(model_config.init_from, base=model_config)
        model_config = dataclasses.replace(model_config, init_from=None)
        model = models.build(model_config)  # seeded init, then every tensor is overwritten
    frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
    state = {f"{MODEL_KEY}.{k}": v for k, v in model.state_dict().items() if k not in frozen}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path / DCP_DIR)), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as exc:  # DCP's own types (one derives from BaseException)
        raise CheckpointError(f"cannot load the model from the checkpoint: {exc}", path=str(path),
                              hint="the checkpoint was written for another architecture") from exc
    model.load_state_dict({k.removeprefix(f"{MODEL_KEY}."): v for k, v in state.items()}, strict=not frozen)
    return model


def _lora_base(config: Config, path: Path) -> torch.nn.Module:
    """The run's base with adapters, verified against the checkpoint's recorded base identity."""
    model = models.build(config.model, generator=seeding.generator(config.train.seed, "model_init"))
    identity = add_adapters(model, config.model, seed=config.train.seed, load_init=False)
    state_file = path / state_file_name(OBJECTIVE_PART)
    recorded = json.loads(state_file.read_text()).get("frozen", {}) if state_file.is_file() else {}
    check_frozen({"base": identity}, {k: v for k, v in recorded.items() if k == "base"})
    return model


def export(paths: RunPaths, out: Path, *, step: int | None = None, dtype: torch.dtype | None = None,
           adapter: bool = False) -> Path:
    """Write the Hugging Face directory ``out`` from a checkpoint of the run at ``paths``.

    A LoRA run exports its adapters merged into the base (a full model directory), or with
    ``adapter`` only its PEFT adapter directory (adapter_model.safetensors,
    adapter_config.json naming ``model.init_from`` as the base) plus the tokenizer files."""
    config = config_lib.load(paths.config)
    lora = config.model.lora.rank > 0
    if adapter and not lora:
        raise UsageError(f"run {paths.root.name} trained no adapters (model.lora.rank is 0)",
                         hint="export it without --adapter / --merge")
    path = checkpoint_dir(paths, step)
    model = load_checkpoint_model(config, path)
    out = Path(out)
    if adapter:
        if dtype is not None:  # the adapters only (an NF4 base does not convert)
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(dtype)
        save_peft_adapter(model, out, base_model_name_or_path=config.model.init_from)
        _write_tokenizer(config, paths, out)
        return path
    if lora:
        model = merge_lora(model, inplace=True)
    state = model.state_dict()
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    save_pretrained(model, out, state_dict=state)
    _keep_source_architecture(paths, config, out, state)
    _write_tokenizer(config, paths, out)
    return path


def _keep_source_architecture(paths: RunPaths, config: Config, out: Path, state: dict) -> None:
    source = _init_source(paths, config, "config.json")
    if source is None:
        return
    raw = json.loads(source.read_text())
    raw["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def _init_source(paths: RunPaths, config: Config, name: str) -> Path | None:
    """A file of the init_from directory: the run's copy, else the directory itself."""
    if config.model.init_from is None:
        return None
    for directory in (paths.artifacts / INIT_SOURCE_DIR, config_path(config.model.init_from).parent):
        if (directory / name).is_file():
            return directory / name
    return None


def _write_tokenizer(config: Config, paths: RunPaths, out: Path) -> None:
    spec = config.data.tokenizer
    template = ChatTemplate.for_tokenizer(spec, config.data.chat_template)
    tokenizer = build_tokenizer(spec)
    if isinstance(tokenizer, ByteTokenizer):
        (out / "tokenizer.json").write_text(tokenizer.hf_tokenizer_json())
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": ByteTokenizer.SPECIALS[0],
            "pad_token": ByteTokenizer.SPECIALS[1],
            "model_max_length": config.data.seq_len,
            "clean_up_tokenization_spaces": False,
        }
    else:
        directory = tokenizer_directory(spec)
        for name in TOKENIZER_FILES:
            if (directory / name).is_file():
                shutil.copyfile(directory / name, out / name)
        existing = out / "tokenizer_config.json"
        tokenizer_config = json.loads(existing.read_text()) if existing.is_file() else {}
    tokenizer_config["chat_template"] = template.source
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
