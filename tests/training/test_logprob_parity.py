"""``logprob_parity`` under ``determinism.batch_invariant`` (training/objectives/logprob_parity.py), in process.

GRPO and PPO on the e2e configs' tiny model (GRPO also as a tiny Qwen3-MoE) with real rollouts from the batch-invariant sampler: the
first update's trainer log-probs equal the sampler's (parity exactly 0) and a forced difference of one
token's last bit is a ``LogprobParityError`` (exit 5) naming the step, the completion's global row, the
token's position and both log-probs when the step settles (on every rank, the one that found it
named); later updates (moved weights) are not checked. PPO's old log-probs
are the sampler's, bitwise what the policy forward it no longer runs gives (full logits and fused head);
with the stock kernels PPO's rollout reports the gap between the two instead.
GRPO in bf16 too: the trainer's autocast over fp32 weights, the sampler's forwards under the same one.
The multi-rank runs: test_logprob_parity_e2e.py.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import models
from core import seeding
from core.config import load
from core.exceptions import ExitCode
from data.batch import IGNORE_INDEX
from data.pipeline.plan import make_plan
from data.pipeline.serial import iterate_serial
from training.determinism import numerics
from training.objectives import grpo, ppo
from training.objectives.base import ObjectiveContext
from training.objectives.logprob_parity import CHECKED, PARITY, LogprobParityError
from training.precision import Precision
from tests import launch

CONFIGS = launch.ROOT / "tests" / "configs"
TINY = ["parallel.strategy=none", "determinism.batch_invariant=true", "train.global_batch_size=2",
        "train.micro_batch_size=2", "data.num_streams=2"]


def _context(config):
    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo",
                           all_gather_object=lambda obj: [obj])
    return ObjectiveContext(config=config, dist=dist, parallel=SimpleNamespace(device=dist.device),
                            place=lambda t: t)


def _setup(objective_class, config):
    model = models.build(config.model, generator=seeding.generator(config.train.seed, "model_init"))
    model.use_numerics(numerics(config))
    objective = objective_class(config)
    context = _context(config)
    parts = objective.extra_parts(context) if hasattr(objective, "extra_parts") else {}
    objective.setup(model, context)
    plan = make_plan(config.data, seed=config.train.seed, global_batch_size=config.train.global_batch_size,
                     rank=0, world_size=1)
    with torch.no_grad():
        batch = objective.prepare(next(iterate_serial(plan)))
    return model, objective, batch, {name: part.module for name, part in parts.items()}


GRPO = [*TINY, "objective.grpo.kl_coef=0", "objective.grpo.group_size=2", "objective.grpo.max_new_tokens=4"]
# Qwen3-MoE at the e2e model's size: a dense layer, then 4 experts top-2, the balancing bias on.
MOE = ["model.arch=qwen3_moe", "model.qwen3_moe.num_experts=4", "model.qwen3_moe.num_experts_per_tok=2",
       "model.qwen3_moe.moe_intermediate_size=64", "model.qwen3_moe.mlp_only_layers=[0]",
       "model.qwen3_moe.bias_update_rate=0.001"]


@pytest.fixture(scope="module")
def grpo_run(tasks_workdir):
    with contextlib.chdir(tasks_workdir):  # the configs' datasets/tasks paths
        return _setup(grpo.GRPOObjective, load(CONFIGS / "e2e-grpo.yaml", GRPO))


@pytest.fixture(scope="module")
def ppo_run(tasks_workdir):
    config = load(CONFIGS / "e2e-ppo.yaml", [*TINY, "objective.ppo.kl_coef=0", "objective.ppo.kl_target=0",
                                            "objective.ppo.max_new_tokens=4"])
    with contextlib.chdir(tasks_workdir):
        return _setup(ppo.PPOObjective, config)


def _off_by_one_bit(monkeypatch, module, row: int):
    """The objective's trainer log-probs with row ``row``'s first labelled token moved to the next float."""
    original = module.label_logps

    def perturbed(model, placed, **kw):
        logps = original(model, placed, **kw)
        position = int((placed.labels[row] != IGNORE_INDEX).nonzero()[0])
        moved = logps.clone()
        moved[row, position] = torch.nextafter(logps[row, position], torch.tensor(0.0))
        return moved

    monkeypatch.setattr(module, "label_logps", perturbed)


def test_grpo_parity_is_exactly_zero_and_a_difference_stops_the_run(grpo_run, monkeypatch):
    model, objective, batch, _ = grpo_run
    first = objective.update_batch(batch, 0)
    assert first is batch and torch.equal(batch.extras[CHECKED], batch.extras["old_logps"])
    assert objective.loss(model, batch).maxima[PARITY].item() == 0.0
    objective.parity.settle(batch.step, objective._context.dist)  # nothing differs
    _off_by_one_bit(monkeypatch, grpo, row=1)
    objective.loss(model, batch)  # the comparison stays on the device until the step settles
    with pytest.raises(LogprobParityError) as info:
        objective.parity.settle(batch.step, objective._context.dist)
    error = info.value
    assert error.exit_code == ExitCode.DETERMINISM == 5
    position = int((batch.labels[1] != IGNORE_INDEX).nonzero()[0])
    assert error.context == {"step": batch.step, "row": batch.sequence_index[1], "position": position,
                             "token": int(batch.labels[1, position])}
    sampled = float(batch.extras["old_logps"][1, position])
    assert repr(sampled) in error.message and repr(float(torch.nextafter(torch.tensor(sampled),
                                                                         torch.tensor(0.0)))) in error.message
    # The second inner update trains moved weights: its rows carry no sampler log-probs to check.
    later = objective.update_batch(batch, 1)
    assert CHECKED not in later.extras and objective.loss(model, later).maxima[PARITY] > 0
    objective.parity.settle(batch.step, objective._context.dist)  # settled comparisons are forgotten


def test_the_logprob_drift_fault_is_a_difference_the_check_finds(grpo_run):
    """runtime.faults' ``logprob_drift@S``: the first compared token of step S reaches the check one
    float nearer zero and the settle names it; the fault fires once, so a second comparison is equal."""
    from runtime.faults import FaultInjector, parse_faults

    model, objective, batch, _ = grpo_run
    faults = FaultInjector(parse_faults([f"logprob_drift@{batch.step}"]), rank=0)
    dist = objective._context.dist
    objective.parity.add(batch.extras[CHECKED].clone(), batch, faults)
    with pytest.raises(LogprobParityError) as info:
        objective.parity.settle(batch.step, dist)
    first = (batch.labels != IGNORE_INDEX).flatten().nonzero()[0].item()
    row, position = divmod(first, batch.labels.shape[1])
    assert info.value.context == {"step": batch.step, "row": batch.sequence_index[row], "position": position,
                                  "token": int(batch.labels[row, position])}
    assert "1 of " in info.value.message
    objective.parity.add(batch.extras[CHECKED].clone(), batch, faults)  # fired once: equal now
    objective.parity.settle(batch.step, dist)


def test_a_difference_on_one_rank_stops_every_rank(grpo_run, monkeypatch):
    """The ranks gather their first differences when the step settles: the rank that found one names
    its row, the others the same row and that rank; where none differs, no rank raises."""
    model, objective, batch, _ = grpo_run
    _off_by_one_bit(monkeypatch, grpo, row=0)
    objective.loss(model, batch)
    found = []
    rank0 = SimpleNamespace(rank=0, all_gather_object=lambda obj: found.append(obj) or [obj, None])
    with pytest.raises(LogprobParityError) as on_rank0:
        objective.parity.settle(batch.step, rank0)
    assert found[0] is not None and "found it" not in on_rank0.value.message
    rank1 = SimpleNamespace(rank=1, all_gather_object=lambda obj: [found[0], obj])
    with pytest.raises(LogprobParityError) as on_rank1:
        objective.parity.settle(batch.step, rank1)  # this rank compared nothing of the step
    assert "differ; rank 0 found it)" in on_rank1.value.message
    assert on_rank1.value.context == on_rank0.value.context
    assert on_rank0.value.context["row"] == batch.sequence_index[0]
    quiet = SimpleNamespace(rank=0, all_gather_object=lambda obj: [obj, None])
    objective.parity.settle(batch.step + 1, quiet)  # a later step with nothing found: no error


@pytest.mark.usefixtures("in_tasks_workdir")
def test_bf16_grpo_parity_is_exactly_zero():
    """parallel.precision=bf16: the trainer's fp32 weights under bf16 autocast (training/precision.py, as
    the step enters it), and the sampler over the same weights under that autocast
    (``Numerics.sampler_autocast``): parity 0. The trainer outside autocast computes otherwise."""
    config = load(CONFIGS / "e2e-grpo.yaml", [*GRPO, "parallel.precision=bf16"])
    model, objective, batch, _ = _setup(grpo.GRPOObjective, config)
    assert (batch.labels != IGNORE_INDEX).any()
    precision = Precision(model.numerics, device=torch.device("cpu"), wrapper_casts=False)
    assert precision.use_autocast
    with precision.autocast():
        assert objective.loss(model, batch).maxima[PARITY].item() == 0.0
    objective.parity.settle(batch.step, objective._context.dist)
    objective.loss(model, batch)
    with pytest.raises(LogprobParityError):  # fp32 compute is not what sampled
        objective.parity.settle(batch.step, objective._context.dist)


@pytest.mark.usefixtures("in_tasks_workdir")
def test_moe_grpo_parity_is_exactly_zero():
    """A tiny Qwen3-MoE GRPO step's rollouts: routed alike in the sampler and the trainer, so parity 0."""
    model, objective, batch, _ = _setup(grpo.GRPOObjective, load(CONFIGS / "e2e-grpo.yaml", [*GRPO, *MOE]))
    assert (batch.labels != IGNORE_INDEX).any()
    for micro in batch.micro_batches(1):
        assert objective.loss(model, micro).maxima[PARITY].item() == 0.0


