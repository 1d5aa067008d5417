"""XLA SPMD on 4 virtual CPU devices trains like plain CPU torch, and checkpoints round-trip.

Run by the XLA lane (``make test-xla``: .venv-xla, PJRT_DEVICE=CPU, CPU_NUM_DEVICES=4);
skipped where torch_xla is not installed. The plain-CPU reference runs in the same
interpreter, before SPMD mode touches any XLA device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

torch_xla = pytest.importorskip("torch_xla")

from core.config import ParallelConfig  # noqa: E402
from distributed import clip_grad_norm_, param_hash  # noqa: E402
from distributed import xla_spmd  # noqa: E402
from tests.distributed.scenarios import MAX_NORM, build_model, make_batch  # noqa: E402

DEVICES = 4
STEPS = 3
PARALLEL = dataclasses.replace(ParallelConfig(), strategy="xla_spmd")


def _step(model, optimizer, batch, *, to=None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    norm = clip_grad_norm_(model, MAX_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), norm


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def _xla_batch(step: int, mesh, device) -> dict[str, torch.Tensor]:
    return {k: xla_spmd.shard_batch(v.to(device), mesh) for k, v in make_batch(step).items()}


@pytest.fixture(scope="module")
def reference() -> dict:
    model = build_model()
    optimizer = _optimizer(model)
    losses, norms = [], []
    for step in range(STEPS + 1):
        loss, norm = _step(model, optimizer, make_batch(step))
        losses.append(float(loss))
        norms.append(float(norm))
    return {"losses": losses, "grad_norms": norms, "hash_initial": param_hash(build_model())}


@pytest.fixture(scope="module")
def spmd():
    """The model set up on the SPMD mesh (once per process: SPMD mode is global)."""
    import torch_xla.runtime as xr

    if xr.global_runtime_device_count() != DEVICES:
        pytest.skip(f"needs PJRT_DEVICE=CPU CPU_NUM_DEVICES={DEVICES}")
    return xla_spmd.setup_xla_spmd(build_model(), PARALLEL)


def test_parameters_are_sharded_on_dim0_and_stay_tied(spmd):
    model, mesh, device = spmd
    assert model.lm_head.weight is model.embed_tokens.weight
    weight = model.layers[0].mlp.up_proj.weight
    assert weight.device.type == "xla"
    assert torch_xla._XLAC._get_xla_sharding_spec(weight) == "{devices=[4,1]0,1,2,3}"
    assert xla_spmd.parameter_spec((6, 4), DEVICES) == (None, None)  # 6 rows do not split by 4


def test_training_matches_single_device_and_checkpoint_round_trips(spmd, reference, tmp_path):
    model, mesh, device = spmd
    assert param_hash(model) == reference["hash_initial"]
    optimizer = _optimizer(model)
    losses, norms = [], []
    for step in range(STEPS):
        loss, norm = _step(model, optimizer, _xla_batch(step, mesh, device))
        xla_spmd.sync()
        losses.append(float(loss))
        norms.append(float(norm))
    torch.testing.assert_close(losses, reference["losses"][:STEPS], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norms, reference["grad_norms"][:STEPS], rtol=1e-4, atol=1e-5)

    # Save after STEPS steps, then continue one step: the expected next loss.
    xla_spmd.save_checkpoint({"model": model.state_dict(), "optim": optimizer.state_dict()}, tmp_path / "ckpt")
    saved_hash = param_hash(model)
    expected, _ = _step(model, optimizer, _xla_batch(STEPS, mesh, device))
    xla_spmd.sync()
    torch.testing.assert_close(float(expected), reference["losses"][STEPS], rtol=1e-5, atol=1e-5)

    # A fresh model and optimizer (different weights) restored from the checkpoint.
    fresh, _, _ = xla_spmd.setup_xla_spmd(build_model(), PARALLEL)
    with torch.no_grad():
        for param in fresh.parameters():
            param.mul_(0.5)
    fresh_optimizer = _optimizer(fresh)
    xla_spmd.prime_optimizer(fresh_optimizer)
    assert param_hash(fresh) != saved_hash
    xla_spmd.load_checkpoint({"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()}, tmp_path / "ckpt")
    assert param_hash(fresh) == saved_hash
    assert torch_xla._XLAC._get_xla_sharding_spec(fresh.layers[0].mlp.up_proj.weight) == "{devices=[4,1]0,1,2,3}"
    resumed, _ = _step(fresh, fresh_optimizer, _xla_batch(STEPS, mesh, device))
    xla_spmd.sync()
    assert float(resumed) == float(expected)
