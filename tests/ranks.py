"""``python tests/ranks.py [--preload MODULE] NPROC PORT SCRIPT ARGS...``: NPROC ranks of SCRIPT on this machine,
each with the environment torchrun gives a rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; rank 0
hosts the store on PORT), without torchrun's elastic agent.

The agent imports torch (about 1.5 s of CPU per job on the 2-core test machine) and polls its
ranks. This launcher imports MODULE (tests/launch.py names ``train``: torch and Lockstep) once,
then forks each rank, which runs SCRIPT as ``__main__`` (as ``python SCRIPT ARGS`` would) with
those imports already done: a 2-rank job of train.py costs one import instead of two, about 1.9 s
of CPU less on the test machine (6.1 -> 4.2 s for 2 steps of tests/configs/e2e.yaml), with the
same ledger bit for bit. The imports start no thread of torch's own when the ranks fork (numpy's
OpenBLAS pool may run; it handles a fork).
Without ``--preload`` nothing is imported ahead (a script that imports no Lockstep, as
tests/test_ranks_launcher.py's, pays for nothing it does not use). tests/launch.py starts every
multi-rank job with it unless the test asks for torchrun (``rendezvous="direct"``, the default):
those jobs are many, and what they check is the ranks' own work. A test of the launcher
contract itself (torchrun's rendezvous, restarts, a killed agent, the CLI's exit codes through
torchrun) starts torchrun.

The job ends as torchrun's does: when a rank fails, the others get SIGTERM (SIGKILL 5 s later),
each rank that failed on its own (not the ranks stopped after it) is named in a summary line
``exitcode : N`` on stderr (what ``launch.Result.exit_code`` reads; a rank killed by signal N:
-N), and the job exits 1; 0 when every rank exits 0. The ranks stay in this process's session,
so killing its process group kills the whole job.

``python tests/ranks.py --call CALL RESULT`` runs a function's ranks instead (tests/launch.py,
``in_fresh_process``): it loads the call that CALL holds (the caller's module path, then the
function and its arguments, whose modules the loading imports), calls it (it forks the ranks and
waits for them) and writes what it returned, or the exception it raised, to RESULT.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

POLL_S = 0.05
GRACE_S = 5.0
ROOT = Path(__file__).resolve().parents[1]
PRELOAD_FLAG = "--preload"
CALL_FLAG = "--call"


def rank_env(rank: int, nproc: int, port: str) -> dict[str, str]:
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)


def preload(script: str, module: str | None) -> None:
    """The module path ``python SCRIPT`` would have (the script's folder first, not tests/,
    this file's), then ``module`` imported from it or the repository."""
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    if module is not None:
        if str(ROOT) not in sys.path:
            sys.path.insert(1, str(ROOT))
        __import__(module)


def become_rank(rank: int, nproc: int, port: str, script: str, args: list[str]) -> None:
    """In a forked child: run ``script`` as ``__main__`` as rank ``rank``. Never returns: the
    script's exit (``SystemExit``, an exception, or its end as exit 0) leaves through the
    interpreter's own exit, as it would in ``python SCRIPT``."""
    os.environ.update(rank_env(rank, nproc, port))
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


def poll(pid: int) -> int | None:
    """The exit code of the rank ``pid`` once it has ended (-N: killed by signal N), else None."""
    done, status = os.waitpid(pid, os.WNOHANG)
    return os.waitstatus_to_exitcode(status) if done else None


def run(nproc: int, port: str, script: str, args: list[str], *, preloaded: str | None = None) -> int:
    preload(script, preloaded)
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            become_rank(rank, nproc, port, script, args)
        pids.append(pid)
    codes: list[int | None] = [None] * nproc
    while True:
        codes = [code if code is not None else poll(pid) for pid, code in zip(pids, codes)]
        if any(code not in (None, 0) for code in codes) or all(code == 0 for code in codes):
            break
        time.sleep(POLL_S)
    failed = {rank: code for rank, code in enumerate(codes) if code not in (None, 0)}
    if not failed:
        return 0
    running = [pid for pid, code in zip(pids, codes) if code is None]
    for pid in running:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while running and time.monotonic() < deadline:
        running = [pid for pid in running if poll(pid) is None]
        time.sleep(POLL_S)
    for pid in running:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    for rank, code in failed.items():
        print(f"[tests/ranks.py] rank {rank} failed: exitcode : {code}", file=sys.stderr, flush=True)
    return 1


def serve_call(call: Path, result: Path) -> None:
    """``--call``: the pickled call in ``call`` made here; ``(True, value)`` or ``(False,
    exception)`` pickled to ``result``, the exception with its traceback here as a note (what
    cannot be pickled comes back as a RuntimeError naming it)."""
    # A call that outlives tests/launch.py's limit gets SIGUSR1: every thread's stack to stderr, in
    # this process and in the ranks it forks (they inherit the handler), before it is killed.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    path, blob = pickle.loads(call.read_bytes())
    sys.path[:] = path
    trace = ""
    try:
        fn, args = pickle.loads(blob)
        out = (True, fn(*args))
    except BaseException as error:  # handed back to the caller, which raises it
        trace = traceback.format_exc()
        error.add_note(f"raised in tests/ranks.py {CALL_FLAG}:\n{trace}")
        out = (False, error)
    try:
        data = pickle.dumps(out)
    except Exception as unpicklable:
        data = pickle.dumps((False, RuntimeError(
            f"tests/ranks.py {CALL_FLAG} cannot hand back {out[1]!r} ({unpicklable!r})\n{trace}")))
    result.write_bytes(data)


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[0] == CALL_FLAG:
        serve_call(Path(argv[1]), Path(argv[2]))
        sys.exit(0)
    module = None
    if argv[0] == PRELOAD_FLAG:
        module, argv = argv[1], argv[2:]
    nproc, port, script, *rest = argv
    sys.exit(run(int(nproc), port, script, rest, preloaded=module))
