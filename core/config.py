"""Typed, frozen, validated configuration.

A config is a tree of frozen dataclasses, one per section. It is loaded from YAML (a file
may ``extends:`` another, relative to itself), patched by dotted command-line overrides
with YAML-typed values (``train.lr=3e-4``), validated (unknown keys and wrong types name
the key path and the nearest valid key) and hashed over a canonical serialization, so the
same settings spelled differently hash the same.

Each field's one-line docstring is the string literal right below it; ``describe()``
collects them for the README's config reference and for error messages.

This module holds the loader and the run's own sections (run, train, checkpoint, runtime) and
re-exports the others (core/config_sections.py: model, LoRA, data, parallel, determinism,
metrics). The ``objective`` section, model.arch's names and the ``model.<arch>`` sections are
registered from above (core/objective_kinds.py, core/model_families.py, built into classes by
core/config_schema.py), and so are the checks of the layers that read the sections
(core/config_checks.py); the loader calls the registering functions first (core/registration.py).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import inspect
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from core import config_checks
from core.config_errors import check_each
from core.config_schema import ObjectiveConfig, model_config_class, objective_config_class, registered_sections, schema_of
from core.config_sections import (AugmentConfig, DataConfig, DeterminismConfig, LoRAConfig, MetricsConfig,  # noqa: F401
                                  ModelArch, ModelConfig, ParallelConfig, SourceConfig)
from core.exceptions import ConfigError
from core.model_families import model_families, model_family
from core.objective_kinds import objective_kind, objective_kinds
from core.record_kinds import RecordKindName, check_record_kind, record_kind_names
from core.registration import ensure_registered



# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    """Semantic part of the run ID: <name>-<YYYYMMDD-HHMMSS>-<hash8>; 1-64 of [A-Za-z0-9._-], starting with a letter or digit."""
    root: str = "runs"
    """Directory that holds run directories (relative to the working directory)."""


@dataclass(frozen=True)
class EvalGenerateConfig:
    source: Optional[SourceConfig] = None
    """Held-out prompt records ({"prompt", "answer"}, record: prompt) decoded and scored at every evaluation; None: off."""
    prompts: int = 128
    """How many of the source's prompts each evaluation decodes (the first ones in the pipeline's order)."""
    max_new_tokens: int = 32
    """Generated tokens per completion at most (fewer where data.seq_len ends first)."""
    samples: int = 0
    """Completions sampled per prompt for sampled pass@1 (metrics generate/sampled_accuracy); 0: greedy only."""
    temperature: float = 1.0
    """Temperature of the sampled completions (> 0; read only when samples > 0)."""


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    """Root seed; every random stream derives from (seed, purpose, step, rank)."""
    max_steps: int = 100
    """Number of optimizer steps."""
    global_batch_size: int = 16
    """Sequences per optimizer step across all ranks."""
    micro_batch_size: int = 4
    """Sequences per forward pass per rank; accumulation steps are derived."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """LR schedule after warmup: cosine, linear, warmup-stable-decay or constant."""
    schedule_steps: Optional[int] = None
    """Length of the LR schedule; None means max_steps."""
    decay_fraction: float = 0.2
    """wsd: fraction of the schedule spent in the final decay."""
    optimizer: Literal["adamw", "muon", "lion", "schedule_free_adamw"] = "adamw"
    """adamw; muon (Muon on hidden matrices, AdamW on the rest); lion; schedule_free_adamw (needs schedule=constant). See docs/optimizers.md."""
    weight_decay: float = 0.1
    """Decoupled weight decay of every optimizer (not applied to norms, biases and embeddings)."""
    beta1: float = 0.9
    """AdamW beta1 (also the AdamW groups of muon, and schedule_free_adamw's interpolation beta)."""
    beta2: float = 0.95
    """AdamW beta2 (also muon's AdamW groups and schedule_free_adamw)."""
    eps: float = 1e-8
    """AdamW epsilon (also muon's AdamW groups and schedule_free_adamw)."""
    muon_momentum: float = 0.95
    """muon: momentum of the hidden matrices' updates."""
    muon_nesterov: bool = True
    """muon: Nesterov momentum."""
    muon_ns_steps: int = 5
    """muon: Newton-Schulz iterations that orthogonalize each update."""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """muon: LR scale per matrix: match_rms_adamw (0.2*sqrt(max dim); shares AdamW's lr) or original (sqrt(max(1, rows/cols)))."""
    lion_beta1: float = 0.9
    """lion: interpolation beta of the sign update."""
    lion_beta2: float = 0.99
    """lion: momentum beta."""
    sf_weight_lr_power: float = 2.0
    """schedule_free_adamw: the average weights step t by lr_t**power."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    loss_chunk_tokens: int = 8192
    """Tokens per chunk of the fused output projection + loss (no full logits); 0: full logits. Not under TP or xla_spmd."""
    eval_interval: int = 0
    """Evaluate on data.eval_source every N steps; 0 disables."""
    eval_batches: int = 4
    """Global batches per evaluation."""
    eval_generate: EvalGenerateConfig = field(default_factory=EvalGenerateConfig)
    """Held-out generation evaluation at every evaluation step: greedy (and sampled) exact-answer accuracy on prompt records (docs/post_training.md)."""


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 50
    """Optimizer steps between checkpoints; 0 disables periodic checkpoints."""
    keep: int = 3
    """Checkpoints retained (oldest deleted first); 0 keeps all."""
    async_save: bool = False
    """Write checkpoints in a background thread; the loop waits only for the staging copy."""
    staging: Literal["auto", "device", "host"] = "auto"
    """Async save copy: device (GPU snapshot, to host off the loop), host (on the loop), auto (device if it fits)."""
    at_end: bool = True
    """Write a checkpoint after the last step."""


@dataclass(frozen=True)
class RuntimeConfig:
    watchdog_timeout_s: float = 300.0
    """Seconds without progress before a rank dumps diagnostics and aborts; 0 disables."""
    watchdog_pause_limit_s: float = 3600.0
    """Longest a paused watchdog (checkpoint writes, compilation) waits before aborting; 0 means no limit."""
    watchdog_exit_grace_s: float = 10.0
    """Seconds a timed-out rank waits after its dump before exiting, so ranks blocked on it can dump too."""
    on_nonfinite: Literal["abort", "skip"] = "abort"
    """Non-finite loss or gradient: abort (exit 7) or skip the update and count it."""
    faults: tuple[str, ...] = ()
    """Injected faults for tests and chaos runs, e.g. 'hang@5:1', 'nan@3', 'sigterm@6'."""
    fault_slow_data_s: float = 2.0
    """Seconds a slow_data fault delays the batch of its step."""
    profile_start_step: int = 0
    """First step of the torch.profiler window; 0 disables profiling."""
    profile_steps: int = 3
    """Steps recorded in the profiler window."""
    strict_env: bool = False
    """Refuse (instead of warn) a resume or replay whose software/hardware environment differs."""
    record_memory_history: bool = False
    """Record CUDA allocation history with stacks, saved in the memory snapshot on out-of-memory."""
    gc_interval: int = 50
    """Python garbage collection at the same steps on every rank, automatic collection off: the youngest generation after every step, the young ones every gc_interval steps, all every 10th time; 0 leaves Python's automatic collection on. See runtime/collection.py."""
    sync_step_end: bool = False
    """Wait for the GPU at every step end, so each step's time holds its own device work (debugging); off, the host prepares the next step while the update runs."""
    deferred_settle: bool = True
    """Read each step's loss, gradient norm and non-finite flags, and write its ledger line and metrics, during the next step, after that step's backward is issued, so the host never waits for the GPU between steps; checkpoint, parameter-hash, evaluation and last steps settle at once. false: every step settles before the next begins. The ledger is the same either way."""


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    """Run identity."""
    model: ModelConfig = field(default_factory=lambda: model_config_class()())
    """Model architecture."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data pipeline."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimization."""
    objective: ObjectiveConfig = field(default_factory=lambda: objective_config_class()())
    """What the loop optimizes: pretraining or a post-training method."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallelism and precision."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence and retention."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Watchdog, failure policy, faults, profiling."""
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)
    """Determinism mode."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric logging."""

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @property
    def hash(self) -> str:
        return config_hash(self)


