"""Contracts of training/checkpoint/manager.py and training/checkpoint/manifest.py.

Bit-identical round trips (plain, DDP, FSDP2, across world sizes), verification that
catches damage, fallback to the previous intact checkpoint, crash safety of LATEST,
retention, and asynchronous saves (host or device staging) equal to synchronous ones and
immune to the training steps that run while they are written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor, Shard

import training.checkpoint.manifest as manifest_lib
import training.checkpoint.manager as checkpointing
from core.config import CheckpointConfig, ParallelConfig
from core.distributed_context import DistributedContext
from core.exceptions import CheckpointError
from training.checkpoint.manifest import read_manifest
from tests import launch
from training.checkpoint.state import DeviceSnapshot, HostBuffers, SnapshotBuffers
from training.checkpoint.manager import (
    CheckpointFormatError,
    CheckpointManager,
    capture_rng_state,
    restore_rng_state,
    step_dir_name,
    verify_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# --------------------------------------------------------------------------- helpers


class TinyNet(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.out = nn.Linear(width, 4)
        self.unused = nn.Linear(2, 2)  # never gets a gradient: AdamW keeps no state for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyNet()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, first: int, last: int, rank: int = 0) -> None:
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(6, 8, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def single_ctx() -> DistributedContext:
    return DistributedContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", timeout_s=60
    )


def manager(path: Path, on_corrupt=None, **config) -> CheckpointManager:
    return CheckpointManager(
        CheckpointConfig(**config), checkpoint_dir=path, dist=single_ctx(), on_corrupt=on_corrupt
    )


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Canonical, unsharded, flat copy of model + optimizer state (any wrapper; collective).

    FSDP2 shards are assembled here from an object all-gather: torch 2.11's own
    ``full_state_dict`` gather (functional collectives) segfaults on CPU/gloo.
    """
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {**{f"model.{k}": unsharded(v) for k, v in msd.items()}, **{f"optim.{k}": unsharded(v) for k, v in osd.items()}}


def unsharded(value):
    if isinstance(value, DTensor):
        assert [type(p) for p in value.placements] == [Shard] and value.placements[0].dim == 0
        shards = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(shards, value.to_local().detach().cpu())
        return torch.cat(shards)
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def model_state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(bits(a[key]), bits(b[key])), f"{key} differs"
        else:
            assert a[key] == b[key], key


def save(mgr: CheckpointManager, step: int, model, opt, **extra) -> Path:
    return mgr.save(
        step,
        model=model,
        optimizer=opt,
        states={"trainer": {"step": step, "loss": 0.1 + step / 3, "nested": {"b": [1, 2.5, None]}},
                 "data": {"streams": [{"epoch": 0, "offset": 17 * step}], "z_first": True}},
        **extra,
    )


@contextlib.contextmanager
def save_thread_held_back():
    """Asynchronous saves started in the block write only once it ends, so whatever the loop
    does in the block (training steps changing tensors in place) happens before the save
    thread reads anything."""
    leave = threading.Event()
    run_in_background = CheckpointManager._run_in_background

    def held_back(self, *args):
        assert leave.wait(timeout=60)
        run_in_background(self, *args)

    CheckpointManager._run_in_background = held_back
    try:
        yield
    finally:
        CheckpointManager._run_in_background = run_in_background
        leave.set()


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def dcp_shard(ckpt: Path) -> Path:
    return next((ckpt / "dcp").glob("*.distcp"))


# --------------------------------------------------------------------------- round trip


