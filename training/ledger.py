"""The ledger: one JSON line per optimizer step, the run's determinism record.

Two runs are bitwise-equal iff their ledgers are equal line for line. Fields (design.md
section 4): step, loss (exact float), grad_norm, lr, tokens, target_tokens, batch_hash,
data_state_hash, and at checkpoint steps and the last step param_hash; ``skipped`` marks a
step whose update was dropped for a non-finite loss.

Only rank 0 writes. A line is written before the checkpoint of its step, so a checkpoint
never exists without its ledger line; on resume every line after the restored step is
dropped (the resumed run writes them again).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from core.exceptions import CheckpointError

# Fields compared by replay (param_hash only where the recorded line has it).
COMPARED_FIELDS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "target_tokens",
    "batch_hash",
    "data_state_hash",
    "param_hash",
    "skipped",
)


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def read(path: Path) -> list[dict[str, Any]]:
    """All complete lines. Only a torn last line (no newline: the writer was killed
    mid-append) is ignored; a damaged complete line anywhere is a CheckpointError naming
    it, so no intact line after it is ever dropped (docs/checkpoints.md, ledger damage)."""
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    complete = lines[:-1]  # the last piece is "" after a final newline, or a torn append
    records = []
    for number, raw in enumerate(complete, start=1):
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise CheckpointError(
                f"ledger line {number} is damaged ({raw[:60]!r}); refusing to drop it or the lines after it",
                file=str(path),
                line=number,
                hint="repair or delete that line by hand (the ledger is the run's determinism record), then resume",
            )
        records.append(record)
    return records


class Ledger:
    def __init__(self, path: Path | None, *, writer: bool) -> None:
        self.path = path
        self.writer = writer and path is not None
        self.last: dict[str, Any] | None = None

    def truncate_after(self, step: int) -> None:
        """Keep lines with step <= ``step`` (drops a torn line too); atomic replace."""
        if not self.writer:
            return
        kept = [r for r in read(self.path) if r["step"] <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as fh:
            fh.writelines(dumps(r) + "\n" for r in kept)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self.last = kept[-1] if kept else None

    def append(self, record: dict[str, Any]) -> None:
        self.last = record
        if not self.writer:
            return
        with open(self.path, "a") as fh:
            fh.write(dumps(record) + "\n")
            fh.flush()


def first_mismatch(expected: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """The first compared field whose value differs, or None. Fields an objective adds
    (``trained_tokens``, ...) are compared after the common ones, by name."""
    others = sorted((set(expected) | set(actual)) - set(COMPARED_FIELDS) - {"step"})
    for field in (*COMPARED_FIELDS, *others):
        if field not in expected and field not in actual:
            continue
        if field == "param_hash" and field not in expected:
            continue
        if not _same(expected.get(field), actual.get(field)):
            return field
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN recorded and NaN replayed
    return a == b