# Keys a resumed run may change. A prefix ending in "." admits every key below it.
RESUMABLE_KEYS = (
    "run.root",  # where the run dir lives now (a run moved to another root resumes from there)
    "train.max_steps", "train.schedule_steps", "train.eval_interval", "train.eval_batches",
    "train.eval_generate.",  # an evaluation only: the ledger does not depend on it
    "checkpoint.", "runtime.", "metrics.", "data.workers", "data.prefetch_batches", "data.max_in_flight", "data.process_pool",
    "parallel.strategy", "parallel.ddp_embedding_grad", "parallel.compile", "parallel.compile_mode",
    "parallel.activation_checkpointing", "parallel.reshard_after_forward", "parallel.fsdp_unit_blocks",
    "parallel.cpu_offload", "parallel.fsdp_cast_parameters", "parallel.backend", "parallel.timeout_s", "parallel.dp_replicate", "parallel.tp", "parallel.ep",
)


def is_resumable(key: str) -> bool:
    """A key of RESUMABLE_KEYS, or one a registered objective kind lists (ObjectiveKind.resumable)."""
    registered = tuple(f"objective.{kind.name}.{k}" for kind in objective_kinds() for k in kind.resumable)
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_KEYS + registered)


# --------------------------------------------------------------------------- loading


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *, world_size: int | None = None) -> Config:
    """Load, override, validate and freeze a config. Raises ConfigError (exit 2). ``world_size``
    adds the constraints between the batch, the streams and that many ranks (core/batch_shape.py).
    The registering functions run first (core/registration.py)."""
    ensure_registered()
    raw: dict[str, Any] = _read_yaml_tree(Path(path), seen=()) if path is not None else {}
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    _tokenizer_from_init(raw)
    config = from_dict(raw)
    validate(config, world_size)
    return config