def test_round_trip_is_bit_identical_and_resumes_identically(tmp_path):
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 3)
    expected = full_state(model, opt)
    torch.manual_seed(1234)
    rng = capture_rng_state("cpu")
    mgr = manager(tmp_path, keep=0)
    path = save(mgr, 3, model, opt, extra_files={"notes/config.yaml": b"a: 1\n"})

    fresh_model, fresh_opt = build(seed=99)  # different weights, optimizer never stepped
    fresh_opt.step = lambda *a, **k: pytest.fail("load must not step the optimizer")
    assert mgr.latest_intact() == (3, path)
    loaded = mgr.load(path, model=fresh_model, optimizer=fresh_opt)
    del fresh_opt.step

    assert_bitwise_equal(full_state(fresh_model, fresh_opt), expected)
    assert fresh_opt.state[fresh_model.unused.weight] == {}  # no state at save -> none after load
    assert loaded.step == 3 and loaded.saved_world_size == 1
    assert loaded.trainer_state == {"step": 3, "loss": 0.1 + 3 / 3, "nested": {"b": [1, 2.5, None]}}
    assert list(loaded.data_state) == ["streams", "z_first"]  # insertion order kept
    assert loaded.extra_files == {"notes/config.yaml": b"a: 1\n"}
    assert torch.equal(loaded.rng_state["cpu"], rng["cpu"])

    # Resuming from the checkpoint continues exactly like the uninterrupted run.
    train_steps(model, opt, 4, 5)
    train_steps(fresh_model, fresh_opt, 4, 5)
    assert_bitwise_equal(full_state(fresh_model, fresh_opt), full_state(model, opt))


def test_rng_state_round_trip():
    torch.manual_seed(7)
    state = capture_rng_state(torch.device("cpu"))
    first = torch.rand(5)
    torch.manual_seed(8)
    restore_rng_state(state, "cpu")
    assert torch.equal(torch.rand(5), first)
    with pytest.raises(CheckpointError, match="RNG state version"):
        restore_rng_state({**state, "version": 99}, "cpu")


def test_never_stepped_optimizer_is_saved_without_stepping_it(tmp_path):
    model, opt = build(seed=0)
    before = model_state(model)
    mgr = manager(tmp_path)
    path = save(mgr, 0, model, opt)
    assert len(opt.state) == 0  # torch's get_state_dict would have stepped it
    assert read_manifest(path).has_optimizer_state is False

    other_model, other_opt = build(seed=5)
    train_steps(other_model, other_opt, 1, 1)
    mgr.load(path, model=other_model, optimizer=other_opt)
    assert len(other_opt.state) == 0
    assert_bitwise_equal(model_state(other_model), before)


# --------------------------------------------------------------------------- trained parts


def saved_keys(path: Path) -> set[str]:
    from distributed.safe_dcp import SafeFileSystemReader

    return set(SafeFileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata)


def test_a_policy_only_checkpoint_keeps_the_single_model_layout(tmp_path):
    """The layout every earlier checkpoint has (docs/checkpoints.md): the policy's tensors under
    the top-level ``model`` and ``optim`` keys, nothing else."""
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    keys = saved_keys(save(manager(tmp_path), 1, model, opt))
    assert {key.split(".", 1)[0] for key in keys} == {"model", "optim"}
    assert checkpointing.saved_part_names(keys) == set()


def test_each_trained_part_round_trips_as_its_own_part(tmp_path):
    model, opt = build(seed=0)
    value, value_opt = build(seed=1)
    value_opt = torch.optim.SGD(value.parameters(), lr=0.1, momentum=0.9)  # a part's own optimizer
    train_steps(model, opt, 1, 3)
    train_steps(value, value_opt, 1, 2, rank=1)
    expected = {"policy": full_state(model, opt), "value": full_state(value, value_opt)}
    mgr = manager(tmp_path)
    path = save(mgr, 3, model, opt, parts={"value": (value, value_opt)})
    keys = saved_keys(path)
    assert checkpointing.saved_part_names(keys) == {"value"}
    assert any(k.startswith("parts.value.model.inp.") for k in keys)
    assert any(k.startswith("parts.value.optim.state.") for k in keys)

    fresh, fresh_opt = build(seed=5)
    fresh_value, _ = build(seed=6)
    fresh_value_opt = torch.optim.SGD(fresh_value.parameters(), lr=0.1, momentum=0.9)
    mgr.load(path, model=fresh, optimizer=fresh_opt, parts={"value": (fresh_value, fresh_value_opt)})
    assert_bitwise_equal(full_state(fresh, fresh_opt), expected["policy"])
    assert_bitwise_equal(full_state(fresh_value, fresh_value_opt), expected["value"])


