"""The run-dir lock is exclusive even when several processes find a stale lock at once."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess

import pytest

from core.exceptions import RunDirLockedError
from core.run_context import RunDirLock

TRIALS = 200
CONTENDERS = 3


def _contend(lock_paths, start, done, results):
    for path in lock_paths:
        start.wait()
        lock = RunDirLock(path)
        try:
            lock.acquire()
            results.put((str(path), os.getpid()))
        except RunDirLockedError:
            lock = None
        done.wait()  # hold it until every contender has tried
        if lock is not None:
            lock.release()


def test_exactly_one_of_racing_processes_takes_a_stale_lock(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = json.dumps({"pid": dead.pid, "host": os.uname().nodename, "time": 0})
    paths = []
    for i in range(TRIALS):
        (tmp_path / f"run{i}").mkdir()
        path = tmp_path / f"run{i}" / ".lock"
        path.write_text(stale)  # left by a killed run: no process holds it
        paths.append(path)
    ctx = multiprocessing.get_context("fork")
    start, done, results = ctx.Barrier(CONTENDERS), ctx.Barrier(CONTENDERS), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(paths, start, done, results)) for _ in range(CONTENDERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * CONTENDERS
    winners: dict[str, list[int]] = {}
    while not results.empty():
        path, pid = results.get()
        winners.setdefault(path, []).append(pid)
    assert {str(p) for p in paths} == set(winners), "a stale lock was taken by no one"
    assert all(len(pids) == 1 for pids in winners.values()), {k: v for k, v in winners.items() if len(v) > 1}


def test_lock_is_refused_while_held_and_free_after_release(tmp_path):
    first, second = RunDirLock(tmp_path / ".lock"), RunDirLock(tmp_path / ".lock")
    first.acquire()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirLockedError, match=str(os.getpid())):
        second.acquire()
    first.release()
    assert not (tmp_path / ".lock").exists()
    second.acquire()
    second.release()
