"""meta.json's git record is the checkout of the code that runs: a run started from a working
directory outside the repository (a run root elsewhere, as the docs' measured commands do)
records the commit of the code, and its working directory beside it."""

from __future__ import annotations

import torch

from core import config as config_lib
from core.distributed_context import DistributedContext
from core.run_context import CODE_ROOT, collect_meta, git_info


def test_a_run_started_outside_the_checkout_records_the_codes_commit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert git_info(tmp_path)["is_repo"] is False  # what the working directory would have recorded
    config = config_lib.load(None, ["run.name=meta"])
    dist = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo",
                              timeout_s=5)
    meta = collect_meta(config, dist)
    code = git_info(CODE_ROOT)
    assert meta["git"]["is_repo"] == code["is_repo"] and meta["git"].get("commit") == code.get("commit")
    assert meta["cwd"] == str(tmp_path)
