"""A full disk is reported as one line on stderr (exit 1), not as a traceback per log record:
the rank's log file drops what it cannot write (core/logging.py), and the failure line says
what happened and what to do (training/session.py)."""

from __future__ import annotations

import errno
import os

import pytest

from core.logging import get_logger, setup_logging
from training import session


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write: no space left)")
def test_a_full_disk_prints_one_line_not_a_traceback_per_log_record(tmp_path, capfd):
    logger = setup_logging(0, tmp_path / "logs", console=False)
    (handler,) = logger.handlers
    handler.stream = open("/dev/full", "w")  # the disk filled up under the run
    try:
        for step in range(20):
            get_logger().info("step %d", step)  # logging would print a traceback for each
        code = session.fail(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), None, None, None)
    finally:
        setup_logging(0, None, console=False)  # closes the handler: what it still holds is dropped too
    err = capfd.readouterr().err.strip()
    assert code == 1
    assert len(err.splitlines()) == 1, err
    assert "disk full" in err and "run.root" in err and "Traceback" not in err
    assert handler.write_failures >= 21  # the 20 records and the failure's traceback, at least
