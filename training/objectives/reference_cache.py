"""Stored reference log-probs of preference pairs, so the reference model runs once per pair.

An entry is a pair's summed completion log-probs under the reference, ``(chosen, rejected)``
as the fp32 values the online path computes, keyed by the pair's provenance
``source|shard|record``. The cache is a directory of append-only JSON-lines files, one per
writer (``entries-rank<R>-of<W>.jsonl``). The first line of each is its header:

- ``fingerprint``: the sha256 of everything the values depend on besides the data (``parts``:
  the reference weights' hash, the data sources, the tokenizer, the chat template,
  ``data.seq_len``, the compute precision, the device type and whether the reference is
  compiled); it names the default directory;
- ``parts`` themselves, so that a mismatch names what differs;
- ``data``: the sha256 of every shard of every source the pairs come from (which covers its
  records and their count).

Opening a cache whose header differs in any of these is refused (``CheckpointError``, exit 4,
naming the differing parts or shards): the stored values would belong to another reference
or other tokens.

Each entry also proves what it holds: ``[key, tokens, chosen, rejected, check]``, where
``tokens`` is the sha256 of the pair's two documents as the trainer saw them (input ids and
labels: the record and its tokenization) and ``check`` the sha256 of the entry's other fields.
A lookup whose pair has other tokens than the entry's, an entry whose ``check`` does not
match (an edited or damaged line) and a non-finite stored value are refused (exit 4, naming
the pair's record and the file's line).

Values are written as ``float.hex`` of fp32 numbers, so reading them back gives the very
bits the online path produced, and a run with ``cache_reference: true`` has the same ledger
as one without. A process killed mid-write leaves at most a torn last line, which is ignored
(that pair is computed again). Files of every writer are read at start-up, so a resume on
another world size, or a later run with the same fingerprint, finds what earlier ones stored.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from core.exceptions import CheckpointError

CACHE_VERSION = 2
HINT = "point objective.dpo.cache_dir at another directory, or delete this one"


def fingerprint(parts: dict) -> str:
    """sha256 of the canonical JSON of what the cached values depend on."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def pair_tokens(batch, row: int, positions: tuple[int, int]) -> str:
    """sha256 of a pair's two documents in ``row`` (those holding ``positions``): input ids and labels."""
    h = hashlib.sha256()
    for position in positions:
        span = next(s for s in batch.provenance[row] if s.start <= position < s.end)
        for tensor in (batch.input_ids, batch.labels):
            h.update(tensor[row, span.start:span.end].to(torch.int64).numpy().tobytes())
    return h.hexdigest()


def _check(key: str, tokens: str, chosen: str, rejected: str) -> str:
    return hashlib.sha256(json.dumps([key, tokens, chosen, rejected]).encode()).hexdigest()[:32]


class ReferenceCache:
    """Pair key -> (chosen, rejected) reference log-probs (floats holding fp32 values)."""

    def __init__(self, directory: Path, parts: dict, *, data: dict, rank: int, world_size: int) -> None:
        self.directory = Path(directory)
        self.header = {"version": CACHE_VERSION, "fingerprint": fingerprint(parts), "parts": parts, "data": data}
        self._entries: dict[str, tuple[str, float, float]] = {}  # key -> (tokens, chosen, rejected)
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
            self._check_header(header, path)
            for number, line in enumerate(lines[1:], start=2):
                try:
                    key, tokens, chosen, rejected, check = json.loads(line)
                    values = (float.fromhex(chosen), float.fromhex(rejected))
                except (ValueError, TypeError):
                    continue  # a torn last line of a killed writer
                where = dict(file=str(path), line=number, record=key)
                if not all(math.isfinite(v) for v in values):
                    raise CheckpointError(f"the cached reference log-probs of pair {key} are not finite "
                                          f"({chosen}, {rejected})", hint=HINT, **where)
                if check != _check(key, tokens, chosen, rejected):
                    raise CheckpointError(f"a reference cache entry does not match its checksum (edited or damaged): "
                                          f"pair {key}", hint=HINT, **where)
                self._entries.setdefault(key, (tokens, *values))

    def _check_header(self, header: dict, path: Path) -> None:
        if header.get("version") != CACHE_VERSION:
            raise CheckpointError(f"the reference cache has format version {header.get('version')}, "
                                  f"this code writes {CACHE_VERSION}", file=str(path), hint=HINT)
        theirs, ours = header.get("parts", {}), self.header["parts"]
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        if header.get("fingerprint") != self.header["fingerprint"] or differ:
            raise CheckpointError(
                f"the reference cache was computed for another {', '.join(differ) or 'configuration'} "
                f"(fingerprint {str(header.get('fingerprint'))[:16]}, now {self.header['fingerprint'][:16]})",
                file=str(path), hint=HINT)
        theirs, ours = header.get("data", {}), self.header["data"]
        for source in sorted(set(theirs) | set(ours)):
            was, now = theirs.get(source, {}), ours.get(source, {})
            changed = sorted(s for s in set(was) | set(now) if was.get(s) != now.get(s))
            if changed:
                shard = changed[0]
                raise CheckpointError(
                    f"the reference cache was computed from other data: shard {shard!r} of source {source!r} "
                    f"{'is new' if shard not in was else 'is gone' if shard not in now else 'changed'} "
                    f"({len(changed)} shard(s) differ)", file=str(path), hint=HINT)

    def get(self, key: str) -> tuple[float, float] | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[1:]

    def lookup(self, keys: list[str], tokens: list[str]) -> list[tuple[float, float]] | None:
        """The entries of every key, or None when any is missing (counted). An entry stored for
        other tokens than the pair's now is refused (CheckpointError naming the record)."""
        found = []
        for key, digest in zip(keys, tokens):
            entry = self._entries.get(key)
            if entry is not None and entry[0] != digest:
                raise CheckpointError(
                    f"the cached reference log-probs of pair {key} were computed from other tokens "
                    f"(the record or its tokenization changed since)", file=str(self.directory), record=key,
                    hint=HINT)
            found.append(None if entry is None else entry[1:])
        if any(v is None for v in found):
            self.misses += 1
            return None
        self.hits += 1
        return found  # type: ignore[return-value]

    def store(self, items: list[tuple[str, str, float, float]]) -> None:
        """Append ``(key, tokens, chosen, rejected)`` entries not stored yet."""
        new = {}
        for key, tokens, chosen, rejected in items:  # a pair may occur twice in a batch: once is enough
            if key not in self._entries and key not in new:
                new[key] = (tokens, chosen, rejected)
        if not new:
            return
        fresh = not self._file.exists() or self._file.stat().st_size == 0
        with self._file.open("a") as out:
            if not fresh and not self._file.read_bytes().endswith(b"\n"):
                out.write("\n")  # end a torn line
            if fresh:
                out.write(json.dumps(self.header, sort_keys=True) + "\n")
            for key, (tokens, chosen, rejected) in new.items():
                values = float(chosen).hex(), float(rejected).hex()
                out.write(json.dumps([key, tokens, *values, _check(key, tokens, *values)]) + "\n")
                self._entries[key] = (tokens, chosen, rejected)
