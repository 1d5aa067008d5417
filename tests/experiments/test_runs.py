"""experiments/runs.py and ``python -m experiments runs``: state, summary, diff, plot."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import Config, RunConfig, TrainConfig, config_hash, save
from experiments.__main__ import main
from experiments.plots import curves
from experiments.runs import config_diff, run_state, summarize

ROOT = Path(__file__).resolve().parents[2]


def _make_run(root, run_id, events, *, ledger_steps=0, lock=None, config=None, metrics=(), checkpoints=()):
    run = root / run_id
    (run / "logs").mkdir(parents=True)
    save(config or Config(run=RunConfig(name=run_id.split("-")[0])), run / "config.yaml")
    (run / "meta.json").write_text(json.dumps({"git_commit": "abc123", "world_size": 2}))
    with open(run / "events.jsonl", "w") as f:
        for i, (kind, fields) in enumerate(events):
            f.write(json.dumps({"event": kind, "time": 1000.0 + i, "rank": fields.pop("rank", 0), "schema_version": 1, **fields}) + "\n")
    with open(run / "ledger.jsonl", "w") as f:
        for step in range(1, ledger_steps + 1):
            f.write(json.dumps({"step": step, "loss": 5.0 - 0.1 * step, "grad_norm": 1.0, "lr": 1e-3 * step, "tokens": 4096}) + "\n")
    with open(run / "metrics.jsonl", "w") as f:
        for step, tps in metrics:
            f.write(json.dumps({"schema_version": 1, "step": step, "time": 1.0, "world_size": 2, "interval_steps": 1,
                                "metrics": {"loss": {"mean": 1.0, "min": 1.0, "max": 1.0, "sum": 2.0}},
                                "slowest_rank": 0, "tokens_per_s": tps, "mfu": None, "eta_s": 1.0}) + "\n")
    for step in checkpoints:
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "manifest.json").write_text("{}")
    if checkpoints:
        (run / "checkpoints" / "LATEST").write_text(f"step_{checkpoints[-1]:08d}\n")
    if lock is not None:
        (run / ".lock").write_text(json.dumps(lock))
    return run


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def runs_root(tmp_path):
    root = tmp_path / "runs"
    host = socket.gethostname()
    _make_run(root, "done-20260101-000000-aaaaaaaa", [("run_started", {"run_id": "x"}), ("finished", {"step": 10})],
              ledger_steps=10, metrics=[(5, 1000.0), (10, 1234.5)], checkpoints=(5, 10))
    _make_run(root, "hung-20260101-000000-bbbbbbbb",
              [("run_started", {"run_id": "x"}), ("watchdog_abort", {"step": 5, "rank": 1}), ("watchdog_abort", {"step": 5})],
              ledger_steps=4)
    _make_run(root, "term-20260101-000000-cccccccc", [("run_started", {"run_id": "x"}), ("stopped", {"step": 6, "signal": "SIGTERM"})])
    _make_run(root, "node-20260101-000000-dddddddd",
              [("run_started", {"run_id": "x"}), ("checkpoint_saved", {"step": 5, "path": "p"})],
              ledger_steps=7, lock={"pid": _dead_pid(), "host": host})
    _make_run(root, "live-20260101-000000-eeeeeeee", [("run_started", {"run_id": "x"})], lock={"pid": os.getpid(), "host": host})
    _make_run(root, "back-20260101-000000-ffffffff",
              [("run_started", {"run_id": "x"}), ("stopped", {"step": 6}), ("resumed", {"run_id": "x", "step": 6}),
               ("finished", {"step": 12})])
    _make_run(root, "again-20260101-000000-11111111",
              [("run_started", {"run_id": "x"}), ("stopped", {"step": 6}), ("resumed", {"run_id": "x", "step": 6})])
    _make_run(root, "nan-20260101-000000-22222222",
              [("run_started", {"run_id": "x"}), ("nonfinite_abort", {"step": 3}), ("failed", {"exit_code": 7})])
    _make_run(root, "far-20260101-000000-33333333", [("run_started", {"run_id": "x"})], lock={"pid": 1, "host": "elsewhere"})
    (root / "not-a-run").mkdir()
    return root


EXPECTED_STATES = {
    "again": "crashed",
    "back": "finished",
    "done": "finished",
    "far": "running",
    "hung": "failed",
    "live": "running",
    "nan": "failed",
    "node": "crashed",
    "term": "stopped",
}


def test_states(runs_root):
    states = {p.name.split("-")[0]: run_state(p)[0] for p in runs_root.iterdir() if p.name != "not-a-run"}
    assert states == EXPECTED_STATES
    assert "stale lock" in run_state(runs_root / "node-20260101-000000-dddddddd")[1]
    assert "elsewhere" in run_state(runs_root / "far-20260101-000000-33333333")[1]


def test_summary_reads_last_ledger_and_metrics(runs_root):
    s = summarize(runs_root / "done-20260101-000000-aaaaaaaa")
    assert (s.state, s.step, s.tokens_per_s) == ("finished", 10, 1234.5)
    assert s.loss == pytest.approx(4.0)


def test_cli_list_table_and_json(runs_root, capsys):
    assert main(["runs", "list", "--root", str(runs_root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["RUN_ID", "STATE", "STEP", "LOSS", "TOK/S"]
    assert len(out) == 1 + len(EXPECTED_STATES)  # not-a-run is not listed
    done = next(line for line in out if line.startswith("done-"))
    assert done.split() == ["done-20260101-000000-aaaaaaaa", "finished", "10", "4.0000", "1,234"]
    assert main(["runs", "--root", str(runs_root), "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {r["run_id"].split("-")[0]: r["state"] for r in listed} == EXPECTED_STATES


def test_cli_show(runs_root, capsys):
    assert main(["runs", "show", "done", "--root", str(runs_root)]) == 0  # unique prefix
    out = capsys.readouterr().out
    assert f"config hash: {config_hash(Config(run=RunConfig(name='done')))}" in out
    assert "state:       finished" in out
    assert "meta.git_commit: abc123" in out
    assert '"step": 10' in out  # last ledger line
    assert "checkpoints: step_00000005, step_00000010  LATEST=step_00000010" in out
    assert "rank0 finished step=10" in out
    assert main(["runs", "show", "done", "--json", "--root", str(runs_root)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["last_ledger"]["step"] == 10 and [e["event"] for e in info["events"]] == ["run_started", "finished"]


def test_cli_unknown_or_ambiguous_run_is_usage_error(runs_root, capsys):
    assert main(["runs", "show", "nope", "--root", str(runs_root)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
    assert main(["runs", "show", "", "--root", str(runs_root)]) == 2
    assert "matches" in capsys.readouterr().err


def test_cli_diff(tmp_path, capsys):
    root = tmp_path / "runs"
    _make_run(root, "a-1", [], config=Config(run=RunConfig(name="a"), train=TrainConfig(lr=1e-3)))
    _make_run(root, "b-1", [], config=Config(run=RunConfig(name="b"), train=TrainConfig(lr=3e-4, max_steps=7)))
    assert config_diff(root / "a-1", root / "b-1") == [
        ("run.name", "a", "b"), ("train.lr", 1e-3, 3e-4), ("train.max_steps", 100, 7)
    ]
    assert main(["runs", "diff", "a-1", "b-1", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "train.lr: 0.001 -> 0.0003" in out and "run.name: 'a' -> 'b'" in out
    assert main(["runs", "diff", "a-1", "a-1", "--root", str(root)]) == 0
    assert "are equal" in capsys.readouterr().out


def test_curves_keep_the_last_record_of_a_re_executed_step(tmp_path):
    run = _make_run(tmp_path, "r-1", [], ledger_steps=3)
    with open(run / "ledger.jsonl", "a") as f:  # resumed from step 2: step 3 again
        f.write(json.dumps({"step": 3, "loss": 9.0, "lr": 0.5}) + "\n" + '{"step": 4, "lo')
    data = curves(run)
    assert data["loss"] == ([1, 2, 3], [4.9, 4.8, 9.0])
    assert data["tokens_per_s"] == ([], [])


def test_cli_plot_writes_png_as_a_real_command(runs_root):
    out = runs_root.parent / "plot.png"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", "runs", "plot", "done", "--root", str(runs_root), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    default = runs_root / "done-20260101-000000-aaaaaaaa" / "artifacts" / "plots.png"
    assert main(["runs", "plot", "done", "--root", str(runs_root)]) == 0
    assert default.is_file()


def test_recent_runs_are_listed_newest_first_whatever_their_names(tmp_path):
    from experiments.runs import recent_runs, resolve_run
    from core.exceptions import UsageError

    root = tmp_path / "runs"
    for run_id in ("zeta-20260101-000000-aaaaaaaa", "alpha-20260301-120000-bbbbbbbb", "mid-20260201-000000-cccccccc"):
        _make_run(root, run_id, [("run_started", {"run_id": run_id})])
    assert recent_runs(root) == ["alpha-20260301-120000-bbbbbbbb", "mid-20260201-000000-cccccccc",
                                 "zeta-20260101-000000-aaaaaaaa"]
    assert recent_runs(root, 1) == ["alpha-20260301-120000-bbbbbbbb"]
    with pytest.raises(UsageError, match="newest first: alpha-20260301-120000-bbbbbbbb, mid-"):
        resolve_run(root, "nope")


def test_runs_list_puts_the_newest_run_on_top(tmp_path, capsys):
    root = tmp_path / "runs"
    for run_id in ("zeta-20260101-000000-aaaaaaaa", "alpha-20260301-120000-bbbbbbbb", "mid-20260201-000000-cccccccc"):
        _make_run(root, run_id, [("run_started", {"run_id": run_id})])
    assert main(["runs", "list", "--root", str(root)]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert listed == ["alpha-20260301-120000-bbbbbbbb", "mid-20260201-000000-cccccccc", "zeta-20260101-000000-aaaaaaaa"]


def test_resume_of_an_unknown_run_names_the_newest_runs_first(tmp_path):
    from core.exceptions import ResumeError
    from training.checkpoint.resume import find_run

    root = tmp_path / "runs"
    for run_id in ("b-20260105-000000-aaaaaaaa", "a-20260107-000000-bbbbbbbb", "c-20260101-000000-cccccccc"):
        _make_run(root, run_id, [("run_started", {"run_id": run_id})])
    with pytest.raises(ResumeError) as info:
        find_run(root, "no-such-run")
    assert "recent runs, newest first: a-20260107-000000-bbbbbbbb, b-20260105-000000-aaaaaaaa, c-20260101" in str(info.value)
