"""Export a checkpoint as a Hugging Face model directory.

``python -m training export --run RUN_ID [--step S] --to DIR`` writes ``config.json``,
``model.safetensors`` (sharded above 5 GB), the tokenizer files with the chat template and, for a
vision-language model, ``preprocessor_config.json`` (the run's ``data.images``),
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
chat template the run trained with goes into ``tokenizer_config.json``, a pretraining run's too; whether
the model is a chat model (``objective.kind`` other than ``causal_lm``) goes into ``lockstep_export.json``
as ``chat_model``, and ``generate --from DIR`` renders text prompts through the template by that;
a run's ``data.template_thinking``, where set, goes there as ``template_thinking``, and ``generate``
and ``score`` pass it to the template as the run did (``enable_thinking``).

LoRA runs (``model.lora.rank > 0``): the checkpoint holds only the adapters, so the base is
rebuilt as the run built it and verified against the identity the checkpoint recorded (exit 4
when it differs). ``--merge`` (the default for such a run) writes the adapters merged into a
full directory as above; ``--adapter`` writes the PEFT adapter directory for the run's
``model.init_from`` base (docs/models.md, "LoRA and QLoRA"), named by absolute path.

A reward model's checkpoint (one with a ``score`` part) exports as a Hugging Face sequence
classifier (``Qwen2/Qwen3ForSequenceClassification``, training/objectives/reward_model_io.py).

The target is checked and written by training/cli/export_target.py (never into a run directory,
through a link or over a directory a run uses; over an existing directory only with ``--overwrite``
and only if it is an earlier export holding nothing else; atomically). ``generation_config.json`` and the
tokenizer's eos end a chat-trained export's turns in ``transformers`` (``_write_tokenizer``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from core.run_context import load_recorded_config
from core.config import Config
from core.exceptions import UsageError
from core.objective_kinds import objective_kind
from core.layout import RunPaths
from data.chat_template import ChatTemplate, read_tokenizer_config
from data.tokenizers import ByteTokenizer, build_tokenizer, tokenizer_directory
from data.vision.images import processing_of
from data.vision.prompt_images import write_processor_config
from models.hf_config import config_path
from models.hf_weights import save_pretrained
from models.lora import merge_lora, save_peft_adapter
from training.checkpoint.load import (
    INIT_SOURCE_DIR,
    TOKENIZER_FILES,
    checkpoint_dir,
    load_checkpoint_model,
)
from training.cli.export_target import check_target, kill_point, staged_directory
from training.objectives.reward_model_io import read_checkpoint_score, write_classifier
from training.rollout.generator import stop_tokens

def export(paths: RunPaths, out: Path, *, step: int | None = None, dtype: torch.dtype | None = None,
           adapter: bool = False, overwrite: bool = False, run_roots: tuple[Path, ...] = ()) -> Path:
    """Write the Hugging Face directory ``out`` from a checkpoint of the run at ``paths``.

    A LoRA run exports its adapters merged into the base (a full model directory), or with
    ``adapter`` only its PEFT adapter directory (adapter_model.safetensors,
    adapter_config.json naming the base by absolute path) plus the tokenizer files. ``out`` is
    checked and written as training/cli/export_target.py says: never into a run directory or
    through a link, never over a directory a run under ``run_roots``, the run's own parent or its
    ``run.root`` uses, over a non-empty one only with ``overwrite`` and only if it is an earlier
    export holding nothing it did not write, and atomically."""
    config = load_recorded_config(paths)  # verified against meta.json before anything in it is used
    lora = config.model.lora.rank > 0
    if adapter and not lora:
        raise UsageError(f"run {paths.root.name} trained no adapters (model.lora.rank is 0)",
                         hint="export it without --adapter / --merge")
    roots = [*run_roots, paths.root.parent, Path(config.run.root)]
    target = check_target(Path(out), overwrite=overwrite, run_roots=roots)
    check_tokenizer_config(config.data.tokenizer)
    path = checkpoint_dir(paths, step)
    model = load_checkpoint_model(config, path)
    about = {"run": paths.root.name, "checkpoint": str(path.resolve()),
             "form": "adapter" if adapter else "merged" if lora else "model",
             "chat_model": objective_kind(config.objective.kind).capabilities.chat_model}  # generate's default
    if config.data.template_thinking is not None:  # recorded only where set: other markers stay as they were
        about["template_thinking"] = config.data.template_thinking  # generate and score render as the run did
    if adapter:
        if dtype is not None:  # the adapters only (an NF4 base does not convert)
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(dtype)
        trained = [p for p in model.parameters() if p.requires_grad]
        with staged_directory(target, need_bytes=sum(p.numel() * p.element_size() for p in trained),
                              about=about) as staging:
            save_peft_adapter(model, staging, base_model_name_or_path=peft_base_reference(paths, config))
            kill_point("weights")
            _write_tokenizer(config, paths, staging)
        return path
    if lora:
        model = merge_lora(model, inplace=True)
    state = model.state_dict()
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    with staged_directory(target, need_bytes=sum(v.numel() * v.element_size() for v in state.values()),
                          about=about) as staging:
        save_pretrained(model, staging, state_dict=state)
        kill_point("weights")
        _keep_source_architecture(paths, config, staging, state)
        _write_tokenizer(config, paths, staging)
        if callable(getattr(model, "prompt_media", None)):  # a vision-language model: how its images are cut
            write_processor_config(staging, processing_of(config.data.images))
        score = read_checkpoint_score(path)
        if score is not None:  # a reward model: a sequence classifier
            write_classifier(staging, score)
    return path


def peft_base_reference(paths: RunPaths, config: Config) -> str | None:
    """What adapter_config.json names as the base: the Hugging Face id where ``model.init_from`` is
    a hub cache snapshot (``.../models--ORG--NAME/snapshots/REV``), else its absolute path, resolved
    against the directory the run started in, so the adapter loads from any working directory."""
    source = config.model.init_from
    if source is None:
        return None
    candidates = [Path(source)] if Path(source).is_absolute() else [Path.cwd() / source]
    if not Path(source).is_absolute():
        recorded = _recorded_cwd(paths)
        candidates += [Path(recorded) / source] if recorded else []
    base = next((c for c in candidates if config_path(c).is_file()), candidates[0]).resolve()
    snapshot = base.parent
    if snapshot.name == "snapshots" and snapshot.parent.name.startswith("models--"):
        return snapshot.parent.name.removeprefix("models--").replace("--", "/", 1)
    return str(base)


def _recorded_cwd(paths: RunPaths) -> str | None:
    try:
        cwd = json.loads(paths.meta.read_text()).get("cwd")
    except (OSError, ValueError, AttributeError):
        return None
    return cwd if isinstance(cwd, str) else None


def check_tokenizer_config(spec: str) -> None:
    """A tokenizer directory's tokenizer_config.json must be a JSON object (the tokenizer, the chat
    template and the export read it): a DataError naming the file, not a traceback, if it is not."""
    directory = tokenizer_directory(spec)
    file = directory / "tokenizer_config.json" if directory is not None else None
    if file is None or not file.is_file():
        return
    read_tokenizer_config(file)


def _keep_source_architecture(paths: RunPaths, config: Config, out: Path, state: dict) -> None:
    source = _init_source(paths, config, "config.json")
    if source is None:
        return
    raw = json.loads(source.read_text())
    raw["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    if "dtype" in raw:  # transformers 5 writes and reads "dtype"; both name the weights' dtype
        raw["dtype"] = raw["torch_dtype"]
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
    """The tokenizer files, the chat template and generation_config.json.

    A chat-trained run (``objective.kind`` other than ``causal_lm``) stops at the end of the turn
    in ``transformers`` as Qwen's instruct checkpoints do: where the template's end-of-turn marker
    is one token (``<|im_end|>`` of the Qwen tokenizer) it becomes the tokenizer's ``eos_token``
    (the end-of-text token stays the pad token) and leads generation_config.json's
    ``eos_token_id`` list; a marker of several tokens (the byte tokenizer) is a ``stop_strings``
    entry, which ``generate`` applies when it is given the tokenizer (``tokenizer=``)."""
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
    generation = _read_generation_config(out)
    eos_ids = [tokenizer.eos_id]
    if objective_kind(config.objective.kind).capabilities.chat_model and template.end_of_turn:
        stop_ids, several = stop_tokens(tokenizer, template)
        if several is None:  # one token: the end of turn is the eos, as in Qwen's instruct checkpoints
            eos_ids = [*stop_ids[1:], tokenizer.eos_id]
            tokenizer_config.setdefault("pad_token", _token_text(tokenizer_config.get("eos_token")))
            tokenizer_config["eos_token"] = template.end_of_turn
        else:
            generation["stop_strings"] = [several]
    generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    generation.setdefault("pad_token_id", tokenizer.eos_id)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def _read_generation_config(out: Path) -> dict:
    """The generation_config.json copied from the tokenizer directory (kept: sampling defaults), or {}."""
    path = out / "generation_config.json"
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}  # a damaged copy is replaced by the one this export writes
    return raw if isinstance(raw, dict) else {}


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
