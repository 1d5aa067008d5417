"""The ledger: one JSON line per optimizer step, the run's determinism record.

Two runs are bitwise-equal iff their ledgers are equal line for line. Fields (docs/contracts.md):
step, loss (exact float), grad_norm, lr, tokens, target_tokens, batch_hash,
data_state_hash, and at checkpoint steps and the last step param_hash; ``skipped`` marks a
step whose update was dropped for a non-finite loss.

Only rank 0 writes. A line is written (and, at checkpoint steps, fsynced) before the checkpoint of its step, so a
checkpoint never exists without its ledger line; on resume every line after the restored
step is dropped (the resumed run writes them again), after checking that the ledger is
whole: line ``n`` holds step ``n`` and every step up to the checkpoint's is there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.exceptions import CheckpointError
from training.checkpoint.manifest import fsync_dir

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


@dataclass(frozen=True)
class LedgerContents:
    """The complete lines of a ledger file, and an incomplete last line (a torn append)."""

    records: list[dict[str, Any]]
    torn: bytes
    """The bytes after the last newline; b"" when the file ends with a complete line."""

    @property
    def last_step(self) -> int:
        return self.records[-1]["step"] if self.records else 0


def read(path: Path) -> list[dict[str, Any]]:
    """All complete lines. Only a torn last line (no newline: the writer was killed
    mid-append) is ignored; a damaged complete line anywhere is a CheckpointError naming
    it, so no intact line after it is ever dropped (docs/checkpoints.md, ledger damage)."""
    return read_contents(path).records


def read_contents(path: Path) -> LedgerContents:
    """``read``, plus the torn last line's bytes."""
    if not path.is_file():
        return LedgerContents([], b"")
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
    return LedgerContents(records, lines[-1])


def check_sequence(records: list[dict[str, Any]], path: Path) -> None:
    """Line ``n`` must hold step ``n``: a run writes one line per step from step 1, and a
    resume drops only lines after its checkpoint. A missing (deleted) line, a repeated or
    out-of-order one is a CheckpointError naming the line and the steps around it."""
    for number, record in enumerate(records, start=1):
        if record["step"] != number:
            previous = f"line {number - 1} is step {records[number - 2]['step']}, " if number > 1 else ""
            raise CheckpointError(
                f"ledger line {number} is step {record['step']}, expected step {number} ({previous}"
                f"so {'a line is missing' if record['step'] > number else 'a step repeats'} before it)",
                file=str(path),
                line=number,
                hint="restore ledger.jsonl from a copy of the run dir; a gap in the determinism record is never filled",
            )


def check_covers(contents: LedgerContents, step: int, path: Path) -> None:
    """A restored checkpoint of ``step`` needs the ledger's lines of steps 1..step: the run
    wrote (and synced) each before its checkpoint, and they are never written again."""
    if contents.last_step >= step:
        return
    torn = f"; a torn last line follows ({contents.torn[:40]!r})" if contents.torn else ""
    raise CheckpointError(
        f"the ledger ends at step {contents.last_step} but the checkpoint restored is of step {step}: "
        f"the lines of steps {contents.last_step + 1}..{step} are lost{torn}",
        file=str(path),
        step=step,
        hint=f"restore ledger.jsonl from a copy, or roll back to a checkpoint at or before step {contents.last_step} "
        "(move the newer step_* directories out of checkpoints/ and write its name into checkpoints/LATEST)",
    )


def completed_checkpoint_step(records: list[dict[str, Any]]) -> int | None:
    """The newest step whose checkpoint the ledger proves was written, or None.

    ``param_hash`` marks checkpoint steps (and a session's last step). A save may still be
    in flight while later steps train (``checkpoint.async_save``), but the next checkpoint
    waits for it, and no line after that next checkpoint's is written before it has. So a
    line after the second of two such steps proves the first one's checkpoint complete."""
    marked = [r["step"] for r in records if "param_hash" in r]
    last = records[-1]["step"] if records else 0
    proven = [earlier for earlier, later in zip(marked, marked[1:]) if later < last]
    return proven[-1] if proven else None


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
        fsync_dir(self.path.parent)  # the rename itself survives a power loss
        self.last = kept[-1] if kept else None

    def append(self, record: dict[str, Any]) -> None:
        """Append one line. Lines of checkpoint steps and of the last step (the ones with a
        ``param_hash``) are fsynced, which makes every earlier line of the file durable too,
        before the step's checkpoint is written (docs/checkpoints.md, ledger durability).
        Other lines reach the page cache (they survive a killed process) without the 5 ms
        an fsync costs per step; the lines after the last checkpoint are written again by
        a resume in any case."""
        self.last = record
        if not self.writer:
            return
        with open(self.path, "a") as fh:
            fh.write(dumps(record) + "\n")
            fh.flush()
            if "param_hash" in record:
                os.fsync(fh.fileno())


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
