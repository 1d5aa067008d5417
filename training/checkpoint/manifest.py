"""The on-disk format of a checkpoint: layout, manifest, verification, durable writes.

Layout, under the run's ``checkpoints/``::

    step_00000040/
      dcp/                  each trained part's model + optimizer (torch.distributed.checkpoint:
                            sharded, reshardable)
      <part>_state.json     the JSON state of each named part: trainer, data, objective, ...
      rng/rank<R>.pt        extra/<name>
      manifest.json         size + sha256 of every other file
    LATEST                  "step_00000040": the newest complete checkpoint
    .tmp-*                  a save in progress, or the leftover of a crashed one (never loaded)

A checkpoint is trusted only through its ``manifest.json``: the size and sha256 of every
other file in the directory, plus a few facts about the save (step, world size, whether
optimizer state was written). The manifest carries a checksum of its own body, so a
damaged manifest is told apart from a damaged shard, and a format version that this code
refuses to read rather than guess at.

Two kinds of failure are kept apart on purpose:

- ``CheckpointCorruptError``: the bytes on disk do not match the manifest (a truncated or
  flipped file, a missing or unexpected file). The caller may fall back to an older
  checkpoint.
- ``CheckpointFormatError``: an intact manifest of a format version this code does not
  read. Falling back would silently restart a run from an older (or no) checkpoint, so
  this is a hard stop.

The checksum rule is part of the format and must not change between versions: sha256 of
the manifest body (every key except ``manifest_sha256``) serialized as JSON with sorted
keys and no whitespace. That is what lets a future version be recognised as "newer",
not "corrupt".

The module also holds the durable-write primitives (write + fsync a file, fsync a
directory) that the save protocol in ``training.checkpoint.manager`` is built from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

from core.exceptions import CheckpointError
from core.layout import list_steps, part_of_state_file, state_file_name  # noqa: F401  (re-exported)

STEP_DIR_PREFIX = "step_"
_STEP_DIR_RE = re.compile(r"step_(\d{8,})")
TMP_PREFIX = ".tmp-"
LATEST_NAME = "LATEST"
LATEST_TMP_NAME = "LATEST.tmp"
DCP_DIR = "dcp"
RNG_DIR = "rng"
EXTRA_DIR = "extra"
TRAINER_PART = "trainer"
DATA_PART = "data"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "lockstep-checkpoint"
MANIFEST_VERSION = 1

KEY_FORMAT = "format"
KEY_VERSION = "version"
KEY_STEP = "step"
KEY_WORLD_SIZE = "world_size"
KEY_HAS_OPTIMIZER_STATE = "has_optimizer_state"
KEY_TORCH_VERSION = "torch_version"
KEY_FILES = "files"
KEY_SIZE = "size"
KEY_SHA256 = "sha256"
KEY_SELF_SHA256 = "manifest_sha256"

_HASH_CHUNK_BYTES = 8 << 20


class CheckpointCorruptError(CheckpointError):
    """A checkpoint whose files do not match its manifest, or whose manifest is unreadable."""

    kind = "checkpoint corrupt"


class CheckpointFormatError(CheckpointError):
    """An intact checkpoint written in a format version this code does not read."""

    kind = "checkpoint format"


@dataclass(frozen=True)
class FileEntry:
    """Size and content hash of one file of a checkpoint."""

    size: int
    sha256: str


@dataclass(frozen=True)
class CheckpointManifest:
    """The table of contents of one checkpoint directory."""

    step: int
    world_size: int
    has_optimizer_state: bool
    torch_version: str
    files: dict[str, FileEntry]

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            KEY_FORMAT: MANIFEST_FORMAT,
            KEY_VERSION: MANIFEST_VERSION,
            KEY_STEP: self.step,
            KEY_WORLD_SIZE: self.world_size,
            KEY_HAS_OPTIMIZER_STATE: self.has_optimizer_state,
            KEY_TORCH_VERSION: self.torch_version,
            KEY_FILES: {
                name: {KEY_SIZE: e.size, KEY_SHA256: e.sha256}
                for name, e in sorted(self.files.items())
            },
        }
        body[KEY_SELF_SHA256] = _body_digest(body)
        return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: Path) -> "CheckpointManifest":
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointCorruptError(f"manifest is not valid JSON ({exc})", file=str(where))
        if not isinstance(body, dict) or KEY_SELF_SHA256 not in body:
            raise CheckpointCorruptError("manifest has no checksum", file=str(where))
        claimed = body.pop(KEY_SELF_SHA256)
        if claimed != _body_digest(body):
            raise CheckpointCorruptError("manifest checksum does not match its body", file=str(where))
        if body.get(KEY_FORMAT) != MANIFEST_FORMAT or body.get(KEY_VERSION) != MANIFEST_VERSION:
            raise CheckpointFormatError(
                f"checkpoint format {body.get(KEY_FORMAT)!r} version {body.get(KEY_VERSION)!r} "
                f"is not readable by this code (it reads {MANIFEST_FORMAT!r} version {MANIFEST_VERSION})",
                file=str(where),
                hint="resume with the Lockstep version that wrote this checkpoint",
            )
        try:
            files = {
                str(name): FileEntry(size=int(e[KEY_SIZE]), sha256=str(e[KEY_SHA256]))
                for name, e in body[KEY_FILES].items()
            }
            return cls(
                step=int(body[KEY_STEP]),
                world_size=int(body[KEY_WORLD_SIZE]),
                has_optimizer_state=bool(body[KEY_HAS_OPTIMIZER_STATE]),
                torch_version=str(body[KEY_TORCH_VERSION]),
                files=files,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # Only reachable if a writer produced a malformed body with a valid checksum.
            raise CheckpointCorruptError(f"manifest is malformed ({exc!r})", file=str(where))


def _body_digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# --------------------------------------------------------------------------- names


def step_dir_name(step: int) -> str:
    return f"{STEP_DIR_PREFIX}{step:08d}"


def parse_step_dir_name(name: str) -> int | None:
    match = _STEP_DIR_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def rng_file_name(rank: int) -> str:
    return f"{RNG_DIR}/rank{rank}.pt"


def extra_file_name(name: str) -> str:
    """Where extra file ``name`` lives in a checkpoint; refuses names that escape it."""
    rel = PurePosixPath(name)
    if rel.is_absolute() or not rel.parts or ".." in rel.parts:
        raise CheckpointError(f"extra file name {name!r} must be a relative path inside the checkpoint")
    return f"{EXTRA_DIR}/{rel.as_posix()}"


def read_latest(checkpoint_dir: Path) -> int | None:
    """The step LATEST names; None when there is no (readable) LATEST."""
    try:
        text = (checkpoint_dir / LATEST_NAME).read_text().strip()
    except FileNotFoundError:
        return None
    return parse_step_dir_name(text)


def write_latest(checkpoint_dir: Path, step: int) -> None:
    """Point LATEST at ``step`` atomically: a reader sees the old or the new name, never a mix."""
    tmp = checkpoint_dir / LATEST_TMP_NAME
    write_file_durably(tmp, f"{step_dir_name(step)}\n".encode())
    os.replace(tmp, checkpoint_dir / LATEST_NAME)
    fsync_dir(checkpoint_dir)


# --------------------------------------------------------------------------- JSON states


def encode_json_state(value: Any, what: str) -> bytes:
    """JSON bytes that decode to exactly ``value`` (insertion order kept); else CheckpointError."""
    _require_json_exact(value, what)
    return (json.dumps(value, indent=1) + "\n").encode()


def _require_json_exact(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _require_json_exact(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(
                    f"{where} has the non-string key {key!r}; JSON would give it back as a string",
                    key=where,
                    hint="use string keys in trainer and data state",
                )
            _require_json_exact(item, f"{where}.{key}")
        return
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which JSON would not give back unchanged",
        key=where,
        hint="store lists, dicts, str, int, float, bool or None in trainer and data state",
    )


# --------------------------------------------------------------------------- reading


def hash_file(path: Path) -> FileEntry:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(size=size, sha256=digest.hexdigest())


def list_files(root: Path) -> list[str]:
    """Every file below ``root`` (POSIX relative paths, sorted), the manifest excluded."""
    names = []
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            rel = (Path(dirpath) / filename).relative_to(root).as_posix()
            if rel != MANIFEST_NAME:
                names.append(rel)
    return sorted(names)


def read_manifest(root: Path) -> CheckpointManifest:
    """The manifest of the checkpoint at ``root``; raises CheckpointCorruptError/FormatError."""
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise CheckpointCorruptError("checkpoint directory is missing", path=str(root))
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorruptError("manifest.json is missing (save did not finish)", path=str(root))
    return CheckpointManifest.from_bytes(data, where=path)


def check_listing(root: Path, manifest: CheckpointManifest) -> str | None:
    """Missing, unexpected or wrongly sized files; None when the listing matches."""
    on_disk = set(list_files(root))
    listed = set(manifest.files)
    if missing := sorted(listed - on_disk):
        return f"missing file {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    if extra := sorted(on_disk - listed):
        return f"unexpected file {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
    for name in sorted(listed):
        size = (root / name).stat().st_size
        if size != manifest.files[name].size:
            return f"{name} has {size} bytes, manifest says {manifest.files[name].size}"
    return None


def check_hashes(root: Path, manifest: CheckpointManifest, names: Iterable[str]) -> str | None:
    """The first of ``names`` whose content differs from the manifest; None when all match."""
    for name in names:
        try:
            actual = hash_file(root / name)
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or exc})"
        expected = manifest.files[name]
        if actual.size != expected.size:
            return f"{name} has {actual.size} bytes, manifest says {expected.size}"
        if actual.sha256 != expected.sha256:
            return f"{name} sha256 {actual.sha256[:12]}... differs from manifest {expected.sha256[:12]}..."
    return None


def check_header(root: Path, step: int | None) -> tuple[CheckpointManifest | None, str | None]:
    """The manifest and the first cheap problem (unreadable manifest, wrong step, listing).

    Raises CheckpointFormatError for an intact manifest of an unreadable format version.
    """
    try:
        manifest = read_manifest(root)
    except CheckpointCorruptError as exc:
        return None, exc.message
    if step is not None and manifest.step != step:
        return None, f"manifest says step {manifest.step}, directory name says {step}"
    return manifest, check_listing(root, manifest)


def verify_checkpoint(path: Path) -> str | None:
    """Check every file of one checkpoint against its manifest: None when intact, else why."""
    path = Path(path)
    try:
        manifest, reason = check_header(path, parse_step_dir_name(path.name))
    except CheckpointFormatError as exc:
        return exc.message
    return reason or check_hashes(path, manifest, sorted(manifest.files))


# --------------------------------------------------------------------------- durable writes


def write_file_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dirs_below(root: Path) -> None:
    """fsync every directory under ``root``, deepest first, ``root`` last."""
    for dirpath, _, _ in os.walk(root, topdown=False):
        fsync_dir(Path(dirpath))
