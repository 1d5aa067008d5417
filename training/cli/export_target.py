"""Where ``python -m training export`` may write, and how it writes there without destroying.

An export replaces a whole directory, and a model directory is often something else's input:
a later run's ``model.init_from``, a frozen reference, a teacher. So, before anything is
built or written:

- ``--to`` must not be a symbolic link or a file, nor lie inside a run directory (one holding
  ``config.yaml`` beside ``meta.json`` / ``ledger.jsonl`` / ``events.jsonl``; e.g.
  ``runs/<id>/artifacts/init_from``, whose files that run's own exports read);
- a non-empty ``--to`` is replaced only with ``--overwrite``, and only if it is a Lockstep export:
  it holds the ``lockstep_export.json`` every export writes (``EXPORT_MARKER``: the run, the
  checkpoint, whether it is a chat model, the run's ``data.template_thinking`` where set, and the
  list of files it wrote; ``generate`` reads ``chat_model`` for its default and, with ``score``,
  ``template_thinking`` for the template), no run directory anywhere inside it, and no file the
  export did not write (a README, evaluation results, a copied run: whatever replacing would lose).
  A directory that merely holds a ``config.json`` (a base model, a project, a run root) is never
  replaced; nor is an export from before the marker existed: delete it yourself or pick a new path;
- a directory that a known run (any run dir under the run roots) names in its config, such as
  ``model.init_from``, ``objective.dpo.reference`` or ``objective.distill.teacher``, is never
  replaced: the error names the run and the key. Relative paths in a run's config are resolved
  against the working directory the run started in (``meta.json``'s ``cwd``) and this one.

Writing: the export is built in a temporary sibling ``.<name>.export-<pid>``, its files and the
directory are fsynced, and only then does it take the target's place, in one ``renameat2``
``RENAME_EXCHANGE`` where the kernel has it (Linux), so a kill at any moment leaves either the
previous directory or the new one, whole. Without the exchange call it is two renames; a kill
between them leaves the previous directory as ``.<name>.previous-<pid>``, which the next export
to that target moves back before it starts. Leftover siblings of dead exports are removed.
Free space for the new files is checked first (the previous directory is only removed after the
new one is in place), and a full disk is one line, exit 4.

``LOCKSTEP_TEST_EXPORT_KILL_AT=<point>`` (``weights``, ``staged``, ``published``) makes the
export SIGKILL itself at that point; the atomicity tests use it to kill at a known moment.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Iterator

import yaml
from safetensors import SafetensorError

from core.exceptions import CheckpointError, UsageError
from core.layout import CONFIG_FILE, EVENTS_FILE, LEDGER_FILE, META_FILE, RUN_MARKERS

EXPORT_MARKER = "lockstep_export.json"
"""Written last into every export: what it is and the files it wrote; only such a directory is replaced."""
EXPORT_MARKER_VERSION = 1
_LISTED_AT_MOST = 3
_RUN_EVIDENCE = (META_FILE, LEDGER_FILE, EVENTS_FILE)
_STAGING_TAG = ".export-"
_PREVIOUS_TAG = ".previous-"
_FREE_SPACE_MARGIN = 1.05
_FREE_SPACE_SLACK = 16 * 1024**2
"""Tokenizer files, JSON files and filesystem overhead beyond the tensors."""
KILL_AT_ENV = "LOCKSTEP_TEST_EXPORT_KILL_AT"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def check_target(to: Path, *, overwrite: bool, run_roots: list[Path]) -> Path:
    """The directory ``to`` as an export target, or a UsageError saying why not (module docstring).

    A previous directory that a killed two-rename publish left aside is moved back first, so it
    is judged (and protected) as the directory it is."""
    if to.is_symlink():
        raise UsageError(f"--to {to} is a symbolic link; an export is not written through links",
                         hint="pass the directory the link points to, or a new path")
    if to.exists() and not to.is_dir():
        raise UsageError(f"--to {to} is a file, not a directory", hint="pass a new or empty directory path")
    resolved = to.resolve()
    if resolved.parent.is_dir():
        try:
            _recover_or_remove_leftovers(resolved)
        except OSError as exc:
            raise _write_error(exc, resolved) from None
    run_dir = enclosing_run_dir(resolved)
    if run_dir is not None:
        raise UsageError(f"--to {to} is inside the run directory {run_dir}; exports never write into a run",
                         hint="export to a directory outside run directories (e.g. exports/<name>)")
    if not resolved.is_dir() or not any(resolved.iterdir()):
        return resolved
    if not overwrite:
        raise UsageError(f"--to {to} exists and is not empty",
                         hint="pass --overwrite to replace it (the old directory stays until the new one is "
                              "complete), or pick a new directory")
    user = _run_using(resolved, run_roots)
    if user is not None:
        run, keys = user
        raise UsageError(f"--to {to} is used by run {run} as {', '.join(keys)}; replacing it would break that "
                         "run's resume, replay and exports", hint="export to another directory")
    _check_replaceable(to, resolved)
    return resolved


def _check_replaceable(to: Path, target: Path) -> None:
    """A UsageError unless ``target`` is a Lockstep export holding only what the export wrote."""
    listed = _exported_files(target / EXPORT_MARKER)
    if listed is None:
        raise UsageError(f"--to {to} is not a Lockstep export (it has no {EXPORT_MARKER}, which every export "
                         "writes); refusing to replace it even with --overwrite", path=str(target),
                         hint="pick a new or empty directory; if it is an export from an older Lockstep and "
                              "nothing in it is needed, delete it yourself first")
    run_dirs, extras = _foreign_entries(target, listed | {EXPORT_MARKER})
    if run_dirs:
        raise UsageError(f"--to {to} holds the run directory {run_dirs[0]}; refusing to replace it even with "
                         "--overwrite", path=str(target),
                         hint="move the run directory out of it, or export to a new directory")
    if extras:
        more = f" and {len(extras) - _LISTED_AT_MOST} more" if len(extras) > _LISTED_AT_MOST else ""
        raise UsageError(f"--to {to} holds files the export did not write ({', '.join(extras[:_LISTED_AT_MOST])}"
                         f"{more}); replacing it would delete them", path=str(target),
                         hint="move them out of the directory, or export to a new directory")


def _exported_files(marker: Path) -> set[str] | None:
    """The relative paths an export's marker lists; None where there is no readable marker."""
    raw = _read_marker(marker)
    files = raw.get("files") if raw is not None else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return set(files)


