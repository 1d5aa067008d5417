"""Launch real training processes for end-to-end tests: 2 ranks through tests/ranks.py (the
default), through torchrun where a test is about torchrun itself, or a single process.

A job's ranks start without torchrun's agent unless the test asks for it (``rendezvous=
"static"`` or ``"c10d"``): the agent imports torch, about 1.6 s more CPU per 2-rank job than
tests/ranks.py on the 2-core test machine, and most end-to-end tests check the ranks' own work.
tests/ranks.py imports train.py's modules once and forks the ranks from there (``--preload
train``: every script the ranks run is train.py or imports it), about 1.9 s less CPU per
2-rank job than a fresh interpreter per rank.
Every job started as ``python SCRIPT.py ...`` (ranks.py, in_turn.py, train.py alone) or ``python -m
MODULE ...`` (``run_module``: ``training export``, ``experiments runs``) is a fork of
this pytest process's zygote (tests/zygote.py, ``popen``), which imported train.py's modules once:
about 4 s of CPU less per job again, the suite's largest single cost before it.
The tests that stay on torchrun are those about it or the commands a user types: its restarts
(tests/runtime/test_restart_continues_the_run.py), the ranks' watch of a killed agent
(tests/runtime/test_launcher_exit.py), the CLI's exit codes through it (tests/test_train_cli.py),
two agents as two nodes (tests/distributed/test_two_nodes_simulated.py)."""

from __future__ import annotations

import atexit
import json
import os
import pickle
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from tests.zygote import Job, Zygote, ZygoteGone

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TRAIN = "train.py"
"""The script the ranks run (a path from the repository root). A test passes another as
``entry=`` to start train.py with something of its own in place: a test objective registered
(tests/training/two_part_train.py, a guarantee-table row's ``Method.entry``) or an objective
that kills its job at a known point (tests/training/ppo_kill_train.py)."""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def exit_code(self) -> int:
        """train.py's own exit code. torchrun and tests/ranks.py exit 1 when a rank fails and
        name each failed rank's exit code in an ``exitcode : N`` line; the first one is the job's."""
        if self.returncode in (0, None):
            return self.returncode
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", self.stderr)
        return int(codes[0]) if codes else self.returncode

    @property
    def run_id(self) -> str:
        for line in self.stdout.splitlines():
            if line.startswith("run_id: "):
                return line.split(": ", 1)[1].strip()
        raise AssertionError(f"no run_id in stdout:\n{self.stdout}\n{self.stderr}")

    @property
    def run_dir(self) -> Path:
        for line in self.stdout.splitlines():
            if line.startswith("run_dir: "):
                return Path(line.split(": ", 1)[1].strip())
        raise AssertionError(f"no run_dir in stdout:\n{self.stdout}\n{self.stderr}")