def test_a_checkpoint_loads_only_into_the_parts_it_was_saved_with(tmp_path):
    model, opt = build(seed=0)
    value, value_opt = build(seed=1)
    train_steps(model, opt, 1, 1)
    train_steps(value, value_opt, 1, 1)
    mgr = manager(tmp_path, keep=0)
    two = save(mgr, 1, model, opt, parts={"value": (value, value_opt)})
    one = save(mgr, 2, model, opt)
    with pytest.raises(CheckpointError, match="holds the trained parts policy, value, this run trains policy(?!,)"):
        mgr.load(two, model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match="holds the trained parts policy, this run trains policy, value"):
        mgr.load(one, model=model, optimizer=opt, parts={"value": (value, value_opt)})
    with pytest.raises(CheckpointError, match="'policy' is the model's own"):
        mgr.save(3, model=model, optimizer=opt, states={"trainer": {}, "data": {}}, parts={"policy": (value, value_opt)})


def test_load_into_another_architecture_is_refused(tmp_path):
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    mgr = manager(tmp_path)
    path = save(mgr, 1, model, opt)

    smaller = nn.Sequential()
    smaller.inp = nn.Linear(8, 16)
    with pytest.raises(CheckpointError, match="no place for"):
        mgr.load(path, model=smaller, optimizer=None)
    torch.manual_seed(0)
    wider = TinyNet(width=32)
    with pytest.raises(CheckpointError):
        mgr.load(path, model=wider, optimizer=torch.optim.AdamW(wider.parameters()))


def test_json_states_must_survive_a_round_trip_and_fail_before_writing(tmp_path):
    model, opt = build(seed=0)
    mgr = manager(tmp_path)
    with pytest.raises(CheckpointError, match=r"trainer_state\.pos is a tuple"):
        mgr.save(1, model=model, optimizer=opt, states={"trainer": {"pos": (1, 2)}, "data": {}})
    with pytest.raises(CheckpointError, match="non-string key"):
        mgr.save(1, model=model, optimizer=opt, states={"trainer": {}, "data": {"streams": {0: 1}}})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_is_refused_before_writing_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, async_save):
    import shutil as shutil_module

    import training.checkpoint.manager as checkpointing

    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    mgr = manager(tmp_path, async_save=async_save)
    save(mgr, 1, model, opt)
    mgr.wait()
    before = sorted(p.name for p in tmp_path.iterdir())
    real = shutil_module.disk_usage

    def nearly_full(path):
        usage = real(path)
        return type(usage)(usage.total, usage.total - 1000, 1000)

    monkeypatch.setattr(checkpointing.shutil, "disk_usage", nearly_full)
    train_steps(model, opt, 2, 2)
    with pytest.raises(CheckpointError, match="not enough free disk space for checkpoint step 2") as info:
        save(mgr, 2, model, opt)
    assert str(tmp_path) in str(info.value) and "GiB free" in str(info.value)
    mgr.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary dir, LATEST unchanged
    assert mgr.latest_intact() == (1, tmp_path / step_dir_name(1))


# --------------------------------------------------------------------------- protocol


def test_layout_latest_and_retention(tmp_path):
    model, opt = build(seed=0)
    mgr = manager(tmp_path, keep=2)
    for step in range(1, 5):
        train_steps(model, opt, step, step)
        save(mgr, step, model, opt)
    assert mgr.list_steps() == [3, 4]
    assert (tmp_path / "LATEST").read_text() == "step_00000004\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_00000003", "step_00000004"]
    files = set(read_manifest(tmp_path / "step_00000004").files)
    assert {"trainer_state.json", "data_state.json", "rng/rank0.pt", "dcp/.metadata"} <= files
    assert mgr.latest_step == 4