def _foreign_entries(target: Path, listed: set[str]) -> tuple[list[Path], list[str]]:
    """(run directories inside ``target``, its non-directory entries ``listed`` lacks), sorted; links
    are entries, never followed."""
    run_dirs: list[Path] = []
    extras: list[str] = []
    for directory, dirnames, filenames in os.walk(target):
        here = Path(directory)
        if any(name in RUN_MARKERS for name in filenames):
            run_dirs.append(here)
        links = [name for name in dirnames if (here / name).is_symlink()]
        for name in (*filenames, *links):
            relative = (here / name).relative_to(target).as_posix()
            if relative not in listed:
                extras.append(relative)
    return sorted(run_dirs), sorted(extras)


def _read_marker(marker: Path) -> dict[str, Any] | None:
    """An export marker's record; None where there is none, or it is a link or not a JSON object."""
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        raw = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def exported_chat_model(directory: Path) -> bool | None:
    """Whether the export in ``directory`` is a chat model (its run's ``objective.kind`` trains on
    chat data), as its marker records; None where the directory has no marker saying it (not a
    Lockstep export, or one written before the marker recorded it)."""
    raw = _read_marker(directory / EXPORT_MARKER)
    chat = raw.get("chat_model") if raw is not None else None
    return chat if isinstance(chat, bool) else None


def exported_template_thinking(directory: Path) -> bool | None:
    """The ``data.template_thinking`` of the run the export in ``directory`` came from, as its marker
    records it (written only where the run set it); None where it records none."""
    raw = _read_marker(directory / EXPORT_MARKER)
    thinking = raw.get("template_thinking") if raw is not None else None
    return thinking if isinstance(thinking, bool) else None


def write_export_marker(directory: Path, about: dict[str, Any]) -> None:
    """Write ``EXPORT_MARKER`` into a finished export: ``about`` (run, checkpoint, form, chat_model, template_thinking)
    and every file the export wrote, so a later ``--overwrite`` replaces only what an export made."""
    files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                   if (p.is_file() or p.is_symlink()) and p.name != EXPORT_MARKER)
    record = {"lockstep_export": EXPORT_MARKER_VERSION, **about, "files": files}
    (directory / EXPORT_MARKER).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def enclosing_run_dir(path: Path) -> Path | None:
    """The run directory ``path`` is, or lies inside; None if none (pass a resolved path)."""
    for directory in (path, *path.parents):
        if _is_run_dir(directory):
            return directory
    return None


def _is_run_dir(directory: Path) -> bool:
    return (directory / CONFIG_FILE).is_file() and any((directory / name).exists() for name in _RUN_EVIDENCE)


