"""Worker processes for the stages that hold the GIL.

Each child is a fresh interpreter (``python -c``), not a fork: the trainer may hold CUDA
contexts and threads, and a spawn-by-import of ``__main__`` would re-run the training
script. A child receives the stage objects once, then applies ``stage.process`` to the
chunks it is sent over a pipe. Worker threads borrow an idle child per chunk, so a thread
waiting for its child releases the GIL and the main process keeps moving.

A child exits on end-of-file of its pipe, so it also goes away if the trainer dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from core.exceptions import DataError
from data.pipeline.queues import BoundedQueue, Closed

_REPO_ROOT = Path(__file__).resolve().parents[2]
_CHILD = "import sys; from data.pipeline.procpool import child_main; child_main(int(sys.argv[1]), int(sys.argv[2]))"
_JOIN_TIMEOUT_S = 10.0


class _Child:
    def __init__(self, stages: dict) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w), env=env, stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C goes to the trainer, which stops cleanly
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.send = Connection(to_child_w, readable=False)
        self.recv = Connection(from_child_r, writable=False)
        self.send.send(stages)

    def run(self, stage: str, chunk):
        try:
            self.send.send((stage, chunk))
            status, payload = self.recv.recv()
        except (EOFError, OSError) as exc:
            code = self.process.poll()
            raise DataError(f"data worker process died (exit code {code})", stage=stage,
                            hint="look for an out-of-memory kill; lower data.workers or data.max_in_flight") from exc
        if status == "ok":
            return payload
        raise DataError(f"{stage} stage failed in a worker process: {payload}", stage=stage,
                        hint="this is a bug in the data pipeline; report it")

    def close(self) -> None:
        for conn in (self.send, self.recv):
            try:
                conn.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=_JOIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ProcessPool:
    """``size`` child processes; ``run`` applies a named stage to a chunk in an idle one."""

    def __init__(self, size: int, stages: dict) -> None:
        self._children = []
        self._idle: BoundedQueue[_Child] = BoundedQueue("process-pool", max(1, size))
        try:
            for _ in range(size):
                child = _Child(stages)
                self._children.append(child)
                self._idle.put(child)
        except BaseException:
            self.close()
            raise

    def run(self, stage: str, chunk):
        child = self._idle.get()
        try:
            return child.run(stage, chunk)
        finally:
            try:
                self._idle.put(child)
            except Closed:
                pass

    def pids(self) -> list[int]:
        return [c.process.pid for c in self._children]

    def close(self) -> None:
        self._idle.close()
        for child in self._children:
            child.close()
        self._children = []


def child_main(read_fd: int, write_fd: int) -> None:
    """The worker process: apply stages to chunks until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    recv = Connection(read_fd, writable=False)
    send = Connection(write_fd, readable=False)
    try:
        stages = recv.recv()
        while True:
            try:
                name, chunk = recv.recv()
            except EOFError:
                return
            try:
                send.send(("ok", stages[name].process(chunk)))
            except Exception as exc:  # reported to the parent, which raises it as a DataError
                send.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
