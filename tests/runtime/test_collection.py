"""runtime.gc_interval: automatic collection off during the loop; the youngest generation
collected after every step, the young ones after every N-th, all of them after every 10N-th;
automatic collection restored after."""

from __future__ import annotations

import gc
import weakref

import pytest

from runtime.collection import FULL_EVERY, CollectionSchedule


@pytest.fixture
def collections():
    seen: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)


def test_collections_run_at_the_scheduled_steps_only(collections):
    assert gc.isenabled()
    schedule = CollectionSchedule(3)
    schedule.start()
    try:
        assert not gc.isenabled()
        collections.clear()
        by_step = {}
        for step in range(1, 3 * FULL_EVERY + 1):
            before = len(collections)
            [[] for _ in range(5000)]  # allocations that would trigger automatic collections
            schedule.after_step(step)
            by_step[step] = collections[before:]
    finally:
        schedule.stop()
    assert gc.isenabled()
    assert by_step[3] == [1] and by_step[6] == [1] and by_step[3 * FULL_EVERY] == [2]
    assert all(by_step[s] == [0] for s in by_step if s % 3)


def test_interval_zero_leaves_automatic_collection_alone(collections):
    schedule = CollectionSchedule(0)
    schedule.start()
    assert gc.isenabled()
    collections.clear()
    schedule.after_step(50)
    schedule.stop()
    assert collections == [] and gc.isenabled()


def test_a_cycle_a_step_leaves_behind_is_freed_after_that_step():
    class Node:
        pass

    schedule = CollectionSchedule(50)
    schedule.start()
    try:
        node = Node()
        node.self = node  # a reference cycle: only the collector frees it
        node.payload = bytearray(1 << 20)
        alive = weakref.ref(node)
        del node
        assert alive() is not None  # automatic collection is off
        schedule.after_step(7)  # not a multiple of the interval
        assert alive() is None
    finally:
        schedule.stop()
