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
``model.init_from`` base (docs/models.md, "LoRA and QLoRA"), named by absolute path.

A reward model's checkpoint (one with a ``score`` part) exports as a Hugging Face sequence
classifier (``Qwen2/Qwen3ForSequenceClassification``, training/objectives/reward_model_io.py).

The target is checked and written by training/export_target.py (never into a run directory,
through a link or over a directory a run uses; atomically). ``generation_config.json`` and the
tokenizer's eos end a chat-trained export's turns in ``transformers`` (``_write_tokenizer``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import models
from core.run_context import load_recorded_config
from core import seeding
from core.config import Config
from core.exceptions import CheckpointError, UsageError
from core.objective_kinds import objective_kind
from core.layout import CHECKPOINTS_DIR, RunPaths, list_steps, step_dir_name
from data.chat_template import ChatTemplate, read_tokenizer_config
from data.tokenizers import ByteTokenizer, build_tokenizer, tokenizer_directory
from models.hf_config import config_path, model_config_from_hf
from models.hf_weights import save_pretrained
from models.lora import add_adapters, merge_lora, save_peft_adapter
from training.checkpoint_manifest import DCP_DIR, state_file_name, verify_checkpoint
from training.export_target import check_target, kill_point, staged_directory
from training.objectives.base import check_frozen
from training.objectives.reward_model_io import read_checkpoint_score, write_classifier
from training.rollout.generator import stop_tokens
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


def resolve_run(run: str, root: str) -> RunPaths:
    """A run directory given as a path, or a run ID under ``root``."""
    from experiments.runs import recent_runs

    path = Path(run)
    if (path / "config.yaml").is_file():
        return RunPaths(path)
    if "/" in run or path.exists():  # a path, not a run ID
        what = "does not exist" if not path.exists() else "is not a run directory (it has no config.yaml)"
        raise UsageError(f"{run} {what}", hint="pass a run ID under --root, a run directory, "
                         "or (generate --from) a Hugging Face directory with config.json")
    paths = RunPaths(Path(root) / run)
    if not paths.config.is_file():
        recent = recent_runs(Path(root), 3)
        raise UsageError(f"no run {run!r} under {root}/",
                         hint=(f"recent runs, newest first: {', '.join(recent)}" if recent
                               else "pass --root DIR if the run lives elsewhere"))
    return paths


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
    reader = SafeFileSystemReader(str(path / DCP_DIR))
    reader.read_metadata()  # a refused file is reported as itself here; inside dcp.load it is only a string
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as exc:  # DCP's own types (one derives from BaseException)
        raise CheckpointError(f"cannot load the model from the checkpoint: {type(exc).__name__}: {exc}".split("\n")[0],
                              path=str(path), hint="the checkpoint does not hold this run's model (another "
                              "architecture or a damaged file); export an older step with --step") from None
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
           adapter: bool = False, overwrite: bool = False, run_roots: tuple[Path, ...] = ()) -> Path:
    """Write the Hugging Face directory ``out`` from a checkpoint of the run at ``paths``.

    A LoRA run exports its adapters merged into the base (a full model directory), or with
    ``adapter`` only its PEFT adapter directory (adapter_model.safetensors,
    adapter_config.json naming the base by absolute path) plus the tokenizer files. ``out`` is
    checked and written as training/export_target.py says: never into a run directory or
    through a link, never over a directory a run under ``run_roots``, the run's own parent or its
    ``run.root`` uses, over a non-empty one only with ``overwrite``, and atomically."""
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
    if adapter:
        if dtype is not None:  # the adapters only (an NF4 base does not convert)
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(dtype)
        trained = [p for p in model.parameters() if p.requires_grad]
        with staged_directory(target, need_bytes=sum(p.numel() * p.element_size() for p in trained)) as staging:
            save_peft_adapter(model, staging, base_model_name_or_path=peft_base_reference(paths, config))
            kill_point("weights")
            _write_tokenizer(config, paths, staging)
        return path
    if lora:
        model = merge_lora(model, inplace=True)
    state = model.state_dict()
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    with staged_directory(target, need_bytes=sum(v.numel() * v.element_size() for v in state.values())) as staging:
        save_pretrained(model, staging, state_dict=state)
        kill_point("weights")
        _keep_source_architecture(paths, config, staging, state)
        _write_tokenizer(config, paths, staging)
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