def free_port() -> int:
    """A port for a job's store that no connection can take before the job listens on it: one free
    now, drawn below the kernel's ephemeral range (from which every outgoing connection, of this
    job's ranks or another test's, gets its local port: a port handed out by ``bind(0)`` is one of
    those, and a connection opened meanwhile may hold it when rank 0 listens, EADDRINUSE)."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000-{low - 1} after 100 draws")


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts here
    return max(low, 10001)


def command(nproc: int, args: list[str], *, rendezvous: str = "direct", entry: str = TRAIN) -> list[str]:
    """``entry args`` (train.py unless named) on ``nproc`` local ranks (one process for 1).

    ``rendezvous="direct"`` (the default) starts the ranks without torchrun (tests/ranks.py: the
    same environment, rank 0 hosting the store, no agent importing torch).
    ``rendezvous="static"`` starts them through torchrun with a master address and port (as
    ``torchrun --master_port`` takes them), about 0.7 s sooner than ``"c10d"``, which a
    restarted job needs: its agent rendezvouses again by ``--rdzv_id``
    (tests/runtime/test_restart_continues_the_run.py)."""
    if nproc == 1:
        return [PYTHON, str(ROOT / entry), *args]
    port = free_port()
    if rendezvous == "direct":
        return [PYTHON, str(ROOT / "tests" / "ranks.py"), "--preload", "train", str(nproc), str(port),
                str(ROOT / entry), *args]
    if rendezvous == "static":
        where = ["--master_addr=127.0.0.1", f"--master_port={port}"]
    elif rendezvous == "c10d":
        where = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    else:
        raise ValueError(f"rendezvous must be static, c10d or direct, got {rendezvous!r}")
    return [
        PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1", *where,
        "--max_restarts=0", "--monitor_interval=0.1", str(ROOT / entry), *args,
    ]


def env(cwd: Path) -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = str(ROOT)
    # The suite's runs are CPU runs with gloo, also on a machine with a GPU (where the
    # CUDA tests, tests/runtime/test_cuda.py, cover the device).
    out["CUDA_VISIBLE_DEVICES"] = ""
    out["OMP_NUM_THREADS"] = "1"
    out["PYTHONUNBUFFERED"] = "1"
    if Path(cwd).resolve() != ROOT:
        # A replay without --dump writes its logs to a fresh temporary directory, which it
        # keeps (and prints): under the test's own directory they go when pytest cleans it up.
        tmp = Path(cwd) / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        out["TMPDIR"] = str(tmp)
    return out


_zygotes: list[Zygote] = []
_ZYGOTES_AT_MOST = 4


def _zygote_for(cmd: list[str], environment: dict[str, str]) -> Zygote | None:
    """A zygote (tests/zygote.py) of this process for ``cmd`` in ``environment``, or None where a
    fresh process must start it. A zygote starts on first use. One whose import saw another
    environment (a test changed this process's) stays for the jobs it runs, and another imports
    in this one, up to ``_ZYGOTES_AT_MOST``."""
    if os.environ.get("LOCKSTEP_TEST_ZYGOTE", "1") == "0" or not Zygote.runs(cmd, PYTHON):
        return None
    for zygote in _zygotes:
        if zygote.alive() and zygote.matches(environment):
            return zygote
    if len(_zygotes) >= _ZYGOTES_AT_MOST:
        return None
    zygote = Zygote(PYTHON, ROOT / "tests" / "zygote.py", "train",
                    {k: v for k, v in environment.items() if k != "TMPDIR"})
    _zygotes.append(zygote)
    return zygote


def zygote_pids() -> list[int]:
    """The process ids of this process's zygotes (children that live as long as it)."""
    return [zygote.proc.pid for zygote in _zygotes]


@atexit.register
def _close_zygotes() -> None:
    for zygote in _zygotes:
        zygote.close()


def popen(cmd: list[str], cwd: Path, environment: dict[str, str], *, capture: bool = True,
          output: int | None = None) -> subprocess.Popen | Job:
    """``cmd`` started in a session of its own (``start_new_session``), its stdout and stderr in text
    pipes (``capture``), or both in the open file ``output`` (a file descriptor) where one is given:
    as a fork of this process's zygote where it can (``python SCRIPT.py ...`` in ``env``'s
    environment: tests/zygote.py), else as a fresh process."""
    zygote = _zygote_for(cmd, environment)
    if zygote is not None:
        try:
            return zygote.start(cmd, cwd, environment, capture=capture, output=output)
        except ZygoteGone:  # its import failed (a fresh process shows why) or it was killed
            pass
    pipe = subprocess.PIPE if capture and output is None else output
    return subprocess.Popen(cmd, cwd=cwd, env=environment, stdout=pipe, text=True, stdin=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if output is not None else pipe, start_new_session=True)


def finish(job: subprocess.Popen | Job, timeout: float) -> tuple[str, str]:
    """``job``'s stdout and stderr once it has ended; past ``timeout`` its whole process group is killed
    and ``subprocess.TimeoutExpired`` raised (as ``subprocess.run``)."""
    try:
        return job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(job)
        job.communicate()
        raise


def train(cwd: Path, args: list[str], *, nproc: int = 2, timeout: float = 300, entry: str = TRAIN,
          rendezvous: str = "direct") -> Result:
    job = popen(command(nproc, args, entry=entry, rendezvous=rendezvous), cwd, env(cwd))
    out, err = finish(job, timeout)
    return Result(job.returncode, out, err)


def train_in_turn(cwd: Path, runs: list[list[str]], *, timeout: float = 300, entry: str = TRAIN) -> list[Result]:
    """``entry`` with each of ``runs``' arguments as one process, one run after the other, as
    ``train(cwd, args, nproc=1)`` each, but forked from one import of train.py's modules
    (tests/in_turn.py): about 2.7 s of CPU less per run after the first. ``timeout`` is per run."""
    out_dir = Path(cwd) / "in-turn" / uuid.uuid4().hex
    out_dir.mkdir(parents=True)
    command = [PYTHON, str(ROOT / "tests" / "in_turn.py"), "--preload", "train", str(out_dir), str(ROOT / entry)]
    for args in runs:
        command += ["--", *args]
    job = popen(command, cwd, env(cwd))
    _, err = finish(job, timeout * len(runs))
    assert job.returncode == 0, err
    return [Result(int((out_dir / f"{i}.code").read_text()), (out_dir / f"{i}.out").read_text(),
                   (out_dir / f"{i}.err").read_text()) for i in range(len(runs))]


def run_module(cwd: Path, args: list[str], *, timeout: float = 300) -> Result:
    """``python -m <args>`` (e.g. ``["training", "export", ...]``) in ``cwd`` with the suite's env
    (a fork of the zygote, ``popen``)."""
    job = popen([PYTHON, "-m", *args], cwd, env(cwd))
    out, err = finish(job, timeout)
    return Result(job.returncode, out, err)


def start(cwd: Path, args: list[str], *, nproc: int = 2, entry: str = TRAIN,
          rendezvous: str = "direct") -> subprocess.Popen | Job:
    """Start a job in its own process group, so the whole job can be SIGKILLed at once."""
    return popen(command(nproc, args, entry=entry, rendezvous=rendezvous), cwd, env(cwd))


def kill_job(proc: subprocess.Popen | Job) -> None:
    with_suppress = getattr(os, "killpg")
    try:
        with_suppress(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


CALL_LIMIT_S = 600.0
"""How long ``in_fresh_process`` waits for its call (and the ranks it forks) to end: the longest
such call of the suite takes well under a minute, so a call past this is hung, and fails naming its
function after the call's processes have printed their stacks (``tests/ranks.py --call``)."""


def in_fresh_process(fn, *args, limit_s: float = CALL_LIMIT_S):
    """``fn(*args)`` in a fresh interpreter (``tests/ranks.py --call``) with this process's module
    path, working directory and environment: its return value, or its exception raised here.
    Unpickling ``fn`` and ``args`` there imports their modules, once: ranks that ``fn`` forks
    (``spawn_ranks``, tests/distributed/dist_harness.py ``run_on_ranks``) start with them imported.
    On the 2-core test machine the suite's 19 such 2-rank calls took 100 CPU-s with their tests
    against 122 with each rank spawned as a fresh interpreter (about 1.1 s less per call); a
    call's wall time grows a little (one process imports, where two ranks imported at once).

    A call still running after ``limit_s`` is hung (a rank that never returns waits forever
    otherwise): every process of its session (the call and the ranks it forked) gets SIGUSR1, on
    which they print every thread's stack to stderr, then SIGKILL, and a ``TimeoutError`` naming
    ``fn`` is raised here."""
    with tempfile.TemporaryDirectory() as tmp:
        call, result = Path(tmp) / "call.pkl", Path(tmp) / "result.pkl"
        call.write_bytes(pickle.dumps((list(sys.path), pickle.dumps((fn, args)))))
        proc = subprocess.Popen([PYTHON, str(ROOT / "tests" / "ranks.py"), "--call", str(call), str(result)],
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _dump_stacks_then_kill(proc.pid)
            proc.wait()
            raise TimeoutError(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)!s} did not end "
                               f"within {limit_s:.0f} s in tests/ranks.py --call: killed; the stacks of its "
                               "processes are above in the test's stderr") from None
        finally:
            if proc.poll() is None:  # the test itself was interrupted: leave no ranks behind
                _kill_session(proc.pid, signal.SIGKILL)
                proc.wait()
        if not result.is_file():
            raise RuntimeError(f"tests/ranks.py --call exited {proc.returncode} without handing back a result")
        returned, value = pickle.loads(result.read_bytes())
    if returned:
        return value
    raise value


def _kill_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the call started its own session: its process group is its pid
    except ProcessLookupError:
        pass


def _session_pids(pid: int) -> list[int]:
    """The processes of the session ``pid`` started (its process group), ``pid`` first."""
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pid:
                found.append(process.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return sorted(found, key=lambda each: (each != pid, each))


def _dump_stacks_then_kill(pid: int, grace_s: float = 3.0, apart_s: float = 0.5) -> None:
    # faulthandler's SIGUSR1 (registered by tests/ranks.py --call), one process at a time: stacks
    # written at once interleave character by character on the stderr they share.
    for each in _session_pids(pid) or [pid]:
        try:
            os.kill(each, signal.SIGUSR1)
        except ProcessLookupError:
            pass
        time.sleep(apart_s)
    time.sleep(grace_s)
    _kill_session(pid, signal.SIGKILL)


def spawn_ranks(target, args_for_rank, *, world: int = 2, timeout: float = 90,
                fresh: bool = False) -> list[int | None]:
    """Run ``target(*args_for_rank(rank))`` in ``world`` processes; their exit codes.

    The ranks are forked from one fresh process that has imported ``target``'s module
    (``in_fresh_process``). ``fresh=True`` spawns each rank as a fresh interpreter instead: for
    ranks that use CUDA, which a process forked after its parent started the CUDA driver (as
    ``torch.cuda.is_available()`` in a module's ``skipif`` may) cannot use.
    Processes still alive after ``timeout`` are killed (their code is then negative)."""
    args = [args_for_rank(rank) for rank in range(world)]
    if fresh:
        return _start_ranks(target, args, "spawn", timeout)
    return in_fresh_process(_start_ranks, target, args, "fork", timeout)


def _start_ranks(target, args: list[tuple], start_method: str, timeout: float) -> list[int | None]:
    import multiprocessing

    ctx = multiprocessing.get_context(start_method)
    procs = [ctx.Process(target=_rank_main, args=(target, rank_args)) for rank_args in args]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [p.exitcode for p in procs]


def _rank_main(target, args) -> None:
    """A spawned rank: ``target(*args)``, then the process group ended and the process left
    without the interpreter's teardown, as train.py leaves (runtime/fast_exit.py). Left to
    interpreter shutdown, a gloo thread still holding a tensor can abort a rank that succeeded
    ("terminate called without an active exception", exit -6). An exception exits 1 as usual."""
    import faulthandler
    import gc

    import torch.distributed as dist

    from runtime.fast_exit import exit_process

    faulthandler.enable(all_threads=True)  # a native crash shows its Python stacks in the test's output
    target(*args)
    if dist.is_initialized():
        gc.collect()  # modules holding the group (DDP's reducer, FSDP's hooks) first
        dist.destroy_process_group()
    # A target that ended the group itself leaves its modules uncollected: collecting a DDP
    # reducer whose gloo group is already destroyed can block for good in the group's
    # destructor (seen about once in 15 runs of test_checkpoint_code_execution).
    exit_process(0)


def spawn_json_ranks(target, out_dir: Path, *, world: int = 2, timeout: float = 90) -> list[dict]:
    """Run ``target(rank, world, port, out_dir)`` on ``world`` spawned ranks, each writing
    ``rank<R>.json`` (or ``rank<R>_error.txt`` with its traceback); returns the JSONs in rank
    order, after asserting that every rank exited 0 (naming the tracebacks if not)."""
    port = free_port()
    codes = spawn_ranks(target, lambda r: (r, world, port, str(out_dir)), world=world, timeout=timeout)
    errors = [f.read_text() for f in Path(out_dir).glob("*_error.txt")]
    written = [(Path(out_dir) / f"rank{r}.json").is_file() for r in range(world)]
    # A rank that died from a signal (negative code) after writing its JSON failed in teardown.
    assert codes == [0] * world, {"exit_codes": codes, "json_written": written, "tracebacks": errors}
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]


def run_dirs_named(runs: Path, name: str) -> set[Path]:
    """The run dirs under ``runs`` of runs whose ``run.name`` is exactly ``name``: IDs
    ``<name>-<YYYYMMDD-HHMMSS>-<hash8>[.N]`` (core/run_context.py). A glob ``<name>-*`` would also
    match another run whose name starts with ``name-`` (``killed-moe`` and ``killed-moe-sft``, which
    share the suite's work dir: the moe row's kill check once resumed and compared the moe-sft row's
    finished run)."""
    pattern = re.compile(re.escape(name) + r"-\d{8}-\d{6}-[0-9a-f]{8}(\.\d+)?")
    return {path for path in runs.glob(f"{name}-*") if pattern.fullmatch(path.name)} if runs.is_dir() else set()


def new_run_dir(runs: Path, name: str, before: set[Path], job, timeout: float = 120) -> Path:
    """The one run dir named ``name`` that ``job`` created (absent from ``before``)."""
    created = lambda: run_dirs_named(runs, name) - before  # noqa: E731
    assert wait_for(lambda: created() or job.poll() is not None, timeout=timeout) and created(), \
        f"no new run dir {name}-<stamp>-<hash> under {runs} (job exit {job.poll()})"
    (run_dir,) = created()
    return run_dir


def kill_and_resume(cwd: Path, args: list[str], *, name: str, seed: int, kills: int = 2,
                    steps: tuple[int, int] = (1, 3), delay_s: float = 0.2, wait_s: float = 120,
                    finish_s: float = 300, entry: str = TRAIN, rendezvous: str = "direct",
                    last_step: int | None = None) -> Path:
    """Start ``args`` (whose run.name is ``name``) on 2 ranks, SIGKILL the whole job at random
    moments ``kills`` times (``steps`` steps after each (re)start, then up to ``delay_s`` later:
    mid-step, mid-rollout or mid-checkpoint), resume it by run ID each time, and return its run dir
    once the last attempt has finished (exit 0, at least one kill landed). Tied to the run's
    progress, not to the clock: a short run can finish within any fixed window. With ``last_step`` (the
    run's train.max_steps) a kill waits for no line past the one before it, so that it lands before the
    run ends however fast its steps are."""
    rng = random.Random(seed)
    before = run_dirs_named(cwd / "runs", name)
    job = start(cwd, args, entry=entry, rendezvous=rendezvous)
    run_dir = new_run_dir(cwd / "runs", name, before, job)
    done = 0
    while done < kills:
        target = len(ledger(run_dir)) + rng.randint(*steps)
        if last_step is not None:
            target = min(target, last_step - 1)
        wait_for(lambda: len(ledger(run_dir)) >= target or job.poll() is not None, timeout=wait_s)
        time.sleep(rng.uniform(0.0, delay_s))
        if job.poll() is not None:
            break
        kill_job(job)
        done += 1
        job = start(cwd, ["--resume", run_dir.name], entry=entry, rendezvous=rendezvous)
    _, err = job.communicate(timeout=finish_s)
    assert job.returncode == 0, err
    assert done >= 1
    return run_dir


def cut_back_copy(run_dir: Path, step: int, suffix: str = "-cut") -> Path:
    """A copy of ``run_dir`` as if it had died right after its checkpoint ``step``."""
    copy = run_dir.parent / (run_dir.name + suffix)
    shutil.copytree(run_dir, copy)
    checkpoints = copy / "checkpoints"
    for path in checkpoints.glob("step_*"):
        if int(path.name.split("_")[1]) > step:
            shutil.rmtree(path)
    (checkpoints / "LATEST").write_text(f"step_{step:08d}")
    return copy


def one_rank_resume_keeps_the_batches(cwd: Path, reference: Path, *, step: int = 4,
                                      same: tuple[str, ...] = ()) -> list[dict]:
    """Resume a copy of the 2-rank run ``reference``, cut back to its checkpoint ``step``, on one
    rank, and assert that it saw the same batches (``batch_hash`` and the ledger keys ``same``)
    and losses within fp32 noise of the reduction order. Returns the resumed copy's ledger."""
    copy = cut_back_copy(reference, step, "-one-rank")
    resumed = train(cwd, ["--resume", copy.name], nproc=1)
    assert resumed.returncode == 0, resumed.stderr
    ref, got = ledger(reference), ledger(copy)
    for key in ("batch_hash", *same):
        assert [r[key] for r in got] == [r[key] for r in ref], key
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
    return got


def replay_verifies(cwd: Path, run_dir: Path, steps: tuple[int, ...] = (3, 6), *, nproc: int = 2,
                    overrides: tuple[str, ...] = ()) -> None:
    """``--replay`` each step of ``run_dir`` (by default one before and one after a checkpoint
    every 4 steps), with the resumable ``overrides``, and assert that it matched the ledger."""
    for step in steps:
        result = train(cwd, ["--replay", run_dir.name, "--step", str(step), *overrides], nproc=nproc)
        assert result.returncode == 0, result.stderr
        assert "match" in result.stdout


def gathered_embedding_grad_matches_dense(cwd: Path, args_for: Callable[[str], list[str]], *, nproc: int = 2) -> None:
    """Train ``args_for(how)`` with ``parallel.ddp_embedding_grad`` dense and gathered; assert the
    gathered run took the all-gather path and that both saw the same batches, with losses
    within fp32 rounding of each other."""
    ledgers = {}
    for how in ("dense", "gathered"):
        result = train(cwd, args_for(how), nproc=nproc)
        assert result.returncode == 0, result.stderr
        ledgers[how] = ledger(result.run_dir if result.run_dir.is_absolute() else cwd / result.run_dir)
    assert "is all-gathered as rows" in result.stdout + result.stderr
    assert [r["batch_hash"] for r in ledgers["gathered"]] == [r["batch_hash"] for r in ledgers["dense"]]
    for a, b in zip(ledgers["dense"], ledgers["gathered"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]


def stall_kill_and_resume(cwd: Path, args: list[str], *, name: str, entry: str = TRAIN,
                          rendezvous: str = "direct") -> Path:
    """Start ``args`` (run.name ``name``, 6 steps, a checkpoint at step 4) with step 5's data
    stalled, SIGKILL the job there, after the step-4 line (the step-4 checkpoint may be complete
    or torn), resume it by run ID without the fault, and return its run dir."""
    before = run_dirs_named(cwd / "runs", name)
    job = start(cwd, [*args, "runtime.faults=[slow_data@5]", "runtime.fault_slow_data_s=30"], entry=entry,
                rendezvous=rendezvous)
    run_dir = new_run_dir(cwd / "runs", name, before, job)
    assert wait_for(lambda: len(ledger(run_dir)) >= 4, timeout=120), job.stderr
    assert job.poll() is None
    kill_job(job)
    assert len(ledger(run_dir)) == 4
    resumed = train(cwd, ["--resume", run_dir.name, "runtime.faults=[]"], entry=entry, rendezvous=rendezvous)
    assert resumed.returncode == 0, resumed.stderr
    return run_dir