def test_retention_counts_only_checkpoints_up_to_latest(tmp_path):
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    mgr = manager(tmp_path, keep=2)
    save(mgr, 1, model, opt)
    save(mgr, 2, model, opt)
    # Newer than LATEST: left by a run that crashed before updating LATEST (or damaged).
    for orphan in (8, 9):
        os.rename(save(manager(tmp_path / "other", keep=0), orphan, model, opt), tmp_path / f"step_0000000{orphan}")
    flip_bit(tmp_path / "step_00000009" / "trainer_state.json", 3)
    save(mgr, 3, model, opt)
    assert mgr.list_steps() == [2, 3, 8, 9]  # orphans neither kept in place of 2 nor deleted
    assert (tmp_path / "LATEST").read_text() == "step_00000003\n"
    reports = []
    assert manager(tmp_path, on_corrupt=lambda *a: reports.append(a)).latest_intact() == (3, tmp_path / "step_00000003")
    assert reports == []  # orphans are not candidates
    save(mgr, 9, model, opt)  # re-saving an orphan's step replaces it
    assert verify_checkpoint(tmp_path / "step_00000009") is None
    assert mgr.list_steps() == [8, 9]


def test_keep_zero_keeps_everything(tmp_path):
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    mgr = manager(tmp_path, keep=0)
    for step in range(1, 5):
        save(mgr, step, model, opt)
    assert mgr.list_steps() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: os.truncate(dcp_shard(p), dcp_shard(p).stat().st_size // 2), "bytes, manifest says"),
        (lambda p: flip_bit(dcp_shard(p), dcp_shard(p).stat().st_size // 2), "sha256"),
        (lambda p: flip_bit(p / "trainer_state.json", 3), "sha256"),
        (lambda p: flip_bit(p / "rng" / "rank0.pt", 100), "sha256"),
        (lambda p: flip_bit(p / "manifest.json", 40), "manifest"),
        (lambda p: (p / "data_state.json").unlink(), "missing file data_state.json"),
        (lambda p: (p / "dcp" / "stray.bin").write_bytes(b"x"), "unexpected file dcp/stray.bin"),
        (lambda p: (p / "manifest.json").unlink(), "manifest.json is missing"),
    ],
    ids=["truncated", "bitflip-shard", "bitflip-json", "bitflip-rng", "bitflip-manifest", "missing", "extra", "no-manifest"],
)
def test_damage_is_detected_and_load_falls_back(tmp_path, damage, reason):
    model, opt = build(seed=0)
    mgr = manager(tmp_path, keep=0)
    train_steps(model, opt, 1, 1)
    good = save(mgr, 1, model, opt)
    expected = full_state(model, opt)
    train_steps(model, opt, 2, 2)
    bad = save(mgr, 2, model, opt)
    assert verify_checkpoint(bad) is None

    damage(bad)
    assert reason in verify_checkpoint(bad)
    reports = []
    reader = manager(tmp_path, on_corrupt=lambda *args: reports.append(args))
    assert reader.latest_intact() == (1, good)
    assert len(reports) == 1 and reports[0][:2] == (2, bad) and reason in reports[0][2]
    fresh_model, fresh_opt = build(seed=3)
    reader.load(good, model=fresh_model, optimizer=fresh_opt)
    assert_bitwise_equal(full_state(fresh_model, fresh_opt), expected)
    with pytest.raises(CheckpointError, match="damaged"):
        reader.load(bad, model=fresh_model, optimizer=fresh_opt)


def test_newer_format_version_is_refused_not_skipped(tmp_path):
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    mgr = manager(tmp_path)
    save(mgr, 1, model, opt)
    path = save(mgr, 2, model, opt)
    body = json.loads((path / "manifest.json").read_text())
    body.pop("manifest_sha256")
    body["version"] = 2
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))  # the documented checksum rule
    body["manifest_sha256"] = hashlib.sha256(canonical.encode()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(body))
    with pytest.raises(CheckpointFormatError, match="version 2"):
        mgr.latest_intact()
    assert "version 2" in verify_checkpoint(path)


