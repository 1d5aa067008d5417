"""Record kinds: what a source's records are (``data.sources[i].record``), one registered row each.

A row declares everything the pipeline needs to know about its records, so no stage asks a
kind by name (tests/data/test_record_kind_names.py):

- its Parquet columns (a row of them becomes one dict), or none: the text of ``text_column``;
- its encoder: a picklable object turning one record into an ``Encoded`` document (token ids,
  its named fields, the pieces it is laid out as), raising ``RecordError`` for a bad record.
  A kind without one (``text``) is decoded to text and tokenized;
- whether it is rendered with the chat template (checked once, its fingerprint in the data
  state), whether each record is a row of its own (prompts), the document fields it declares
  (data/fields.py) and the record fields it reads only when an objective asks (``margin``).

The built-in kinds are rows in their own modules (``BUILT_IN``), imported on first use; a
test or a user's package registers more with ``register_record_kind``. Each name is also
handed to core (core/record_kinds.py), which checks ``data.sources[i].record`` against them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np

from core.exceptions import ConfigError
from core.record_kinds import register_record_kind_name, unregister_record_kind_name
from data.fields import DocField

BUILT_IN = ("data.kinds.text:KIND", "data.kinds.chat:KIND", "data.kinds.prompt_completion:KIND",
            "data.kinds.prompt:KIND", "data.preference:KIND", "data.kinds.image_chat:KIND",
            "data.kinds.image_prompt:KIND")
"""The built-in rows, by import path, in the order of ``data.sources[i].record``'s doc."""


@dataclass
class Encoded:
    """One record encoded into a pipeline document."""

    ids: np.ndarray
    """(N,) int32 token ids (of every piece, in order)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Its document fields by name (data/fields.py): (N,) arrays, scalars, or lists of arrays (ragged)."""
    pieces: tuple[int, ...] = ()
    """Where each piece after the first starts in ``ids``: a document of several pieces (a preference
    pair) is laid out as adjacent documents of one row, each with its separator, never cut or truncated."""


class RecordEncoder(Protocol):
    """Turns one record (a JSON object, or a dict of a Parquet row's columns) into a document.

    An encoder whose records name files relative to their shard (images) sets
    ``reads_files = True`` and is called as ``document(record, shard=<the shard's path>)``."""

    def document(self, record: Any) -> Encoded: ...


@dataclass(frozen=True)
class EncoderSetup:
    """What a kind's encoder is built from, once per source."""

    template: Any
    """The chat template (data/chat_template.py ``ChatTemplate``), where a source's kind uses it; else None."""
    tokenizer: Any
    """The run's tokenizer (data/tokenizers.py)."""
    loss_on: str
    """data.loss_on: which tokens of a conversation carry loss."""
    record_fields: frozenset[str] = frozenset()
    """Optional record fields the objective reads (core.objective_kinds.record_fields)."""
    images: Any = None
    """data.images (core ImagesConfig): how a kind's images become patches (data/vision); None: the defaults."""


@dataclass(frozen=True)
class RecordKind:
    """One ``data.sources[i].record`` value: its records, their encoding and their fields."""

    name: str
    """The data.sources[i].record value."""
    summary: str
    """What its records hold, in a few words, for the docs and errors."""
    columns: Optional[tuple[str, ...]] = None
    """The Parquet columns a record is read from (one dict per row); None: the text of text_column."""
    encoder: Optional[Callable[[EncoderSetup], RecordEncoder]] = None
    """Builds the source's encoder; None: the record is text, decoded and tokenized (data.packing may split it)."""
    uses_template: bool = False
    """Its records are rendered with the chat template (data.chat_template; its fingerprint joins the data state)."""
    one_per_row: bool = False
    """Each record is a row of its own (a prompt with its answer): never packed with others, never cut."""
    fields: tuple[DocField, ...] = ()
    """The document fields its encoder fills (data/fields.py; rows of whole documents carry the target mask anyway)."""
    record_fields: tuple[str, ...] = ()
    """Record fields it reads only when the objective asks (core.objective_kinds.record_fields)."""

    def declares(self, field_name: str) -> bool:
        """Its documents carry the field ``field_name`` (what an objective asks of its data, never the kind's name)."""
        return any(f.name == field_name for f in self.fields)

    @property
    def whole_documents(self) -> bool:
        """Its documents need rows of whole documents (data.packing=whole): every structured kind does."""
        return self.encoder is not None


_KINDS: dict[str, RecordKind] = {}


def register_record_kind(kind: RecordKind) -> None:
    """Register a row (again under the same name: replaced); its name becomes a valid data.sources[i].record."""
    _KINDS[kind.name] = kind
    register_record_kind_name(kind.name, kind.summary, one_per_row=kind.one_per_row)


def unregister_record_kind(name: str) -> None:
    """Remove a registered row (a test's own kind, after the test)."""
    _KINDS.pop(name, None)
    unregister_record_kind_name(name)


def register_built_in_kinds() -> None:
    """Register the built-in rows, each unless a row of its name is registered (idempotent): what
    training/registry.py calls before a config is read, and every lookup here first."""
    for path in BUILT_IN:
        module, attr = path.split(":")
        kind = getattr(importlib.import_module(module), attr)
        if kind.name not in _KINDS:
            register_record_kind(kind)


def record_kinds() -> dict[str, RecordKind]:
    """Every registered row by name, in the order of registration."""
    register_built_in_kinds()
    return dict(_KINDS)


def record_kind(name: str, *, key: str = "data.sources[i].record") -> RecordKind:
    """The row named ``name``; a ConfigError listing the registered names if there is none."""
    kinds = record_kinds()
    if name not in kinds:
        raise ConfigError(f"unknown record kind {name!r} (registered: {', '.join(kinds)})", key=key,
                          hint="use one of the registered kinds, or register the kind (data.record_kinds)")
    return kinds[name]


def declared_fields(kinds: list[RecordKind]) -> dict[str, DocField]:
    """The document fields the kinds declare, by name; two kinds declaring one name differently: a bug."""
    out: dict[str, DocField] = {}
    for kind in kinds:
        for f in kind.fields:
            if out.setdefault(f.name, f) != f:
                raise ConfigError(f"record kinds declare the document field {f.name!r} differently "
                                  f"({kind.name!r} and another)", key="data.sources",
                                  hint="give the fields distinct names in their record kinds")
    return out
