"""Batch-invariant numerics (models/batch_invariant.py, ``Numerics.batch_invariant``): the anchors' chain.

Every comparison of the chain is exact (``torch.equal``): the trainer's log-probs of a sequence at
micro-batch 1 == 2 == 8, beside packing neighbours and at another row; the trainer's logits ==
the sampler's prefill; the sampler's decode == its prefill over the generated tokens; the sampler's
log-probs == the trainer's (full logits and the fused head). The chain runs for Qwen3, Qwen2 and
Qwen3-MoE; for the mixture also every layer's top-k experts of every token, the sampler's cached
forward against the trainer's. The controls swap one invariant
kernel for the stock one and see the chain break, so the chain's equalities are the kernels'
doing, not this CPU's luck. In bf16 the chain runs the trainer's fp32 weights under bf16 autocast
(``Numerics.autocast``) and the sampler over the same weights under ``Numerics.sampler_autocast``;
its control samples from the default mode's bf16 copy without autocast and sees the chain break.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import models
from core.config import ModelConfig
from core.config_schema import model_config_class
from core.exceptions import ConfigError
from models import batch_invariant
from models.generation.kv_cache import KVCache
from models.forward import ModelOutput
from models.generation.sampler import SampleKey, Sampler, SamplingParams
from models.numerics import Numerics
from models.qwen3_moe.family import Qwen3MoeSettings
from models.qwen3_moe.dims import resolve_moe_dims
from models.qwen3_moe.moe import Router, SparseMoe
from training.objectives.token_logps import autocast_dtype, linear_token_logps, model_numerics, token_logps_from_logits

QWEN3 = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, attention="sdpa")
QWEN2 = dataclasses.replace(QWEN3, arch="qwen2", head_dim=None, tie_embeddings=False)  # q/k/v biases
# Qwen3-MoE: both layers mixtures of 4 experts, top-2 renormalized (the router's softmax, the
# renormalization, the expert loop and the combine over the slots all run batch-invariant).
MOE = model_config_class()(**{**dataclasses.asdict(QWEN3), "arch": "qwen3_moe", "qwen3_moe": Qwen3MoeSettings(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)})
EXACT = Numerics(batch_invariant=True)
SEQ = 40
PROMPT_LENGTHS = (3, 9, 17, 1)


def _model(config: ModelConfig, numerics: Numerics = EXACT) -> torch.nn.Module:
    model = models.build(config, generator=torch.Generator().manual_seed(5)).eval()
    model.use_numerics(numerics)
    return model


def _run(model: torch.nn.Module, *args, **kwargs) -> torch.Tensor:
    """The model's logits or head result, out of the ``ModelOutput`` a family may wrap them in."""
    out = model(*args, **kwargs)
    if isinstance(out, ModelOutput):
        return out.head if out.head is not None else out.logits
    return out


def _ids(rows: int = 8, length: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=[QWEN3, QWEN2, MOE], ids=["qwen3", "qwen2", "qwen3-moe"])
def config(request):
    return request.param


# ---------------------------------------------------------------- the kernels


