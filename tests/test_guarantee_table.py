"""The guarantee table (tests/methods.py) stays true to the files it names and to the runs its
checks need: a row's method file and entry script exist, the file shares the row's worker
group, row names are unique (they name the rows' runs), and every row's runs reach past the
checkpoint its checks resume from."""

from __future__ import annotations

import pytest

from tests import conftest, launch
from tests.methods import METHODS, TABLE, worker_group


def test_row_names_are_unique():
    names = [method.name for method in METHODS]
    assert len(set(names)) == len(names), names


def test_a_rows_runs_are_found_by_their_exact_name_not_by_another_rows_that_extends_it(tmp_path):
    """Rows' run names may prefix one another (moe, moe-sft, moe-grpo) and share one work dir: a
    row's kill check must find its own run, never the other row's."""
    for run_id in ("killed-moe-20261202-112908-f3201818", "killed-moe-sft-20261202-112908-0a1b2c3d",
                   "killed-moe-grpo-20261202-112909-0a1b2c3d", "killed-moe-20261202-112908-f3201818.2"):
        (tmp_path / run_id).mkdir()
    assert {d.name for d in launch.run_dirs_named(tmp_path, "killed-moe")} == {
        "killed-moe-20261202-112908-f3201818", "killed-moe-20261202-112908-f3201818.2"}
    assert {d.name for d in launch.run_dirs_named(tmp_path, "killed-moe-sft")} == {
        "killed-moe-sft-20261202-112908-0a1b2c3d"}
    assert launch.run_dirs_named(tmp_path / "absent", "killed-moe") == set()


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_a_rows_checks_and_its_method_file_share_a_worker_group(method):
    assert method.config_path.is_file(), method.config_path
    check = f"{TABLE}::test_replay_verifies_before_and_after_a_checkpoint[{method.name}]"
    if method.e2e_file is None:
        assert worker_group(check) == method.name
        return
    path = f"tests/training/{method.e2e_file}"
    assert (conftest.ROOT / path).is_file(), path
    assert worker_group(check) == worker_group(f"{path}::test_anything") == path


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_a_rows_entry_script_exists(method):
    assert (conftest.ROOT / method.entry).is_file(), method.entry


def test_other_tests_are_grouped_by_file():
    assert worker_group("tests/core/test_config.py::test_x[a-b]") == "tests/core/test_config.py"


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_every_row_resumes_from_a_checkpoint_before_its_last_step(method):
    assert 0 < method.one_rank_step < method.steps
    assert all(0 < step <= method.steps for step in method.replay_steps)
    assert 0 < method.accumulation_steps <= method.steps
    if method.kill.stall:  # killed while step 5's data is stalled, after the step-4 checkpoint
        assert method.steps >= 6
