"""The order of ``make test``'s worker groups (longest first), what each group costs, and how that
is measured.

``make test`` hands whole worker groups (``tests.methods.worker_group``: a file, or a guarantee-
table row with its method's e2e file) to its workers (3) in collection order, a worker taking the
next group as it nears the end of its last. The longest groups go first, so that the short ones
fill the workers in at the end and they finish together. How long a group is comes from
tests/group_costs.json: the CPU seconds of its tests that start processes (``slow``) and of its
in-process tests, each the pytest process's and its waited-for children's (ranks and commands
included), fixtures charged to the test that set them up, measured on the 2-core test machine.
Only the selected tests count: ``make test-fast`` orders the groups by their in-process part.
A group or part the table lacks (a new file, a new guarantee-table row) is estimated from its
tests: ``SLOW_TEST_S`` for each slow test, ``FAST_TEST_S`` for each other.

    pytest -n 0 --record-group-costs tests/group_costs.json [tests ...]

measures the groups it runs and writes them into the table (the other groups stay as they
were). Measure one process (``-n 0``), whole groups: a group's shared runs (tests/guarantees.py
``References``) are charged to the first of its tests that uses them.

The table as checked in (2026-11-29, on the shared 2-core machine while it was busy): every
in-process part and the rows' slow parts by the recorder; the slow part of a dozen more files
as the file's CPU seconds (``/usr/bin/time``, ``-n 0``) less its in-process part; the other
groups' slow parts are estimated.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("group_costs.json")
SLOW, IN_PROCESS = "slow", "in_process"
# The fallback per test. In-process: the measured groups' mean (0.23 CPU-s with 2 intra-op
# threads, 0.12 with one). Slow: below the measured groups' mean (9.9 CPU-s over 107 tests; the
# heaviest files were measured first); 314 slow tests in a suite of 19m20s on 2 cores put the
# mean near 7.
SLOW_TEST_S = 8.0
FAST_TEST_S = 0.25
_MARK = pytest.StashKey[float]()
CPU_S = "cpu_s"


def load(path: Path = TABLE) -> dict[str, dict[str, float]]:
    """The table: CPU seconds by group and part (``slow``, ``in_process``); empty without the file."""
    return json.loads(path.read_text())["groups"] if path.is_file() else {}


def estimate(measured: dict[str, float], slow: int, fast: int) -> float:
    """CPU seconds of a group's selected tests (``slow`` and ``fast`` of them): each part
    selected as measured, else the fallback."""
    return sum(measured.get(part, count * per_test) if count else 0.0
               for part, count, per_test in ((SLOW, slow, SLOW_TEST_S), (IN_PROCESS, fast, FAST_TEST_S)))


def cpu_s() -> float:
    """CPU seconds of this process, of its children that have been waited for, and of the jobs its
    zygotes ran (tests/zygote.py: the zygote itself is waited for only at the session's end)."""
    from tests.zygote import finished_jobs_cpu_s

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + finished_jobs_cpu_s()


class Order:
    """Sorts the selected tests by their group's cost, longest group first; after ``-m`` and
    ``-k`` have deselected (``trylast``). The sort is stable: a group's tests keep their order."""

    def __init__(self, path: Path = TABLE) -> None:
        self.table = load(path)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items) -> None:
        from tests.methods import worker_group

        counts: dict[str, list[int]] = {}
        for item in items:
            count = counts.setdefault(worker_group(item.nodeid), [0, 0])
            count[item.get_closest_marker("slow") is None] += 1
        cost = {group: estimate(self.table.get(group, {}), slow, fast) for group, (slow, fast) in counts.items()}
        items.sort(key=lambda item: (-cost[worker_group(item.nodeid)], worker_group(item.nodeid)))


class Recorder:
    """In the process that runs the tests: each report (setup, call, teardown) carries the CPU
    seconds of its phase as the user property ``cpu_s`` (pytest-xdist sends it to the controller)."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        item.stash[_MARK] = cpu_s()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item):
        outcome = yield
        now = cpu_s()
        outcome.get_result().user_properties.append((CPU_S, now - item.stash.get(_MARK, now)))
        item.stash[_MARK] = now


class Writer:
    """In the controller (or the only process): sums the reports' ``cpu_s`` by worker group and
    part, and writes them into the table at the end of the session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.groups: dict[str, dict[str, float]] = {}

    def pytest_runtest_logreport(self, report) -> None:
        from tests.methods import worker_group

        part = SLOW if SLOW in report.keywords else IN_PROCESS
        parts = self.groups.setdefault(worker_group(report.nodeid), {})
        parts[part] = parts.get(part, 0.0) + sum(value for name, value in report.user_properties if name == CPU_S)

    def pytest_sessionfinish(self, session) -> None:
        if not self.groups:
            return
        table = json.loads(self.path.read_text()) if self.path.is_file() else {"groups": {}}
        for group, parts in self.groups.items():
            table["groups"].setdefault(group, {}).update({part: round(s, 1) for part, s in parts.items()})
        self.path.write_text(dump(table["groups"]))


def dump(groups: dict[str, dict[str, float]]) -> str:
    """The table's JSON: one group a line, longest first."""
    lines = [f"  {json.dumps(group)}: {json.dumps(dict(sorted(parts.items())))}"
             for group, parts in sorted(groups.items(), key=lambda item: (-sum(item[1].values()), item[0]))]
    return '{"groups": {\n' + ",\n".join(lines) + "\n}}\n"
