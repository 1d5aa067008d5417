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
    result = launch.train(tmp_path, ["--config", TINY, *overrides], nproc=2, timeout=120)
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