def test_ppo_old_log_probs_are_the_sampler_s_and_the_first_update_checks_them(ppo_run, monkeypatch):
    model, objective, batch, parts = ppo_run
    old = batch.extras["old_logps"]
    mask = batch.labels != IGNORE_INDEX
    assert mask.any() and torch.equal(old, batch.extras[CHECKED])
    for fuse in (False, True):  # the forward PPO's prepare ran before, on both of the trainer's heads
        objective.fuse_head = fuse
        forward = objective._each_micro(batch, lambda placed: objective._token_logps(model, placed))
        assert torch.equal(forward * mask, old), fuse
    objective.fuse_head = False
    updates = [objective.update_batch(batch, u) for u in range(objective.updates_per_batch)]
    assert CHECKED in updates[0].extras and all(CHECKED not in share.extras for share in updates[1:])
    assert objective.loss(model, updates[0], parts).maxima[PARITY].item() == 0.0
    assert objective.loss(model, updates[1], parts).maxima[PARITY].item() == 0.0  # reported, not checked
    objective.parity.settle(batch.step, objective._context.dist)
    _off_by_one_bit(monkeypatch, ppo, row=0)
    objective.loss(model, updates[0], parts)
    with pytest.raises(LogprobParityError) as info:
        objective.parity.settle(batch.step, objective._context.dist)
    assert info.value.context["row"] == updates[0].sequence_index[0] and info.value.context["step"] == batch.step