def _run_using(target: Path, run_roots: list[Path]) -> tuple[str, list[str]] | None:
    """(run name, config keys) of the first run whose config names ``target`` (or a path inside it)."""
    for root in dict.fromkeys(r.resolve() for r in run_roots):
        if not root.is_dir():
            continue
        for run_dir in sorted(p for p in root.iterdir() if p.is_dir() and _is_run_dir(p)):
            bases = [Path.cwd(), *_recorded_cwd(run_dir)]
            keys = [key for key, value in _string_leaves(_read_yaml(run_dir / CONFIG_FILE))
                    if any((base / value).resolve().is_relative_to(target) for base in bases)]
            if keys:
                return run_dir.name, keys
    return None


def _recorded_cwd(run_dir: Path) -> list[Path]:
    try:
        cwd = json.loads((run_dir / META_FILE).read_text()).get("cwd")
    except (OSError, ValueError, AttributeError):
        return []
    return [Path(cwd)] if isinstance(cwd, str) else []


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None  # not a run we can read; nothing it names can be protected


def _string_leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _string_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _string_leaves(value, f"{prefix}[{i}]")
    elif isinstance(node, str) and node and not node.startswith("run:") and "\n" not in node:
        yield prefix, node


# --------------------------------------------------------------------------- writing


@contextlib.contextmanager
def staged_directory(target: Path, *, need_bytes: int, about: dict[str, Any]) -> Iterator[Path]:
    """A fresh sibling of ``target`` to write the export into; on a clean exit it gets the export
    marker (``about`` plus the files written) and replaces ``target``."""
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _check_free_space(parent, need_bytes)
        staging = parent / f".{target.name}{_STAGING_TAG}{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    except OSError as exc:
        raise _write_error(exc, target) from None
    try:
        yield staging
        write_export_marker(staging, about)
        _fsync_tree(staging)
        kill_point("staged")
        _publish(staging, target)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise _write_error(exc, target) from None
    except SafetensorError as exc:  # safetensors reports an I/O error of its writer as its own type
        shutil.rmtree(staging, ignore_errors=True)
        full = "StorageFull" in str(exc) or "code: 28" in str(exc)
        raise _write_error(OSError(errno.ENOSPC if full else errno.EIO, str(exc)), target) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def kill_point(point: str) -> None:
    """Test hook: SIGKILL this process at ``point`` when the environment asks for it."""
    if os.environ.get(KILL_AT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _publish(staging: Path, target: Path) -> None:
    if not target.exists():
        os.rename(staging, target)
    elif _exchange(staging, target):
        kill_point("published")
        shutil.rmtree(staging)  # it now holds the previous directory
    else:
        previous = target.parent / f".{target.name}{_PREVIOUS_TAG}{os.getpid()}"
        os.rename(target, previous)
        os.rename(staging, target)
        kill_point("published")
        shutil.rmtree(previous)
    _fsync_dir(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the call is unavailable."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False  # this kernel or filesystem cannot exchange: fall back to two renames
    raise OSError(code, os.strerror(code), str(b))


def _recover_or_remove_leftovers(target: Path) -> None:
    """Put back a previous directory a killed two-rename publish left aside; drop dead stagings."""
    for path in sorted(target.parent.glob(f".{target.name}.*-*")):
        tag, _, pid = path.name[len(target.name) + 1:].rpartition("-")
        if f"{tag}-" not in (_STAGING_TAG, _PREVIOUS_TAG) or not pid.isdigit() or _alive(int(pid)):
            continue
        if f"{tag}-" == _PREVIOUS_TAG and not target.exists():
            os.rename(path, target)
        else:
            shutil.rmtree(path)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # an earlier attempt of this very process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_free_space(directory: Path, need_bytes: int) -> None:
    need = int(need_bytes * _FREE_SPACE_MARGIN) + _FREE_SPACE_SLACK
    free = shutil.disk_usage(directory).free
    if free < need:
        raise CheckpointError(
            f"not enough free disk space for the export: it needs about {need / 1024**2:.1f} MiB, "
            f"{directory} has {free / 1024**2:.1f} MiB free", path=str(directory),
            hint="free disk space or export to another disk (--to); nothing was written")


def _write_error(exc: OSError, target: Path) -> CheckpointError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(f"the disk filled up while writing the export: {exc.strerror}", path=str(target),
                               hint="free disk space and export again; the previous directory (if any) is intact")
    return CheckpointError(f"cannot write the export: {exc}", path=str(target),
                           hint="check the permissions and the path of --to; the previous directory (if any) is intact")


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
