"""The record kind names ``data.sources[i].record`` may take, registered from above.

Core knows no record kind: the data layer's rows (data/record_kinds.py) each hand their name
here when registered, with what core's own checks ask of it (``one_per_row``: the held-out
generation source of ``train.eval_generate`` must hold records one a row), and the config loader
checks a source's ``record`` against them (``check_record_kind``). Asked while none is registered,
this runs the registration hook (core/registration.py) first, which registers the built-in kinds.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import NewType

from core.exceptions import ConfigError

RecordKindName = NewType("RecordKindName", str)
"""data.sources[i].record's type: the name of a registered record kind; the loader refuses any other
name and lists the registered ones (serialized and hashed as the string it is)."""


@dataclass(frozen=True)
class RecordKindNameRow:
    """What core knows of a registered record kind: its summary and what core's checks ask of it."""

    summary: str
    """What its records hold, in a few words."""
    one_per_row: bool = False
    """Each record is a row of its own (a prompt with its answer), as its data-layer row declares."""


_NAMES: dict[str, RecordKindNameRow] = {}


def register_record_kind_name(name: str, summary: str, *, one_per_row: bool = False) -> None:
    """Make ``name`` a valid data.sources[i].record value (``summary``: what its records hold;
    ``one_per_row``: each record is a row of its own)."""
    _NAMES[name] = RecordKindNameRow(summary=summary, one_per_row=one_per_row)


def unregister_record_kind_name(name: str) -> None:
    """Remove ``name`` (a test's own kind, after the test)."""
    _NAMES.pop(name, None)


def record_kind_names() -> dict[str, str]:
    """Every registered record kind name with its summary, in the order of registration."""
    return {name: row.summary for name, row in _rows().items()}


def one_per_row(name: str, *, key: str) -> bool:
    """Whether the registered record kind ``name`` holds one record a row; a ConfigError naming
    ``key`` where no kind of that name is registered."""
    return _rows()[check_record_kind(name, key=key)].one_per_row


def _rows() -> dict[str, RecordKindNameRow]:
    if not _NAMES:
        from core.registration import ensure_registered

        ensure_registered()
    return dict(_NAMES)


def check_record_kind(value: str, *, key: str) -> str:
    """``value``, or a ConfigError naming ``key`` unless it is a registered record kind."""
    names = record_kind_names()
    if value not in names:
        near = difflib.get_close_matches(str(value), list(names), n=1, cutoff=0.5)
        raise ConfigError(f"{key} must be one of {' | '.join(map(repr, names))}, got {value!r}", key=key,
                          hint=f"did you mean {near[0]!r}?" if near else
                          "pick one of the listed values, or register a record kind (data/record_kinds.py)")
    return value
