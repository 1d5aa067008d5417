"""Whether a process named in a run dir's lock is still there (torch-free: the run browser
uses it too)."""

from __future__ import annotations

import psutil


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a process on this host that has not exited.

    A zombie has exited: a killed process whose parent died too stays one where nothing
    reaps orphans (a container without an init process), holding nothing. A process this
    user may not inspect counts as alive.
    """
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.AccessDenied:
        return True
    except (psutil.NoSuchProcess, ValueError):
        return False
