"""The config sections built from registrations: ``objective`` (one settings section per objective
kind, core/objective_kinds.py) and ``model.<arch>`` (one settings section per model family that has
settings, core/model_families.py).

core.config reads a config through these classes wherever its schema names a placeholder
(``ObjectiveConfig``, ``ModelConfig``): ``schema_of`` swaps in the class built from what is
registered. A class is built once per set of registrations, so configs read under the same ones
are of the same class (and compare equal); one pickles as its plain values and is rebuilt under
the receiving process's registrations.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal

from core.config_sections import ModelConfig
from core.model_families import ModelFamily, model_families
from core.objective_kinds import ObjectiveKind, objective_kinds


@dataclass(frozen=True)
class ObjectiveConfig:
    """The ``objective`` section. Its fields come from the registered objective kinds
    (core/objective_kinds.py): ``kind``, then one settings section per kind that has settings,
    in the order of registration. A config holds an ``objective_config_class()``, a subclass;
    it pickles as its plain values and is rebuilt under the receiving process's registrations."""

    def __reduce__(self):
        return _section_from_dict, ("objective", _plain(self))


def objective_config_class() -> type:
    """The ``objective`` section's dataclass: ``kind`` (a Literal of the registered names, the
    first one the default) and each kind's settings section, in the order of registration."""
    return _objective_schema(objective_kinds())


@functools.lru_cache(maxsize=None)
def _objective_schema(kinds: tuple[ObjectiveKind, ...]) -> type:
    names = tuple(k.name for k in kinds)
    fields: list[tuple[str, Any, Any]] = [("kind", Literal[names], field(default=names[0]))]
    docs = {"kind": _kind_doc(kinds)}
    for k in kinds:
        if k.settings is not None:
            fields.append((k.name, k.settings, field(default_factory=k.settings)))
            docs[k.name] = f"objective.kind={k.name}: its settings."
    schema = dataclasses.make_dataclass("ObjectiveConfig", fields, bases=(ObjectiveConfig,), frozen=True)
    schema.__module__, schema.__qualname__ = "core.config", "ObjectiveConfig"
    schema.field_docs = docs  # core.config's _field_docs reads these: the class has no source of its own
    return schema


def _kind_doc(kinds: tuple[ObjectiveKind, ...]) -> str:
    named = [f"{k.name} ({k.summary})" for k in kinds]
    listed = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " or " + named[-1]
    return f"Training objective: {listed}; docs/architecture.md."


def model_config_class() -> type:
    """The ``model`` section's dataclass: ModelConfig itself while no registered family has settings
    (the Qwen rows have none), else a subclass adding each such family's ``model.<name>`` section."""
    return _model_schema(tuple(f for f in model_families() if f.settings is not None))


@functools.lru_cache(maxsize=None)
def _model_schema(families: tuple[ModelFamily, ...]) -> type:
    if not families:
        return ModelConfig
    from core.config import _field_docs  # the base class's own field docs, read from its source

    fields = [(f.name, f.settings, field(default_factory=f.settings)) for f in families]
    schema = dataclasses.make_dataclass("ModelConfig", fields, bases=(ModelConfig,), frozen=True)
    schema.__module__, schema.__qualname__ = "core.config", "ModelConfig"
    schema.field_docs = {**_field_docs(ModelConfig), **{f.name: f"model.arch={f.name}: its settings." for f in families}}
    schema.__reduce__ = lambda self: (_section_from_dict, ("model", _plain(self)))
    return schema


def schema_of(tp: Any) -> Any:
    """The registered class behind a placeholder section type (ObjectiveConfig, ModelConfig), else ``tp``."""
    if tp is ObjectiveConfig:
        return objective_config_class()
    if tp is ModelConfig:
        return model_config_class()
    return tp


def registered_sections() -> list[str]:
    """Keys of the sections registered after configs existed, hashed only once a key of theirs is
    set: each later objective kind's section and its own such keys, each model family's section."""
    keys = []
    for kind in objective_kinds():
        if kind.settings is not None:
            keys += [f"objective.{kind.name}.{k}" for k in kind.hashed_only_when_set]
            if not kind.hash_default_section:
                keys.append(f"objective.{kind.name}")
    for family in model_families():
        if family.settings is not None:
            keys += [f"model.{family.name}.{k}" for k in family.hashed_only_when_set]
            keys.append(f"model.{family.name}")
    return keys


def _plain(section: Any) -> Any:
    from core.config import to_dict

    return to_dict(section)


def _section_from_dict(name: str, raw: dict[str, Any]) -> Any:
    from core.config import _build

    return _build(schema_of(ObjectiveConfig if name == "objective" else ModelConfig), raw, f"{name}.")
