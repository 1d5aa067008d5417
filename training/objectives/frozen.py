"""Frozen models an objective needs besides the trained one: a reference or a teacher.

A frozen model is built once, in ``Objective.setup``, from a *source*:

- ``init``: the trained model's starting weights (``model.init_from``, else the seeded
  initialization of ``model.*``), rebuilt the same way the trained model was;
- a local Hugging Face directory (``config.json`` + safetensors);
- ``run:RUN_ID`` or ``run:RUN_ID@STEP`` (under ``run.root``), or ``run:RUN_DIR[@STEP]``: the model of
  a Lockstep checkpoint (the newest, or that step), verified against its manifest.

A source that names none of these (a ``run:`` naming no run included) is a ConfigError under its
config key; the memory estimate (training/memory_estimate.py) reads every frozen source's model
config before the run dir exists, so that error, and a model too large to fit, come first.

It is spread like the trained model: fully sharded under ``fsdp`` (no optimizer, no
gradients), a plain replica on the rank's device otherwise; with ``parallel.compile`` its
blocks are compiled as the trained model's are.

Its outputs are batch contents (a reference's log-probs, a reward model's scores), so they
must not depend on the number of GPUs. It computes one way under every strategy and world
size: fp32 parameters (FSDP gathers them as stored, with no mixed-precision cast) under the
autocast of ``parallel.precision``, which its ``context()`` enters. Under FSDP2's bf16 policy
a sharded model would compute with bf16 parameters and activations, while one GPU, where
nothing is sharded, computes with fp32 parameters under autocast: the same reference gave
other log-probs after a 2 -> 1 GPU resume (docs/performance.md, "GPU count"). The price under
FSDP is fp32 gathers, twice the bytes of bf16 ones, for the frozen forward only.

It is never saved: checkpoints record its identity, ``{"path": source, "sha256": <param_hash of its weights>}``, and a resume
refuses a frozen model whose identity differs (training/checkpoint/state.py ``check_frozen``).
"""

from __future__ import annotations

import dataclasses
import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch
from torch import nn

import models
from core import seeding
from core.config import Config
from core.distributed_context import DistributedContext
from core.exceptions import ConfigError, LockstepError, ResumeError
from distributed import param_hash, parallelize, unwrap
from distributed.compile import apply_compile
from distributed.model_structure import plan_of
from distributed.topology import build_mesh
from models.hf_config import model_config_from_hf
from models.lora import adapters_disabled

RUN_PREFIX = "run:"


@dataclass
class FrozenModel:
    role: str
    """What it is for: reference, teacher."""
    module: nn.Module
    identity: dict[str, str]
    """{"path": its source, "sha256": the hash of its weights}."""
    vocab_size: int
    collective: bool = False
    """Its forward is collective (sharded weights): every rank must run it when any rank does."""
    context: Callable[[], ContextManager] = field(default=contextlib.nullcontext)
    """Entered around each of its forwards: the precision's autocast (built models), the
    adapters switched off (``adapter_off``)."""


def build_frozen(config: Config, source: str, *, role: str, dist: DistributedContext, key: str) -> FrozenModel:
    """The frozen model ``source`` names (module docstring); ``key`` is the config key, for errors."""
    model_config = _model_config(config, source, key=key)
    model = source_model(config, source, key=key)
    for param in model.parameters():
        param.requires_grad_(False)
    model.eval()
    if config.parallel.strategy == "fsdp":
        topology = build_mesh(config.parallel, dist)
        frozen_parallel = dataclasses.replace(config.parallel, activation_checkpointing="none")
        model = parallelize(model, frozen_parallel, dist, topology, cast_parameters=False)
    else:
        model = model.to(dist.device)
        if config.parallel.compile:  # its forward costs the host as much as the policy's
            apply_compile(model)
    identity = {"path": source if source != "init" else f"init:{config.model.init_from or 'seed'}",
                "sha256": param_hash(model)}
    return FrozenModel(role=role, module=model, identity=identity, vocab_size=model_config.vocab_size,
                       collective=dist.is_distributed and config.parallel.strategy == "fsdp",
                       context=functools.partial(compute_autocast, config.parallel.precision, dist.device))


def compute_autocast(precision: str, device: torch.device) -> ContextManager:
    """The autocast a frozen model's forward runs under: off for fp32, else ``precision``'s dtype."""
    if precision == "fp32":
        return torch.autocast(device_type=device.type, enabled=False)
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def source_model(config: Config, source: str, *, key: str) -> nn.Module:
    """The plain model (host, fp32, trainable) a source names (module docstring): frozen models
    start from it, and so does PPO's critic trunk (training/objectives/critic.py)."""
    if source.startswith(RUN_PREFIX):
        from training.checkpoint.load import checkpoint_dir, load_checkpoint_model

        run, step = _run_source(config, source, key=key)
        path = checkpoint_dir(run.paths, step)
        model = load_checkpoint_model(run.config, path)
        check_finite_weights(model, source=source, path=path, key=key)
        return model
    # the same seeded initialization (or init_from weights) as the trained model's
    return models.build(_model_config(config, source, key=key),
                        generator=seeding.generator(config.train.seed, "model_init"))


