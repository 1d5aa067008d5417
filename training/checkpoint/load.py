"""Finding a run and loading a model from its checkpoint: the run lookup by ID or directory
(``resolve_run``), a checkpoint verified against its manifest (``checkpoint_dir``), Lockstep's
model with a checkpoint's weights (``load_checkpoint_model``, LoRA runs rebuilt on their recorded
base), and the init_from files a run keeps (``record_init_source``). Used by frozen models
(``run:RUN_ID`` sources), train.py, ``python -m training generate`` and ``export``."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import models
from core import seeding
from core.config import Config
from core.exceptions import CheckpointError, UsageError
from core.layout import CHECKPOINTS_DIR, RunPaths, list_steps, step_dir_name
from distributed.safe_dcp import SafeFileSystemReader
from models.hf_config import model_config_from_hf
from models.lora import add_adapters
from training.checkpoint.manifest import DCP_DIR, state_file_name, verify_checkpoint
from training.checkpoint.state import check_frozen

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


def _shape_source(config: Config, checkpoint: Path) -> str:
    """Where a run that started ``model.init_from`` a directory reads its model's shape: the run's
    copy of that directory's config.json (``record_init_source``), so its checkpoints load from any
    working directory (a relative ``init_from`` such as ``exports/tiny`` names a directory under the
    run's own) and after the directory moved; else the directory itself."""
    copy = RunPaths(checkpoint.parent.parent).artifacts / INIT_SOURCE_DIR
    return str(copy) if (copy / "config.json").is_file() else config.model.init_from


def resolve_run(run: str, root: str) -> RunPaths:
    """A run directory given as a path, or a run ID under ``root`` (or a unique prefix of one, as
    ``--resume`` and ``runs show`` take: training/checkpoint/resume.py ``find_run``)."""
    from core.exceptions import ResumeError
    from training.checkpoint.resume import find_run

    path = Path(run)
    if (path / "config.yaml").is_file():
        return RunPaths(path)
    if "/" in run or path.exists():  # a path, not a run ID
        what = "does not exist" if not path.exists() else "is not a run directory (it has no config.yaml)"
        raise UsageError(f"{run} {what}", hint="pass a run ID under --root, a run directory, "
                         "or (generate --from) a Hugging Face directory with config.json")
    try:
        return find_run(root, run)
    except ResumeError as exc:  # no such run, or a prefix of several: a usage error of the tool
        raise UsageError(exc.message, hint=exc.hint) from None


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
            model_config = model_config_from_hf(_shape_source(config, path), base=model_config)
        # the run's own init: what a frozen part (a vision tower), which the checkpoint leaves out, still holds
        model = models.build(dataclasses.replace(model_config, init_from=None),
                             generator=seeding.generator(config.train.seed, "model_init"))
        if config.model.init_from is not None and not all(p.requires_grad for p in model.parameters()):
            model = models.build(model_config)  # the frozen part as the run read it
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
