"""Routing replay (``model.qwen3_moe.routing_replay``; models/routing_replay.py), in process on a tiny fp32 Qwen3-MoE.

The sampler records every prompt and fed token's experts per sparse layer (the routing its cached
forward chose: equal to the full forward's under batch-invariant numerics, the last sampled token
-1); a training forward handed that record routes each recorded token to the recorded experts even
where a perturbed router would choose others, counts those tokens in ``routing_replay_mismatch``,
and still gives the router its gradient (the weights are the router's probabilities at the recorded
experts, renormalized). Without the key nothing is recorded, a record is refused, and the config
hash is the one without the key; a GRPO and a PPO step's rollout batch carries the record in its
batch hash and the loss forward reports a mismatch of 0 (sampler and trainer route alike).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import models
from core import seeding
from core.config import load
from core.config_schema import model_config_class
from core.exceptions import ConfigError
from data.batch import IGNORE_INDEX
from data.pipeline.plan import make_plan
from data.pipeline.serial import iterate_serial
from models.forward import ModelInputs, model_forward, record_emitted
from models.generation.sampler import SampleKey, Sampler, SamplingParams
from models.numerics import Numerics
from models.qwen3_moe.family import Qwen3MoeSettings
from models.qwen3_moe.moe import SparseMoe
from models.routing_replay import ROUTING, replayed
from training.determinism import numerics
from training.objectives import grpo, ppo
from training.objectives.base import ObjectiveContext
from tests import launch

VOCAB, TOP_K, EXPERTS = 96, 2, 4
# A dense first layer, then two mixtures of 4 experts, top-2 renormalized: sparse layers 1 and 2.
SETTINGS = Qwen3MoeSettings(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                            mlp_only_layers=(0,), routing_replay=True)
CONFIG = model_config_class()(arch="qwen3_moe", vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_layers=3,
                              num_heads=4, num_kv_heads=2, head_dim=16, attention="sdpa", qwen3_moe=SETTINGS)
EXACT = Numerics(batch_invariant=True)
PROMPTS = ([5, 17, 3, 44, 9, 61, 2], [70, 8, 33], [12, 90, 4, 4, 18])


def _model(config=CONFIG, numerics: Numerics = EXACT) -> torch.nn.Module:
    model = models.build(config, generator=torch.Generator().manual_seed(3)).eval()
    model.use_numerics(numerics)
    return model


def _samples(model: torch.nn.Module, *, schedule: str = "groups", rows: int = 4, ahead: bool = False):
    sampler = Sampler(model, max_batch=rows, max_len=24, prefill_chunk=4, schedule=schedule, prefill_ahead=ahead)
    keys = [SampleKey(7, "replay", 0, i, 0) for i in range(len(PROMPTS))]
    return sampler.generate(PROMPTS, keys, SamplingParams(temperature=1.0, max_new_tokens=6))


def _rows(samples) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) the prompts + samples (zero-padded) and their (B, T, layers, k) records (-1 beyond)."""
    width = max(len(p) + len(s.tokens) for p, s in zip(PROMPTS, samples))
    ids = torch.zeros(len(samples), width, dtype=torch.int64)
    routing = torch.full((len(samples), width, 2, TOP_K), -1, dtype=torch.int64)
    for i, (prompt, sample) in enumerate(zip(PROMPTS, samples)):
        n = len(prompt) + len(sample.tokens)
        ids[i, :n] = torch.tensor(prompt + sample.tokens)
        routing[i, :n] = sample.routing
    return ids, routing


def _chosen(model: torch.nn.Module, ids: torch.Tensor, routing: torch.Tensor | None = None):
    """The model's output and each sparse layer's chosen experts (B, T, k), in layer order."""
    chosen = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: chosen.append(out.experts))  # the blocks ask routed=True
             for m in model.modules() if isinstance(m, SparseMoe)]
    try:
        media = None if routing is None else {ROUTING: routing}
        out = model(ids, media=media)
    finally:
        for hook in hooks:
            hook.remove()
    return out, chosen


@pytest.mark.parametrize("schedule, rows, ahead", [("groups", 4, False), ("refill", 2, False), ("refill", 2, True)],
                         ids=["groups", "refill", "refill-prefilled-ahead"])
def test_the_sampler_records_each_token_s_experts_as_the_full_forward_chooses_them(schedule, rows, ahead):
    """On either schedule: on refill with 2 rows for 3 prompts a row is handed back and refilled (its
    record read before its next prompt is copied in), with ``ahead`` from the staging pool."""
    model = _model()
    assert model.generation_spec().routing == (2, TOP_K)
    samples = _samples(model, schedule=schedule, rows=rows, ahead=ahead)
    ids, routing = _rows(samples)
    with torch.no_grad():
        _, own = _chosen(model, ids)
    for i, (prompt, sample) in enumerate(zip(PROMPTS, samples)):
        n = len(prompt) + len(sample.tokens)
        assert sample.routing.shape == (n, 2, TOP_K) and sample.routing.dtype == torch.int16
        assert (sample.routing[n - 1] == -1).all()  # the last sampled token is never fed back
        for layer in range(2):  # every other token: the experts the trainer's own forward chooses
            assert torch.equal(sample.routing[: n - 1, layer].long(), own[layer][i, : n - 1])