def check_finite_weights(model: nn.Module, *, source: str, path: Path, key: str) -> None:
    """Refuse a checkpoint's model that holds NaN or Inf, as a Hugging Face directory's weights are
    refused when they load (models/hf_weights.py): a frozen model's or critic's NaN would only show
    as a non-finite loss, naming no file."""
    for name, param in model.named_parameters():
        if param.is_floating_point() and not bool(torch.isfinite(param).all()):
            bad = int((~torch.isfinite(param)).sum())
            raise ConfigError(f"{key}={source!r}: tensor {name!r} of the checkpoint's model holds {bad} non-finite "
                              "value(s) (NaN or Inf)", key=key, file=str(path), tensor=name,
                              hint="the weights are damaged or came from a diverged run; name another checkpoint (@STEP)")


def adapter_off_reference(model: nn.Module, config: Config, *, dist: DistributedContext,
                          base_identity: dict[str, str] | None, key: str) -> FrozenModel:
    """The trained LoRA model with its adapters off, as a frozen reference: no second copy.

    ``model`` is the trained model as the strategy wrapped it. DDP's wrapper is skipped (its
    forward prepares a gradient sync that a no_grad forward does not need); FSDP2 and tensor
    parallelism shard the model itself, so its forward stays collective there. Run it inside
    ``context()`` (under no_grad: activation checkpointing then recomputes nothing).
    ``modules_to_save`` would keep their trained weights, which core/config.py refuses.
    """
    if base_identity is None:
        raise ConfigError(f"{key}=adapter_off needs LoRA adapters (model.lora.rank > 0)", key=key,
                          hint="set model.lora.rank, or use reference: init")
    inner = unwrap(model)
    collective = dist.is_distributed and (config.parallel.strategy == "fsdp" or config.parallel.tp > 1)
    return FrozenModel(role="reference", module=inner, identity=dict(base_identity),
                       vocab_size=inner.config.vocab_size, collective=collective,
                       context=lambda: adapters_disabled(inner))


def _model_config(config: Config, source: str, *, key: str):
    if source == "init":
        return config.model
    if source.startswith(RUN_PREFIX):
        run, _ = _run_source(config, source, key=key)
        model = run.config.model
        if model.init_from is not None:
            model = model_config_from_hf(model.init_from, base=model)
        return dataclasses.replace(model, init_from=None)
    path = Path(source)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}={source!r} is neither 'init', 'run:RUN_ID[@STEP]' nor a Hugging Face directory",
                          key=key, file=str(path / "config.json"),
                          hint="point it at a directory with config.json and safetensors weights")
    return dataclasses.replace(model_config_from_hf(path, base=config.model), init_from=str(path))


@dataclass
class _Run:
    paths: object  # core.layout.RunPaths
    config: Config


def _run_source(config: Config, source: str, *, key: str) -> tuple[_Run, int | None]:
    from core.layout import RunPaths
    from core.run_context import load_recorded_config
    from training.checkpoint.resume import find_run

    spec = source[len(RUN_PREFIX):]
    name, _, step = spec.partition("@")
    if step and not step.isdigit():
        raise ConfigError(f"{key}={source!r}: the step after @ must be a number", key=key)
    path = Path(name)
    try:
        paths = RunPaths(path) if (path / "config.yaml").is_file() else find_run(config.run.root, name)
    except ResumeError as exc:  # no such run: this key is wrong, a config error before any run dir
        raise ConfigError(f"{key}={source!r}: {exc.message}", key=key,
                          hint=exc.hint or f"point {key} at an existing run (run:RUN_ID under run.root)") from exc
    try:
        # Verified like a resume's: an edited config.yaml would describe a model other than the weights.
        run_config = load_recorded_config(paths)
    except ResumeError:
        raise  # the run exists but its config.yaml was edited: exit 4 with the differing keys
    except LockstepError as exc:  # its config does not load: this key is wrong
        raise ConfigError(f"{key}={source!r}: {exc.message}", key=key, file=exc.context.get("file"),
                          hint=exc.hint or f"point {key} at an existing run (run:RUN_ID under run.root)") from exc
    return _Run(paths, run_config), (int(step) if step else None)


def run_checkpoint(config: Config, source: str, *, key: str) -> Path:
    """The checkpoint directory a ``run:RUN_ID[@STEP]`` source names (its newest, or that step),
    verified against its manifest."""
    from training.checkpoint.load import checkpoint_dir

    run, step = _run_source(config, source, key=key)
    return checkpoint_dir(run.paths, step)


def frozen_model_config(config: Config, source: str, *, key: str):
    """The model config a frozen ``source`` would be built with (no weights are read)."""
    return _model_config(config, source, key=key)


def frozen_tokenizer(config: Config, source: str, *, key: str) -> str | None:
    """The ``data.tokenizer`` a ``run:`` source was trained with (None for other sources)."""
    if not source.startswith(RUN_PREFIX):
        return None
    run, _ = _run_source(config, source, key=key)
    return run.config.data.tokenizer


def output_weight(module: nn.Module) -> torch.Tensor:
    """A frozen model's full output weight (V, d) (its plan's ``output``), gathered once where it is
    sharded (fsdp)."""
    weight = module.get_submodule(plan_of(module).output).weight.detach()
    full = getattr(weight, "full_tensor", None)
    return full() if full is not None else weight
