"""``python tests/zygote.py SOCKET MODULE``: import MODULE once, then start every job asked for on the
Unix socket SOCKET as a fork of this process, so that a job pays no import of its own.

A job is a command ``[python, SCRIPT, ARGS...]`` or ``[python, -m, MODULE, ARGS...]`` with its
working directory, environment and standard streams (file descriptors sent over the socket). Its
process is what ``python SCRIPT ARGS`` (``python -m MODULE ARGS``) would be, started in a session
of its own (as ``subprocess.Popen(start_new_session=True)``): SCRIPT runs as ``__main__`` with its
folder first on the module path (MODULE, with the working directory first), and leaves through the
interpreter's own exit. What differs is only what MODULE's import read of the environment: the
caller (``Zygote.start``) sends a job here only when its environment equals this process's, but
for the variables that change from test to test (``VOLATILE``).

On the 2-core test machine importing train.py's modules (torch and Lockstep) costs about 4 s of
CPU: tests/launch.py starts the suite's jobs here, one zygote per pytest worker, and pays it once
per worker instead of once per job. tests/ranks.py (ranks forked from one import) and
tests/in_turn.py (runs forked from one import) do the same inside one job; run here, their
``--preload`` finds the module imported.

The client side (``Zygote``, ``Job``) imports nothing heavy: it runs in the pytest process.
"""

from __future__ import annotations

import gc
import os
import pickle
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

POLL_S = 0.02
MODULE_FLAG = "-m"
VOLATILE = frozenset({"TMPDIR", "PYTEST_CURRENT_TEST"})
"""Environment variables a job may set to other values than the zygote's: none is read on import."""
_LENGTH = struct.Struct("!I")
_CODE = struct.Struct("!q")
_END = struct.Struct("!qd")  # a job's exit code and CPU seconds (its own and its waited-for children's)
_finished_cpu_s = 0.0


# ---------------------------------------------------------------------------------------- the server

def _settle() -> None:
    """What every job would otherwise repeat after the import: the interpreter's package list
    (a run's ``pip-freeze.txt``, experiments/artifacts.py, cached once a process), then the
    import's objects moved out of the collector's sight (``gc.freeze``), so that a job's full
    collections (its teardown's, the loop's schedule) do not walk torch's module graph again."""
    if "experiments.artifacts" in sys.modules:
        sys.modules["experiments.artifacts"].freeze_lines()
    gc.collect()
    gc.freeze()