def test_leftover_tmp_dirs_are_ignored_and_cleaned(tmp_path):
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    save(manager(tmp_path), 1, model, opt)
    leftover = tmp_path / ".tmp-step_00000002-deadbeef"
    (leftover / "dcp").mkdir(parents=True)
    (leftover / "dcp" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "LATEST.tmp").write_text("step_00000002\n")

    assert manager(tmp_path).list_steps() == [1]  # constructor (rank 0) cleans
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_00000001"]
    leftover.mkdir()
    reader = CheckpointManager(CheckpointConfig(), checkpoint_dir=tmp_path, dist=single_ctx(), read_only=True)
    assert leftover.exists()  # read-only managers (replay) touch nothing
    assert reader.latest_intact()[0] == 1
    with pytest.raises(CheckpointError, match="read-only"):
        save(reader, 2, model, opt)
    save(manager(tmp_path), 2, model, opt)
    assert not leftover.exists()


def test_failure_mid_save_keeps_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    mgr = manager(tmp_path)
    first = save(mgr, 1, model, opt)
    real_write = manifest_lib.write_file_durably
    calls = []

    def failing_write(path, data):
        calls.append(path)
        if len(calls) == 2:  # after the DCP shards and one small file are on disk
            raise OSError(28, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr("training.checkpoint.manager.write_file_durably", failing_write)
    with pytest.raises(CheckpointError, match="No space left"):
        save(mgr, 2, model, opt)
    monkeypatch.undo()
    assert (tmp_path / "LATEST").read_text() == "step_00000001\n"
    assert [p.name.startswith(".tmp-step_00000002") for p in tmp_path.iterdir()].count(True) == 1
    assert mgr.latest_intact() == (1, first)

    # Crash between writing LATEST.tmp and replacing LATEST: LATEST still names step 1.
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst).name == "LATEST":
            raise OSError(5, "I/O error")
        real_replace(src, dst)

    monkeypatch.setattr(manifest_lib.os, "replace", failing_replace)
    with pytest.raises(CheckpointError, match="I/O error"):
        save(mgr, 3, model, opt)
    monkeypatch.undo()
    assert (tmp_path / "LATEST").read_text() == "step_00000001\n"
    assert mgr.latest_intact() == (1, first)  # step 3 is published but newer than LATEST


