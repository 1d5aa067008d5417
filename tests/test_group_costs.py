"""``make test``'s order of worker groups (tests/group_costs.py): longest first by the measured
table, a group or part the table lacks estimated from its tests, and a table that names only
groups that exist."""

from __future__ import annotations

import json
from pathlib import Path

from tests import group_costs
from tests.group_costs import FAST_TEST_S, IN_PROCESS, SLOW, SLOW_TEST_S
from tests.methods import BY_NAME, TABLE

ROOT = Path(__file__).resolve().parents[1]


def test_a_measured_part_counts_when_selected_and_a_missing_one_is_estimated():
    measured = {SLOW: 100.0, IN_PROCESS: 4.0}
    assert group_costs.estimate(measured, 3, 10) == 104.0
    assert group_costs.estimate(measured, 0, 10) == 4.0  # make test-fast: the in-process part only
    assert group_costs.estimate(measured, 3, 0) == 100.0
    assert group_costs.estimate({IN_PROCESS: 4.0}, 2, 10) == 2 * SLOW_TEST_S + 4.0
    assert group_costs.estimate({}, 2, 10) == 2 * SLOW_TEST_S + 10 * FAST_TEST_S


class _Item:
    def __init__(self, nodeid: str, slow: bool):
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name):
        return name if self.slow and name == "slow" else None


def test_groups_run_longest_first_and_a_rows_checks_stay_with_its_file(tmp_path):
    table = tmp_path / "costs.json"
    table.write_text(json.dumps({"groups": {"tests/a.py": {IN_PROCESS: 1.0},
                                            "tests/training/test_sft_e2e.py": {SLOW: 50.0},
                                            "tests/c.py": {SLOW: 20.0, IN_PROCESS: 40.0}}}))
    items = [_Item("tests/a.py::t1", False), _Item("tests/a.py::t2", False), _Item("tests/c.py::t1", True),
             _Item(f"{TABLE}::test_x[sft]", True), _Item("tests/c.py::t2", False),
             _Item("tests/training/test_sft_e2e.py::t1", True), _Item("tests/new.py::t1", True)]
    group_costs.Order(table).pytest_collection_modifyitems(items)
    assert [item.nodeid for item in items] == [
        "tests/c.py::t1", "tests/c.py::t2",  # 60 s
        f"{TABLE}::test_x[sft]", "tests/training/test_sft_e2e.py::t1",  # 50 s, the row's check with its file
        "tests/new.py::t1",  # not measured: one slow test
        "tests/a.py::t1", "tests/a.py::t2"]
    # The in-process tests alone (make test-fast): the c.py group's 40 s still leads, a.py's 1 s next.
    fast = [item for item in items if not item.slow]
    group_costs.Order(table).pytest_collection_modifyitems(fast)
    assert [item.nodeid for item in fast] == ["tests/c.py::t2", "tests/a.py::t1", "tests/a.py::t2"]


def test_the_table_names_only_groups_that_exist_with_their_parts():
    for group, parts in group_costs.load().items():
        assert (ROOT / group).is_file() or group in BY_NAME, f"tests/group_costs.json: {group} is no worker group"
        assert parts and set(parts) <= {SLOW, IN_PROCESS} and all(s >= 0 for s in parts.values()), group


class _Report:
    def __init__(self, nodeid: str, slow: bool, cpu_s: float):
        self.nodeid, self.keywords, self.user_properties = nodeid, {"slow": 1} if slow else {}, [("cpu_s", cpu_s)]


def test_the_writer_sums_phases_by_group_and_part_and_keeps_the_other_groups(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"groups": {"tests/a.py": {IN_PROCESS: 2.0}, "tests/b.py": {SLOW: 9.0}}}))
    writer = group_costs.Writer(path)
    for report in (_Report("tests/a.py::t1", True, 1.5), _Report("tests/a.py::t1", True, 2.0),  # setup, call
                   _Report(f"{TABLE}::test_x[sft]", True, 4.0), _Report("tests/training/test_sft_e2e.py::t", False, 0.5)):
        writer.pytest_runtest_logreport(report)
    writer.pytest_sessionfinish(None)
    assert group_costs.load(path) == {"tests/b.py": {SLOW: 9.0}, "tests/training/test_sft_e2e.py": {SLOW: 4.0, IN_PROCESS: 0.5},
                                      "tests/a.py": {IN_PROCESS: 2.0, SLOW: 3.5}}
    assert list(group_costs.load(path)) == ["tests/b.py", "tests/a.py", "tests/training/test_sft_e2e.py"]  # longest first