def test_a_linear_row_does_not_depend_on_the_number_of_rows_or_its_place():
    weight = torch.randn(384, 128, generator=torch.Generator().manual_seed(0))
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(1))
    alone = batch_invariant.linear(x[:1], weight)[0]
    for rows in (2, 7, 64, 65, 300):
        assert torch.equal(batch_invariant.linear(x[:rows], weight)[0], alone)
    moved = torch.cat([x[1:100], x[:1]])  # row 0 now the 100th, in the second block
    assert torch.equal(batch_invariant.linear(moved, weight)[-1], alone)
    torch.testing.assert_close(batch_invariant.linear(x, weight), x @ weight.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_row_does_not_depend_on_the_number_of_rows_or_its_place(dtype):
    """RMSNorm's mean is a fixed tree per row: a row alone, among 2 to 300 rows or moved to another
    place gives the same bits (fp32 and a bf16 residual stream, normalized in fp32)."""
    weight = (1 + 0.1 * torch.randn(1000, generator=torch.Generator().manual_seed(0))).to(dtype)
    x = torch.randn(300, 1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    alone = batch_invariant.rms_norm(x[:1], weight, 1e-6)[0]
    for rows in (2, 7, 64, 65, 300):
        assert torch.equal(batch_invariant.rms_norm(x[:rows], weight, 1e-6)[0], alone), rows
    moved = torch.cat([x[1:100], x[:1]]).reshape(4, 25, 1000)  # row 0 now the last of a (4, 25) batch
    assert torch.equal(batch_invariant.rms_norm(moved, weight, 1e-6)[-1, -1], alone)
    x32 = x.float()
    stock = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(batch_invariant.rms_norm(x, weight, 1e-6), stock)


def test_the_rotary_table_stays_fp32_under_autocast_and_fsdp_s_input_cast():
    """The angles are fp32 whatever the precision: built under bf16 autocast, and passed through the
    cast FSDP2's bf16 policy applies to a block's tensor inputs (which rounds a tensor or dataclass)."""
    from torch.distributed.utils import _apply_to_tensors

    from models.qwen.rope import RotaryTable

    positions = torch.arange(4096).expand(2, -1)
    plain = RotaryTable.build(positions, 128, 1e6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        table = RotaryTable.build(positions, 128, 1e6)
    assert table.cos.dtype == table.sin.dtype == torch.float32
    assert torch.equal(table.cos, plain.cos) and torch.equal(table.sin, plain.sin)
    passed = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, table)
    assert passed is table and passed.cos.dtype == torch.float32
    rounded = _apply_to_tensors(lambda t: t.to(torch.bfloat16), (table.cos,))  # the control: a tuple is entered
    assert rounded[0].dtype == torch.bfloat16


def test_a_pairwise_sum_padded_with_zeros_is_unchanged():
    values = torch.randn(5, 112, generator=torch.Generator().manual_seed(0))
    for extra in (16, 144):
        assert torch.equal(batch_invariant.pairwise_sum(F.pad(values, (0, extra))), batch_invariant.pairwise_sum(values))
    columns = values.t().contiguous()  # the same sums over dim 0
    assert torch.equal(batch_invariant.pairwise_sum(columns, dim=0), batch_invariant.pairwise_sum(values))
    torch.testing.assert_close(batch_invariant.pairwise_sum(values), values.sum(-1))


def test_a_mixture_s_token_does_not_depend_on_the_tokens_beside_it():
    """A Qwen3-MoE block's mixture (router, expert loop, combine) under the kernels' context: a token
    alone gives the bits it gives among 300 (its experts see other row counts); the stock kernels do not."""
    config = dataclasses.replace(MOE, hidden_size=128, head_dim=32, qwen3_moe=Qwen3MoeSettings(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384))
    layer = SparseMoe(resolve_moe_dims(config))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 300, 128, generator=generator)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        alone = {}
        for invariant in (True, False):
            with batch_invariant.Linears() if invariant else contextlib.nullcontext():
                whole = layer(x)[0][0]
                alone[invariant] = [torch.equal(layer(x[:, i:i + 1])[0][0, 0], whole[i]) for i in range(0, 300, 37)]
    assert all(alone[True]) and not all(alone[False])


def test_the_log_softmax_and_norm_compute_what_the_stock_ones_do():
    logits = torch.randn(6, 96, generator=torch.Generator().manual_seed(0)) * 5
    tokens = torch.arange(6) * 7
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(batch_invariant.token_logprobs(logits, tokens), expected)
    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(1))
    weight = torch.rand(48, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(batch_invariant.rms_norm(x, weight, 1e-6),
                               weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(batch_invariant.silu(x), F.silu(x))
    torch.testing.assert_close(batch_invariant.softmax(logits), torch.softmax(logits, -1))


def test_the_exact_kernel_attends_as_sdpa_does(config):
    ids = _ids()
    with torch.no_grad():
        stock = _run(_model(config, Numerics()), ids)
        exact = _run(_model(config), ids)
    torch.testing.assert_close(exact, stock, rtol=0, atol=1e-5)


def test_without_triton_the_cuda_kernels_refuse_with_the_key_to_fix(monkeypatch):
    """On CUDA the kernels are models/batch_invariant_triton.py's; where Triton is missing the dispatch
    raises a ConfigError naming determinism.batch_invariant, never the stock kernels."""
    import sys

    monkeypatch.setitem(sys.modules, "triton", None)  # ``import triton`` now fails as if not installed
    monkeypatch.delitem(sys.modules, "models.batch_invariant_triton", raising=False)
    with pytest.raises(ConfigError, match="needs Triton") as raised:
        batch_invariant._cuda_kernels()
    assert raised.value.context["key"] == "determinism.batch_invariant" and "pip install triton" in raised.value.hint


def test_on_cuda_the_row_reductions_are_the_triton_kernels_and_fp64_stays_on_the_trees(monkeypatch):
    """The norm, the log-partition (and so ``token_logprobs``) and the softmax dispatch to
    models/batch_invariant_triton.py's row kernels where the tensors are on CUDA; fp64 keeps the tree
    sums (the kernels compute in fp32). Here the CUDA side is a stand-in that records its calls."""
    import types

    calls = []

    def kernel(name):
        def run(x, *args):
            calls.append(name)
            return torch.full(x.shape[:-1] if name == "logsumexp" else x.shape, float(len(calls)))
        return run

    monkeypatch.setattr(batch_invariant, "_on_cuda", lambda x: True)
    monkeypatch.setattr(batch_invariant, "_cuda_kernels", lambda: types.SimpleNamespace(
        rms_norm=kernel("rms_norm"), logsumexp=kernel("logsumexp"), softmax=kernel("softmax")))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(batch_invariant.rms_norm(x, torch.ones(8), 1e-6), torch.full((3, 8), 1.0))
    assert torch.equal(batch_invariant.logsumexp(x.bfloat16()), torch.full((3,), 2.0))
    assert torch.equal(batch_invariant.softmax(x), torch.full((3, 8), 3.0))
    tokens = torch.tensor([0, 5, 7])
    picked = x.gather(-1, tokens[:, None])[:, 0]
    assert torch.equal(batch_invariant.token_logprobs(x, tokens), picked - 4.0)
    assert calls == ["rms_norm", "logsumexp", "softmax", "logsumexp"]
    x64 = x.double()
    assert torch.equal(batch_invariant.logsumexp(x64), batch_invariant._logsumexp_by_trees(x64))
    assert torch.equal(batch_invariant.softmax(x64), batch_invariant._softmax_by_trees(x64))
    assert len(calls) == 4


def test_batch_invariance_needs_bitwise_mode():
    with pytest.raises(ConfigError, match="determinism.batch_invariant"):
        Numerics(mode="fast", batch_invariant=True)


# ---------------------------------------------------------------- the chain


def test_trainer_log_probs_do_not_depend_on_micro_batch_row_or_packing(config):
    model, ids = _model(config), _ids()
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        whole = token_logps_from_logits(_run(model, ids), labels, invariant=True)
        for micro in (1, 2):
            split = torch.cat([token_logps_from_logits(_run(model, ids[i:i + micro]), labels[i:i + micro], invariant=True)
                               for i in range(0, len(ids), micro)])
            assert torch.equal(split, whole)
        reversed_rows = token_logps_from_logits(_run(model, ids.flip(0)), labels.flip(0), invariant=True)
        assert torch.equal(reversed_rows.flip(0), whole)
        # Row 0's first 27 tokens packed after a 13-token neighbour, in a row of another length.
        packed = torch.cat([ids[1, :13], ids[0, :27]])[None]
        positions = torch.cat([torch.arange(13), torch.arange(27)])[None]
        documents = torch.cat([torch.zeros(13), torch.ones(27)]).long()[None]
        logits = _run(model, packed, position_ids=positions, document_ids=documents)[0, 13:]
        assert torch.equal(token_logps_from_logits(logits, labels[0, :27], invariant=True)[:26], whole[0, :26])


def test_the_fused_head_gives_the_full_logits_log_probs(config):
    model, ids = _model(config), _ids()
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        full = token_logps_from_logits(_run(model, ids), labels, invariant=True)
        for chunk in (7, 64, 1000):
            fused = _run(model, ids, head=lambda h, w, chunk=chunk: linear_token_logps(
                h, w, labels, chunk_tokens=chunk, invariant=True))
            assert torch.equal(fused, full)


def test_prefill_equals_the_trainer_and_decode_equals_prefill(config):
    model, ids = _model(config), _ids(rows=3)
    with torch.no_grad():
        trainer = _run(model, ids)  # (3, T, V)
        spec = model.generation_spec()

        def cache(rows: int) -> KVCache:
            return KVCache.for_spec(spec, batch=rows, slots=64)

        # Prefill: each row's prefix up to t in one chunk, beside another row, into a cache of 64 slots.
        for t in (0, 5, 22, SEQ - 1):
            positions = torch.arange(t + 1).expand(3, t + 1)
            last = _run(model, ids[:, :t + 1], position_ids=positions, cache=cache(3))
            assert torch.equal(last, trainer[:, t])
        # Decode: one token a step, four rows (one a dummy), the last step's logits per position.
        decode = cache(4)
        rows = torch.cat([ids, ids[:1].flip(1)])
        for t in range(SEQ):
            logits = _run(model, rows[:, t:t + 1], position_ids=torch.full((4, 1), t), cache=decode)
            assert torch.equal(logits[:3], trainer[:, t])


def _sample(model, prompts, params, max_batch=4):
    sampler = Sampler(model, max_batch=max_batch, max_len=64, prefill_chunk=8)
    keys = [SampleKey(seed=0, purpose="test", step=0, prompt_index=i) for i in range(len(prompts))]
    return sampler.generate(prompts, keys, params)


SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=20)
RULES = {"sampled": SAMPLED, "top_p": SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=20),
         "greedy": SamplingParams(temperature=0, max_new_tokens=20)}
