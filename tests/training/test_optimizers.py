"""training/optimizers/build.py and training/optimizers/: the group rules, each update against its
formulas, Muon under FSDP2 against one process (2 gloo ranks), and 2-rank SIGKILL/resume
with every optimizer ending in the uninterrupted run's ledger."""

from __future__ import annotations

import copy
import json
import math
import os
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import models
from core.config import ModelConfig, ParallelConfig, TrainConfig, load
from core.exceptions import ConfigError
from tests import launch
from tests.e2e_config import e2e_args
from training.optimizers.build import build_optimizer, evaluation_weights, param_groups, parameter_roles
from training.optimizers.lion import Lion
from training.optimizers.local_shards import LocalShardAdamW
from training.optimizers.muon import Muon, newton_schulz, orthogonalize
from training.optimizers.schedule_free import ScheduleFreeAdamW

CPU = torch.device("cpu")
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)


# --------------------------------------------------------------------------- group rules


def _names(model: nn.Module, params) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, (_, p) in parameter_roles(model).items() if id(p) in ids}


@pytest.mark.parametrize("tied", [True, False])
def test_groups_decay_and_muon_by_role(tied):
    model = models.build(replace(TINY, tie_embeddings=tied))
    groups = param_groups(model, 0.1, muon=True)
    if tied:  # no decayed AdamW parameter is left: the empty group is dropped
        groups.insert(1, {"params": [], "weight_decay": 0.1, "use_muon": False})
    muon, decay, no_decay = groups
    assert (muon["weight_decay"], decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.1, 0.0)
    assert muon["use_muon"] and not decay["use_muon"] and not no_decay["use_muon"]
    hidden = {f"layers.0.self_attn.{n}_proj.weight" for n in "qkvo"} | {f"layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    assert _names(model, muon["params"]) == hidden
    assert _names(model, decay["params"]) == (set() if tied else {"lm_head.weight"})
    assert "embed_tokens.weight" in _names(model, no_decay["params"])  # embeddings are not decayed
    assert all(p.ndim == 1 for p in no_decay["params"] if p is not model.embed_tokens.weight)
    every = [p for g in (muon, decay, no_decay) for p in g["params"]]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters()))
    # Without Muon the same decay split, in two groups.
    plain_decay, plain_no_decay = param_groups(model, 0.1)
    assert all(g["params"] for g in param_groups(model, 0.1, muon=True))
    assert _names(model, plain_decay["params"]) == hidden | _names(model, decay["params"])
    assert _names(model, plain_no_decay["params"]) == _names(model, no_decay["params"])


def test_frozen_parameters_are_in_no_group():
    model = models.build(TINY)
    model.embed_tokens.weight.requires_grad_(False)
    groups = param_groups(model, 0.1, muon=True)
    assert all(p is not model.embed_tokens.weight for g in groups for p in g["params"])


@pytest.mark.parametrize(
    "name, cls", [("adamw", LocalShardAdamW), ("muon", Muon), ("lion", Lion), ("schedule_free_adamw", ScheduleFreeAdamW)]
)
def test_build_optimizer_by_name(name, cls):
    config = TrainConfig(optimizer=name, schedule="constant")
    assert type(build_optimizer(models.build(TINY), config, CPU)) is cls


def test_config_rules_for_optimizers_and_float8():
    with pytest.raises(ConfigError, match="train.schedule"):
        load(None, ["train.optimizer=schedule_free_adamw", "train.schedule=cosine"])
    with pytest.raises(ConfigError, match="train.muon_ns_steps"):
        load(None, ["train.muon_ns_steps=0"])
    with pytest.raises(ConfigError, match="train.lion_beta2"):
        load(None, ["train.lion_beta2=1.0"])
    with pytest.raises(ConfigError) as err:
        load(None, ["parallel.float8=tensorwise", "parallel.device=cpu", "parallel.precision=bf16"])
    assert err.value.context["key"] == "parallel.float8" and "sm89" in str(err.value) and "torchao" in err.value.hint
    with pytest.raises(ConfigError, match="parallel.precision"):
        load(None, ["parallel.float8=rowwise", "parallel.device=cuda", "parallel.precision=fp32"])
    assert load(None, ["parallel.float8=rowwise", "parallel.device=cuda", "parallel.precision=bf16"]).parallel.float8 == "rowwise"


# --------------------------------------------------------------------------- updates


