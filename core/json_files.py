"""Reading a JSON file that must hold one object (a config.json, a preprocessor_config.json, ...).

Each layer names the failure with its own error type (a model directory's file is a ConfigError,
a dataset's a DataError), so the type is the caller's; the message names the file either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.exceptions import LockstepError


def read_json_object(file: Path, error: type[LockstepError], *, hint: str | None = None) -> dict[str, Any]:
    """The object in ``file``; ``error`` naming the file where it cannot be read, is not JSON or holds
    something other than an object."""
    try:
        raw = json.loads(Path(file).read_text())
    except (OSError, ValueError) as exc:
        raise error(f"{file} is not readable JSON: {exc}", file=str(file), hint=hint) from None
    if not isinstance(raw, dict):
        raise error(f"{file} holds a {type(raw).__name__}, not a JSON object", file=str(file), hint=hint)
    return raw
