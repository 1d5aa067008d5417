"""models/generation/scheduler.py: continuous refill gives every sample bitwise the tokens of the group schedule and of
the sample alone, in any order, and finished rows stop costing decode steps."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from models.generation.nucleus import triton_available
from models.generation.sampler import SampleKey, Sampler, SamplingParams
from models.generation.scheduler import RowSlots, StagingPool, decode_steps
from tests.models.sampler_model import QWEN3

STOPS = tuple(range(0, QWEN3.vocab_size, 8))  # 12 of 96 tokens: sampled completions end after ~8 tokens
LENGTHS = (3, 9, 1, 17, 5, 2, 12, 7, 4, 6, 15, 2, 8, 1, 11, 3, 5, 9, 2)  # 19 samples through 4 rows
RULES = {
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=STOPS),
    "sampled": SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=STOPS),
    "filtered": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=24, stop_token_ids=STOPS),
}


def _sampler(model, schedule, prefill_rows=None):
    return Sampler(model, max_batch=4, max_len=40, prefill_chunk=8, schedule=schedule, prefill_rows=prefill_rows)


def _prompts(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, QWEN3.vocab_size, (n,), generator=generator).tolist() for n in LENGTHS]


def _keys():
    return [SampleKey(1, "test", 3, prompt_index, prompt_index % 2) for prompt_index in range(len(LENGTHS))]


@pytest.fixture(scope="module")
def group_samples(sampler_model):
    """(rule, prefill_rows) -> the group schedule's samples of ``_prompts()`` under ``_keys()``, generated
    once for the module (the refill tests compare against them)."""
    computed = {}

    def samples(rule: str, prefill_rows=None) -> list:
        if (rule, prefill_rows) not in computed:
            groups = _sampler(sampler_model, "groups", prefill_rows)
            computed[rule, prefill_rows] = groups.generate(_prompts(), _keys(), RULES[rule])
        return computed[rule, prefill_rows]

    return samples


@pytest.mark.parametrize("rule,prefill_rows", [(rule, None) for rule in sorted(RULES)] + [("filtered", 1), ("sampled", 3)])
def test_refill_equals_the_group_schedule_each_sample_alone_and_any_order(sampler_model, group_samples, rule,
                                                                          prefill_rows):
    """Also with prefills of fewer rows than the cache has: 1 (a prompt per forward) and 3 (a
    refill point's prompts split across forwards, the last padded)."""
    params, prompts, keys = RULES[rule], _prompts(), _keys()
    refill = _sampler(sampler_model, "refill", prefill_rows)
    expected = group_samples(rule, prefill_rows)
    got = refill.generate(prompts, keys, params)
    assert got == expected  # tokens, log-probs (exact floats) and finish reasons
    order = np.random.default_rng(7).permutation(len(prompts)).tolist()
    shuffled = refill.generate([prompts[i] for i in order], [keys[i] for i in order], params)
    assert [shuffled[order.index(i)] for i in range(len(prompts))] == expected
    for i in (0, 3, 13, 18):  # alone: one sample, padded to the four rows
        assert refill.generate([prompts[i]], [keys[i]], params) == [expected[i]], i
    lengths = [len(s.tokens) for s in expected]
    assert {s.finish_reason for s in expected} == {"stop", "length"}, lengths  # the set mixes both ends
    assert min(lengths) < 6 and max(lengths) >= 20, lengths


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(torch.device("cuda")),
                    reason="compiled CUDA-graph steps run on CUDA (benchmarks on a GPU)")
def test_refill_steps_captured_as_one_graph_give_the_group_schedules_samples(sampler_model):
    """On CUDA a refill decode step (the rows' bookkeeping, the forward, the rule) is one graph per
    rule, kept from call to call with the rows' state: calls under other rules between two calls
    under one change none of its samples."""
    model, prompts, keys = copy.deepcopy(sampler_model).cuda(), _prompts(), _keys()
    refill, groups = _sampler(model, "refill"), _sampler(model, "groups")
    expected = {rule: groups.generate(prompts, keys, params) for rule, params in RULES.items()}
    for rule in [*sorted(RULES), *sorted(RULES)]:
        assert refill.generate(prompts, keys, RULES[rule]) == expected[rule], rule
    assert len(refill._refill_steps) == len(RULES)  # one graph per rule, captured once
    assert refill.generate([prompts[3]], [keys[3]], RULES["filtered"]) == [expected["filtered"][3]]


