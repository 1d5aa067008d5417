"""models/generation/sampler.py: batch-invariant keyed sampling, greedy parity with the full forward, limits, bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import models
from core.exceptions import ConfigError, DataError
from models.generation.sampler import (
    SampleKey,
    Sampler,
    SamplingParams,
    counter_uniforms,
    sample_next,
)
from tests.models.sampler_model import QWEN3, build_sampler_model

QWEN2 = dataclasses.replace(QWEN3, arch="qwen2", head_dim=None, tie_embeddings=False)
LENGTHS = (1, 3, 9, 17, 5, 2, 12, 7)  # ragged; 9, 12 and 17 span several prefill chunks of 8
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12)
FILTERED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, max_new_tokens=12)


@pytest.fixture(scope="module")
def sampler(sampler_model):
    return Sampler(sampler_model, max_batch=8, max_len=40, prefill_chunk=8)


def _prompts(lengths=LENGTHS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, QWEN3.vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _keys(count, *, seed=1, sample_index=0):
    return [SampleKey(seed, "test", 3, prompt_index, sample_index) for prompt_index in range(count)]


@pytest.fixture(scope="module")
def batched(sampler):
    """params -> the module's sampler's samples of ``_prompts()`` under ``_keys(8)``, generated once
    (the batch the invariance and stop-token tests start from)."""
    computed = {}

    def samples(params: SamplingParams) -> list:
        if params not in computed:
            computed[params] = sampler.generate(_prompts(), _keys(len(LENGTHS)), params)
        return computed[params]

    return samples


@pytest.mark.parametrize("params", [SAMPLED, FILTERED], ids=["plain", "filtered"])
def test_a_sample_does_not_depend_on_batch_size_or_order(sampler, batched, params):
    prompts, keys, batched = _prompts(), _keys(len(LENGTHS)), batched(params)
    alone = [sampler.generate([p], [k], params)[0] for p, k in zip(prompts, keys)]
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    shuffled = sampler.generate([prompts[i] for i in order], [keys[i] for i in order], params)
    for i in range(len(prompts)):
        assert batched[i] == alone[i], i  # tokens, log-probs (exact floats) and finish reason
        assert shuffled[order.index(i)] == batched[i], i
    assert len({tuple(s.tokens) for s in batched}) == len(prompts)


def test_more_prompts_than_max_batch_run_in_groups_with_the_same_result(sampler_model, sampler):
    prompts = _prompts((4, 1, 6, 2, 9, 3, 5, 8, 2, 7, 1), seed=4)
    keys = _keys(len(prompts), seed=9)
    small = Sampler(sampler_model, max_batch=8, max_len=40, prefill_chunk=8)  # same shapes: same numbers
    grouped = small.generate(prompts * 2, keys + keys, SAMPLED)  # 22 prompts: groups of 8, 8, 6
    assert grouped[: len(prompts)] == grouped[len(prompts):]
    assert grouped[: len(prompts)] == sampler.generate(prompts, keys, SAMPLED)


def test_same_key_repeats_and_sample_index_changes_the_sample(sampler):
    prompts = _prompts()[:4]
    first = sampler.generate(prompts, _keys(4), SAMPLED)
    assert sampler.generate(prompts, _keys(4), SAMPLED) == first
    other = sampler.generate(prompts, _keys(4, sample_index=1), SAMPLED)
    assert all(a.tokens != b.tokens for a, b in zip(first, other))
    reseeded = sampler.generate(prompts, _keys(4, seed=2), SAMPLED)
    assert all(a.tokens != b.tokens for a, b in zip(first, reseeded))


@pytest.mark.parametrize("config", [QWEN3, QWEN2], ids=["qwen3", "qwen2"])
def test_greedy_equals_the_argmax_of_a_full_forward_at_every_position(config):
    model = models.build(config, generator=torch.Generator().manual_seed(11)).eval()
    sampler = Sampler(model, max_batch=4, max_len=48, prefill_chunk=8)
    prompts = _prompts((1, 6, 19, 10), seed=3)
    samples = sampler.generate(prompts, _keys(4), SamplingParams(temperature=0, max_new_tokens=20))
    for prompt, sample in zip(prompts, samples):
        assert len(sample.tokens) == 20 and sample.finish_reason == "length"
        with torch.no_grad():
            logits = model(torch.tensor([prompt + sample.tokens]))[0, len(prompt) - 1 : -1]  # (new, vocab)
        assert logits.argmax(dim=-1).tolist() == sample.tokens
        expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(sample.tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, rtol=0, atol=1e-5)


def test_sampled_log_probs_are_the_untempered_model_log_probs(sampler_model, sampler):
    prompts = _prompts()[:3]
    for sample, prompt in zip(sampler.generate(prompts, _keys(3), FILTERED), prompts):
        with torch.no_grad():
            logits = sampler_model(torch.tensor([prompt + sample.tokens]))[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(sample.tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, rtol=0, atol=1e-5)


def test_stop_tokens_end_a_sample_and_are_kept(sampler, batched):
    prompts, free = _prompts(), batched(SAMPLED)
    stop = free[2].tokens[4]  # the token sample 2 draws 5th
    stopped = sampler.generate(prompts, _keys(8), dataclasses.replace(SAMPLED, stop_token_ids=(stop,)))
    for before, after in zip(free, stopped):
        end = before.tokens.index(stop) + 1 if stop in before.tokens else None
        if end is None:
            assert after == before
        else:  # the same draws up to and including the first stop token, then the end
            assert after.tokens == before.tokens[:end] and after.logprobs == before.logprobs[:end]
            assert after.finish_reason == "stop"
    assert len(stopped[2].tokens) <= 5 and stopped[2].finish_reason == "stop"


@pytest.mark.slow  # compiles the prefill and decode forwards from a cold cache (about 29 CPU-s): in make test, not in make test-fast
def test_the_compiled_sampler_is_batch_invariant_and_draws_the_eager_tokens(sampler_model):
    """compile=True (the CUDA default; on the CPU without graphs): the decode step's and the
    prefill's forwards compile whole (fullgraph), a sample alone equals it in the batch bitwise,
    and every token equals the eager sampler's (log-probs may differ in the last bits)."""
    prompts, keys = _prompts(), _keys(len(LENGTHS))
    compiled = Sampler(sampler_model, max_batch=4, max_len=40, prefill_chunk=8, prefill_rows=2, compile=True)
    eager = Sampler(sampler_model, max_batch=4, max_len=40, prefill_chunk=8, prefill_rows=2)
    for params in (SAMPLED, FILTERED):
        batched = compiled.generate(prompts, keys, params)
        assert [s.tokens for s in batched] == [s.tokens for s in eager.generate(prompts, keys, params)]
        assert compiled.generate(prompts[3:4], keys[3:4], params) == batched[3:4]