def test_ppo_reports_the_stock_kernels_gap_from_its_rollout(tasks_workdir):
    """Outside batch_invariant the old log-probs are the trainer's forward and the rollout's ``parity`` is
    max |sampler - old| over the sampled tokens: the sampler's ride along as rollout correction's."""
    from training.objectives.rollout_correction import ROLLOUT_LOGPS

    stock = [o for o in TINY if not o.startswith("determinism.")]
    config = load(CONFIGS / "e2e-ppo.yaml", [*stock, "objective.ppo.kl_coef=0", "objective.ppo.kl_target=0",
                                            "objective.ppo.max_new_tokens=4", "objective.ppo.rollout_correction={}"])
    with contextlib.chdir(tasks_workdir):
        _, _, batch, _ = _setup(ppo.PPOObjective, config)
    mask = batch.labels != IGNORE_INDEX
    gap = ((batch.extras["old_logps"] - batch.extras[ROLLOUT_LOGPS]).abs() * mask).max().item()
    assert mask.any() and CHECKED not in batch.extras
    assert batch.prepared.parity == gap and batch.prepared.summary()["parity"] == gap
    assert 0.0 <= gap < 1e-4  # fp32 on the CPU: the last bits of two kernels


def test_ppo_old_log_probs_in_bf16_are_the_first_update_s_forward(tasks_workdir):
    """On one process in bf16 the loop runs the updates under autocast over fp32 weights; prepare's
    forwards of the trained parts run under the same autocast, so the first update's forward gives the
    old log-probs bit for bit (ratio exactly 1, nothing clipped) and the critic's values its old values."""
    stock = [o for o in TINY if not o.startswith("determinism.")]
    config = load(CONFIGS / "e2e-ppo.yaml", [*stock, "parallel.precision=bf16", "objective.ppo.kl_coef=0",
                                            "objective.ppo.kl_target=0", "objective.ppo.max_new_tokens=4"])
    with contextlib.chdir(tasks_workdir):
        model, objective, batch, parts = _setup(ppo.PPOObjective, config)
    first = objective.update_batch(batch, 0)
    mask = first.labels != IGNORE_INDEX
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad(), autocast:  # the loop's training forward (training/step.py)
        logps = objective._token_logps(model, first).float()
        values = objective._values(first, critic=parts[ppo.CRITIC])
        out = objective.loss(model, first, parts)
    assert mask.any()
    assert torch.equal(logps * mask, first.extras["old_logps"] * mask)
    assert torch.equal(values * mask, first.extras["old_values"] * mask)
    assert out.metrics["clip_fraction"].item() == 0.0 and out.metrics["approx_kl"].item() == 0.0
    with torch.no_grad():  # the control: the fp32 forward prepare ran before is other bits
        assert not torch.equal(objective._token_logps(model, first).float() * mask, logps * mask)


