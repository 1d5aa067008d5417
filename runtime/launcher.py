"""``python train.py --nproc N ...``: N ranks on this machine, with train.py's exit codes.

torchrun reports a failed rank with a ``ChildFailedError`` traceback and exits 1 whatever the
rank's code was, and a Ctrl-C that the ranks turned into a clean checkpoint still ends in a
``SignalException`` traceback and exit 1. This launcher starts the same ranks through torch's
elastic launch API (one node, a c10d rendezvous on a free local port, no restarts) and keeps
the typed contract:

- a failing job prints the first failing rank's one line once and exits with that rank's code
  (a rank killed by signal N: 128 + N);
- a rank that died without a line before any other rank ended (the OOM killer's SIGKILL, a
  native crash) is that first failure, not the peer whose collective then failed ("Connection
  reset by peer"): ``RankDeaths`` notes when each rank ended, to the millisecond;
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
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from types import FrameType
from typing import Callable, Sequence

from core.exceptions import LockstepError, UsageError

LAUNCHER_ENV = "LOCKSTEP_LAUNCHER"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
NPROC_FLAG = "--nproc"
_FORWARDED = (signal.SIGINT, signal.SIGTERM)
_STOPS = (signal.SIGINT, signal.SIGTERM)
"""What the agent (after a failure) and a user (a stop) send: a rank they end is no root cause."""
_SIGNAL_CAUSES = {
    signal.SIGKILL: "the OOM killer, or a kill -9?",
    signal.SIGSEGV: "a crash in native code: its Python stacks are in its log",
    signal.SIGABRT: "an abort in native code: its Python stacks are in its log",
    signal.SIGBUS: "a crash in native code: its Python stacks are in its log",
}


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


class RankDeaths:
    """When each child process of this launcher ended (``time.monotonic_ns``), by pid.

    A daemon thread finds the ranks among this process's children (every 50 ms until ``nproc`` are
    found) and waits on a pidfd of each, which becomes readable when the process exits (before the
    agent reaps it, which it does every 0.1 s). A rank the OOM killer SIGKILLs ends before its
    peers notice (the kernel closes its sockets last thing before it reports its exit; the peer
    then still has to raise, write its error and exit), so the order of ends tells the root cause
    where the peers' own times cannot. Where pidfds are missing (not Linux), nothing is noted."""

    def __init__(self, nproc: int, *, find_every_s: float = 0.05) -> None:
        self.ended: dict[int, int] = {}
        self._nproc = nproc
        self._find_every_ms = int(find_every_s * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lockstep-rank-deaths", daemon=True)

    def start(self) -> "RankDeaths":
        if hasattr(os, "pidfd_open"):
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1)

    def _watch(self) -> None:
        import psutil

        poller, fds, found = select.poll(), {}, set()
        try:
            while not self._stop.is_set():
                if len(found) < self._nproc:
                    for child in psutil.Process().children():
                        if child.pid not in found:
                            found.add(child.pid)
                            try:
                                fd = os.pidfd_open(child.pid)
                            except OSError:  # already reaped: its end was not seen
                                continue
                            fds[fd] = child.pid
                            poller.register(fd, select.POLLIN)
                wait_ms = self._find_every_ms if len(found) < self._nproc else 100
                for fd, _ in poller.poll(wait_ms):
                    self.ended.setdefault(fds[fd], time.monotonic_ns())
                    poller.unregister(fd)
        finally:
            for fd in fds:
                os.close(fd)


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
    deaths = RankDeaths(nproc).start()
    try:
        elastic_launch(_launch_config(nproc, log_dir), sys.executable)(script, *args)
        return 0
    except ChildFailedError as failed:
        rank, code, line = first_failure(failed.failures, ended=deaths.ended)
        print(line, file=sys.stderr, flush=True)
        return code
    except _StopBeforeRanks as stop:
        return stop.exit_code
    except SignalException as stop:  # a torch whose agent took the signal after all: it stopped the ranks
        print(f"stop: {stop.sigval.name} received; the ranks were stopped by the elastic agent", file=sys.stderr)
        return 128 + int(stop.sigval)
    finally:
        deaths.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(log_dir, ignore_errors=True)


