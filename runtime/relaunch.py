"""The same run across launcher restarts: torchrun ``--max_restarts`` and Slurm requeues.

When a launcher restarts its workers (a rank crashed, a node was lost, the job was
preempted and requeued) it runs the same command line again. Without help, ``--config X``
would then start a new run. Instead:

- The first attempt records its run ID under ``<run.root>/.launches/<launch key>``. The
  launch key names the job: ``slurm-<SLURM_JOB_ID>`` under Slurm (a requeued job keeps its
  ID), else ``torchelastic-<TORCHELASTIC_RUN_ID>`` (torchrun's ``--rdzv_id``; every restart
  of one torchrun job shares it). Without either there is no key and nothing is recorded.
- A later attempt of the same job (``TORCHELASTIC_RESTART_COUNT`` or ``SLURM_RESTART_COUNT``
  above 0) that finds the record continues that run, exactly as ``--resume RUN_ID`` with the
  same overrides: same run ID and dir, from its newest intact checkpoint.
- An injected step fault (``runtime.faults``) fires once per run: the restarted attempt drops
  the faults whose step the earlier attempt already reached (at most one past its last
  ledger line), so ``crash@S:R`` does not crash every restart again.

A job whose first attempt died before creating its run dir has no record; its restart
starts the run afresh, which loses nothing.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Mapping, Sequence

LAUNCHES_DIR = ".launches"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def launch_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The name of this job across its restarts, from the launcher's variables."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_JOB_ID"):
        return "slurm-" + _UNSAFE.sub("_", env["SLURM_JOB_ID"])
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return "torchelastic-" + _UNSAFE.sub("_", run_id)
    return None


def is_restart(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher says this is a later attempt of the job."""
    env = os.environ if environ is None else environ
    return any(int(env.get(name, "0") or 0) > 0 for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def record_launch(run_root: str | Path, run_id: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """Remember that this job's run is ``run_id`` (rank 0, once the run dir exists)."""
    key = launch_key(environ)
    if key is None:
        return None
    directory = Path(run_root) / LAUNCHES_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"run_id": run_id}))
    os.replace(tmp, path)
    return path


def launched_run(run_root: str | Path, environ: Mapping[str, str] | None = None) -> str | None:
    """The run an earlier attempt of this job created, when this is a restart; else None."""
    key = launch_key(environ)
    if key is None or not is_restart(environ):
        return None
    try:
        return str(json.loads((Path(run_root) / LAUNCHES_DIR / f"{key}.json").read_text())["run_id"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def faults_not_yet_reached(faults: Sequence[str], last_recorded_step: int) -> list[str]:
    """The fault entries whose step an earlier attempt has not reached. A step-start fault
    at step S fires when step S begins, and the ledger holds every step before it, so an
    attempt whose ledger ends at L reached every step <= L + 1."""
    from runtime.faults import parse_fault

    kept = []
    for index, entry in enumerate(faults):
        spec = parse_fault(entry, index=index)
        if spec.step is None or spec.step > last_recorded_step + 1:
            kept.append(entry)
    return kept
