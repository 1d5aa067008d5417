"""train.py ends the process group only after the model is gone.

DDP's reducer and FSDP's hooks hold the group. Left alive into interpreter shutdown, a gloo
worker thread that drops its last tensor there cannot take the GIL and the rank aborts
("terminate called without an active exception"), failing a run that had succeeded. This
checks the order on two real ranks: when ``DistributedContext.close`` runs, no module is left.
"""

from __future__ import annotations

import gc
import os

import pytest

from tests.distributed.dist_harness import run_on_ranks
from tests.e2e_config import e2e_args

pytestmark = pytest.mark.slow


def _train_and_count_modules_at_close(workdir: str, args: list[str]) -> dict:
    import torch.nn as nn

    import train
    from core.distributed_context import DistributedContext

    os.chdir(workdir)
    seen: dict = {}
    original = DistributedContext.close

    def close(self):
        if "modules" not in seen:
            seen["modules"] = [type(o).__name__ for o in gc.get_objects() if isinstance(o, nn.Module)]
        original(self)

    DistributedContext.close = close
    seen["exit_code"] = train.main(args)
    return seen


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_no_module_outlives_the_process_group(e2e_workdir, strategy):
    args = e2e_args(max_steps=2, name=f"teardown-{strategy}", overrides=[f"parallel.strategy={strategy}"])
    for rank, seen in enumerate(run_on_ranks(_train_and_count_modules_at_close, 2, str(e2e_workdir), args)):
        assert seen["exit_code"] == 0, (rank, seen)
        assert seen["modules"] == [], f"rank {rank}: still alive when the group ends: {seen['modules']}"


def test_no_module_outlives_the_process_group_after_a_failed_step(e2e_workdir):
    args = e2e_args(max_steps=4, name="teardown-nan", overrides=["runtime.faults=[nan@2]"])
    for rank, seen in enumerate(run_on_ranks(_train_and_count_modules_at_close, 2, str(e2e_workdir), args)):
        assert seen["exit_code"] == 7, (rank, seen)
        assert seen["modules"] == [], f"rank {rank}: still alive when the group ends: {seen['modules']}"