_KILL_LOOP = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from core.config import CheckpointConfig
    from core.distributed_context import DistributedContext
    from training.checkpoint.manager import CheckpointManager
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                             backend="gloo", timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    mgr = CheckpointManager(CheckpointConfig(keep=2, async_save=sys.argv[2] == "async"),
                            checkpoint_dir=Path(sys.argv[1]), dist=ctx)
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            model[0].weight.add_(1.0)
        mgr.save(step, model=model, optimizer=opt, states={"trainer": {"step": step}, "data": {}})
        print(step, flush=True)
    """
)


@pytest.mark.parametrize("mode, delay", [("sync", 0.013), ("async", 0.029), ("sync", 0.061)])
def test_sigkill_mid_save_never_leaves_latest_broken(tmp_path, mode, delay):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_LOOP, str(tmp_path), mode], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        for _ in range(3):  # a few complete saves first
            assert proc.stdout.readline(), proc.stderr.read()
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    latest = (tmp_path / "LATEST").read_text().strip()
    assert verify_checkpoint(tmp_path / latest) is None
    reports = []
    found = manager(tmp_path, on_corrupt=lambda *a: reports.append(a)).latest_intact()
    assert found is not None and found[1].name == latest and reports == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# --------------------------------------------------------------------------- async


@pytest.mark.parametrize("staging", ["host", "device"])
def test_async_save_equals_sync_and_copies_before_returning(tmp_path, staging):
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 2)
    expected = full_state(model, opt)
    torch.manual_seed(5)
    sync_path = save(manager(tmp_path / "sync"), 2, model, opt)
    torch.manual_seed(5)
    mgr = manager(tmp_path / "async", async_save=True, staging=staging)
    async_path = save(mgr, 2, model, opt)
    train_steps(model, opt, 3, 3)  # the loop goes on while the checkpoint is written
    mgr.wait()
    assert mgr.in_flight is False

    sync_files, async_files = read_manifest(sync_path).files, read_manifest(async_path).files
    assert sorted(sync_files) == sorted(async_files)
    for name in sync_files:
        if name != "dcp/.metadata":  # DCP's metadata records the path it was written to
            assert sync_files[name] == async_files[name], name
    fresh_model, fresh_opt = build(seed=4)
    mgr.load(async_path, model=fresh_model, optimizer=fresh_opt)
    assert_bitwise_equal(full_state(fresh_model, fresh_opt), expected)

    # The next save refills the same host buffers; the earlier checkpoint is unaffected.
    expected_3 = full_state(model, opt)
    path_3 = save(mgr, 3, model, opt)
    train_steps(model, opt, 4, 4)
    mgr.wait()
    assert verify_checkpoint(async_path) is None
    mgr.load(path_3, model=fresh_model, optimizer=fresh_opt)
    assert_bitwise_equal(full_state(fresh_model, fresh_opt), expected_3)


@pytest.mark.parametrize("staging", ["host", "device"])
def test_async_save_is_not_changed_by_steps_taken_before_wait(tmp_path, staging):
    """The key property of staging: what save() saw is written, whatever the loop does next."""
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 2)
    expected = full_state(model, opt)
    mgr = manager(tmp_path, async_save=True, staging=staging)
    with save_thread_held_back():
        path = save(mgr, 2, model, opt)
        train_steps(model, opt, 3, 3)  # in place: parameters, exp_avg, exp_avg_sq, step
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        changed = full_state(model, opt)
    assert all(not torch.equal(changed[k], v) for k, v in expected.items() if isinstance(v, torch.Tensor))
    mgr.wait()

    fresh_model, fresh_opt = build(seed=4)
    mgr.load(path, model=fresh_model, optimizer=fresh_opt)
    assert_bitwise_equal(full_state(fresh_model, fresh_opt), expected)


@contextlib.contextmanager
def lockstep_records():
    """The records the ``lockstep`` logger emits at INFO and above meanwhile, from a handler of its own
    (not caplog's: an in-process run earlier in the worker leaves the logger non-propagating, and
    pytest attaches its capture handlers to such loggers too, so caplog could see a record twice)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("lockstep")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.parametrize("staging, on_loop", [("host", True), ("device", False), ("auto", True)])
def test_staging_decides_where_the_host_copy_is_made(tmp_path, monkeypatch, staging, on_loop):
    """host copies on the loop's thread, device on the save thread; auto on a CPU is host."""
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    threads = []

    def spy(cls):
        copy = cls.copy

        def spied(self, state, *args):
            threads.append(threading.current_thread())
            return copy(self, state, *args)

        monkeypatch.setattr(cls, "copy", spied)

    spy(HostBuffers)
    spy(SnapshotBuffers)
    mgr = manager(tmp_path, async_save=True, staging=staging)
    with lockstep_records() as records:
        save(mgr, 1, model, opt)
        mgr.wait()
        save(mgr, 2, model, opt)
        mgr.wait()
    assert len(threads) == 2
    assert all((t is threading.current_thread()) == on_loop for t in threads)
    decisions = [r.getMessage() for r in records if r.getMessage().startswith("checkpoint staging")]
    logged_once = ["checkpoint staging: host (the state is not on a CUDA device)"]
    assert decisions == (logged_once if staging == "auto" else [])