def first_failure(failures: dict, *, ended: dict[int, int] | None = None) -> tuple[int, int, str]:
    """(rank, exit code, one line) of the root cause.

    A rank that ended without a line, not by the agent's or a user's stop signal, is the root
    cause when it ended first of all the failed ranks (``ended``: pid -> ``RankDeaths`` time): the
    OOM killer's victim, not the peer whose collective failed on its closed connection. Otherwise
    the earliest of the failures a rank explained (by its own nanosecond time); only where none
    did, the earliest by torchelastic's time (whole seconds, taken when it noticed: a rank the
    agent killed after a peer failed would otherwise sort first)."""

    def when(item) -> tuple[int, int, int]:
        rank, failure = item
        if _explained(failure):
            return 0, int(failure.error_file_data["message"]["extraInfo"]["time_ns"]), rank
        return 1, failure.timestamp, rank

    rank, failure = _ended_first_unexplained(failures, ended or {}) or min(failures.items(), key=when)
    code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
    if _explained(failure):
        return rank, code, str(failure.error_file_data["message"]["message"])
    if failure.exitcode < 0:
        cause = _SIGNAL_CAUSES.get(-failure.exitcode)
        what = f"was killed by {failure.signal_name()}" + (f" ({cause})" if cause else "")
    else:
        what = f"exited with code {code} without a message"
    after = len(failures) - 1
    peers = f"; {after} other rank{'s' if after > 1 else ''} ended after it" if after else ""
    return rank, code, f"[rank {rank}] {what}{peers} -> its log is logs/rank{rank}.log in the run dir"


def _explained(failure) -> bool:
    message = failure.error_file_data.get("message")
    return isinstance(message, dict) and "time_ns" in message.get("extraInfo", {})


def _ended_first_unexplained(failures: dict, ended: dict[int, int]):
    """(rank, failure) of a rank that ended first of all, without a line and not by a stop signal;
    None if the first to end explained itself or was stopped, or the ends were not seen."""
    seen = [(ended[f.pid], rank, f) for rank, f in failures.items() if getattr(f, "pid", None) in ended]
    if not seen:
        return None
    _, rank, failure = min(seen, key=lambda item: (item[0], item[1]))
    stopped = -failure.exitcode in _STOPS
    return None if _explained(failure) or stopped else (rank, failure)


def launch_if_asked(script: str, argv: Sequence[str], check: Callable[[list[str], int], None] | None = None) -> None:
    """With ``--nproc N`` in ``argv``: ``check(the other arguments, N)`` first, then launch
    ``script`` with them as N ranks and exit with the job's code; without it, return (this
    process is a rank), after ``check(argv, 1)`` where the process is the whole job (started by
    hand, not by a launcher). ``check`` raises a LockstepError for what no rank should start with
    (train.py's: the command line and the config for N ranks), which is printed as its one
    line, without a rank's prefix, and exits with its code before any rank exists (and before
    torch loads: a typo is answered in well under a second)."""
    from runtime.fast_exit import exit_process

    try:
        nproc, rest = split_nproc(argv)
        if {"-h", "--help"} & set(rest):  # help: this process prints it, once
            return
        if nproc is None:
            if check is not None and _alone():
                _check_alone(check, rest)
            return
        if check is not None:
            check(rest, nproc)
    except LockstepError as error:
        print(error, file=sys.stderr, flush=True)
        exit_process(error.exit_code)
        return
    exit_process(launch(nproc, script, rest))


def _alone() -> bool:
    """This process is the whole job: started by hand (``python train.py ...``), not as a rank of
    ``--nproc``, torchrun or another launcher that sets the rank's environment."""
    return not ({LAUNCHER_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"} & set(os.environ))


def _check_alone(check: Callable[[list[str], int], None], rest: list[str]) -> None:
    """A one-process run's ``check`` for one rank, before torch loads: a typed error is its one line
    without a rank's prefix (raised to ``launch_if_asked``); anything else is left to the rank itself,
    which checks it all again and reports it as a failure of its own."""
    try:
        check(rest, 1)
    except LockstepError:
        raise
    except Exception:  # noqa: BLE001 - the rank's own check reports it, with its log
        return
