"""A rank that dies from a fatal signal in native code prints its Python stacks first."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_native_abort_after_process_setup_prints_the_python_stack():
    """train.py's process setup enables faulthandler: an abort (as glibc's on a corrupted heap)
    prints the stack of the line that was running, and the process still dies by the signal."""
    script = textwrap.dedent(
        """
        import os
        from core.config import load
        from training import session
        from training.registry import register_all

        register_all()
        session.prepare_process(load(None, ["parallel.device=cpu"]))

        def step_that_crashes():
            os.abort()

        step_that_crashes()
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGABRT, (result.returncode, result.stderr)
    assert "Fatal Python error: Aborted" in result.stderr
    assert 'in step_that_crashes' in result.stderr and "Current thread" in result.stderr