def test_one_decode_step_per_sampling_rule_whatever_the_budget_or_stop_tokens(sampler_model):
    """A rule's step (its compiled forward and captured rule, on CUDA) is built once and reused."""
    sampler = Sampler(sampler_model, max_batch=4, max_len=24, prefill_chunk=8)
    prompts = _prompts((3, 5))
    for params in (SAMPLED, dataclasses.replace(SAMPLED, max_new_tokens=3, stop_token_ids=(7,)), SAMPLED):
        sampler.generate(prompts, _keys(2), params)
    assert len(sampler._decode_steps) == 1
    sampler.generate(prompts, _keys(2), dataclasses.replace(SAMPLED, top_p=0.5))
    assert len(sampler._decode_steps) == 2


def test_max_new_tokens_and_the_context_end_bound_a_sample(sampler):
    short, long = _prompts((3, 36), seed=6)
    samples = sampler.generate([short, long], _keys(2), dataclasses.replace(SAMPLED, max_new_tokens=7))
    assert len(samples[0].tokens) == 7 and samples[0].finish_reason == "length"
    assert len(samples[1].tokens) == 4 and samples[1].finish_reason == "length"  # 36 + 4 = max_len 40
    assert len(samples[0].logprobs) == 7 and len(samples[1].logprobs) == 4


def test_filters_keep_only_allowed_tokens():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=generator).repeat(4000, 1) * 3
    uniforms = torch.from_numpy(counter_uniforms(np.arange(4000, dtype=np.uint64), 1)[:, 0])
    probs = torch.softmax(logits[0], dim=-1)
    ranked = probs.argsort(descending=True)
    cases = {
        SamplingParams(top_k=3): set(ranked[:3].tolist()),
        SamplingParams(min_p=0.3): set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist()),
    }
    mass_before = probs[ranked].cumsum(0) - probs[ranked]
    cases[SamplingParams(top_p=0.6)] = set(ranked[mass_before < 0.6].tolist())
    for params, allowed in cases.items():
        tokens, _ = sample_next(logits, uniforms, params)
        assert set(tokens.tolist()) == allowed, params  # every allowed token drawn, no other
    tokens, _ = sample_next(logits, uniforms, SamplingParams(top_k=1))
    assert set(tokens.tolist()) == {int(probs.argmax())}


def test_inverse_cdf_draws_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(20000, 1)
    uniforms = torch.from_numpy(counter_uniforms(np.arange(20000, dtype=np.uint64) * 7919, 1)[:, 0])
    for temperature in (1.0, 0.5):
        tokens, logprobs = sample_next(logits, uniforms, SamplingParams(temperature=temperature))
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        observed = torch.bincount(tokens, minlength=5).float() / len(tokens)
        torch.testing.assert_close(observed, expected, rtol=0, atol=0.015)
        torch.testing.assert_close(logprobs, torch.log_softmax(logits[0], -1)[tokens])  # untempered


