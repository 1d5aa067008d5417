"""A failure after the run dir exists prints one line on stderr and nothing but the two
first lines on stdout; the traceback goes to logs/rank<R>.log and diagnostics/."""

from __future__ import annotations

from tests import launch
from tests.e2e_config import e2e_args


def test_a_failure_prints_one_line_and_files_the_traceback(e2e_workdir):
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
    run_dir = e2e_workdir / result.run_dir
    assert "Traceback" in (run_dir / "logs" / "rank0.log").read_text()
    assert "Traceback" in (run_dir / "diagnostics" / "rank0_failure.txt").read_text()