# Every sampling rule for the dense families; Qwen3-MoE's routing does not depend on the rule (its
# per-token routing: test_the_sampler_s_cached_forward_routes_every_token_as_the_trainer_does), so it
# samples only, which keeps its decode steps of one row (about 10 s each rule) out of the fast lane.
SAMPLER_CASES = [pytest.param(model_config, rule, id=f"{name}-{rule_name}")
                 for name, model_config in (("qwen3", QWEN3), ("qwen2", QWEN2)) for rule_name, rule in RULES.items()]
SAMPLER_CASES.append(pytest.param(MOE, SAMPLED, id="qwen3-moe-sampled"))


@pytest.mark.parametrize("model_config, params", SAMPLER_CASES)
@pytest.mark.parametrize("max_batch", [1, 4])
def test_the_sampler_log_probs_are_the_trainer_log_probs(model_config, params, max_batch):
    model, ids = _model(model_config), _ids()
    prompts = [ids[i, :n].tolist() for i, n in enumerate(PROMPT_LENGTHS)]
    samples = _sample(model, prompts, params, max_batch=max_batch)
    # The trainer's batch: one row per completion, prompt + completion, padded to one length.
    rows = torch.zeros(len(prompts), 64, dtype=torch.long)
    labels = torch.full_like(rows, -100)
    for i, (prompt, sample) in enumerate(zip(prompts, samples)):
        sequence = prompt + sample.tokens
        rows[i, :len(sequence)] = torch.tensor(sequence)
        labels[i, len(prompt) - 1:len(sequence) - 1] = torch.tensor(sample.tokens)
    with torch.no_grad():
        for micro in (1, 4):
            trainer = torch.cat([_run(model, rows[i:i + micro], head=lambda h, w, lab=labels[i:i + micro]: linear_token_logps(
                h, w, lab, chunk_tokens=16, invariant=True)) for i in range(0, len(rows), micro)])
            for i, (prompt, sample) in enumerate(zip(prompts, samples)):
                picked = trainer[i, len(prompt) - 1:len(prompt) - 1 + len(sample.tokens)]
                assert torch.equal(picked, torch.tensor(sample.logprobs, dtype=torch.float32))