def serve(path: str, module: str) -> None:
    """Import ``module``, then accept jobs on ``path`` until the parent process is gone."""
    __import__(module)
    _settle()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    # A job's end (SIGCHLD) wakes the loop through this pipe; it also looks every second whether the
    # pytest worker that started it is still there.
    woken, wake = os.pipe()
    for fd in (woken, wake):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake)
    parent = os.getppid()
    jobs: dict[int, socket.socket] = {}  # pid -> the connection that waits for its exit code
    while os.getppid() == parent:
        readable, _, _ = select.select([server, woken], [], [], 1.0)
        if woken in readable:
            while True:
                try:
                    if not os.read(woken, 512):
                        break
                except BlockingIOError:
                    break
        if server in readable:
            conn, _ = server.accept()
            command, cwd, env, fds = _receive(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for held in (server, conn, *jobs.values()):
                    held.close()
                os.close(woken)
                os.close(wake)
                become_job(command, cwd, env, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(_CODE.pack(pid))
            jobs[pid] = conn
        while jobs:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = jobs.pop(pid, None)
            if conn is None:
                continue
            try:
                conn.sendall(_END.pack(os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime))
            except OSError:  # the caller has gone
                pass
            conn.close()
    for pid in jobs:  # the pytest worker has gone: so do its jobs
        _kill_group(pid)


def _receive(conn: socket.socket) -> tuple[list[str], str, dict[str, str], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, _LENGTH.size, 3)
    while len(head) < _LENGTH.size:
        head += conn.recv(_LENGTH.size - len(head))
    (size,) = _LENGTH.unpack(head)
    body = b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    command, cwd, env = pickle.loads(body)
    return command, cwd, env, list(fds)


def become_job(command: list[str], cwd: str, env: dict[str, str], fds: list[int]) -> None:
    """In a forked child: ``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` (``command[1:]``).
    Never returns: the script's exit (``SystemExit``, an exception, or its end as exit 0) leaves
    through the interpreter's own exit."""
    os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR read again
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    if command[1] == MODULE_FLAG:  # sys.argv[0] becomes the module's file, as python -m sets it
        sys.argv = [command[2], *command[3:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(command[2], run_name="__main__", alter_sys=True)
        raise SystemExit(0)
    script = command[1]
    sys.argv = [script, *command[2:]]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------- the client

def finished_jobs_cpu_s() -> float:
    """CPU seconds of the jobs this process's zygotes ran whose end it has read (``Job.wait``): a
    zygote lives as long as this process, so ``resource.getrusage(RUSAGE_CHILDREN)`` sees them only
    at its end (tests/group_costs.py adds them to a test's CPU seconds)."""
    return _finished_cpu_s


class ZygoteGone(RuntimeError):
    """The zygote ended (its import failed, or it was killed) before it could start a job."""


class Job:
    """A job the zygote started: the part of ``subprocess.Popen``'s interface the tests use (``pid``,
    ``poll``, ``wait``, ``communicate``, ``send_signal``, ``kill``, ``terminate``, ``stdout``,
    ``stderr``, ``returncode``). ``pid`` leads the job's process group."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], stdout, stderr) -> None:
        self.conn, self.pid, self.args = conn, pid, args
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None
        self.cpu_s: float | None = None
        """CPU seconds of the job and its waited-for children, once it has ended."""
        self._readers: dict[str, threading.Thread] = {}
        self._output: dict[str, str] = {}

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.conn], [], [], 0)[0]:
            self._read_code()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_code()
        return self.returncode

    def _read_code(self) -> None:
        global _finished_cpu_s
        data = b""
        while len(data) < _END.size:
            chunk = self.conn.recv(_END.size - len(data))
            if not chunk:
                raise RuntimeError(f"the zygote ended before job {self.pid} did")
            data += chunk
        self.returncode, self.cpu_s = _END.unpack(data)
        _finished_cpu_s += self.cpu_s
        self.conn.close()

    def communicate(self, input=None, timeout: float | None = None) -> tuple[str, str]:
        """Both streams read to their end, then the exit code: as ``Popen.communicate`` (text)."""
        if input is not None:
            raise ValueError("a zygote job has no standard input")
        deadline = None if timeout is None else time.monotonic() + timeout
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and name not in self._readers:
                reader = threading.Thread(target=self._drain, args=(name, stream), daemon=True)
                reader.start()
                self._readers[name] = reader
        for reader in self._readers.values():
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._output.get("stdout"), self._output.get("stderr")

    def _drain(self, name: str, stream) -> None:
        self._output[name] = stream.read()
        stream.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A zygote process for this (pytest) process, started by ``ensure`` and ended with it."""

    def __init__(self, python: str, script: Path, module: str, env: dict[str, str]) -> None:
        self.folder = tempfile.mkdtemp(prefix="zygote-")
        self.path = os.path.join(self.folder, "socket")
        self.env = env
        self.python = python
        self.proc = subprocess.Popen([python, str(script), self.path, module], env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def alive(self) -> bool:
        return self.proc.poll() is None

    @staticmethod
    def runs(command: list[str], python: str) -> bool:
        """Whether ``command`` is one a zygote starts: ``python SCRIPT.py ...`` or ``python -m MODULE ...``."""
        return len(command) >= 2 and command[0] == python and (
            command[1].endswith(".py") or (command[1] == MODULE_FLAG and len(command) >= 3))

    def matches(self, env: dict[str, str]) -> bool:
        """Whether a job in ``env`` may start here: this zygote imported in the same environment (but
        ``VOLATILE``)."""
        def kept(e: dict[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items() if k not in VOLATILE}

        return kept(env) == kept(self.env)

    def start(self, command: list[str], cwd: Path, env: dict[str, str], *, capture: bool = True,
              output: int | None = None) -> Job:
        """``command`` as a job (``Job``), its stdout and stderr in pipes (``capture``), both in the
        open file ``output`` (a file descriptor) where one is given, or else this process's."""
        conn = self._connect()
        capture = capture and output is None
        with open(os.devnull, "rb") as devnull:
            pipes = [os.pipe() for _ in range(2)] if capture else []
            outputs = [w for _, w in pipes] if capture else [output, output] if output is not None else [1, 2]
            body = pickle.dumps((list(command), str(cwd), dict(env)))
            socket.send_fds(conn, [_LENGTH.pack(len(body))], [devnull.fileno(), *outputs])
            conn.sendall(body)
        for _, w in pipes:
            os.close(w)
        data = b""
        while len(data) < _CODE.size:
            chunk = conn.recv(_CODE.size - len(data))
            if not chunk:
                raise ZygoteGone("the zygote ended before starting the job")
            data += chunk
        (pid,) = _CODE.unpack(data)
        streams = [os.fdopen(r, "r") for r, _ in pipes] if capture else [None, None]
        return Job(conn, pid, list(command), *streams)

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + 120  # the zygote's import, on a busy machine
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.path)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if not self.alive() or time.monotonic() > deadline:
                    raise ZygoteGone(f"the zygote at {self.path} did not start (exit {self.proc.poll()})") from None
                time.sleep(POLL_S)

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.rmdir(self.folder)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
