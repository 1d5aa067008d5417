"""train.py's command line: bad input exits 2 with a message naming the key, before any
process group or run dir exists (tested through real torchrun launches)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import launch

TINY = str(launch.ROOT / "configs" / "tiny.yaml")


def _assert_config_error(result, *needles, cwd: Path):
    assert result.exit_code == 2, (result.stdout, result.stderr)
    for needle in needles:
        assert needle in result.stderr, result.stderr
    assert not (cwd / "runs").exists(), "a run dir was created for a bad config"
    assert "run_id:" not in result.stdout


CONFIG_ERRORS = {
    "unknown-key": (["train.max_step=3"], ["train.max_step", "did you mean train.max_steps"]),
    "wrong-type": (["train.micro_batch_size=four"], ["train.micro_batch_size", "int"]),
    "indivisible-batch": (["train.global_batch_size=16", "train.micro_batch_size=3"],
                          ["train.global_batch_size", "micro_batch_size"]),
    "model-shape": (["model.num_kv_heads=3"], ["model.num_kv_heads", "model.num_heads=4"]),
    "cuda-without-a-gpu": (["parallel.device=cuda"], ["parallel.device", "no CUDA device is visible"]),  # launch hides GPUs
}


@pytest.mark.parametrize("case", ["unknown-key", "cuda-without-a-gpu"])
def test_config_errors_exit_2_on_two_ranks(tmp_path, case):
    overrides, needles = CONFIG_ERRORS[case]
    result = launch.train(tmp_path, ["--config", TINY, *overrides], nproc=2, timeout=120, rendezvous="static")
    _assert_config_error(result, *needles, cwd=tmp_path)


@pytest.mark.parametrize("case", ["wrong-type", "indivisible-batch", "model-shape"])
def test_config_errors_exit_2_in_process(tmp_path, monkeypatch, capsys, case):
    """The same path as on two ranks (the config is resolved before anything else), called
    in this process: the launches above already show it happens before any process group."""
    import train

    overrides, needles = CONFIG_ERRORS[case]
    monkeypatch.chdir(tmp_path)
    code = train.main(["--config", TINY, *overrides])
    captured = capsys.readouterr()
    _assert_config_error(SimpleNamespace(exit_code=code, stdout=captured.out, stderr=captured.err), *needles,
                         cwd=tmp_path)


def test_missing_config_file_exits_2(tmp_path):
    result = launch.train(tmp_path, ["--config", "nope.yaml"], nproc=1, timeout=60)
    _assert_config_error(result, "nope.yaml", "does not exist", cwd=tmp_path)


def test_usage_errors_exit_2(tmp_path):
    result = launch.train(tmp_path, ["--config", TINY, "--step", "3"], nproc=1, timeout=60)
    _assert_config_error(result, "--step", cwd=tmp_path)
    result = launch.train(tmp_path, [], nproc=1, timeout=60)
    _assert_config_error(result, "--config", cwd=tmp_path)


def test_resume_of_unknown_run_exits_4(tmp_path):
    result = launch.train(tmp_path, ["--resume", "no-such-run"], nproc=1, timeout=60)
    assert result.exit_code == 4, result.stderr
    assert "no-such-run" in result.stderr


@pytest.mark.slow
def test_resuming_a_finished_run_says_to_raise_max_steps(e2e_workdir):
    from tests.e2e_config import e2e_args

    done = launch.train(e2e_workdir, e2e_args(max_steps=2, name="done"), nproc=1)
    assert done.exit_code == 0, done.stderr
    again = launch.train(e2e_workdir, ["--resume", done.run_id], nproc=1)
    assert again.exit_code == 0, again.stderr
    last = again.stdout.strip().splitlines()[-1]
    assert last == (f"finished: run {done.run_id} already has 2 steps (train.max_steps=2), nothing to train -> "
                    f"raise train.max_steps to continue it, e.g. --resume {done.run_id} train.max_steps=4"), last
    assert "n/a" not in again.stdout and "Traceback" not in again.stderr, again.stderr


@pytest.mark.slow
def test_resume_takes_a_unique_run_id_prefix_and_warns_of_a_reshaped_schedule(e2e_workdir):
    """``--resume`` takes the prefixes ``runs show`` takes; raising max_steps warns with both LRs."""
    from tests.e2e_config import e2e_args
    from tests.guarantees import run_dir

    done = launch.train(e2e_workdir, e2e_args(max_steps=3, name="prefix"), nproc=1)
    assert done.exit_code == 0, done.stderr
    prefix = done.run_id[:-4]
    resumed = launch.train(e2e_workdir, ["--resume", prefix, "train.max_steps=5"], nproc=1)
    assert resumed.exit_code == 0, resumed.stderr
    assert resumed.run_id == done.run_id
    assert [r["step"] for r in launch.ledger(run_dir(e2e_workdir, resumed))] == [1, 2, 3, 4, 5]
    warning = next(line for line in resumed.stdout.splitlines() if "reshapes" in line)
    assert "train.max_steps 3 -> 5" in warning and "step 4," in warning and warning.count("lr ") == 1, warning
    assert warning.endswith("-> add train.schedule_steps=3 to keep the recorded one"), warning
    other = run_dir(e2e_workdir, done).parent / (prefix + "zzzz")  # a second run the prefix names
    other.mkdir()
    (other / "config.yaml").write_bytes((run_dir(e2e_workdir, done) / "config.yaml").read_bytes())
    ambiguous = launch.train(e2e_workdir, ["--resume", prefix], nproc=1)
    assert ambiguous.exit_code == 4, ambiguous.stderr
    assert "matches 2 runs" in ambiguous.stderr and done.run_id in ambiguous.stderr and other.name in ambiguous.stderr
    assert "Traceback" not in ambiguous.stderr, ambiguous.stderr


@pytest.mark.slow
def test_the_system_python_without_the_environment_says_to_activate_it(tmp_path):
    """`python3 train.py` with an interpreter that lacks torch: one line, exit 2, no traceback."""
    import subprocess
    import sys

    # -S: without the site module, this interpreter sees the standard library only (as the
    # system Python does, where nothing is installed), and train.py through PYTHONPATH.
    proc = subprocess.run([sys.executable, "-S", str(launch.ROOT / "train.py"), "--config", TINY], cwd=tmp_path,
                          env=launch.env(tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "has no torch" in lines[0] and "make setup" in lines[0] and ". .venv/bin/activate" in lines[0], lines[0]


def test_help_names_nproc_and_exits_0(tmp_path, monkeypatch, capsys):
    import train

    monkeypatch.chdir(tmp_path)
    assert train.main(["--help"]) == 0
    captured = capsys.readouterr()
    assert "--nproc N" in captured.out and captured.err == "", captured.err