@pytest.mark.usefixtures("in_tasks_workdir")
@pytest.mark.parametrize("variant", [
    ["objective.grpo.importance=sequence"],  # GSPO
    ["objective.grpo.loss_norm=dr_grpo", "objective.grpo.advantage_std=none"],  # Dr. GRPO
    ["objective.grpo.loss_norm=token", "objective.grpo.clip_eps_high=0.28"],  # DAPO's token mean and clip-higher
])
def test_grpo_variants_parity_is_exactly_zero(variant):
    """The variants change the loss over the log-probs, not the log-probs: the first update's trainer
    forward gives the sampler's bits under each of them."""
    model, objective, batch, _ = _setup(grpo.GRPOObjective, load(CONFIGS / "e2e-grpo.yaml", [*GRPO, *variant]))
    assert (batch.labels != IGNORE_INDEX).any()
    assert objective.loss(model, objective.update_batch(batch, 0)).maxima[PARITY].item() == 0.0


@pytest.mark.usefixtures("in_tasks_workdir")
def test_agent_ppo_episodes_parity_is_exactly_zero():
    """PPO's episodes (turns sampled between the environment's observations): the sampler's log-probs of
    every sampled token of every turn are its old log-probs, and the first update's forward gives them."""
    config = load(CONFIGS / "e2e-agent-ppo.yaml", [*TINY, "objective.ppo.kl_coef=0", "objective.ppo.kl_target=0"])
    model, objective, batch, parts = _setup(ppo.PPOObjective, config)
    labelled = batch.labels != IGNORE_INDEX
    assert objective.episodes is not None and labelled.any()
    turns = [int((row[1:] & ~row[:-1]).sum()) + int(row[0]) for row in labelled]  # runs of sampled tokens
    assert max(turns) > 1  # some episode went on after an observation
    first = objective.update_batch(batch, 0)
    assert CHECKED in first.extras
    assert objective.loss(model, first, parts).maxima[PARITY].item() == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: on the CPU nothing waits")
def test_the_comparison_does_not_make_the_host_wait_for_the_gpu():
    """``ParityCheck.add`` on CUDA tensors under ``set_sync_debug_mode("error")`` (any wait for the GPU
    raises); ``settle`` then reads them in one copy and names the one differing token."""
    from training.objectives.logprob_parity import ParityCheck

    cuda = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    sampled = -torch.rand(4, 16, generator=generator).to(cuda)
    labels = torch.randint(0, 100, (4, 16), generator=generator).to(cuda)
    labels[:, :5] = IGNORE_INDEX
    trainer = sampled.clone()
    trainer[2, 9] = torch.nextafter(sampled[2, 9], torch.zeros((), device=cuda))
    micro = SimpleNamespace(extras={CHECKED: sampled}, labels=labels, step=7, sequence_index=[10, 11, 12, 13])
    check = ParityCheck()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        check.add(sampled.clone(), micro)
        check.add(trainer, micro)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    dist = SimpleNamespace(rank=0, all_gather_object=lambda obj: [obj])
    with pytest.raises(LogprobParityError) as info:
        check.settle(7, dist)
    assert info.value.context == {"step": 7, "row": 12, "position": 9, "token": int(labels[2, 9])}
    assert "1 of 44 sampled tokens" in info.value.message