# prefill_ahead: the next pending prompts wait prefilled in a staging pool of 2 * prefill_rows rows;
# a refill point takes what it holds and prefills the rest of its free rows itself. With 3 prompts
# per prefill and a point every step, the pool serves every point after the first; with 1 per
# prefill and a point every 7 steps, some points free more rows than the pool holds.
@pytest.mark.parametrize("every,ahead,prefill_rows", [(1, False, None), (7, False, None), (1, True, 3), (7, True, 1),
                                                      (16, True, None)])
def test_the_refill_interval_and_prefilling_ahead_change_no_sample(sampler_model, group_samples, every, ahead,
                                                                   prefill_rows):
    params, prompts, keys = RULES["filtered"], _prompts(), _keys()
    refill = Sampler(sampler_model, max_batch=4, max_len=40, prefill_chunk=8, refill_every=every,
                     prefill_ahead=ahead, prefill_rows=prefill_rows)
    staged, taken, topped_up = [], [], []  # per staged group: its samples; per refill point: from the pool, the rest
    stage, refill_rows = refill._stage, refill._refill

    def counted_stage(groups):
        staged.extend(len(group) for group, _ in groups)
        return stage(groups)

    def counted_refill(state, assigned, prompts, keys, budgets, held, width):
        taken.append(len(held))
        topped_up.append(len(assigned) - len(held))
        return refill_rows(state, assigned, prompts, keys, budgets, held, width)

    refill._stage, refill._refill = counted_stage, counted_refill
    assert refill.generate(prompts, keys, params) == group_samples("filtered")
    assert sum(taken) + sum(topped_up) == len(prompts)  # every sample starts once
    if not ahead:
        assert not staged and not any(taken), (staged, taken)
        return
    assert sum(staged) == sum(taken), (staged, taken)  # every staged sample is taken: none is prefilled twice
    assert topped_up[0] == 4  # the first point fills every row itself
    if (every, prefill_rows) == (1, 3):  # the pool (6 rows) serves every point after the first
        assert sum(taken) == len(prompts) - 4 and not any(topped_up[1:]), (taken, topped_up)
    elif (every, prefill_rows) == (7, 1):  # the pool (2 rows) is short at some points: the rest are prefilled there
        assert sum(1 for n in topped_up[1:] if n) >= 2 and sum(taken) >= 8, (taken, topped_up)


def test_the_staging_pool_stages_the_next_pending_samples_once_and_hands_them_out_in_order():
    slots, pool = RowSlots(2, 8), StagingPool(4, 2)
    _, assigned = slots.refill(np.ones(2, dtype=bool))
    assert assigned == [(0, 0), (1, 1)] and pool.take([0, 1]) == []  # the first point: nothing staged yet
    assert pool.next_groups(slots.pending) == [([2, 3], [0, 1]), ([4, 5], [2, 3])]
    assert pool.next_groups(slots.pending) == []  # full
    _, assigned = slots.refill(np.array([False, True]))
    assert assigned == [(1, 2)] and pool.take([2]) == [0]
    assert pool.next_groups(slots.pending) == []  # one slot free: less than a group, and two are pending
    _, assigned = slots.refill(np.array([True, True]))
    assert assigned == [(0, 3), (1, 4)] and pool.take([3, 4]) == [1, 2]
    assert pool.next_groups(slots.pending) == [([6, 7], [0, 1])]
    _, assigned = slots.refill(np.array([True, False]))
    assert assigned == [(0, 5)] and pool.take([5]) == [3]
    _, assigned = slots.refill(np.array([True, True]))
    assert assigned == [(0, 6), (1, 7)] and pool.take([6, 7]) == [0, 1] and pool.free == [0, 1, 2, 3]
    assert not slots.pending and pool.next_groups(slots.pending) == []


def test_a_refill_point_sees_the_rows_done_a_step_before_it():
    """One sample of 4 tokens through one row, a point every 2 steps: done after step 4, seen at
    point 6 (flags of step 5); with a point every step, at point 4 itself."""
    assert decode_steps([4, 1], 1, 2, "refill", budget=8) == 6 + 2
    assert decode_steps([4, 1], 1, 1, "refill", budget=8) == 4 + 1
    assert decode_steps([3, 1], 1, 2, "refill", budget=8) == 4 + 2  # done after step 3, seen at point 4


