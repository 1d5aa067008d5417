"""Runtime guards end to end, 2 ranks on CPU (tests/ranks.py, torchrun's rank environment), with injected faults:

- hang@5:1 with a 5 s watchdog: the job ends well within a minute, non-zero, with the
  stacks of both ranks in diagnostics/ (the hung rank's shows where it hangs);
- nan@3: exit 7 with the batch provenance dumped (abort); the run completes with the step
  marked (skip), and a replay of step 3 skips it again;
- sigterm@6: exit 0 with a checkpoint, and --resume ends with the uninterrupted ledger;
- crash@7:0: resume from the last checkpoint gives the uninterrupted ledger, and a replay of
  step 7 (the recorded config still holds the crash) verifies instead of dying;
- `python -m experiments runs list` shows these runs with the right states; `runs plot`
  writes a PNG.
"""

from __future__ import annotations

import json
import time

import pytest

from tests import launch
from tests.e2e_config import e2e_args

pytestmark = pytest.mark.slow

STEPS = 10


@pytest.fixture(scope="module")
def reference(e2e_workdir):
    result = launch.train(e2e_workdir, e2e_args(max_steps=STEPS, name="ref"), nproc=2)
    assert result.returncode == 0, result.stderr
    return _abs(e2e_workdir, result.run_dir)


def _abs(workdir, path):
    return path if path.is_absolute() else workdir / path


def test_hang_is_caught_by_the_watchdog(e2e_workdir):
    # Both ranks stop heartbeating within a few milliseconds of each other (rank 0 blocks in
    # step 5's first collective), so both dump within a watchdog poll (0.5 s) of each other:
    # a 3 s exit grace (default 10 s) keeps the hung rank alive until its peer has dumped.
    started = time.monotonic()
    result = launch.train(
        e2e_workdir,
        e2e_args(max_steps=STEPS, name="hang", overrides=["runtime.faults=[hang@5:1]", "runtime.watchdog_timeout_s=5",
                                                          "runtime.watchdog_exit_grace_s=3"]),
        nproc=2,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert elapsed < 60, f"took {elapsed:.0f}s"
    diag = _abs(e2e_workdir, result.run_dir) / "diagnostics"
    stacks = {p.name: p.read_text() for p in diag.glob("*stack*")}
    assert any("rank0" in name for name in stacks) and any("rank1" in name for name in stacks), list(stacks)
    hung = next(text for name, text in stacks.items() if "rank1" in name)
    assert "faults.py" in hung  # the hung rank's stack shows the injected hang
    events = [e["event"] for e in launch.events(_abs(e2e_workdir, result.run_dir))]
    assert "watchdog_abort" in events


def test_nan_aborts_with_provenance(e2e_workdir):
    result = launch.train(e2e_workdir, e2e_args(max_steps=STEPS, name="nan", overrides=["runtime.faults=[nan@3]"]), nproc=2)
    assert result.exit_code == 7, result.stderr
    run_dir = _abs(e2e_workdir, result.run_dir)
    dumps = list((run_dir / "diagnostics").glob("nonfinite_step00000003_rank*.json"))
    assert dumps, list((run_dir / "diagnostics").iterdir())
    record = json.loads(dumps[0].read_text())
    assert record["provenance"], record
    assert len(launch.ledger(run_dir)) == 2  # the bad step never reached the ledger


def test_nan_skip_completes_and_marks_the_step(e2e_workdir):
    result = launch.train(
        e2e_workdir,
        e2e_args(max_steps=6, name="nanskip", overrides=["runtime.faults=[nan@3]", "runtime.on_nonfinite=skip"]),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr
    lines = launch.ledger(_abs(e2e_workdir, result.run_dir))
    assert len(lines) == 6
    assert lines[2].get("skipped") is True and not any(r.get("skipped") for r in lines[:2] + lines[3:])
    # A replay keeps the nan fault (runtime/faults.py): step 3 is skipped again, as recorded.
    launch.replay_verifies(e2e_workdir, _abs(e2e_workdir, result.run_dir), steps=(3,))


def test_sigterm_checkpoints_and_resume_is_identical(e2e_workdir, reference):
    first = launch.train(e2e_workdir, e2e_args(max_steps=STEPS, name="term", overrides=["runtime.faults=[sigterm@6]"]), nproc=2)
    assert first.returncode == 0, first.stderr
    run_dir = _abs(e2e_workdir, first.run_dir)
    assert len(launch.ledger(run_dir)) == 6
    assert "stopped" in [e["event"] for e in launch.events(run_dir)]
    resumed = launch.train(e2e_workdir, ["--resume", run_dir.name, "runtime.faults=[]"], nproc=2)
    assert resumed.returncode == 0, resumed.stderr
    assert launch.ledger(run_dir) == launch.ledger(reference)
    metric_steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metric_steps == list(range(1, STEPS + 1))  # each step once, also across the resume


def test_crash_then_resume_is_identical(e2e_workdir, reference):
    first = launch.train(e2e_workdir, e2e_args(max_steps=STEPS, name="crash", overrides=["runtime.faults=[crash@7:0]"]), nproc=2)
    assert first.returncode != 0
    run_dir = _abs(e2e_workdir, first.run_dir)
    resumed = launch.train(e2e_workdir, ["--resume", run_dir.name, "runtime.faults=[]"], nproc=2)
    assert resumed.returncode == 0, resumed.stderr
    assert launch.ledger(run_dir) == launch.ledger(reference)
    metric_steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metric_steps == list(range(1, STEPS + 1))  # steps after the checkpoint were not kept twice
    # The recorded config still holds crash@7:0; a replay drops process-level faults, so it
    # verifies step 7 instead of dying there (runtime/faults.py).
    launch.replay_verifies(e2e_workdir, run_dir, steps=(7,))


def test_run_browser_lists_states_and_plots(e2e_workdir, reference, tmp_path):
    root = str(e2e_workdir / "runs")
    listing = launch.run_module(launch.ROOT, ["experiments", "runs", "list", "--root", root], timeout=120)
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line for line in listing.stdout.splitlines() if line.strip()}
    assert "finished" in rows[reference.name]
    for prefix, state in (("nan-", "failed"), ("hang-", "failed")):
        matching = [line for name, line in rows.items() if name.startswith(prefix)]
        if matching:
            assert state in matching[0], matching[0]
    png = tmp_path / "plot.png"
    plot = launch.run_module(launch.ROOT, ["experiments", "runs", "plot", reference.name, "--root", root,
                                           "--out", str(png)], timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
