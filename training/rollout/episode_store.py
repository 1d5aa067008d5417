"""Each step's episodes, kept in the run directory beside the ledger.

``<run_dir>/episodes/step_<NNNNNNNN>.json`` holds, for a run with an environment, every episode
of that step by global row (``prompt row * group_size + sample``): per turn the sampled ids,
the observation ids, the tools called, the malformed calls and the outcome; the episode's
reward and counts (``EpisodeResult.record``). Rank 0 writes it (atomically: a temporary file,
then a rename) when the step's ledger fields are gathered, before the step's ledger line.

A replay reads it and appends the recorded observations instead of calling the environment; a
resumed step reads the file its first attempt wrote (if it got that far) and compares the
environment's new answers with it (training/rollout/episodes.py). A resume overwrites it.

A replay first checks the file against the step's ledger line: the ``episodes_hash`` recomputed
from its rows (every episode's sampled and observation ids and mask, in global row order) must be
the recorded one, else the file was edited or damaged after the run wrote it: a CheckpointError
naming the file and both hashes (exit 4), before anything is replayed with it. (The hash covers
ids, not rewards: an edited reward shows as the replayed step's reward fields differing.)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

from core.exceptions import CheckpointError, DataError, ResumeError
from core.layout import EPISODES_DIR, LEDGER_FILE, episodes_file_name
from training.rollout.episodes import EpisodeResult, Turn

VERSION = 1


def episodes_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / EPISODES_DIR / episodes_file_name(step)


def write_episodes(run_dir: Path, step: int, records: dict[int, dict[str, Any]]) -> Path:
    """Write step ``step``'s episode records ({global row: record})."""
    path = episodes_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    payload = {"version": VERSION, "step": step, "rows": {str(row): record for row, record in sorted(records.items())}}
    temporary.write_text(json.dumps(payload, separators=(",", ":")))
    os.replace(temporary, path)
    return path


def read_episodes(run_dir: Path, step: int, group_size: int) -> Optional[dict[tuple[int, int], dict[str, Any]]]:
    """Step ``step``'s records as {(prompt row, sample): record}, or None when none was written.
    A file that does not parse or is of another version is a DataError naming it."""
    path = episodes_path(run_dir, step)
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text())
        if payload.get("version") != VERSION or payload.get("step") != step:
            raise ValueError(f"version {payload.get('version')!r} step {payload.get('step')!r}, "
                             f"expected version {VERSION} step {step}")
        return {(int(row) // group_size, int(row) % group_size): record for row, record in payload["rows"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"the episode record {path} is unreadable: {exc}", file=str(path), step=step,
                        hint="it is written by the run itself; restore it, or resume from a checkpoint before "
                             "this step with the file removed") from None


def step_records(run_dir: Path, step: int, group_size: int, *, replay: bool) -> dict[str, Any]:
    """``GroupRollout.collect``'s ``recorded`` and ``call_environment`` for step ``step``: a replay
    appends the recorded observations and never calls the environment (a step without its record
    is a ResumeError, exit 4); a recording run compares its answers with what an earlier attempt
    of the step recorded (a resume), or has nothing to compare."""
    recorded = read_episodes(run_dir, step, group_size)
    if recorded is None and replay:
        raise ResumeError(f"step {step} has no episode record ({episodes_path(run_dir, step)}): a replay "
                          "appends the recorded observations and never calls the environment",
                          step=step, hint="replay a step the run recorded with this version of the code")
    if replay:
        check_against_ledger(run_dir, step, recorded, group_size)
    return {"recorded": recorded, "call_environment": not replay}


def recorded_hash(recorded: dict[tuple[int, int], dict[str, Any]], group_size: int) -> str:
    """The ledger's ``episodes_hash`` of a step's records: sha256 over each episode's digest
    (``EpisodeResult.digest``), in global row order."""
    rows = sorted(recorded, key=lambda key: key[0] * group_size + key[1])
    digests = (_digest(recorded[key]) for key in rows)
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()


def check_against_ledger(run_dir: Path, step: int, recorded: dict[tuple[int, int], dict[str, Any]],
                         group_size: int) -> None:
    """A replayed step's record must hash to its ledger line's ``episodes_hash`` (module docstring)."""
    expected = _ledger_line(Path(run_dir) / LEDGER_FILE, step).get("episodes_hash")
    if expected is None:
        return  # no line (the replay names the missing line itself) or a step without episodes
    path = episodes_path(run_dir, step)
    try:
        found = recorded_hash(recorded, group_size)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"the episode record {path} is unreadable: {type(exc).__name__}: {exc}", file=str(path),
                        step=step, hint="it is written by the run itself; restore it from a copy of the run dir") from None
    if found != expected:
        raise CheckpointError(
            f"the episode record {path.name} of step {step} hashes to {found}, the ledger's episodes_hash is "
            f"{expected}: it was changed after the run wrote it", file=str(path), step=step,
            hint="restore the file from a copy of the run dir; a replay appends its observations as recorded")


def _digest(record: dict[str, Any]) -> str:
    turns = tuple(Turn(tuple(int(t) for t in turn["sampled"]), (), tuple(int(t) for t in turn["observation"]))
                  for turn in record["turns"])
    return EpisodeResult(turns, 0.0).digest


def _ledger_line(ledger: Path, step: int) -> dict[str, Any]:
    """Step ``step``'s line of the ledger ({} where it has none; a line that does not parse, such as
    a torn last one, is skipped: the replay reads the ledger itself and names a damaged line)."""
    try:
        lines = ledger.read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step") == step:
            return record
    return {}
