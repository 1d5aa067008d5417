"""Run a function on N real processes (gloo on 127.0.0.1) and collect what each returns."""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from tests import launch
from training.registry import register_all


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(*args)`` on every rank (with torchrun's env set); returns the results by rank.

    The ranks are forked, as ``torch.multiprocessing``'s processes, from one fresh process that
    has imported ``fn``'s module (``launch.in_fresh_process``): a rank's exception is raised here
    as torch's ``ProcessRaisedException``, whose message holds the rank's traceback, as
    ``mp.spawn`` raises it. Ranks that have not all ended after ``launch.CALL_LIMIT_S`` print their
    stacks and are killed, and a ``TimeoutError`` naming ``fn`` is raised (a hang fails its test)."""
    port = launch.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        launch.in_fresh_process(_fork_ranks, world_size, port, tmp, fn, args)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


_KEPT: list = []


def keep_until_exit(obj):
    """``obj``, referenced until the rank's ``os._exit`` (``_entry``), so that it is never freed. A DDP
    model freed when ``fn`` returns destroys its Reducer while holding the GIL, whose process group
    joins gloo's worker thread, which may be freeing its last all-reduce's tensors and so waits for the
    GIL: a rank of tests/training/test_pooled_aux_loss.py hung there for 13 minutes (py-spy --native)."""
    _KEPT.append(obj)
    return obj


def _fork_ranks(world_size: int, port: int, out_dir: str, fn, args) -> None:
    # The configs a rank loads need the registered kinds (tests/conftest.py): registered here
    # once, in the fresh process, for every rank forked from it.
    register_all()
    mp.start_processes(_entry, args=(world_size, port, out_dir, fn, args), nprocs=world_size, join=True,
                       start_method="fork")


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)  # a native crash shows its Python stacks in the test's output
    result = fn(*args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    # The result is on disk. Skip interpreter teardown: gloo's C++ threads occasionally
    # abort there ("terminate called without an active exception") after FSDP runs, which
    # would fail a test whose work had already succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