def test_snapshot_buffers_copy_every_byte_through_small_chunks_and_reuse_their_buffers():
    """Chunks of 7 bytes cut through elements and tensors; odd dtypes, strides and sizes."""
    gen = torch.Generator().manual_seed(0)

    def state(offset):
        return {
            "model": {
                "w": torch.randn(5, 3, generator=gen) + offset,
                "t": (torch.randn(4, 6, generator=gen) + offset).t(),  # not contiguous
                "b": torch.randn(9, generator=gen).to(torch.bfloat16),
                "i": torch.arange(11, dtype=torch.int64) * (offset + 1),
                "mask": torch.rand(13, generator=gen) > 0.5,
                "empty": torch.empty(0, 4),
                "scalar": torch.tensor(3.5 + offset),
            },
            "step": 7,
        }

    buffers = SnapshotBuffers(chunk_bytes=7)
    first, second = state(0), state(1)
    copied = buffers.copy(first)
    assert copied["step"] == 7
    assert_bitwise_equal(copied["model"], first["model"])
    assert all(not v.is_pinned() for v in copied["model"].values())
    again = buffers.copy(second)
    assert_bitwise_equal(again["model"], second["model"])
    assert all(again["model"][k] is copied["model"][k] for k in first["model"])  # refilled, not reallocated
    assert again["model"]["t"].shape == second["model"]["t"].shape


def test_device_snapshot_refuses_lazy_tensors():
    with pytest.raises(CheckpointError, match="snapshots CUDA and CPU tensors, not meta ones"):
        DeviceSnapshot({"model": {"w": torch.empty(2, device="meta")}}, torch.device("cpu"))


def test_device_snapshot_copy_failure_surfaces_at_wait(tmp_path, monkeypatch):
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    mgr = manager(tmp_path, async_save=True, staging="device")
    no_memory = RuntimeError("out of pinned memory")
    monkeypatch.setattr(SnapshotBuffers, "copy", lambda self, state, *a: (_ for _ in ()).throw(no_memory))
    save(mgr, 1, model, opt)  # the host copy is the save thread's
    with pytest.raises(CheckpointError, match="copying the checkpoint to host memory failed: .*out of pinned"):
        mgr.wait()
    monkeypatch.undo()
    save(mgr, 2, model, opt)
    mgr.wait()
    assert mgr.latest_intact()[0] == 2


def test_async_failure_surfaces_at_wait_and_next_save_works(tmp_path, monkeypatch):
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    mgr = manager(tmp_path, async_save=True)
    monkeypatch.setattr("training.checkpoint.manager.hash_file", lambda p: (_ for _ in ()).throw(OSError(5, "EIO")))
    save(mgr, 1, model, opt)
    with pytest.raises(CheckpointError, match="EIO"):
        mgr.wait()
    monkeypatch.undo()
    mgr.wait()  # the error is reported once
    save(mgr, 2, model, opt)
    mgr.wait()
    assert mgr.latest_intact()[0] == 2


# --------------------------------------------------------------------------- several ranks


def run_on_two_ranks(fn, *args) -> list:
    port = launch.free_port()
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank_entry, args=(port, out, fn, args), nprocs=2, join=True)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _rank_entry(rank: int, port: int, out: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    with DistributedContext.from_env(ParallelConfig(device="cpu", backend="gloo", timeout_s=60)) as ctx:
        result = fn(ctx, *args)
        ctx.barrier()
    torch.save(result, Path(out) / f"rank{rank}.pt")


def _wrap(model: nn.Module, strategy: str) -> nn.Module:
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))  # CPU even where CUDA exists
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model.out, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _save_ddp_and_fsdp2(ctx: DistributedContext, root: str) -> dict:
    return {
        "ddp": _save_on_ranks(ctx, f"{root}/ddp", "ddp", async_save=False),
        "fsdp": _save_on_ranks(ctx, f"{root}/fsdp", "fsdp", async_save=True),
        # DTensor snapshots on rank 0, host copies on rank 1 (auto may choose per rank); the
        # save thread starts only after the next steps changed the shards in place.
        "fsdp_mixed": _save_on_ranks(
            ctx,
            f"{root}/fsdp_mixed",
            "fsdp",
            async_save=True,
            staging="device" if ctx.rank == 0 else "host",
            held_back=True,
        ),
    }


