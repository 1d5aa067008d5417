"""core/environment.py: every entry point run by a Python without .venv's packages says so in
one line and exits 2 (train.py's own case is in tests/test_train_cli.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import launch

ENTRY_POINTS = [
    (["-m", "training", "export", "--help"], "-m training"),
    (["-m", "data", "prepare"], "-m data"),
    (["-m", "experiments", "runs", "list"], "-m experiments"),
    ([str(launch.ROOT / "scripts" / "config_reference.py"), "--check"], "scripts/config_reference.py"),
    ([str(launch.ROOT / "scripts" / "agent_sft_eval.py"), "--help"], "scripts/agent_sft_eval.py"),
    ([str(launch.ROOT / "scripts" / "random_checkpoint.py"), "--help"], "scripts/random_checkpoint.py"),
]


def test_every_script_checks_the_environment_first():
    """A new script under scripts/ gets the check too (and a row above)."""
    scripts = sorted(p.name for p in (launch.ROOT / "scripts").glob("*.py"))
    assert scripts == sorted(args[0].rsplit("/", 1)[1] for args, _ in ENTRY_POINTS if args[0].endswith(".py"))
    for name in scripts:
        assert "require_dependencies(" in (launch.ROOT / "scripts" / name).read_text(), name


@pytest.mark.slow
@pytest.mark.parametrize("args, entry", ENTRY_POINTS, ids=[entry for _, entry in ENTRY_POINTS])
def test_an_entry_point_without_the_environment_says_to_use_it(args, entry):
    # -S: without the site module this interpreter sees the standard library only (as the system
    # Python does, where nothing is installed); the repository root is the working directory.
    proc = subprocess.run([sys.executable, "-S", *args], cwd=launch.ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
    assert f"{sys.executable} has no torch" in lines[0], lines[0]
    assert "make setup" in lines[0] and f"`.venv/bin/python {entry}`" in lines[0], lines[0]