# 3 stop tokens of 96: completions end after ~32 tokens, up to 96. The second set adds 41 ids outside
# the vocabulary, which are never sampled (more than a few stop ids took torch.isin's sort-based path).
@pytest.mark.parametrize("stops,ahead", [((5, 40, 77), False), ((5, 40, 77) + tuple(range(200, 240)) + (-1,), False),
                                         ((5, 40, 77), True)])
def test_finished_rows_take_the_next_samples_and_save_decode_steps(sampler_model, stops, ahead):
    """Counted model forwards: refill decodes about the mean completion length per row, groups the longest;
    a row is done exactly when it samples a stop id (refill points every refill_every steps). Prefilling
    ahead changes no decode step."""
    params = SamplingParams(temperature=1.0, max_new_tokens=96, stop_token_ids=stops)
    prompts, keys = _prompts(), _keys()
    counts = {}
    for schedule in ("refill", "groups"):
        sampler = Sampler(sampler_model, max_batch=4, max_len=112, prefill_chunk=8, schedule=schedule,
                          prefill_ahead=ahead)
        calls = []
        forward = sampler.model._forward_cached

        def counted(input_ids, position_ids, cache, forward=forward, calls=calls):
            calls.append(input_ids.shape[1])
            return forward(input_ids, position_ids, cache)

        sampler.model._forward_cached = counted
        try:
            samples = sampler.generate(prompts, keys, params)
        finally:
            del sampler.model._forward_cached
        counts[schedule] = sum(1 for width in calls if width == 1)  # decode steps (prefill chunks are 8 wide)
        lengths = [len(s.tokens) for s in samples]  # of the samples whose forwards were counted
        every = sampler.refill_every if schedule == "refill" else 16
        assert counts[schedule] == decode_steps(lengths, 4, every, schedule, budget=96), (schedule, counts)
    assert counts["refill"] < 0.6 * counts["groups"], counts


@pytest.mark.parametrize("prefill_rows", [1, 2, 4])
def test_a_refill_prefill_writes_its_rows_and_leaves_the_others_untouched(sampler_model, prefill_rows):
    sampler = _sampler(sampler_model, "refill", prefill_rows)
    for layer in range(sampler.cache.num_layers):
        for buffer in sampler.cache.read(layer):
            buffer.normal_(generator=torch.Generator().manual_seed(layer))
    before = [buffer.clone() for buffer in sampler.cache.tensors()]
    sampler._prefill([3, 1], [[1, 2, 3], [5, 6, 7, 8, 9]])
    alone = _sampler(sampler_model, "refill", prefill_rows)
    alone._prefill([0], [[5, 6, 7, 8, 9]])
    for old, new, single in zip(before, sampler.cache.tensors(), alone.cache.tensors()):
        assert torch.equal(old[[0, 2, 4]], new[[0, 2, 4]])  # rows not refilled and the scratch row: unchanged
        assert torch.equal(new[1, :, :4], single[0, :, :4])  # row 1's prompt (but its last token), as alone
        assert not torch.equal(old[3, :, :2], new[3, :, :2])  # and row 3's


def test_prefill_rows_above_max_batch_is_a_config_error(sampler_model):
    from core.exceptions import ConfigError

    with pytest.raises(ConfigError, match="prefill_rows"):
        _sampler(sampler_model, "refill", prefill_rows=5)


def test_row_slots_hand_back_finished_rows_and_fill_free_ones_in_call_order():
    slots = RowSlots(rows=3, samples=5)
    assert slots.refill(np.array([True, True, True])) == ([], [(0, 0), (1, 1), (2, 2)])
    assert slots.refill(np.array([False, True, False])) == ([(1, 1)], [(1, 3)])
    assert slots.refill(np.array([True, True, False])) == ([(0, 0), (1, 3)], [(0, 4)])
    assert slots.busy
    assert slots.refill(np.array([True, True, True])) == ([(0, 4), (2, 2)], [])
    assert not slots.busy


def test_an_unknown_schedule_or_a_refill_interval_below_one_is_a_config_error(sampler_model):
    from core.exceptions import ConfigError

    with pytest.raises(ConfigError, match="schedule"):
        Sampler(sampler_model, max_batch=2, max_len=8, schedule="compact")
    with pytest.raises(ConfigError, match="refill_every"):
        Sampler(sampler_model, max_batch=2, max_len=8, refill_every=0)