def _tokenizer_from_init(raw: dict[str, Any]) -> None:
    """A model fine-tuned ``model.init_from`` a Hugging Face directory uses that directory's
    tokenizer (and so its chat template) unless ``data.tokenizer`` is set: the resolved config
    then names the directory, so the run records what it used."""
    model, data = raw.get("model"), raw.get("data")
    init_from = model.get("init_from") if isinstance(model, dict) else None
    if not isinstance(init_from, str) or (isinstance(data, dict) and "tokenizer" in data):
        return
    if (Path(init_from) / "tokenizer.json").is_file():
        raw.setdefault("data", {})["tokenizer"] = init_from


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from a plain nested dict (e.g. a run dir's config.yaml)."""
    ensure_registered()
    return _build(Config, raw, "")


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b=value`` -> ("a.b", YAML-typed value)."""
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} is not of the form key.path=value",
            hint="write overrides like train.lr=3e-4",
        )
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key", hint="write key.path=value")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override value for {key} is not valid YAML: {exc}", key=key) from exc
    return key, value


def _read_yaml_tree(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            f"config file {str(path)!r} does not exist",
            file=str(path),
            hint="pass an existing YAML file to --config, e.g. configs/tiny.yaml",
        )
    resolved = path.resolve()
    if resolved in seen:
        chain = " -> ".join(str(p) for p in (*seen, resolved))
        raise ConfigError(f"extends: cycle {chain}", file=str(path), hint="remove the cycle")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}", file=str(path)) from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping at top level", file=str(path))
    parent_name = raw.pop("extends", None)
    if parent_name is None:
        return raw
    parent = _read_yaml_tree((path.parent / str(parent_name)), seen=(*seen, resolved))
    return _deep_merge(parent, raw)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                f"cannot set {key}: {'.'.join(parts[: i + 1])} is not a section", key=key
            )
        node = child
    node[parts[-1]] = value


# --------------------------------------------------------------------------- typed build


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _nearest(name: str, options: list[str]) -> str | None:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return match[0] if match else None


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(raw).__name__}",
            key=prefix.rstrip(".") or None,
            hint=f"expected the keys {', '.join(_field_names(cls))}",
        )
    hints = typing.get_type_hints(cls)
    names = _field_names(cls)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in names:
            near = _nearest(str(key), names)
            raise ConfigError(
                f"unknown key {path!r}",
                key=path,
                hint=(f"did you mean {prefix}{near!s}?" if near else f"valid keys: {', '.join(names)}"),
            )
        kwargs[key] = _coerce(hints[key], value, path)
    return cls(**kwargs)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if tp is ModelArch:
        return " | ".join(repr(f.name) for f in model_families())
    if tp is RecordKindName:
        return " | ".join(map(repr, record_kind_names()))
    return getattr(tp, "__name__", str(tp))


def _value_hint(path: str, value: Any) -> str | None:
    """The hint for a value users put under the wrong key: an objective.kind value that a registered
    kind names as something of its own (ObjectiveKind.kind_hints)."""
    if path != "objective.kind":
        return None
    hints = {wrong: hint for kind in objective_kinds() for wrong, hint in kind.kind_hints}
    return hints.get(str(value).lower())


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if origin is Literal:
        options = typing.get_args(tp)
        if value not in options:
            near = _nearest(str(value), [str(o) for o in options])
            raise ConfigError(
                f"{path} must be one of {_type_name(tp)}, got {value!r}",
                key=path,
                hint=_value_hint(path, value)
                or (f"did you mean {near!r}?" if near else "pick one of the listed values"),
            )
        return value
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
            value = [value]
        return tuple(_coerce(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is ModelArch:
        return model_family(value).name  # any other value: ConfigError listing the registered names
    if tp is RecordKindName:
        return check_record_kind(value, key=path)  # any other value: ConfigError listing the registered names
    if dataclasses.is_dataclass(tp):
        return _build(schema_of(tp), value, f"{path}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads "3e-4" as a string; accept it as the float it spells
                parsed = float(value)
            except ValueError:
                parsed = None
            if parsed is not None and math.isfinite(parsed):
                return parsed
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(
        f"{path} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})",
        key=path,
        hint=f"set {path} to a value of type {_type_name(tp)}",
    )


# --------------------------------------------------------------------------- validation


def validate(config: Config, world_size: int | None = None) -> None:
    """Core's checks of the run's own sections, then those the layers above registered for theirs
    (core/config_checks.py: parallelism, the optimizer, the model and LoRA), then the model family's
    and the objective kind's own (``ModelFamily.validate``, ``ObjectiveKind.validate``), then
    held-out generation's, then the model's shape as its family resolves it (``models.qwen.dims``):
    every violated constraint in one error, a check that reads a section found wrong left out
    (core/config_errors.py). ``world_size`` adds the batch-divisibility checks (core/batch_shape.py)."""
    check_each(config, (lambda view: config_checks.check_run_sections(view, world_size),
                        *config_checks.registered_checks(), model_family(config.model.arch).validate,
                        objective_kind(config.objective.kind).validate, config_checks.check_eval_generate,
                        config_checks.check_model_shape))


def validate_world(config: Config, world_size: int) -> None:
    """Checks that need the world size (run before any process group is created): every
    violated constraint between the batch, the streams and the ranks in one ConfigError."""
    config_checks.check_batch_shape(config, world_size)


# --------------------------------------------------------------------------- serialization


def to_dict(config: Any) -> Any:
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    return config


def canonical_json(config: Config) -> str:
    """Sorted keys, no whitespace, floats in repr form: equal settings give equal text."""
    return json.dumps(to_dict(config), sort_keys=True, separators=(",", ":"))


# Keys added after runs and configs existed: while one holds its default it is left out of the
# hashed text, so every earlier config keeps its hash (and its runs their IDs); set, it is hashed.
# ``section.list[].key`` names a key of every entry of a list (compared with the default entry's).
# An objective kind lists its own such keys (ObjectiveKind.hashed_only_when_set), and a kind
# registered after the registry existed has its whole section treated so (hash_default_section),
# as has every model family's section (core/config_schema.py, registered_sections).
HASHED_ONLY_WHEN_SET = ("train.eval_generate", "data.template_clock", "data.template_thinking", "data.images",
                        "parallel.ep", "determinism.batch_invariant", "parallel.fsdp_cast_parameters")


def _hashed_only_when_set() -> list[str]:
    """Core's keys and the registered sections', deepest first: a key inside a section is compared
    (and dropped) before the section is."""
    return sorted([*HASHED_ONLY_WHEN_SET, *registered_sections()], key=lambda k: -k.count("."))


def config_hash(config: Config) -> str:
    tree, defaults = to_dict(config), to_dict(Config())
    for key in _hashed_only_when_set():
        *parents, leaf = key.split(".")
        nodes, default = [tree], defaults
        for part in parents:
            if part.endswith("[]"):  # every entry of a list, against the default list's first entry
                nodes, default = [entry for node in nodes for entry in node[part[:-2]]], default[part[:-2]][0]
            else:
                nodes, default = [node[part] for node in nodes], default[part]
        for node in nodes:
            if leaf in node and node[leaf] == default[leaf]:
                del node[leaf]
        # The default drops it too: a section compared later (a kind's, hashed only when set)
        # still equals its default when this key was the only one at its default.
        default.pop(leaf, None)
    return hashlib.sha256(json.dumps(tree, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=True)


def save(config: Config, path: str | Path) -> None:
    Path(path).write_text(to_yaml(config))


def diff(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    """Every leaf key whose value differs: (dotted key, a's value, b's value)."""
    out: list[tuple[str, Any, Any]] = []
    _diff(to_dict(a), to_dict(b), "", out)
    return out


def diff_resolved(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``diff`` of two resolved configs as plain nested dicts (a config.yaml, meta.json's record)."""
    out: list[tuple[str, Any, Any]] = []
    _diff(a, b, "", out)
    return out


def _diff(a: Any, b: Any, prefix: str, out: list) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            _diff(a.get(key), b.get(key), f"{prefix}{key}.", out)
    elif a != b:
        out.append((prefix.rstrip("."), a, b))


# --------------------------------------------------------------------------- docs


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every leaf field, from the field docstrings. A list of
    sections (``data.sources``) and an optional section (``data.eval_source``) get a row of
    their own and then one per field of an item: ``data.sources[i].path``, ``data.eval_source.path``."""
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        tp = schema_of(hints[f.name])
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((f"{prefix}{f.name}", _type_name(tp), repr(to_dict(default)), docs.get(f.name, "")))
        item = _section_inside(tp)
        if item is not None:
            index = "[i]" if typing.get_origin(tp) is tuple else ""
            rows.extend(describe(item, f"{prefix}{f.name}{index}."))
    return rows


def _section_inside(tp: Any) -> type | None:
    """The dataclass of a ``tuple[Section, ...]`` or ``Optional[Section]`` field, else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
    if typing.get_origin(tp) in (tuple, Union) and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _field_docs(cls: type) -> dict[str, str]:
    if "field_docs" in vars(cls):  # a section built from registrations (objective_config_class)
        return dict(cls.field_docs)
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = nxt.value.value
    return docs
