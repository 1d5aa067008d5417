"""A failure after the run dir exists prints one line on stderr and nothing but the two
first lines on stdout; the traceback goes to logs/rank<R>.log and diagnostics/. A run that
fails before its first step leaves no run dir, only those logs under runs/failed-starts/."""

from __future__ import annotations

import pytest

from experiments.runs import find_runs
from tests import launch
from tests.e2e_config import e2e_args


@pytest.mark.slow
def test_a_failure_before_the_first_step_prints_one_line_and_leaves_only_its_logs(e2e_workdir):
    result = launch.train(
        e2e_workdir,
        e2e_args(max_steps=2, name="fails", overrides=["data.sources=[{path: nowhere/*.jsonl}]"]),
        nproc=1,
    )
    assert result.exit_code == 3, result.stdout + result.stderr
    assert "Traceback" not in result.stdout and "Traceback" not in result.stderr
    assert result.stdout.splitlines()[:2] == [f"run_id: {result.run_id}", f"run_dir: {result.run_dir}"]
    assert "error" not in "\n".join(result.stdout.splitlines()[2:]).lower(), result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nowhere" in lines[0], result.stderr
    runs = e2e_workdir / "runs"
    assert not (e2e_workdir / result.run_dir).exists()  # nothing to resume: no run dir in `failed` state
    assert result.run_id not in [p.name for p in find_runs(runs)]
    aside = runs / "failed-starts" / result.run_id
    assert sorted(p.name for p in aside.iterdir()) == ["diagnostics", "logs"]
    assert "Traceback" in (aside / "logs" / "rank0.log").read_text()
    assert "Traceback" in (aside / "diagnostics" / "rank0_failure.txt").read_text()
    resumed = launch.train(e2e_workdir, ["--resume", result.run_id], nproc=1, timeout=120)
    assert resumed.exit_code == 4 and f"no run {result.run_id!r}" in resumed.stderr, resumed.stderr


def test_only_a_fresh_run_without_a_ledger_line_failing_with_exit_1_to_4_is_set_aside(tmp_path):
    from core.config import Config
    from core.layout import RunPaths
    from core.run_context import RunContext
    from training import failed_start

    paths = RunPaths(tmp_path / "runs" / "r-20260101-000000-aaaaaaaa")
    (paths.root / "logs").mkdir(parents=True)
    (paths.root / "checkpoints").mkdir()
    paths.config.write_text("run: {}\n")
    (paths.root / "logs" / "rank0.log").write_text("Traceback ...\n")
    run = RunContext(Config(), paths.root.name, paths, resumed=False)
    assert [code for code in range(9) if failed_start.applies(run, code)] == [1, 2, 3, 4]
    assert not failed_start.applies(RunContext(Config(), paths.root.name, paths, resumed=True), 3)
    paths.ledger.write_text('{"step": 1}\n')
    assert not failed_start.applies(run, 3)  # a step was trained: the run dir stays, resumable or not
    paths.ledger.write_text("")
    aside = failed_start.set_aside(run)
    assert aside == tmp_path / "runs" / "failed-starts" / paths.root.name and not paths.root.exists()
    assert sorted(p.name for p in aside.iterdir()) == ["logs"]
    assert failed_start.output_dir(run) == aside  # a rank failing later writes its failure there
