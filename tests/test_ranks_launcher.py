"""tests/ranks.py, the guarantee table's launcher without torchrun's agent: each rank gets
torchrun's environment, and the module path and the imports of ``--preload`` (a forked rank runs
its script as ``python SCRIPT`` would, with that module imported), a failing rank ends the job as
torchrun ends it (the others stopped, its code in an ``exitcode : N`` line that
``launch.Result.exit_code`` reads), and a job whose ranks all exit 0 exits 0. Its ``--call``
(``launch.spawn_ranks``, ``dist_harness.run_on_ranks``) forks a function's ranks, separate
processes, from one fresh process, and their exit codes come back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launch

pytestmark = pytest.mark.slow

RANK_SCRIPT = """
import json, os, sys, time
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")
rank = int(os.environ["RANK"])
with open(f"rank{rank}.json", "w") as out:
    json.dump({"env": {key: os.environ[key] for key in keys}, "path0": sys.path[0], "__name__": __name__,
               "preloaded": "colorsys" in sys.modules}, out)
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(3)
if sys.argv[1] == "fail":
    time.sleep(60)  # stopped by the launcher once rank 1 failed
"""


def _run(tmp_path, mode: str, preload: tuple[str, ...] = ()) -> launch.Result:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    argv = [sys.executable, str(launch.ROOT / "tests" / "ranks.py"), *preload, "2", "29999", str(script), mode]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    return launch.Result(proc.returncode, proc.stdout, proc.stderr)


def test_every_rank_gets_torchruns_environment_and_the_job_exits_0(tmp_path):
    import json

    result = _run(tmp_path, "ok", preload=("--preload", "colorsys"))  # a small module no rank imports itself
    assert result.returncode == 0 and result.exit_code == 0, result.stderr
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["path0"] == str(tmp_path.resolve()) and seen["__name__"] == "__main__" and seen["preloaded"]
        assert seen["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "GROUP_RANK": "0", "ROLE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


def test_a_failing_rank_stops_the_others_and_its_code_is_the_jobs(tmp_path):
    import time

    started = time.monotonic()
    result = _run(tmp_path, "fail")
    assert time.monotonic() - started < 20  # rank 0 was stopped, not waited for (it sleeps 60 s)
    assert result.returncode == 1 and result.exit_code == 3, result.stderr
    # only the rank that failed on its own is named, not rank 0, which the launcher stopped
    assert result.stderr.splitlines() == ["[tests/ranks.py] rank 1 failed: exitcode : 3"]


def test_the_table_starts_its_jobs_through_it():
    command = launch.command(2, ["--config", "x.yaml"], rendezvous="direct")
    assert command[1:5] == [str(launch.ROOT / "tests" / "ranks.py"), "--preload", "train", "2"]
    assert command[6:] == [str(launch.ROOT / "train.py"), "--config", "x.yaml"]


def _write_pids(rank: int, out: str) -> None:
    Path(out, f"rank{rank}").write_text(f"{os.getpid()} {os.getppid()}")
    if rank == 1:
        raise SystemExit(3)


def test_spawn_ranks_forks_separate_ranks_from_one_fresh_process(tmp_path):
    assert launch.spawn_ranks(_write_pids, lambda rank: (rank, str(tmp_path))) == [0, 3]
    (pid0, parent0), (pid1, parent1) = ((tmp_path / f"rank{rank}").read_text().split() for rank in (0, 1))
    assert pid0 != pid1 and parent0 == parent1 != str(os.getpid())



def _hang_in_a_forked_child(pid_file: str) -> None:
    import time

    child = os.fork()
    if child == 0:  # a rank that never returns
        Path(pid_file).write_text(str(os.getpid()))
        time.sleep(3600)
        os._exit(0)
    os.waitpid(child, 0)  # its parent waits for it, as mp.start_processes(join=True) does


def test_a_hung_call_fails_naming_its_function_after_printing_the_stacks_and_leaves_no_process(tmp_path, capfd):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(TimeoutError, match=r"_hang_in_a_forked_child did not end within 8 s"):
        launch.in_fresh_process(_hang_in_a_forked_child, str(pid_file), limit_s=8)
    err = capfd.readouterr().err
    # faulthandler's dump from both processes: the call's, waiting on its child, and the child's, asleep
    assert err.count("in _hang_in_a_forked_child") >= 2, err
    child = int(pid_file.read_text())
    assert launch.wait_for(lambda: not Path(f"/proc/{child}").exists(), 5), "the forked child outlived the limit"