def _splitmix64(stream: int, counter: int) -> int:
    """Reference: the counter-th output of splitmix64 started at ``stream``, in Python integers."""
    mask = (1 << 64) - 1
    z = (stream + counter * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_counter_uniforms_are_splitmix64_in_the_unit_interval():
    streams = [0, 1, 2**63 + 12345, 2**64 - 1]
    u = counter_uniforms(np.array(streams, dtype=np.uint64), 5)
    expected = [[(_splitmix64(s, t) >> 40) / 2**24 for t in range(1, 6)] for s in streams]
    assert u.dtype == np.float32 and u.tolist() == expected  # exact: machine-independent numbers
    many = counter_uniforms(np.arange(1000, dtype=np.uint64), 64)
    assert 0 <= many.min() and many.max() < 1 and abs(float(many.mean()) - 0.5) < 0.01
    assert len(np.unique(many)) > 63000
    key = SampleKey(7, "rollout", 2, 5, 1)
    assert key.stream() == 8056529493150017435  # pinned: recorded samples must keep replaying
    assert np.array_equal(key.uniforms(8)[:3], key.uniforms(3))  # a longer sample extends, never reshuffles
    fields = [SampleKey(8, "rollout", 2, 5, 1), SampleKey(7, "eval", 2, 5, 1), SampleKey(7, "rollout", 3, 5, 1),
              SampleKey(7, "rollout", 2, 6, 1), SampleKey(7, "rollout", 2, 5, 0)]
    assert len({k.stream() for k in [key, *fields]}) == 6


def test_bad_prompts_are_data_errors_naming_the_prompt(sampler):
    good = _prompts()[:2]
    with pytest.raises(DataError, match="prompt 1 is empty") as caught:
        sampler.generate([good[0], [], good[1]], _keys(3), SAMPLED)
    assert caught.value.context["record"] == 1
    with pytest.raises(DataError, match="prompt 2 has 40 tokens.*max_len=40"):
        sampler.generate([good[0], good[1], [1] * 40], _keys(3), SAMPLED)
    with pytest.raises(DataError, match="prompt 0 holds token id 96"):
        sampler.generate([[3, 96]], _keys(1), SAMPLED)
    with pytest.raises(ConfigError, match="2 prompts but 1 keys"):
        sampler.generate(good, _keys(1), SAMPLED)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 2.0), ("max_new_tokens", 0)],
)
def test_bad_sampling_params_are_config_errors(field, value):
    with pytest.raises(ConfigError, match=f"sampling {field}"):
        SamplingParams(**{field: value})


# --------------------------------------------------------------------------- sharded models on two ranks

_RANK_PROMPTS = (3, 1, 7, 12, 5, 2)


def _sharded_generation(parallel_overrides: dict) -> list:
    """Each rank samples the prompts p with p % 2 == rank from a parallelized model's gathered copy."""
    from core.distributed_context import DistributedContext
    from distributed import build_mesh, parallelize
    from tests.distributed.scenarios import cpu_parallel
    from training.rollout.generation_model import generation_model

    parallel = cpu_parallel(**parallel_overrides)
    with DistributedContext.from_env(parallel) as dist:
        model = build_sampler_model()
        model = parallelize(model, parallel, dist, build_mesh(parallel, dist))
        with pytest.raises(ConfigError, match="plain, unsharded"):
            Sampler(model, max_batch=4, max_len=24)
        local = generation_model(model)
        mine = [i for i in range(len(_RANK_PROMPTS)) if i % dist.world_size == dist.rank]
        prompts = _prompts(_RANK_PROMPTS, seed=8)
        sampler = Sampler(local, max_batch=4, max_len=24, prefill_chunk=8)
        samples = sampler.generate([prompts[i] for i in mine], [_keys(len(prompts))[i] for i in mine], FILTERED)
        return list(zip(mine, samples))


def _two_rank_generation() -> dict:
    from core.distributed_context import DistributedContext
    from tests.distributed.scenarios import cpu_parallel

    torch.set_num_threads(1)
    # One process group serves every strategy: a second init_process_group on the same
    # port after a destroyed one can hang in the store's rendezvous.
    with DistributedContext.from_env(cpu_parallel(strategy="ddp")):
        return {name: _sharded_generation(overrides) for name, overrides in
                (("ddp", {"strategy": "ddp"}), ("fsdp", {"strategy": "fsdp"}), ("fsdp_tp", {"strategy": "fsdp", "tp": 2}))}


def test_samples_of_a_sharded_model_on_two_ranks_equal_one_process(sampler_model):
    from tests.distributed.dist_harness import run_on_ranks

    prompts = _prompts(_RANK_PROMPTS, seed=8)
    expected = Sampler(sampler_model, max_batch=4, max_len=24, prefill_chunk=8).generate(prompts, _keys(len(prompts)), FILTERED)
    by_rank = run_on_ranks(_two_rank_generation, 2)
    for strategy in ("ddp", "fsdp", "fsdp_tp"):
        gathered = dict(pair for rank in by_rank for pair in rank[strategy])
        assert sorted(gathered) == list(range(len(prompts))), strategy
        assert [gathered[i] for i in range(len(prompts))] == expected, strategy