def test_a_replayed_forward_uses_the_recorded_experts_and_counts_the_tokens_that_differ():
    model = _model()
    ids, routing = _rows(_samples(model))
    with torch.no_grad():
        replay, _ = _chosen(model, ids, routing)
        assert replay.metrics["routing_replay_mismatch"].sum.item() == 0  # the sampler's own routing
        for layer in (1, 2):  # another router: its own top-k differs for some tokens
            model.layers[layer].mlp.gate.weight.mul_(-1.0).add_(0.05)
        _, own = _chosen(model, ids)
        out, chosen = _chosen(model, ids, routing)
    recorded = routing[:, :, 0, 0] >= 0  # (B, T)
    differs = torch.zeros_like(recorded)
    for layer in range(2):
        keep = recorded.unsqueeze(-1)
        assert torch.equal(torch.where(keep, chosen[layer], -1), torch.where(keep, routing[:, :, layer], -1))
        assert torch.equal(chosen[layer][~recorded], own[layer][~recorded])  # unrecorded tokens: own routing
        differs |= (own[layer].sort(-1).values != routing[:, :, layer].sort(-1).values).any(-1) & recorded
    assert differs.any()
    metric = out.metrics["routing_replay_mismatch"]
    assert metric.sum.item() == differs.sum().item() and float(metric.count) == recorded.sum().item()


def test_the_router_gets_gradients_under_replay():
    model = _model(numerics=Numerics())
    ids, routing = _rows(_samples(model))
    model.train()
    out = model(ids, media={ROUTING: routing})
    out.logits.float().square().mean().backward()
    for layer in (1, 2):
        grad = model.layers[layer].mlp.gate.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_without_the_key_nothing_is_recorded_and_a_record_is_refused():
    plain = dataclasses.replace(CONFIG, qwen3_moe=dataclasses.replace(SETTINGS, routing_replay=False))
    model = _model(plain)
    assert model.generation_spec().routing is None
    assert all(sample.routing is None for sample in _samples(model))
    ids = torch.tensor([PROMPTS[0]])
    with pytest.raises(ConfigError, match="routing_replay"):
        model(ids, media={ROUTING: torch.zeros(1, len(PROMPTS[0]), 2, TOP_K, dtype=torch.int64)})
    inputs = ModelInputs(ids)
    assert replayed(SimpleNamespace(extras={}, media={})).media == {}
    assert "routing_replay_mismatch" not in model_forward(model, inputs).metrics


def test_the_key_is_hashed_only_when_set():
    path = launch.ROOT / "configs" / "tiny-moe-grpo.yaml"
    base = load(path, [])
    assert load(path, ["model.qwen3_moe.routing_replay=false"]).hash == base.hash
    assert load(path, ["model.qwen3_moe.routing_replay=true"]).hash != base.hash


TINY = ["parallel.strategy=none", "determinism.batch_invariant=true", "train.global_batch_size=2",
        "train.micro_batch_size=2", "data.num_streams=2", "model.arch=qwen3_moe", "model.qwen3_moe.num_experts=4",
        "model.qwen3_moe.num_experts_per_tok=2", "model.qwen3_moe.moe_intermediate_size=32",
        "model.qwen3_moe.mlp_only_layers=[0]", "model.qwen3_moe.routing_replay=true"]
RUNS = {"grpo": (grpo.GRPOObjective, "e2e-grpo.yaml", ["objective.grpo.kl_coef=0", "objective.grpo.group_size=2",
                                                       "objective.grpo.max_new_tokens=4"]),
        "ppo": (ppo.PPOObjective, "e2e-ppo.yaml", ["objective.ppo.kl_coef=0", "objective.ppo.kl_target=0",
                                                   "objective.ppo.max_new_tokens=4"])}


@pytest.mark.usefixtures("in_tasks_workdir")
@pytest.mark.parametrize("method", sorted(RUNS))
def test_a_rollout_batch_carries_the_record_in_its_batch_hash_and_the_loss_replays_it(method):
    """GRPO's and PPO's first update: the batch's ``routing`` extra covers each row's prompt + completion
    but its last token, changes the row digests, and the loss forward replays it (mismatch 0: under
    batch-invariant numerics sampler and trainer route alike)."""
    objective_class, path, overrides = RUNS[method]
    config = load(launch.ROOT / "tests" / "configs" / path, [*TINY, *overrides])
    model = models.build(config.model, generator=seeding.generator(config.train.seed, "model_init"))
    model.use_numerics(numerics(config))
    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo",
                           all_gather_object=lambda obj: [obj])
    context = ObjectiveContext(config=config, dist=dist, parallel=SimpleNamespace(device=dist.device),
                               place=lambda t: t)
    objective = objective_class(config)
    parts = {name: part.module for name, part in objective.extra_parts(context).items()} \
        if hasattr(objective, "extra_parts") else {}
    objective.setup(model, context)
    plan = make_plan(config.data, seed=config.train.seed, global_batch_size=config.train.global_batch_size,
                     rank=0, world_size=1)
    with torch.no_grad():
        batch = objective.prepare(next(iterate_serial(plan)))
    routing = batch.extras[ROUTING]
    assert routing.shape == (*batch.input_ids.shape, model.dims.num_sparse_layers, 2)
    ends = (batch.document_ids == 0).sum(dim=1)  # each row's prompt + completion
    for row, end in enumerate(ends.tolist()):
        assert (routing[row, : end - 1] >= 0).all() and (routing[row, end - 1:] == -1).all()
    other = batch.with_extras(**{ROUTING: routing.flip(-1)})
    assert [d for _, d in other.row_digests()] != [d for _, d in batch.row_digests()]
    first = objective.update_batch(batch, 0) if hasattr(objective, "update_batch") else batch
    assert (first.labels != IGNORE_INDEX).any()
    with record_emitted([model]) as emitted:
        objective.loss(model, first, parts) if parts else objective.loss(model, first)
    mismatch = dict(emitted.metrics())["routing_replay_mismatch"]
    recorded = (first.extras[ROUTING][:, :, 0, 0] >= 0).sum().item()
    assert recorded > 0 and mismatch.sum.item() == 0 and float(mismatch.count) == recorded
