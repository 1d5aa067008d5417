"""Every run dir lies directly inside run.root: no run ID or link leads a run elsewhere."""

from __future__ import annotations

import pytest
import torch

from core import config as config_lib
from core.distributed_context import DistributedContext
from core.exceptions import ConfigError
from core.run_context import RunContext, run_paths


@pytest.mark.parametrize("run_id", ["../x", "..", ".", "/etc", "a/b", "-rf", "", "x\n"])
def test_run_ids_that_are_not_one_path_component_are_refused(tmp_path, run_id):
    with pytest.raises(ConfigError):
        run_paths(tmp_path, run_id)


def test_a_run_dir_linked_outside_the_root_is_refused(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root" / "r-1").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="outside run.root"):
        run_paths(tmp_path / "root", "r-1")
    assert run_paths(tmp_path / "root", "r-2").root == tmp_path / "root" / "r-2"


def test_resume_of_a_traversing_id_touches_nothing(tmp_path):
    config = config_lib.load(None, [f"run.root={tmp_path / 'runs'}"])
    dist = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", timeout_s=5)
    with pytest.raises(ConfigError):
        RunContext.open_existing(config.run.root, "../../outside", dist, lock=True)
    assert not (tmp_path / "outside").exists() and not (tmp_path.parent / "outside").exists()
