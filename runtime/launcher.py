"""``python train.py --nproc N ...``: N ranks on this machine, with train.py's exit codes.

torchrun reports a failed rank with a ``ChildFailedError`` traceback and exits 1 whatever the
rank's code was, and a Ctrl-C that the ranks turned into a clean checkpoint still ends in a
``SignalException`` traceback and exit 1. This launcher starts the same ranks through torch's
elastic launch API (one node, a c10d rendezvous on a free local port, no restarts) and keeps
the typed contract:

- a failing job prints the first failing rank's one line once and exits with that rank's code
  (a rank killed by signal N: 128 + N);
- SIGINT and SIGTERM reach every rank once (the agent's own handlers, which would raise in the
  launcher, are left out); the ranks agree on a step boundary, checkpoint and exit 0, and so
  does the launcher.

A failing rank writes its line into the error file torchelastic gives it
(``TORCHELASTIC_ERROR_FILE``, with the time in nanoseconds, so that the root cause sorts
before the peers that failed because of it; torchrun's summary shows it too). A rank that
knows it runs under this launcher (``LOCKSTEP_LAUNCHER`` in its environment) leaves the
printing to the launcher, and only its rank 0 prints the stop notice of a signal.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from types import FrameType
from typing import Sequence

from core.exceptions import UsageError

LAUNCHER_ENV = "LOCKSTEP_LAUNCHER"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
NPROC_FLAG = "--nproc"
_FORWARDED = (signal.SIGINT, signal.SIGTERM)


def under_launcher(environ: dict[str, str] | None = None) -> bool:
    """Whether this process is a rank started by ``launch``."""
    return (os.environ if environ is None else environ).get(LAUNCHER_ENV) == "1"


def split_nproc(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """``--nproc N`` (or ``--nproc=N``) taken out of ``argv``: (N or None, the other arguments)."""
    rest: list[str] = []
    value: str | None = None
    found = False
    items = iter(argv)
    for item in items:
        if item == NPROC_FLAG:
            found, value = True, next(items, None)
        elif item.startswith(NPROC_FLAG + "="):
            found, value = True, item.split("=", 1)[1]
        else:
            rest.append(item)
    if not found:
        return None, rest
    if value is None or not value.isdigit() or int(value) < 1:
        raise UsageError(f"--nproc needs a number of ranks >= 1, got {value!r}", hint="e.g. --nproc 2")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        raise UsageError(
            "--nproc starts its own ranks and cannot run under torchrun",
            hint="drop --nproc, or run `python train.py --nproc N ...` without torchrun",
        )
    return int(value), rest


def report_failure(line: str) -> bool:
    """Write the rank's one-line failure into its torchelastic error file (torchrun's summary
    then shows it too). Returns True under ``launch``, which prints the first one: the caller
    then prints nothing; False where the caller must print it itself."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    now = time.time_ns()
    record = {"message": {"message": line, "extraInfo": {"timestamp": now // 10**9, "time_ns": now}}}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as out:
            json.dump(record, out)
    except OSError:
        return False
    return under_launcher()


class _StopBeforeRanks(BaseException):
    """A stop signal before any rank was started: nothing to stop but the launcher."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.exit_code = 128 + signum


def _forward_to_ranks(signum: int, frame: FrameType | None) -> None:
    import psutil

    ranks = psutil.Process().children()
    if not ranks:
        raise _StopBeforeRanks(signum)
    for rank in ranks:
        try:
            rank.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def _launch_config(nproc: int, log_dir: str):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"lockstep-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, chosen when the store starts
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    # The agent would turn SIGINT/SIGTERM into an exception in this process and tear the
    # ranks down; ``_forward_to_ranks`` lets them stop cleanly instead.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
    if hasattr(config, "signals_to_handle"):
        config.signals_to_handle = "SIGHUP,SIGQUIT"
    return config


def launch(nproc: int, script: str, args: Sequence[str]) -> int:
    """Run ``python script args`` as ``nproc`` ranks; the job's exit code (module docstring)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # their tracebacks and notices, not ours
    os.environ[LAUNCHER_ENV] = "1"
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks share the cores
    log_dir = tempfile.mkdtemp(prefix="lockstep-launch-")
    previous = {sig: signal.signal(sig, _forward_to_ranks) for sig in _FORWARDED}
    try:
        elastic_launch(_launch_config(nproc, log_dir), sys.executable)(script, *args)
        return 0
    except ChildFailedError as failed:
        rank, code, line = first_failure(failed.failures)
        print(line, file=sys.stderr, flush=True)
        return code
    except _StopBeforeRanks as stop:
        return stop.exit_code
    except SignalException as stop:  # a torch whose agent took the signal after all: it stopped the ranks
        print(f"stop: {stop.sigval.name} received; the ranks were stopped by the elastic agent", file=sys.stderr)
        return 128 + int(stop.sigval)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(log_dir, ignore_errors=True)


def first_failure(failures: dict) -> tuple[int, int, str]:
    """(rank, exit code, one line) of the root cause: the earliest of the failures a rank
    explained (by its own nanosecond time); only where none did, the earliest by torchelastic's
    time (whole seconds, taken when it noticed: a rank the agent killed after a peer failed
    would otherwise sort first)."""

    def when(item) -> tuple[int, int, int]:
        rank, failure = item
        message = failure.error_file_data.get("message")
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        if "time_ns" in extra:
            return 0, int(extra["time_ns"]), rank
        return 1, failure.timestamp, rank

    rank, failure = min(failures.items(), key=when)
    code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
    message = failure.error_file_data.get("message")
    if isinstance(message, dict) and "time_ns" in message.get("extraInfo", {}):
        return rank, code, str(message["message"])
    if failure.exitcode < 0:
        what = f"was killed by {failure.signal_name()}"
    else:
        what = f"exited with code {code} without a message"
    return rank, code, f"[rank {rank}] {what} -> its log is logs/rank{rank}.log in the run dir"


def launch_if_asked(script: str, argv: Sequence[str]) -> None:
    """With ``--nproc N`` in ``argv``: launch ``script`` with the other arguments as N ranks
    and exit with the job's code; without it, return (this process is a rank)."""
    from runtime.fast_exit import exit_process

    try:
        nproc, rest = split_nproc(argv)
    except UsageError as error:
        print(error, file=sys.stderr, flush=True)
        exit_process(error.exit_code)
        return
    if nproc is not None and not {"-h", "--help"} & set(rest):  # help: printed once, by this process
        exit_process(launch(nproc, script, rest))