def test_on_cuda_the_sampler_replays_the_eager_forwards_as_graphs_but_not_a_mixture_s():
    """Under batch_invariant nothing is compiled; the Sampler's default replays the eager decode step
    as a CUDA graph (``eager_graphs``), except for a model whose plan declares experts: its expert
    loop reads token counts on the host, which a graph would replay frozen. The stock numerics leave
    graphs to torch.compile."""
    from models.generation.sampler import eager_graphs

    assert eager_graphs(_model(QWEN3)) and eager_graphs(_model(QWEN2))
    assert not eager_graphs(_model(MOE))
    assert not eager_graphs(_model(QWEN3, Numerics()))
    sampler = Sampler(_model(QWEN3), max_batch=2, max_len=16)  # on the CPU: neither compiled nor graphed
    assert not sampler.compile and not sampler.cuda_graphs


def _routes(model: torch.nn.Module, forwards) -> list[list[torch.Tensor]]:
    """Per router (layer order), the top-k experts (N, k) each call of ``forwards()`` chose."""
    routers = [module for module in model.modules() if isinstance(module, Router)]
    chosen: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [router.register_forward_hook(lambda module, args, out, i=i: chosen[i].append(out.experts))
             for i, router in enumerate(routers)]
    try:
        forwards()
    finally:
        for hook in hooks:
            hook.remove()
    return chosen


