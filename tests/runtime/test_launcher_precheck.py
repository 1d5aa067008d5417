"""``python train.py --nproc N`` checks the command line and the config for N ranks in its own
process, before it starts a rank: every violated constraint between the batch, the streams and
the ranks at once (core/batch_shape.py), one line without a rank's prefix, exit 2."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

from core import config as config_lib
from core.batch_shape import batch_shape_violations, check_batch_shape
from core.exceptions import ConfigError, UsageError
from core.run_context import RunPaths, determinism_env
from tests import launch
from training.command_line import check_before_ranks

TINY = str(launch.ROOT / "configs" / "tiny.yaml")  # global batch 16, micro-batch 4, 8 streams
TWO_WRONG_ON_TWO_RANKS = ["train.global_batch_size=12", "data.num_streams=3"]  # 12 % (4 x 2) and 3 % 2


def test_every_violation_is_listed_in_one_line():
    config = config_lib.load(TINY)
    assert batch_shape_violations(config, 2) == []
    found = batch_shape_violations(config, 3)
    assert [error.context["key"] for error in found] == ["train.global_batch_size", "data.num_streams"]
    with pytest.raises(ConfigError) as info:
        check_batch_shape(config, 3)
    line = str(info.value)
    assert "\n" not in line and line.startswith("config error: 2 batch constraints fail on 3 ranks: (1) ")
    assert "micro_batch_size=4 x data-parallel ranks=3" in line and "data.num_streams=8 is not divisible" in line
    assert line.endswith("-> world sizes this config fits: 1, 2, 4")


def test_one_violation_is_raised_as_it_is():
    config = config_lib.load(TINY, ["parallel.strategy=none"])
    with pytest.raises(ConfigError) as info:
        check_batch_shape(config, 2)
    assert str(info.value) == ("config error: parallel.strategy=none cannot run on 2 ranks [key=parallel.strategy] "
                               "-> use ddp or fsdp for several ranks")


def test_load_for_a_world_size_reports_the_streams_with_the_ranks():
    """global batch % streams holds on any world size and was refused alone before the ranks'
    checks ran: with the world size, it comes with them."""
    with pytest.raises(ConfigError) as info:
        config_lib.load(TINY, ["train.global_batch_size=12"], world_size=3)
    assert "2 batch constraints fail on 3 ranks" in str(info.value)
    with pytest.raises(ConfigError, match="^config error: train.global_batch_size=12 is not divisible by data.num"):
        config_lib.load(TINY, ["train.global_batch_size=12"])


def test_the_check_reads_the_command_line_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_before_ranks(["--config", TINY], 2)
    with pytest.raises(UsageError, match="exactly one of"):
        check_before_ranks([], 2)
    with pytest.raises(ConfigError, match="train.lr must be float"):
        check_before_ranks(["--config", TINY, "train.lr=abc"], 2)
    assert list(tmp_path.iterdir()) == []


def test_a_resume_is_checked_with_its_recorded_config(tmp_path):
    config = config_lib.load(TINY, ["run.name=r"])
    paths = RunPaths(tmp_path / "r-1")
    paths.root.mkdir()
    config_lib.save(config, paths.config)
    paths.meta.write_text(json.dumps({"config_hash": config.hash,
                                      "determinism": determinism_env(config, torch.device("cpu"))}))
    check_before_ranks(["--resume", "r-1", f"run.root={tmp_path}"], 4)
    with pytest.raises(ConfigError, match="2 batch constraints fail on 3 ranks"):
        check_before_ranks(["--resume", "r", f"run.root={tmp_path}"], 3)  # a prefix, as a rank takes it


def test_a_process_alone_is_checked_for_one_rank_and_a_launched_rank_checks_itself(monkeypatch):
    """Without --nproc the config is checked before torch loads where the process is the whole job; a
    rank that torchrun or --nproc started (RANK in its environment) leaves it to its own start."""
    import runtime.fast_exit
    from runtime import launcher

    exits, asked = [], []

    def check(argv, world_size):
        asked.append(world_size)
        raise ConfigError("train.lr must be float", key="train.lr")

    monkeypatch.setattr(runtime.fast_exit, "exit_process", exits.append)
    for name in (launcher.LAUNCHER_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    launcher.launch_if_asked("train.py", ["--config", TINY], check=check)
    assert asked == [1] and exits == [ConfigError.exit_code]
    monkeypatch.setenv("RANK", "0")
    launcher.launch_if_asked("train.py", ["--config", TINY], check=check)
    assert asked == [1] and exits == [ConfigError.exit_code]
    monkeypatch.delenv("RANK")
    launcher.launch_if_asked("train.py", ["--config", TINY],
                             check=lambda argv, n: asked.append(1 / 0))  # not a typed error: the rank reports it
    assert exits == [ConfigError.exit_code]


@pytest.mark.slow
def test_nproc_answers_two_violations_before_any_rank_starts(tmp_path):
    cmd = [launch.PYTHON, str(launch.ROOT / "train.py"), "--nproc", "2", "--config", TINY, *TWO_WRONG_ON_TWO_RANKS]
    started = time.monotonic()
    result = subprocess.run(cmd, cwd=tmp_path, env=launch.env(tmp_path), capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: 2 batch constraints fail on 2 ranks"), lines
    assert "train.global_batch_size=12 is not divisible by train.micro_batch_size=4" in lines[0]
    assert "data.num_streams=3 is not divisible by data-parallel ranks=2" in lines[0]
    assert "[rank" not in result.stderr and not (tmp_path / "runs").exists()
    # Without --nproc: the same check for one rank (12 sequences over 5 streams), no prefix either.
    alone = subprocess.run([*cmd[:2], *cmd[4:-1], "data.num_streams=5"], cwd=tmp_path, env=launch.env(tmp_path),
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and alone.stdout == "", alone.stderr
    assert alone.stderr.splitlines() == ["config error: train.global_batch_size=12 is not divisible by "
                                         "data.num_streams=5 [key=train.global_batch_size] -> every stream contributes "
                                         "the same number of sequences to a global batch: use a global batch "
                                         "that is a multiple of 5, or (a new run: the stream count is part of the "
                                         "data order) a data.num_streams that divides 12"], alone.stderr
    # The launcher's own imports only, no torch (1.2-1.4 s on a 2-core machine at load 5-8; ranks
    # would add their start-up on top): the bound leaves room for a loaded test machine.
    assert elapsed < 40, elapsed


@pytest.mark.slow
def test_the_check_of_a_new_runs_config_imports_no_torch(tmp_path):
    """What makes the answer fast: a new run's command line and config are read and checked by
    modules that import no torch (models, training.objectives and their settings read lazily)."""
    probe = ("import sys\n"
             "from core.exceptions import ConfigError\n"
             "from training.command_line import check_before_ranks\n"
             f"check_before_ranks(['--config', {TINY!r}], 2)\n"
             "try:\n"
             f"    check_before_ranks(['--config', {TINY!r}, *{list(TWO_WRONG_ON_TWO_RANKS)!r}], 2)\n"
             "except ConfigError:\n"
             "    print('refused', 'torch' in sys.modules)\n")
    result = subprocess.run([launch.PYTHON, "-c", probe], cwd=launch.ROOT, env=launch.env(tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "refused False", (result.stdout, result.stderr)
