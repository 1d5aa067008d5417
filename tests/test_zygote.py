"""tests/zygote.py: a job forked from the zygote is what ``python SCRIPT ARGS`` is (its arguments,
working directory, environment, streams, exit code, own session), and tests/launch.py starts a job
there only in the environment the zygote imported in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests import launch
from tests.zygote import Job, Zygote, ZygoteGone, finished_jobs_cpu_s

pytestmark = pytest.mark.slow

SCRIPT = """
import json, os, sys, time
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "path0": sys.path[0],
                  "value": os.environ.get("ZYGOTE_TEST_VALUE"), "pgid": os.getpgid(0), "pid": os.getpid()}))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""


@pytest.fixture()
def zygote(tmp_path):
    env = {**os.environ, "ZYGOTE_TEST_VALUE": "imported"}
    z = Zygote(sys.executable, launch.ROOT / "tests" / "zygote.py", "json", env)
    yield z, env
    z.close()


def test_a_job_is_the_script_run_as_main_in_its_own_session(zygote, tmp_path):
    z, env = zygote
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    before = finished_jobs_cpu_s()
    job = z.start([sys.executable, str(script), "3", "x"], work, {**env, "TMPDIR": str(tmp_path)})
    assert job.cpu_s is None
    out, err = job.communicate(timeout=60)
    assert job.cpu_s >= 0 and finished_jobs_cpu_s() == before + job.cpu_s  # tests/group_costs.py counts it
    seen = json.loads(out)
    assert job.returncode == 3 and err == "to stderr\n"
    assert seen["argv"] == [str(script), "3", "x"] and seen["name"] == "__main__"
    assert seen["cwd"] == str(work) and seen["path0"] == str(tmp_path) and seen["value"] == "imported"
    assert seen["pid"] == job.pid == seen["pgid"]  # a session (and process group) of its own


def test_a_job_writes_both_streams_into_an_open_file_where_one_is_given(zygote, tmp_path):
    z, env = zygote
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    log = tmp_path / "job.log"
    with log.open("a") as handle:
        job = z.start([sys.executable, str(script), "0"], tmp_path, env, output=handle.fileno())
    assert job.stdout is None and job.stderr is None and job.wait(timeout=60) == 0
    lines = log.read_text().splitlines()  # the two streams' lines, in either order
    assert len(lines) == 2 and "to stderr" in lines
    assert json.loads(next(line for line in lines if line != "to stderr"))["argv"] == [str(script), "0"]


def test_a_module_job_is_what_python_dash_m_runs(zygote, tmp_path):
    z, env = zygote
    (tmp_path / "zygote_job_module.py").write_text(SCRIPT)
    command = [sys.executable, "-m", "zygote_job_module", "4", "y"]
    job = z.start(command, tmp_path, env)
    out, err = job.communicate(timeout=60)
    fresh = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    seen, want = json.loads(out), json.loads(fresh.stdout)
    assert job.returncode == fresh.returncode == 4 and err == fresh.stderr == "to stderr\n"
    assert {k: seen[k] for k in ("argv", "cwd", "name", "path0", "value")} == \
        {k: want[k] for k in ("argv", "cwd", "name", "path0", "value")}
    assert seen["argv"][0] == str(tmp_path / "zygote_job_module.py") and seen["pid"] == seen["pgid"]


def test_a_killed_job_reports_the_signal_and_a_wait_times_out(zygote, tmp_path):
    z, env = zygote
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    job = z.start([sys.executable, str(script), "sleep"], tmp_path, env)
    assert job.stdout.readline()  # running
    assert job.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(timeout=0.2)
    launch.kill_job(job)  # SIGKILL to its process group
    assert job.returncode == -signal.SIGKILL
    job.communicate(timeout=10)


def test_only_the_environment_the_zygote_imported_in_starts_there(zygote, tmp_path):
    z, env = zygote
    assert Zygote.runs([sys.executable, "x.py"], sys.executable)
    assert Zygote.runs([sys.executable, "-m", "training"], sys.executable)
    assert not Zygote.runs([sys.executable, "-m"], sys.executable)
    assert not Zygote.runs([sys.executable, "-c", "pass"], sys.executable)
    assert z.matches({**env, "TMPDIR": "/elsewhere", "PYTEST_CURRENT_TEST": "another"})
    assert not z.matches({**env, "ZYGOTE_TEST_VALUE": "changed"})


def test_launch_runs_train_jobs_in_zygotes(tmp_path):
    job = launch.popen([sys.executable, str(launch.ROOT / "tests" / "ranks.py"), "1", str(launch.free_port()),
                        str(launch.ROOT / "tests" / "no_such_script.py")], tmp_path, launch.env(tmp_path))
    assert isinstance(job, Job)
    _, err = launch.finish(job, 120)
    assert job.returncode == 1 and "no_such_script.py" in err


def test_a_zygote_whose_import_failed_is_gone_and_starts_nothing(tmp_path):
    z = Zygote(sys.executable, launch.ROOT / "tests" / "zygote.py", "no_such_module_here", dict(os.environ))
    try:
        with pytest.raises(ZygoteGone):
            z.start([sys.executable, str(tmp_path / "job.py")], tmp_path, dict(os.environ))
    finally:
        z.close()
