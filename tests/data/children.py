"""The worker processes a test's pipeline started: this process's children, less the ones that
live as long as this process: the multiprocessing resource tracker, which an earlier test's
``torch.multiprocessing.spawn`` may have started, and the zygotes that start end-to-end jobs
(tests/zygote.py, ``tests.launch``)."""

from __future__ import annotations

from multiprocessing import resource_tracker

import psutil

from tests import launch


def worker_children() -> list[psutil.Process]:
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    kept = {tracker, *launch.zygote_pids()}
    return [child for child in psutil.Process().children() if child.pid not in kept]
