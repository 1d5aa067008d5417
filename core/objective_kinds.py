"""The objective kinds the config loader (core/config.py) reads configs with, registered from above.

Core knows no training method. Each objective kind declares its settings section, its checks and
its capabilities as an ``ObjectiveKind``; training/registry.py hands them to this registry before
any config is read (core/registration.py), and core.config builds the ``objective`` section from
them. A kind is asked what it can do (``ObjectiveCapabilities``), never compared by name. The model
families are rows of their own (core/model_families.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from core.exceptions import ConfigError
from core.registration import ensure_registered


@dataclass(frozen=True)
class ObjectiveCapabilities:
    """What the rest of the stack needs to know about a training method, declared by it
    instead of being inferred from its name. Defaults describe a method that claims nothing."""

    fused_head: bool = False
    """Its loss is next-token cross entropy over the output head, which the loop may fuse with the projection (parallel.float8_head)."""
    bounded_tokens: bool = False
    """A step looks up at most (rows per rank x data.seq_len) tokens per rank (parallel.ddp_embedding_grad=gathered)."""
    cuda_graph_safe: bool = True
    """Its forwards keep their shapes from step to step, so CUDA graphs suit them (parallel.compile_mode=reduce-overhead)."""
    chat_model: bool = False
    """The trained model is used through the chat template: export makes the end of turn a stop token, generate renders prompts with it."""
    resumes_stateless_checkpoints: bool = False
    """May resume a checkpoint that holds no objective state (written before objectives existed: pretraining)."""
    ledger_over_updates: bool = False
    """Several updates per batch (PPO's epochs x minibatches): its ledger fields are means over every update's metric sums, not the first update's."""


@dataclass(frozen=True)
class ObjectiveKind:
    """One ``objective.kind``: its settings, checks and capabilities, registered from above
    (training/registry.py) with ``register_objective``."""

    name: str
    """The objective.kind value, and the key of its settings section (objective.<name>)."""
    summary: str
    """What it trains, in a few words, for objective.kind's doc."""
    objective: str = ""
    """Its objective class by import path, ``module:Class`` (training.objectives.dpo:DPOObjective):
    what training.objectives builds for this kind. Core only carries it (it imports nothing above itself)."""
    capabilities: ObjectiveCapabilities = ObjectiveCapabilities()
    """What it declares about itself (ObjectiveCapabilities)."""
    settings: Optional[type] = None
    """A frozen dataclass with a docstring under each field: the objective.<name> section (None: no section)."""
    validate: Optional[Callable[[Any], None]] = None
    """Its checks of a loaded config (its section, and what it needs of data.*, train.*, ...); raises ConfigError."""
    resumable: tuple[str, ...] = ()
    """Keys of its section a resumed run may change (RESUMABLE_KEYS)."""
    hashed_only_when_set: tuple[str, ...] = ()
    """Keys of its section added after configs existed: left out of the hash while at their default (HASHED_ONLY_WHEN_SET)."""
    hash_default_section: bool = False
    """Hash its section even where it holds only defaults: the sections that were hashed before kinds were
    registered keep every config's hash. A kind registered later leaves it out then, so that registering it
    changes no other config's hash."""
    kind_hints: tuple[tuple[str, str], ...] = ()
    """(value, hint): objective.kind values that are not kinds but name something of this one (DPO's losses)."""
    record_fields: Optional[Callable[[Any], tuple[str, ...]]] = None
    """Given a loaded config, the optional record fields its data must carry beside the tokens (the reward
    model's per-pair ``margin``: data/preference.py); None: none."""


@dataclass
class _Registered:
    """What the layers above hand the loader: objective kinds in order."""

    kinds: dict[str, ObjectiveKind] = field(default_factory=dict)


_REGISTERED = _Registered()
ENTRY_POINT_HINT = "register one with core.objective_kinds.register_objective (training/registry.py does)"


def register_objective(kind: ObjectiveKind) -> None:
    """Add an objective kind to the schema. Registering the same kind again does nothing; another
    kind under a registered name is refused. The kind registered first is the default."""
    known = _REGISTERED.kinds.get(kind.name)
    if known is not None and known != kind:
        raise ConfigError(f"objective.kind {kind.name!r} is registered twice, by two different kinds",
                          key="objective.kind", hint="give the new objective a name of its own")
    if kind.settings is not None and not dataclasses.is_dataclass(kind.settings):
        raise ConfigError(f"objective.kind {kind.name!r}: its settings must be a dataclass, got {kind.settings!r}",
                          key=f"objective.{kind.name}")
    if known is None:
        _REGISTERED.kinds[kind.name] = kind


def replace_objective(kind: ObjectiveKind) -> None:
    """Build a registered kind with another row (a test's entry script: its own class for the kind),
    in the registered row's place in the order; ConfigError for a kind not registered."""
    if kind.name not in _REGISTERED.kinds:
        raise ConfigError(f"objective.kind {kind.name!r} is not registered, so it cannot be replaced",
                          key="objective.kind", hint="register it with register_objective")
    _REGISTERED.kinds[kind.name] = kind


def registered_names() -> frozenset[str]:
    """The names registered so far (none before an entry point registered them)."""
    return frozenset(_REGISTERED.kinds)


def unregister_objective(name: str) -> None:
    """Remove a registered kind (a test's own kind, once the test is done)."""
    _REGISTERED.kinds.pop(name, None)


def objective_kinds() -> tuple[ObjectiveKind, ...]:
    """The registered kinds, in the order of registration."""
    if not _REGISTERED.kinds:
        ensure_registered()
    if not _REGISTERED.kinds:
        raise ConfigError("no objective kinds are registered, so no config can be read", hint=ENTRY_POINT_HINT)
    return tuple(_REGISTERED.kinds.values())


def objective_kind(name: str) -> ObjectiveKind:
    """The registered kind ``name`` (a loaded config's objective.kind always is one)."""
    for kind in objective_kinds():
        if kind.name == name:
            return kind
    raise ConfigError(f"objective.kind {name!r} is not registered", key="objective.kind", hint=ENTRY_POINT_HINT)


def record_fields(config: Any) -> tuple[str, ...]:
    """What the configured objective reads of the data records beside the tokens (ObjectiveKind.record_fields):
    every pipeline of the run's data is built with it (training/builders.py, ``python -m data inspect``)."""
    kind = objective_kind(config.objective.kind)
    return tuple(kind.record_fields(config)) if kind.record_fields is not None else ()
