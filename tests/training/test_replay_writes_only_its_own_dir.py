"""A replay reads the replayed run and writes only into its own directory (--dump DIR, or a
fresh temporary one, removed when every step matched): the run dir is byte-for-byte
unchanged afterwards."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests import launch
from tests.e2e_config import e2e_args

pytestmark = pytest.mark.slow


def _snapshot(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(run_dir.rglob("*"))
    }


def test_replay_leaves_the_replayed_run_untouched(e2e_workdir, tmp_path):
    result = launch.train(
        e2e_workdir, e2e_args(max_steps=3, name="replayed", overrides=["checkpoint.interval=2"]), nproc=1
    )
    assert result.returncode == 0, result.stderr
    run_dir = e2e_workdir / result.run_dir
    before = _snapshot(run_dir)

    dump = tmp_path / "dump"
    replay = launch.train(e2e_workdir, ["--replay", result.run_id, "--step", "3", "--dump", str(dump)], nproc=1)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert (dump / "logs" / "rank0.log").is_file()
    assert _snapshot(run_dir) == before

    plain = launch.train(e2e_workdir, ["--replay", result.run_id, "--step", "3"], nproc=1)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    own = Path(next(l for l in plain.stdout.splitlines() if l.startswith("replay_dir: ")).split(": ", 1)[1])
    assert not own.is_relative_to(run_dir)
    assert not own.exists() and f"{own} removed" in plain.stdout  # every step matched: nothing to look at
    assert (dump / "logs" / "rank0.log").is_file()  # a --dump DIR stays
    assert _snapshot(run_dir) == before
