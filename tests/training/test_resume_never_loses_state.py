"""Resume never throws away a run's record silently:

- every checkpoint damaged: exit 4 listing them (no silent restart from step 1), ledger kept;
- a damaged line in the middle of ledger.jsonl: exit 4 naming the line, no line dropped;
- a torn last line (a writer killed mid-append) is still dropped, and the run continues;
- a run dir moved to another root resumes from there with ``run.root=NEW``.
"""

from __future__ import annotations

import shutil

import pytest

from core.exceptions import CheckpointError
from tests import launch
from tests.e2e_config import e2e_args
from training.record import ledger as ledger_lib

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(e2e_workdir):
    """A 4-step run with checkpoints at steps 2 and 4."""
    result = launch.train(
        e2e_workdir,
        e2e_args(max_steps=4, name="keep", overrides=["checkpoint.interval=2", "run.root=runs-keep"]),
        nproc=1,
    )
    assert result.returncode == 0, result.stderr
    return e2e_workdir / result.run_dir, result.run_id


def _copy(run_dir, tmp_path):
    root = tmp_path / "moved"
    shutil.copytree(run_dir, root / run_dir.name)
    return root, root / run_dir.name


def test_resume_with_every_checkpoint_damaged_exits_4_and_lists_them(finished_run, e2e_workdir, tmp_path):
    run_dir, run_id = finished_run
    root, copy = _copy(run_dir, tmp_path)
    for step in (2, 4):
        shard = next((copy / "checkpoints" / f"step_{step:08d}" / "dcp").glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    before = (copy / "ledger.jsonl").read_text()
    result = launch.train(e2e_workdir, ["--resume", run_id, f"run.root={root}", "train.max_steps=6"], nproc=1)
    assert result.exit_code == 4, result.stdout + result.stderr
    assert "steps 2, 4" in result.stderr
    assert (copy / "ledger.jsonl").read_text() == before


def test_a_moved_run_resumes_from_its_new_root(finished_run, e2e_workdir, tmp_path):
    run_dir, run_id = finished_run
    root, copy = _copy(run_dir, tmp_path)
    result = launch.train(e2e_workdir, ["--resume", run_id, f"run.root={root}", "train.max_steps=5"], nproc=1)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["step"] for r in launch.ledger(copy)] == [1, 2, 3, 4, 5]
    assert launch.ledger(copy)[:4] == launch.ledger(run_dir)


def test_a_damaged_middle_ledger_line_is_refused_by_resume(finished_run, e2e_workdir, tmp_path):
    run_dir, run_id = finished_run
    root, copy = _copy(run_dir, tmp_path)
    lines = (copy / "ledger.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1][: len(lines[1]) // 2] + "\n"
    damaged = "".join(lines)
    (copy / "ledger.jsonl").write_text(damaged)
    result = launch.train(e2e_workdir, ["--resume", run_id, f"run.root={root}", "train.max_steps=6"], nproc=1)
    assert result.exit_code == 4, result.stdout + result.stderr
    assert "ledger line 2" in result.stderr
    assert (copy / "ledger.jsonl").read_text() == damaged


def test_ledger_read_names_a_damaged_line_and_drops_only_a_torn_last_one(tmp_path):
    path = tmp_path / "ledger.jsonl"
    good = [ledger_lib.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    path.write_text(good[0] + "\n" + good[1] + "\n" + good[2][:7])  # killed mid-append
    assert [r["step"] for r in ledger_lib.read(path)] == [1, 2]
    path.write_text(good[0] + "\n" + "{garbage\n" + good[2] + "\n")
    with pytest.raises(CheckpointError, match="ledger line 2") as info:
        ledger_lib.read(path)
    assert info.value.exit_code == 4
    path.write_text(good[0] + "\n" + "[1, 2]\n" + good[2] + "\n")
    with pytest.raises(CheckpointError, match="ledger line 2"):
        ledger_lib.read(path)