def test_the_sampler_s_cached_forward_routes_every_token_as_the_trainer_does():
    """The sampled sequences (prompt + completion) through the cached forward the Sampler runs (a
    prefill chunk of 8, then one token a step, beside a dummy row) and through the trainer's forward:
    every layer's top-k experts of every token are the same."""
    model, ids = _model(MOE), _ids()
    prompts = [ids[i, :n].tolist() for i, n in enumerate(PROMPT_LENGTHS)]
    samples = _sample(model, prompts, SamplingParams(temperature=1.0, max_new_tokens=20))
    sequences = [prompt + sample.tokens for prompt, sample in zip(prompts, samples)]
    rows = torch.zeros(len(sequences) + 1, max(map(len, sequences)), dtype=torch.long)  # the last a dummy
    for i, sequence in enumerate(sequences):
        rows[i, :len(sequence)] = torch.tensor(sequence)
    rows[-1] = ids[-1, :rows.shape[1]]
    batch, length, chunk = len(sequences), rows.shape[1], 8

    def cached():
        cache = KVCache.for_spec(model.generation_spec(), batch=len(rows), slots=64)
        _run(model, rows[:, :chunk], position_ids=torch.arange(chunk).expand(len(rows), chunk), cache=cache)
        for t in range(chunk, length):
            _run(model, rows[:, t:t + 1], position_ids=torch.full((len(rows), 1), t), cache=cache)

    with torch.no_grad():
        trainer = _routes(model, lambda: _run(model, rows[:batch]))
        sampler = _routes(model, cached)
    assert len(trainer) == 2
    for layer, ((whole,), calls) in enumerate(zip(trainer, sampler)):  # the trainer: one forward
        k = whole.shape[-1]
        whole = whole.view(batch, length, k)
        steps = [calls[0].view(len(rows), chunk, k)] + [c.view(len(rows), 1, k) for c in calls[1:]]
        assert torch.equal(torch.cat(steps, dim=1)[:batch], whole), layer
        assert len(torch.unique(whole.sort(dim=-1).values.view(-1, k), dim=0)) > 1  # the router does choose


# ---------------------------------------------------------------- bf16: the trainer's autocast in the sampler

BF16 = Numerics(batch_invariant=True, precision="bf16")
CPU = torch.device("cpu")
BF16_CASES = [pytest.param(QWEN3, id="qwen3"), pytest.param(QWEN2, id="qwen2"), pytest.param(MOE, id="qwen3-moe")]


