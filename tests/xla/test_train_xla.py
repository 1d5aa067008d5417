"""``parallel.strategy=xla_spmd`` through the real entry point (train.py), end to end.

Run by the XLA lane (``make test-xla``: .venv-xla); skipped where torch_xla is not
installed. Every run is a ``train.py`` process of this interpreter on the small e2e config,
with 4 virtual CPU devices (PJRT_DEVICE=CPU CPU_NUM_DEVICES=4):

- the SPMD run writes the run-dir contract (ledger with parameter hashes, checkpoints);
- its ledger matches a ``parallel.strategy=none`` run of the same interpreter: the same
  batches and data states, loss and gradient norm within float tolerance (the sharded
  reductions add in another order);
- a run that crashes after a checkpoint and is resumed ends with a ledger identical, line
  for line and bit for bit, to the uninterrupted run's (which saves asynchronously), and
  ``--replay`` of a step after a checkpoint matches the ledger;
- an unsupported combination exits 2 naming the key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch_xla")

from tests import launch  # noqa: E402
from tests.e2e_config import e2e_args  # noqa: E402

DEVICES = 4
STEPS = 6
# micro_batch_size 4: each micro-batch splits evenly over the devices (2 per step).
COMMON = ["train.micro_batch_size=4", "checkpoint.interval=3"]
TIMEOUT = 240


@pytest.fixture(scope="module", autouse=True)
def four_cpu_devices():
    """launch.env copies os.environ, so every train.py process sees 4 virtual CPU devices."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PJRT_DEVICE", "CPU")
        patch.setenv("CPU_NUM_DEVICES", str(DEVICES))
        yield


def _train(workdir: Path, name: str, overrides: list[str]) -> tuple[launch.Result, Path | None]:
    """One train.py process of this interpreter; its run dir (None if none was made)."""
    result = launch.train(workdir, e2e_args(max_steps=STEPS, name=name, overrides=overrides), nproc=1, timeout=TIMEOUT)
    if "run_dir: " not in result.stdout:
        return result, None
    return result, result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


@pytest.fixture(scope="module")
def reference(e2e_workdir):
    """One uninterrupted xla_spmd run that the other tests compare against."""
    result, run_dir = _train(e2e_workdir, "xla", ["parallel.strategy=xla_spmd", *COMMON, "checkpoint.async_save=true"])
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


def test_spmd_run_writes_ledger_and_checkpoints(reference):
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert [r["step"] for r in lines if "param_hash" in r] == [3, 6]
    checkpoints = reference / "checkpoints"
    assert (checkpoints / "LATEST").read_text().strip() == "step_00000006"
    assert (checkpoints / "step_00000003" / "manifest.json").is_file()
    events = [e["event"] for e in launch.events(reference)]
    assert events[0] == "run_started" and "checkpoint_saved" in events and events[-1] == "finished"
    log = (reference / "logs" / "rank0.log").read_text()
    assert f"xla_spmd: {DEVICES} XLA devices" in log