def _save_on_ranks(
    ctx: DistributedContext,
    ckpt_dir: str,
    strategy: str,
    async_save: bool,
    staging: str = "auto",
    held_back: bool = False,
) -> dict:
    torch.manual_seed(0)
    model = _wrap(TinyNet(), strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train_steps(model, opt, 1, 2, rank=ctx.rank)
    expected = full_state(model, opt)
    config = CheckpointConfig(async_save=async_save, staging=staging)
    mgr = CheckpointManager(config, checkpoint_dir=Path(ckpt_dir), dist=ctx)
    with save_thread_held_back() if held_back else contextlib.nullcontext():
        save(mgr, 2, model, opt)
        # Training collectives while the save runs (held back: before the save reads anything).
        train_steps(model, opt, 3, 4, rank=ctx.rank)
    mgr.wait()
    return expected


def _load_on_ranks(ctx: DistributedContext, ckpt_dir: str, strategy: str) -> dict:
    torch.manual_seed(123)
    model = _wrap(TinyNet(), strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = CheckpointManager(CheckpointConfig(), checkpoint_dir=Path(ckpt_dir), dist=ctx)
    step, path = mgr.latest_intact()
    loaded = mgr.load(path, model=model, optimizer=opt)
    return {"state": full_state(model, opt), "has_rng": loaded.rng_state is not None}


def test_two_ranks_ddp_and_fsdp2_save_then_one_process_loads(tmp_path):
    saved = run_on_two_ranks(_save_ddp_and_fsdp2, str(tmp_path))[0]
    assert sorted(saved) == ["ddp", "fsdp", "fsdp_mixed"]
    assert read_manifest(tmp_path / "ddp" / "step_00000002").world_size == 2
    assert {"rng/rank0.pt", "rng/rank1.pt"} <= set(read_manifest(tmp_path / "fsdp" / "step_00000002").files)
    for name, expected in saved.items():
        model, opt = build(seed=77)
        mgr = manager(tmp_path / name)
        mgr.load(mgr.latest_intact()[1], model=model, optimizer=opt)
        assert_bitwise_equal(full_state(model, opt), expected)


def test_one_process_save_then_two_fsdp2_ranks_load(tmp_path):
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 2)
    save(manager(tmp_path), 2, model, opt)
    results = run_on_two_ranks(_load_on_ranks, str(tmp_path), "fsdp")
    assert_bitwise_equal(results[0]["state"], full_state(model, opt))
    assert [r["has_rng"] for r in results] == [True, False]  # rank 1 did not exist at save time


def test_several_writer_threads_write_several_files_that_load_bitwise(tmp_path, monkeypatch):
    """On hosts with cores to spare DCP writes a rank's shards in several files, hashed in parallel."""
    monkeypatch.setattr(checkpointing, "_IO_THREADS", 3)
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 2)
    expected = full_state(model, opt)
    mgr = manager(tmp_path, async_save=True, staging="device")
    path = save(mgr, 2, model, opt)
    mgr.wait()
    assert len(list((path / "dcp").glob("*.distcp"))) == 3
    assert verify_checkpoint(path) is None
    fresh_model, fresh_opt = build(seed=4)
    mgr.load(path, model=fresh_model, optimizer=fresh_opt)
    assert_bitwise_equal(full_state(fresh_model, fresh_opt), expected)


def test_a_save_that_waits_for_the_previous_one_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing, "_SLOW_WAIT_WARN_S", 0.2)
    model, opt = build(seed=0)
    train_steps(model, opt, 1, 1)
    mgr = manager(tmp_path, async_save=True)
    run_in_background = CheckpointManager._run_in_background

    def slow(self, *args):
        time.sleep(0.5)
        run_in_background(self, *args)

    monkeypatch.setattr(CheckpointManager, "_run_in_background", slow)
    with lockstep_records() as records:
        save(mgr, 1, model, opt)
        save(mgr, 2, model, opt)  # step 1 is still being written
        mgr.wait()
        save(mgr, 3, model, opt)  # nothing in flight: no warning
        mgr.wait()
    warnings = [r.getMessage() for r in records if "waited" in r.getMessage()]
    assert len(warnings) == 1
    assert "checkpoint step 2 waited" in warnings[0] and "save of step 1" in warnings[0]
    assert "raise checkpoint.interval" in warnings[0]
