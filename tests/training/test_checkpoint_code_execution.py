"""A checkpoint is data, never code: DCP's pickled ``.metadata`` and its pickled non-tensor
values are loaded through an allowlist (distributed/safe_dcp.py), so a crafted checkpoint whose
manifest hashes were recomputed is refused with exit 4 on ``--resume`` and ``--replay`` and
runs nothing. Real checkpoints of a model and AdamW under none, DDP and FSDP2 still load.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from core.exceptions import CheckpointError
from tests import launch
from tests.e2e_config import e2e_args
from training.checkpoint.manifest import CheckpointManifest, hash_file, read_manifest
from distributed.safe_dcp import SafeFileSystemReader, load_metadata


class _Payload:
    """Unpickles into a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 11))


def test_crafted_metadata_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    meta = tmp_path / ".metadata"
    meta.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError) as info:
        load_metadata(meta)
    assert not marker.exists()
    assert str(meta) in str(info.value) and "system" in str(info.value)
    assert info.value.exit_code == 4


def test_non_metadata_pickle_and_garbage_are_checkpoint_errors(tmp_path):
    meta = tmp_path / ".metadata"
    meta.write_bytes(pickle.dumps({"just": "a dict"}))
    with pytest.raises(CheckpointError, match="not a torch.distributed.checkpoint Metadata"):
        load_metadata(meta)
    meta.write_bytes(b"\x80\x05garbage")
    with pytest.raises(CheckpointError, match="not readable"):
        load_metadata(meta)


def test_crafted_non_tensor_value_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    dcp.save({"value": _Payload(marker)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert not marker.exists()
    with pytest.raises((CheckpointError, dcp.CheckpointException)) as info:  # DCP wraps a reader error
        dcp.load({"value": None}, storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")), no_dist=True)
    assert not marker.exists()
    assert "not weights-only loadable" in str(info.value)


def _save_and_load_model_and_optimizer(mode: str, out: str, world: int, rank: int) -> None:
    """Train one step of a tiny model under ``mode``, save with DCP, load back through the safe reader."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=out.rsplit("-", 1)[1], RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _tiny_model()
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(10).view(2, 5)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    expected = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in msd.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, storage_reader=SafeFileSystemReader(out))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    msd, _ = get_state_dict(model, opt)
    for k, v in msd.items():
        got = v.full_tensor() if hasattr(v, "full_tensor") else v
        assert torch.equal(got, expected[k]), k


def test_real_checkpoints_load_through_the_allowlist(tmp_path):
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(10).view(2, 5)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.save(state, checkpoint_id=tmp_path / "none", no_dist=True)
    SafeFileSystemReader(str(tmp_path / "none")).read_metadata()
    for mode in ("ddp", "fsdp"):
        out = f"{tmp_path}/{mode}-{launch.free_port()}"
        codes = launch.spawn_ranks(_save_and_load_model_and_optimizer, lambda r: (mode, out, 2, r), world=2, timeout=120)
        assert codes == [0, 0], (mode, codes)


def _craft_checkpoint(ckpt: Path, marker: Path) -> None:
    """Replace DCP's .metadata with a payload and recompute the manifest, as an attacker would."""
    meta = ckpt / "dcp" / ".metadata"
    meta.write_bytes(pickle.dumps(_Payload(marker)))
    manifest = read_manifest(ckpt)
    files = dict(manifest.files)
    files["dcp/.metadata"] = hash_file(meta)
    forged = CheckpointManifest(
        step=manifest.step,
        world_size=manifest.world_size,
        has_optimizer_state=manifest.has_optimizer_state,
        torch_version=manifest.torch_version,
        files=files,
    )
    (ckpt / "manifest.json").write_bytes(forged.to_bytes())


@pytest.mark.slow
def test_resume_and_replay_refuse_a_crafted_checkpoint(e2e_workdir):
    result = launch.train(
        e2e_workdir, e2e_args(max_steps=4, name="crafted", overrides=["checkpoint.interval=2"]), nproc=1
    )
    assert result.returncode == 0, result.stderr
    run_dir = e2e_workdir / result.run_dir
    marker = e2e_workdir / "pwned"
    for step in (2, 4):
        _craft_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}", marker)

    resumed = launch.train(e2e_workdir, ["--resume", result.run_id, "train.max_steps=6"], nproc=1)
    assert resumed.exit_code == 4, resumed.stdout + resumed.stderr
    assert not marker.exists()
    assert "dcp/.metadata" in resumed.stderr

    replayed = launch.train(e2e_workdir, ["--replay", result.run_id, "--step", "4"], nproc=1)
    assert replayed.exit_code == 4, replayed.stdout + replayed.stderr
    assert not marker.exists()
