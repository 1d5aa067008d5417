"""Stored reference log-probs of preference pairs, so the reference model runs once per pair.

An entry is a pair's summed completion log-probs under the reference, ``(chosen, rejected)``
as the fp32 values the online path computes, keyed by the pair's provenance
``source|shard|record``. The cache is a directory of append-only JSON-lines files, one per
writer (``entries-rank<R>-of<W>.jsonl``); the first line of each holds the *fingerprint* of
everything the values depend on: the reference weights' hash, the data sources, the
tokenizer, the chat template, ``data.seq_len``, the compute precision, the device type and
whether the reference is compiled (``parallel.compile``).
Opening a cache whose files carry another fingerprint is refused (``CheckpointError``, exit
4): the stored values would belong to another reference or other tokens.

Values are written as ``float.hex`` of fp32 numbers, so reading them back gives the very
bits the online path produced, and a run with ``cache_reference: true`` has the same ledger
as one without. A process killed mid-write leaves at most a torn last line, which is ignored
(that pair is computed again). Files of every writer are read at start-up, so a resume on
another world size, or a later run with the same fingerprint, finds what earlier ones stored.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from core.exceptions import CheckpointError

CACHE_VERSION = 1


def fingerprint(parts: dict) -> str:
    """sha256 of the canonical JSON of what the cached values depend on."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class ReferenceCache:
    """Pair key -> (chosen, rejected) reference log-probs (floats holding fp32 values)."""

    def __init__(self, directory: Path, fingerprint: str, *, rank: int, world_size: int) -> None:
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self._entries: dict[str, tuple[float, float]] = {}
        self._file = self.directory / f"entries-rank{rank}-of{world_size}.jsonl"
        self._load()
        self.hits = 0
        self.misses = 0

    def _load(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.directory.glob("entries-*.jsonl")):
            lines = path.read_text().split("\n")
            if not lines or not lines[0]:
                continue
            try:
                header = json.loads(lines[0])
            except ValueError:  # killed while writing the header: nothing stored yet
                path.unlink(missing_ok=True)
                continue
            if header.get("fingerprint") != self.fingerprint or header.get("version") != CACHE_VERSION:
                raise CheckpointError(
                    "the reference cache was computed for another reference, data, tokenizer, template, "
                    f"seq_len or precision (fingerprint {str(header.get('fingerprint'))[:16]}, "
                    f"now {self.fingerprint[:16]})",
                    path=str(path),
                    hint="point objective.dpo.cache_dir at another directory, or delete this one",
                )
            for line in lines[1:]:
                try:
                    key, chosen, rejected = json.loads(line)
                except (ValueError, TypeError):
                    continue  # a torn last line of a killed writer
                self._entries.setdefault(key, (float.fromhex(chosen), float.fromhex(rejected)))

    def get(self, key: str) -> tuple[float, float] | None:
        return self._entries.get(key)

    def lookup(self, keys: list[str]) -> list[tuple[float, float]] | None:
        """The entries of every key, or None when any is missing (counted)."""
        found = [self._entries.get(k) for k in keys]
        if any(v is None for v in found):
            self.misses += 1
            return None
        self.hits += 1
        return found  # type: ignore[return-value]

    def store(self, items: list[tuple[str, float, float]]) -> None:
        new = {}
        for key, chosen, rejected in items:  # a pair may occur twice in a batch: once is enough
            if key not in self._entries and key not in new:
                new[key] = (chosen, rejected)
        if not new:
            return
        fresh = not self._file.exists() or self._file.stat().st_size == 0
        with self._file.open("a") as out:
            if not fresh and not self._file.read_bytes().endswith(b"\n"):
                out.write("\n")  # end a torn line
            if fresh:
                out.write(json.dumps({"fingerprint": self.fingerprint, "version": CACHE_VERSION}) + "\n")
            for key, (chosen, rejected) in new.items():
                out.write(json.dumps([key, float(chosen).hex(), float(rejected).hex()]) + "\n")
                self._entries[key] = (chosen, rejected)