def _seeded(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
@pytest.mark.parametrize("rule", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch_muon_bitwise(rule, nesterov):
    ours_w = nn.Parameter(_seeded((12, 7), 0))
    theirs_w = nn.Parameter(ours_w.detach().clone())
    ours = Muon([{"params": [ours_w], "weight_decay": 0.1}], lr=0.02, nesterov=nesterov, adjust_lr=rule)
    theirs = torch.optim.Muon([theirs_w], lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=rule)
    for step in range(3):
        ours_w.grad = _seeded((12, 7), 10 + step)
        theirs_w.grad = ours_w.grad.clone()
        ours.step()
        theirs.step()
        assert torch.equal(ours_w, theirs_w)
    assert torch.equal(ours.state[ours_w]["momentum_buffer"], theirs.state[theirs_w]["momentum_buffer"])


@pytest.mark.parametrize("shape", [(12, 7), (7, 12), (9, 9)])
def test_own_newton_schulz_equals_torchs(shape):
    matrix = _seeded(shape, 3)
    ours = newton_schulz(matrix, 5)
    assert ours.dtype == torch.bfloat16 and ours.shape == shape
    assert torch.equal(ours, orthogonalize(matrix, 5, use_torch=True))  # torch's where it exists
    # Close to orthogonal: singular values spread around 1 (the quintic does not converge to 1).
    singular = torch.linalg.svdvals(ours.float())
    assert 0.5 < singular.min() and singular.max() < 1.5
    assert torch.equal(matrix, _seeded(shape, 3))  # the input is left alone


def test_muon_adamw_groups_match_torch_adamw():
    ours_p = [nn.Parameter(_seeded((5,), 1)), nn.Parameter(_seeded((6, 3), 2))]
    theirs_p = [nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = Muon([{"params": ours_p, "use_muon": False, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    theirs = torch.optim.AdamW(theirs_p, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(4):
        for i, (a, b) in enumerate(zip(ours_p, theirs_p)):
            a.grad = _seeded(a.shape, 100 * step + i)
            b.grad = a.grad.clone()
        ours.step()
        theirs.step()
    for a, b in zip(ours_p, theirs_p):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_lion_step_by_hand():
    w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = Lion([{"params": [w], "weight_decay": 0.5}], lr=0.1, betas=(0.9, 0.99))
    opt.state[w]["exp_avg"].copy_(torch.tensor([1.0, 1.0, -1.0]))
    w.grad = torch.tensor([-20.0, 3.0, 5.0])
    opt.step()
    # c = 0.9 m + 0.1 g = [-1.1, 1.2, -0.4]; w <- w (1 - 0.1*0.5) - 0.1 sign(c)
    expected = torch.tensor([1.0 * 0.95 + 0.1, -2.0 * 0.95 - 0.1, 0.5 * 0.95 + 0.1])
    torch.testing.assert_close(w.detach(), expected)
    torch.testing.assert_close(opt.state[w]["exp_avg"], torch.tensor([0.99 - 0.2, 0.99 + 0.03, -0.99 + 0.05]))


def test_schedule_free_follows_the_papers_sequences():
    """y, z and x of Algorithm 1, computed here in float64 from the formulas, against the
    optimizer's y (parameters), z (state) and x (eval mode)."""
    beta1, beta2, eps, wd, lrs = 0.9, 0.999, 1e-8, 0.1, [0.01, 0.02, 0.02]
    x0 = _seeded((4,), 5).double()
    w = nn.Parameter(x0.float().clone())
    opt = ScheduleFreeAdamW([{"params": [w], "weight_decay": wd}], lr=0.0, betas=(beta1, beta2), eps=eps)
    x, z, v, weight_sum = x0.clone(), x0.clone(), torch.zeros(4, dtype=torch.float64), 0.0
    for t, lr in enumerate(lrs, start=1):
        y = (1 - beta1) * z + beta1 * x
        g = _seeded((4,), 50 + t).double()
        v = beta2 * v + (1 - beta2) * g * g
        gamma = lr * math.sqrt(1 - beta2**t)
        z = z - gamma * (g / (v.sqrt() + eps) + wd * y)
        weight_sum += gamma**2
        c = gamma**2 / weight_sum
        x = (1 - c) * x + c * z
        for group in opt.param_groups:
            group["lr"] = lr
        w.grad = g.float()
        opt.step()
        y_next = (1 - beta1) * z + beta1 * x
        torch.testing.assert_close(w.detach().double(), y_next, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[w]["z"].double(), z, rtol=1e-5, atol=1e-6)
    y_bits = w.detach().clone()
    with evaluation_weights(opt, nn.Module()):
        torch.testing.assert_close(w.detach().double(), x, rtol=1e-5, atol=1e-6)
        with pytest.raises(RuntimeError, match="eval mode"):
            opt.step()
    assert torch.equal(w.detach(), y_bits)  # back to the training weights, bit for bit


def test_evaluation_weights_leave_other_optimizers_alone():
    w = nn.Parameter(torch.ones(3))
    opt = Lion([w], lr=0.1)
    with evaluation_weights(opt, nn.Module()):
        assert torch.equal(w.detach(), torch.ones(3))


@pytest.mark.parametrize("name", ["adamw", "muon", "lion", "schedule_free_adamw"])
def test_state_dict_round_trip_continues_bitwise(name):
    """What a checkpoint restores (Optimizer.load_state_dict casts state tensors to the
    parameter's dtype) continues exactly like the optimizer that never stopped."""
    config = TrainConfig(optimizer=name, schedule="constant", lr=0.01)
    torch.manual_seed(0)
    model = models.build(TINY)
    opt = build_optimizer(model, config, CPU)

    def step(m, o, s):
        for i, p in enumerate(m.parameters()):
            p.grad = _seeded(p.shape, 100 * s + i)
        o.step()

    for s in range(2):
        step(model, opt, s)
    resumed = models.build(TINY)
    resumed.load_state_dict(model.state_dict())
    resumed_opt = build_optimizer(resumed, config, CPU)
    resumed_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for s in range(2, 4):
        step(model, opt, s)
        step(resumed, resumed_opt, s)
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


# --------------------------------------------------------------------------- FSDP2


class _Mixed(nn.Module):
    """Uneven shards on 2 ranks (9 and 5 rows), an embedding, a vector."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 9, bias=False)
        self.down = nn.Linear(9, 5)
        self.scale = nn.Parameter(torch.ones(5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(self.embed(ids))) * self.scale


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    config = TrainConfig(optimizer=name, schedule="constant", lr=0.01, muon_adjust_lr="original")
    return build_optimizer(model, config, CPU)


def _fsdp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
        from core.distributed_context import DistributedContext
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, distribute_tensor

        result = {}
        with DistributedContext.from_env(ParallelConfig(device="cpu", backend="gloo", timeout_s=60)):
            mesh = init_device_mesh("cpu", (world,))
            for name in ("muon", "adamw", "lion", "schedule_free_adamw"):
                torch.manual_seed(0)
                single = _Mixed()
                sharded = _Mixed()
                sharded.load_state_dict(single.state_dict())
                # The same update dispatched through DTensor (no on_local_shards).
                dispatched = _Mixed()
                dispatched.load_state_dict(single.state_dict())
                # Kept gathered after forward, like the root unit in distributed/fsdp.py.
                fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
                fully_shard(dispatched, mesh=mesh, reshard_after_forward=False)
                opts = _optimizer(name, single), _optimizer(name, sharded)
                via_dtensor = _optimizer(name, dispatched)
                via_dtensor.step_on_local_shards = False
                for step in range(3):
                    params = zip(single.named_parameters(), sharded.named_parameters(), dispatched.parameters())
                    for i, ((_, a), (_, b), c) in enumerate(params):
                        a.grad = _seeded(a.shape, 1000 * step + i)
                        b.grad = distribute_tensor(a.grad, mesh, b.placements)
                        c.grad = distribute_tensor(a.grad, mesh, c.placements)
                    for opt in opts:
                        opt.step()
                    via_dtensor.step()
                result[f"{name}/local_vs_dtensor"] = _same_update(opts[1], via_dtensor, sharded, dispatched)
                ids = torch.arange(8).reshape(2, 4)
                with torch.no_grad():
                    with evaluation_weights(opts[1], sharded):  # schedule-free: x in, y back
                        evaluated = sharded(ids)
                    after = sharded(ids)  # must run on y again, not on x still gathered
                    expected = single(ids)
                result[f"{name}/forward_after_eval"] = {"out": {"equal": torch.equal(after, expected),
                                                                "max_diff": float((after - expected).abs().max())}}
                result[f"{name}/eval_differs"] = bool(not torch.equal(evaluated, expected))
                sharded.reshard()  # the forwards left it gathered
                full = {n: p.full_tensor() for n, p in sharded.named_parameters()}
                assert all(isinstance(p, DTensor) for p in sharded.parameters())
                result[name] = {
                    n: {"equal": torch.equal(p.detach(), full[n]), "max_diff": float((p.detach() - full[n]).abs().max())}
                    for n, p in single.named_parameters()
                }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(out_dir, f"rank{rank}_error.txt").write_text(traceback.format_exc())
        raise


def _same_update(local: torch.optim.Optimizer, dispatched: torch.optim.Optimizer, a: nn.Module, b: nn.Module) -> dict:
    """Parameters and state of two sharded runs: bitwise equal, and the state of ``local``
    still DTensors split like their parameters (what checkpoints save)."""
    from torch.distributed.tensor import DTensor

    out = {"params_equal": all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(a.parameters(), b.parameters()))}
    states_equal, layout_kept = True, True
    for p, q in zip(a.parameters(), b.parameters()):
        mine, theirs = local.state[p], dispatched.state[q]
        states_equal &= sorted(mine) == sorted(theirs)
        for key, value in mine.items():
            other = theirs[key]
            if isinstance(other, DTensor):
                layout_kept &= isinstance(value, DTensor) and value.placements == p.placements and value.shape == p.shape
                states_equal &= isinstance(value, DTensor) and torch.equal(value.to_local(), other.to_local())
            else:
                layout_kept &= not isinstance(value, DTensor)
                states_equal &= bool(torch.equal(torch.as_tensor(value), torch.as_tensor(other)))
    out["state_equal"], out["state_layout_kept"] = bool(states_equal), bool(layout_kept)
    owners = {id(p) for p in a.parameters()}
    out["no_local_keys_left"] = all(id(k) in owners for k in local.state)
    return out


def test_fsdp_updates_equal_one_process(tmp_path):
    """Muon gathers each matrix before Newton-Schulz; the others are elementwise. All four
    give the single-process parameters on 2 FSDP2 ranks (within fp32 tolerance; bitwise here)."""
    for ranks_result in launch.spawn_json_ranks(_fsdp_worker, tmp_path, timeout=180):
        flags = {k: ranks_result.pop(k) for k in list(ranks_result) if k.endswith("/eval_differs")}
        # Stepping on local shards (on_local_shards) is the DTensor-dispatched update, bit for
        # bit, and leaves the state as DTensors keyed by the parameters.
        same = {k: ranks_result.pop(k) for k in list(ranks_result) if k.endswith("/local_vs_dtensor")}
        assert all(all(check.values()) for check in same.values()), same
        assert flags == {f"{n}/eval_differs": n == "schedule_free_adamw" for n in ("muon", "adamw", "lion", "schedule_free_adamw")}
        for name, params in ranks_result.items():
            for param, check in params.items():
                assert check["max_diff"] <= 1e-6, (name, param, check)
        assert all(c["equal"] for c in ranks_result["muon"].values()), ranks_result["muon"]
        # After an evaluation on x, training forwards run on y again, bit for bit.
        assert ranks_result["schedule_free_adamw/forward_after_eval"]["out"]["equal"]


# --------------------------------------------------------------------------- kill/resume

KILL_CASES = {
    # case: (optimizer, strategy, extra overrides). Under fsdp the elementwise optimizers
    # step on their local shards (training/optimizers/local_shards.py). Every case runs under
    # fsdp, the path with optimizer-specific state handling; a replicated (ddp) optimizer's
    # state is resumed like AdamW's, which the guarantee table's rows run.
    "muon": ("muon", "fsdp", []),
    "lion-fsdp": ("lion", "fsdp", ["train.lr=3e-4", "train.weight_decay=0.3"]),
    "schedule_free_adamw": ("schedule_free_adamw", "fsdp", ["train.schedule=constant"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(KILL_CASES))
def test_sigkill_and_resume_gives_the_uninterrupted_ledger(e2e_workdir, case):
    """SIGKILL + resume ends in the uninterrupted ledger; a step after the resume replays to
    a match; the reference's step-4 checkpoint resumed on one rank keeps the batches."""
    optimizer, strategy, extra = KILL_CASES[case]
    overrides = [f"train.optimizer={optimizer}", f"parallel.strategy={strategy}", "checkpoint.interval=2", *extra]
    reference = launch.train(e2e_workdir, e2e_args(max_steps=6, name=f"ref-{case}", overrides=overrides))
    assert reference.returncode == 0, reference.stderr
    reference_dir = e2e_workdir / reference.run_dir if not reference.run_dir.is_absolute() else reference.run_dir
    expected = launch.ledger(reference_dir)
    assert len(expected) == 6 and expected[-1]["loss"] < expected[0]["loss"]

    # Step 5 waits for its data long enough to be SIGKILLed there, after the step-4 line
    # (the step-4 checkpoint may be complete or torn: both must resume to the same ledger).
    name = f"killed-{case}"
    run_dir = launch.stall_kill_and_resume(e2e_workdir, e2e_args(max_steps=6, name=name, overrides=overrides), name=name)
    assert launch.ledger(run_dir) == expected
    # The run's config still holds slow_data@5, which a replay drops (runtime/faults.py).
    launch.replay_verifies(e2e_workdir, run_dir, steps=(5,))
    launch.one_rank_resume_keeps_the_batches(e2e_workdir, reference_dir, step=4)