def test_bf16_numerics_keep_the_parameters_and_give_the_sampler_the_training_autocast():
    cuda = torch.device("cuda", 0)
    assert BF16.generation_dtype(cuda) is None and BF16.generation_dtype(CPU) is None
    with BF16.sampler_autocast(CPU):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    # The default mode: the bf16 copy on CUDA, no autocast around the sampler's forwards.
    stock = Numerics(precision="bf16")
    assert stock.generation_dtype(cuda) == torch.bfloat16
    with stock.sampler_autocast(CPU):
        assert not torch.is_autocast_enabled("cpu")
    with EXACT.sampler_autocast(CPU):  # fp32: no autocast either
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("model_config", BF16_CASES)
def test_bf16_autocast_prefill_equals_the_trainer_and_decode_equals_prefill(model_config):
    """The trainer's fp32 weights under bf16 autocast (``Numerics.autocast``, training/precision.py's);
    the sampler's prefill and decode over the same weights under ``sampler_autocast``, into an fp32
    cache: the same bits at every position."""
    model, ids = _model(model_config, BF16), _ids(rows=3, length=24)
    with torch.no_grad():
        with BF16.autocast(CPU):
            trainer = _run(model, ids)  # (3, T, V) bf16
        assert trainer.dtype == torch.bfloat16
        spec = model.generation_spec()
        assert spec.dtype == torch.float32  # the cache holds the keys/values the trainer's attention reads
        with BF16.sampler_autocast(CPU):
            for t in (0, 9, 23):
                positions = torch.arange(t + 1).expand(3, t + 1)
                last = _run(model, ids[:, :t + 1], position_ids=positions,
                            cache=KVCache.for_spec(spec, batch=3, slots=32))
                assert torch.equal(last, trainer[:, t])
            decode = KVCache.for_spec(spec, batch=4, slots=32)
            rows = torch.cat([ids, ids[:1].flip(1)])
            for t in range(ids.shape[1]):
                logits = _run(model, rows[:, t:t + 1], position_ids=torch.full((4, 1), t), cache=decode)
                assert torch.equal(logits[:3], trainer[:, t])


def _trainer_logps(model, prompts, samples, numerics):
    """The trainer's log-probs of each sample's tokens: one row per completion, under ``numerics``'
    training autocast, through the fused head."""
    rows = torch.zeros(len(prompts), 64, dtype=torch.long)
    labels = torch.full_like(rows, -100)
    for i, (prompt, sample) in enumerate(zip(prompts, samples)):
        sequence = prompt + sample.tokens
        rows[i, :len(sequence)] = torch.tensor(sequence)
        labels[i, len(prompt) - 1:len(sequence) - 1] = torch.tensor(sample.tokens)
    with torch.no_grad(), numerics.autocast(CPU):
        trainer = _run(model, rows, head=lambda h, w: linear_token_logps(
            h, w, labels, chunk_tokens=16, compute_dtype=autocast_dtype(CPU), invariant=True))
    return [trainer[i, len(p) - 1:len(p) - 1 + len(s.tokens)] for i, (p, s) in enumerate(zip(prompts, samples))]


@pytest.mark.parametrize("model_config", BF16_CASES)
def test_bf16_sampler_log_probs_are_the_trainer_log_probs(model_config):
    model, ids = _model(model_config, BF16), _ids()
    prompts = [ids[i, :n].tolist() for i, n in enumerate(PROMPT_LENGTHS)]
    samples = _sample(model, prompts, SAMPLED, max_batch=4)
    for trainer, sample in zip(_trainer_logps(model, prompts, samples, BF16), samples):
        assert torch.equal(trainer, torch.tensor(sample.logprobs, dtype=torch.float32))


