"""The worker processes a test's pipeline started: this process's children, less the
multiprocessing resource tracker, which an earlier test's ``torch.multiprocessing.spawn``
may have started and which lives as long as this process."""

from __future__ import annotations

from multiprocessing import resource_tracker

import psutil


def worker_children() -> list[psutil.Process]:
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return [child for child in psutil.Process().children() if child.pid != tracker]
