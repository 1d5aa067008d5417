"""Python garbage collection at fixed steps, the same step on every rank.

CPython collects when its allocation counters say so: at a different moment on each rank.
A collection pauses its rank's host for a few to a few hundred milliseconds, and in a
data-parallel step every other rank then waits for it at the next collective, so each rank's
pauses add up for all of them (a full collection of a trainer's heap takes 100-300 ms). With
``runtime.gc_interval: N`` the loop turns automatic collection off for the run and, on every
rank after the same steps, collects:

- the youngest generation after every step (tens of microseconds: a step's own objects), so
  reference cycles a step leaves behind, and any tensors they hold, are freed at once;
- the two young generations after every N-th step;
- all generations after every 10N-th (objects that outlive the young generations are few in
  a steady loop, but cycles among them are freed only there).

``gc_interval: 0`` leaves Python's automatic collection on.
"""

from __future__ import annotations

import gc

FULL_EVERY = 10
"""A full collection after every FULL_EVERY-th scheduled one."""


class CollectionSchedule:
    """The loop's schedule: ``start()`` turns automatic collection off, ``stop()`` restores it."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._was_enabled = False

    def start(self) -> None:
        if self.interval > 0:
            self._was_enabled = gc.isenabled()
            gc.collect(1)  # start the run with the setup's young garbage gone
            gc.disable()

    def stop(self) -> None:
        if self.interval > 0 and self._was_enabled:
            gc.enable()

    def after_step(self, step: int) -> None:
        if self.interval <= 0:
            return
        if step % (self.interval * FULL_EVERY) == 0:
            gc.collect(2)
        else:
            gc.collect(1 if step % self.interval == 0 else 0)