def test_spmd_matches_a_plain_run(e2e_workdir, reference):
    plain, run_dir = _train(e2e_workdir, "plain", ["parallel.strategy=none", *COMMON])
    assert plain.returncode == 0, plain.stderr[-4000:]
    expected, got = launch.ledger(run_dir), launch.ledger(reference)
    assert len(got) == len(expected) == STEPS
    for want, have in zip(expected, got):
        for key in ("step", "lr", "tokens", "target_tokens", "batch_hash", "data_state_hash"):
            assert have[key] == want[key], key
        assert have["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
        assert have["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4, abs=1e-6)


def test_crash_then_resume_is_bitwise_identical(e2e_workdir, reference):
    # Synchronous saves here: an asynchronous one might still be in flight at the crash.
    overrides = ["parallel.strategy=xla_spmd", *COMMON, "runtime.faults=[crash@5]"]
    crashed, run_dir = _train(e2e_workdir, "xla-crash", overrides)
    assert crashed.returncode != 0
    assert [r["step"] for r in launch.ledger(run_dir)] == [1, 2, 3, 4]
    resumed = launch.train(e2e_workdir, ["--resume", run_dir.name, "runtime.faults=[]"], nproc=1, timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    resumed_at = [e["step"] for e in launch.events(run_dir) if e["event"] == "resumed"]
    assert resumed_at == [3]
    assert launch.ledger(run_dir) == launch.ledger(reference)


def test_replay_from_a_checkpoint_matches(e2e_workdir, reference):
    result = launch.train(e2e_workdir, ["--replay", reference.name, "--step", "5"], nproc=1, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "steps 4..5 match" in result.stdout


def test_unsupported_combination_exits_2(e2e_workdir):
    result, _ = _train(e2e_workdir, "xla-bf16", ["parallel.strategy=xla_spmd", "parallel.precision=bf16"])
    assert result.exit_code == 2, result.stderr[-4000:]
    assert "parallel.precision" in result.stderr


def test_checkpoint_round_trip_keeps_optimizer_state_sharded(tmp_path):
    """In process: CheckpointManager saves XLA state and loads it back; ``after_load``
    shards the loaded optimizer moments like their parameters, as training leaves them."""
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    import models
    from core import config as config_lib, seeding
    from core.distributed_context import DistributedContext
    from distributed.topology import build_mesh
    from tests.e2e_config import E2E_CONFIG
    from training import xla
    from training.checkpoint.manager import CheckpointManager
    from training.optimizers.build import build_optimizer

    if xr.global_runtime_device_count() != DEVICES:
        pytest.skip(f"needs PJRT_DEVICE=CPU CPU_NUM_DEVICES={DEVICES}")
    spec = torch_xla._XLAC._get_xla_sharding_spec
    config = config_lib.load(E2E_CONFIG, ["parallel.strategy=xla_spmd"])
    dist = DistributedContext.from_env(config.parallel)  # one process: no process group

    def build(seed: int):
        plain = models.build(config.model, generator=seeding.generator(seed, "model_init"))
        model, plan = xla.setup(plain, config, build_mesh(config.parallel, dist))
        return model, plan, build_optimizer(model, config.train, plan.device)

    def train_step(model, plan, optimizer) -> float:
        ids = torch.randint(0, config.model.vocab_size, (DEVICES, 16), generator=torch.Generator().manual_seed(7))
        positions = torch.arange(16).repeat(DEVICES, 1)
        logits = model(plan.place_batch(ids), position_ids=plan.place_batch(positions),
                       document_ids=plan.place_batch(torch.zeros_like(ids)))
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        plan.sync()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        plan.sync()
        return float(loss.detach())

    model, plan, optimizer = build(0)
    train_step(model, plan, optimizer)
    manager = CheckpointManager(config.checkpoint, checkpoint_dir=tmp_path, dist=dist)
    path = manager.save(1, model=model, optimizer=optimizer, states={"trainer": {"version": 1}, "data": {"version": 1}})
    manager.wait()
    saved_hash = plan.param_hash(model)
    expected = train_step(model, plan, optimizer)

    fresh, fresh_plan, fresh_optimizer = build(1)
    assert fresh_plan.param_hash(fresh) != saved_hash
    manager.load(path, model=fresh, optimizer=fresh_optimizer)
    fresh_plan.after_load(fresh, fresh_optimizer)
    assert fresh_plan.param_hash(fresh) == saved_hash
    for param in fresh.parameters():
        for name in ("exp_avg", "exp_avg_sq"):
            assert spec(fresh_optimizer.state[param][name]) == spec(param), name
    assert spec(fresh.layers[0].mlp.up_proj.weight) == "{devices=[4,1]0,1,2,3}"
    assert train_step(fresh, fresh_plan, fresh_optimizer) == expected
