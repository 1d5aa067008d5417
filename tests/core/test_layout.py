"""core/layout.py: the one definition of a run dir's names and checkpoint dir naming."""

from pathlib import Path

import pytest

from core import layout
from core.layout import RunPaths


def test_step_dir_name_round_trips_through_the_parser():
    for step in (0, 1, 42, 12_345_678, 123_456_789):
        name = layout.step_dir_name(step)
        assert name.startswith("step_") and len(name) >= len("step_00000000")
        assert layout.parse_step_dir_name(name) == step


@pytest.mark.parametrize("name", ["LATEST", "step_1", "step_0000001x", ".tmp-step_00000001", "step_00000001.old", ""])
def test_other_names_are_not_checkpoint_steps(name):
    assert layout.parse_step_dir_name(name) is None


def test_run_paths_use_the_layout_names(tmp_path: Path):
    paths = RunPaths(tmp_path)
    assert paths.ledger == tmp_path / "ledger.jsonl"
    assert paths.lock == tmp_path / ".lock"
    assert paths.latest == tmp_path / "checkpoints" / "LATEST"
    assert paths.checkpoint(7) == tmp_path / "checkpoints" / "step_00000007"
    assert {getattr(paths, sub) for sub in layout.SUBDIRS} == {tmp_path / s for s in layout.SUBDIRS}