def test_under_fsdp_s_cast_the_sampler_runs_a_bf16_copy_without_autocast():
    """Where FSDP2's policy casts the trainer's parameters to bf16 (``Numerics.wrapper_casts``, set by
    training/builders.py), the trainer computes with bf16 parameters and no autocast: the generation copy
    is that bf16 model and the sampler enters no autocast, so its log-probs are a bf16 model's. (FSDP's
    trainer differs from that model still: its input cast rounds each block's rotary table to bf16,
    docs/determinism.md.)"""
    from training.rollout.generation_model import generation_model

    cast = dataclasses.replace(BF16, wrapper_casts=True)
    assert cast.parameters_cast and cast.generation_dtype(CPU) == torch.bfloat16
    with cast.autocast(CPU), cast.sampler_autocast(CPU):
        assert not torch.is_autocast_enabled("cpu")
    model, ids = _model(QWEN3, cast), _ids()
    copy = generation_model(model)
    assert copy is not model and copy.embed_tokens.weight.dtype == torch.bfloat16 and copy.numerics is cast
    prompts = [ids[i, :n].tolist() for i, n in enumerate(PROMPT_LENGTHS)]
    samples = _sample(copy, prompts, SAMPLED, max_batch=4)
    for trainer, sample in zip(_trainer_logps(copy, prompts, samples, cast), samples):
        assert torch.equal(trainer, torch.tensor(sample.logprobs, dtype=torch.float32))


def test_control_a_bf16_copy_without_autocast_is_not_the_bf16_trainer():
    """The computation the sampler ran before (the default mode's bf16 generation copy, its residual
    stream, norms, rotary products and cache in bf16) is not the trainer's under autocast."""
    model, ids = _model(QWEN3, BF16), _ids()
    prompts = [ids[i, :n].tolist() for i, n in enumerate(PROMPT_LENGTHS)]
    copy = _model(QWEN3, BF16).to(torch.bfloat16)
    samples = _sample(copy, prompts, SAMPLED, max_batch=4)
    trainer = _trainer_logps(model, prompts, samples, BF16)
    assert not all(torch.equal(t, torch.tensor(s.logprobs, dtype=torch.float32)) for t, s in zip(trainer, samples))


def test_the_trainer_finds_the_numerics_of_a_wrapped_model():
    model = _model(QWEN3)

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert model_numerics(Wrapper(model)) is EXACT
    assert model_numerics(torch.nn.Linear(2, 2)) == Numerics()


# ---------------------------------------------------------------- controls


def _stock_linear(x, weight, bias=None):
    return F.linear(x, weight, bias)


def _stock_cached(q, k, v, mask):
    from models.attention import attend_cached

    return attend_cached(q, k, v, mask, kernel="fp32")


@pytest.mark.parametrize("kernel,stock", [("linear", _stock_linear), ("attend_cached", _stock_cached)])
def test_control_a_stock_kernel_breaks_sampler_trainer_parity(monkeypatch, kernel, stock):
    model, ids = _model(QWEN3), _ids()
    prompts = [ids[i, :n].tolist() for i, n in enumerate(PROMPT_LENGTHS)]
    monkeypatch.setattr(batch_invariant, kernel, stock)
    # One row a decode step: the stock matmul of one row (a matrix-vector product here) rounds
    # otherwise than the trainer's of a whole sequence.
    samples = _sample(model, prompts, SamplingParams(temperature=1.0, max_new_tokens=20), max_batch=1)
    equal = []
    with torch.no_grad():
        for prompt, sample in zip(prompts, samples):
            logits = _run(model, torch.tensor([prompt + sample.tokens]))[0, len(prompt) - 1:-1]
            trainer = batch_invariant.token_logprobs(logits, torch.tensor(sample.tokens))
            equal.append(torch.equal(trainer, torch.tensor(sample.logprobs, dtype=torch.float32)))
    assert not all(equal)


def test_control_the_stock_log_softmax_is_not_the_invariant_one():
    logits = torch.randn(64, 151, generator=torch.Generator().manual_seed(0)) * 4
    tokens = torch.randint(0, 151, (64,), generator=torch.Generator().manual_seed(1))
    stock = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert not torch.equal(stock, batch_invariant.token_logprobs(logits, tokens))
