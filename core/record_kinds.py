"""The record kind names ``data.sources[i].record`` may take, registered from above.

Core knows no record kind: the data layer's rows (data/record_kinds.py) each hand their name
here when registered, and the config loader checks a source's ``record`` against them
(``check_record_kind``). Asked while none is registered, this runs the registration hook
(core/registration.py) first, which registers the built-in kinds.
"""

from __future__ import annotations

import difflib
from typing import NewType

from core.exceptions import ConfigError

RecordKindName = NewType("RecordKindName", str)
"""data.sources[i].record's type: the name of a registered record kind; the loader refuses any other
name and lists the registered ones (serialized and hashed as the string it is)."""

_NAMES: dict[str, str] = {}


def register_record_kind_name(name: str, summary: str) -> None:
    """Make ``name`` a valid data.sources[i].record value (``summary``: what its records hold)."""
    _NAMES[name] = summary


def unregister_record_kind_name(name: str) -> None:
    """Remove ``name`` (a test's own kind, after the test)."""
    _NAMES.pop(name, None)


def record_kind_names() -> dict[str, str]:
    """Every registered record kind name with its summary, in the order of registration."""
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
