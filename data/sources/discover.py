"""Expand a source path (file, directory or glob) into sorted shard files with formats."""

from __future__ import annotations

import glob
from pathlib import Path

from core.exceptions import DataError

_SUFFIX_FORMATS = (
    (".jsonl.zst", "jsonl.zst"), (".ndjson.zst", "jsonl.zst"), (".json.zst", "jsonl.zst"),
    (".zst", "jsonl.zst"), (".parquet", "parquet"), (".jsonl", "jsonl"), (".ndjson", "jsonl"),
    (".json", "jsonl"), (".txt", "text"), (".text", "text"), (".md", "text"),
)
_GLOB_CHARS = "*?["


def format_of(path: str) -> str | None:
    """The format implied by a file's suffix, or None."""
    lower = path.lower()
    for suffix, fmt in _SUFFIX_FORMATS:
        if lower.endswith(suffix):
            return fmt
    return None


def expand(pattern: str) -> tuple[Path, list[Path]]:
    """(root, files): the files a path names, sorted, and the directory their IDs are relative to."""
    if any(ch in pattern for ch in _GLOB_CHARS):
        parts = Path(pattern).parts
        fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if any(c in p for c in _GLOB_CHARS))]]
        root = Path(*fixed) if fixed else Path(".")
        files = [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
    else:
        path = Path(pattern)
        if path.is_file():
            return path.parent, [path]
        if not path.is_dir():
            raise DataError(
                f"data path {pattern!r} does not exist", file=pattern,
                hint="check data.sources[].path (run python -m data prepare for the stdlib corpus)",
            )
        root = path
        files = [p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path))]
    if not files:
        raise DataError(f"no files match {pattern!r}", file=pattern,
                        hint="check the path or glob in data.sources[].path")
    return root, sorted(files, key=lambda p: p.as_posix())


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)
